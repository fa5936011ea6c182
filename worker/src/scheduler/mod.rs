//! Per-model-version scheduling: a dynamic batch queue shared by an instance group.
//!
//! - Requests are pushed straight into the version's [`policy::BatchQueue`] under a mutex
//!   (a few hundred nanoseconds); a full queue or priority level answers `RESOURCE_EXHAUSTED`
//!   at once.
//! - Each **instance** is an OS thread owning one ONNX Runtime session (compute never runs on
//!   the async runtime). An idle instance asks the policy for a batch; if the policy says
//!   "wait until t" it sleeps on a condition variable with a microsecond timeout (tokio's timer
//!   has millisecond granularity, too coarse for queue delays of 100 µs). A batch therefore
//!   forms while instances are busy and grows under load. Pushes wake a sleeping instance only
//!   when that can change its decision: the queue was empty, the batch target is reached, or
//!   the request carries its own deadline.
//! - Timeouts fire when they expire (they bound the sleep), and entries whose caller has gone
//!   are dropped before their batch forms (checked at least every [`CANCEL_SCAN_INTERVAL`]).
//! - With `preserve_ordering`, answers are released in arrival order through a [`Sequencer`].

pub mod policy;

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nereid_common::{Code, Status};
use tokio::sync::oneshot;

use crate::backend::{InstanceSession, JobInputs};
use crate::metrics::VersionStats;
use crate::tensor::OutputTensor;
use policy::{BatchPolicy, BatchQueue, Decision, DropReason, Pending, QueueFull};

/// While requests wait, the batcher looks for callers that went away at least this often, so a
/// cancelled request leaves the queue (and the pending gauge) promptly, not when its batch forms.
pub const CANCEL_SCAN_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

pub type JobResult = Result<Vec<OutputTensor>, Status>;

/// One validated request on its way to an instance.
pub struct Job {
    pub rows: usize,
    /// Non-batch dims of every input, concatenated with separators.
    pub shape_key: Vec<i64>,
    /// One `(shape, bytes)` per model input, in the model's input order.
    pub inputs: Vec<Option<(Vec<i64>, Bytes)>>,
    /// Per model output: does this request want it?
    pub wanted: Vec<bool>,
    pub priority: u64,
    pub timeout_us: u64,
    pub arrived: Instant,
    /// The caller's deadline, if its transport set one.
    pub deadline: Option<Instant>,
    pub reply: oneshot::Sender<JobResult>,
    seq: u64,
}

impl Job {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rows: usize,
        shape_key: Vec<i64>,
        inputs: Vec<Option<(Vec<i64>, Bytes)>>,
        wanted: Vec<bool>,
        priority: u64,
        timeout_us: u64,
        reply: oneshot::Sender<JobResult>,
    ) -> Self {
        Job {
            rows,
            shape_key,
            inputs,
            wanted,
            priority,
            timeout_us,
            arrived: Instant::now(),
            deadline: None,
            reply,
            seq: 0,
        }
    }
}

impl Pending for Job {
    fn rows(&self) -> usize {
        self.rows
    }
    fn shape_key(&self) -> &[i64] {
        &self.shape_key
    }
    fn is_cancelled(&self) -> bool {
        self.reply.is_closed()
    }
    fn deadline(&self) -> Option<Instant> {
        self.deadline
    }
}

/// Releases answers in arrival order (`preserve_ordering`).
#[derive(Default)]
pub struct Sequencer {
    inner: Mutex<SequencerState>,
}

#[derive(Default)]
struct SequencerState {
    next: u64,
    held: BTreeMap<u64, Option<(oneshot::Sender<JobResult>, JobResult)>>,
}

impl Sequencer {
    /// Delivers `result` for `seq` once every earlier sequence number has been delivered or
    /// skipped. `reply` None marks a request that left without an answer to hold.
    fn complete(&self, seq: u64, reply: Option<(oneshot::Sender<JobResult>, JobResult)>) {
        let mut state = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        state.held.insert(seq, reply);
        loop {
            let next = state.next;
            match state.held.remove(&next) {
                Some(entry) => {
                    if let Some((tx, result)) = entry {
                        let _ = tx.send(result);
                    }
                    state.next += 1;
                }
                None => break,
            }
        }
    }
}

/// How answers leave an instance.
#[derive(Clone)]
enum Delivery {
    Direct,
    Ordered(Arc<Sequencer>),
}

impl Delivery {
    fn send(&self, job_seq: u64, tx: oneshot::Sender<JobResult>, result: JobResult) {
        match self {
            Delivery::Direct => {
                let _ = tx.send(result);
            }
            Delivery::Ordered(seq) => seq.complete(job_seq, Some((tx, result))),
        }
    }
    fn skip(&self, job_seq: u64) {
        if let Delivery::Ordered(seq) = self {
            seq.complete(job_seq, None);
        }
    }
}

/// State shared by request handlers and instance threads.
struct Shared {
    state: Mutex<QueueState>,
    wake: Condvar,
    stats: Arc<VersionStats>,
    delivery: Delivery,
}

struct QueueState {
    queue: BatchQueue<Job>,
    next_seq: u64,
    /// The last handle is gone: drain what is queued, then stop.
    closed: bool,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Handle to one model version's queue. Dropping it lets the instances drain what is queued,
/// then stop.
pub struct Scheduler {
    shared: Arc<Shared>,
}

impl Scheduler {
    /// Starts one thread per instance session.
    pub fn start(
        label: &str,
        policy: BatchPolicy,
        preserve_ordering: bool,
        sessions: Vec<InstanceSession>,
        stats: Arc<VersionStats>,
    ) -> std::io::Result<Scheduler> {
        let delivery = if preserve_ordering { Delivery::Ordered(Arc::default()) } else { Delivery::Direct };
        let shared = Arc::new(Shared {
            state: Mutex::new(QueueState { queue: BatchQueue::new(policy), next_seq: 0, closed: false }),
            wake: Condvar::new(),
            stats,
            delivery,
        });
        for (i, session) in sessions.into_iter().enumerate() {
            let shared = shared.clone();
            std::thread::Builder::new().name(format!("{label}#{i}")).spawn(move || instance_thread(session, shared))?;
        }
        Ok(Scheduler { shared })
    }

    /// Queues a job. Fails at once with `RESOURCE_EXHAUSTED` when the queue (or the job's
    /// priority level, `max_queue_size`) is full.
    pub fn submit(&self, mut job: Job) -> Result<(), Status> {
        let wake = {
            let mut state = self.shared.lock();
            if state.queue.len() >= MAX_QUEUED {
                return Err(Status::exhausted("the model's request queue is full, retry later"));
            }
            job.seq = state.next_seq;
            let was_empty = state.queue.is_empty();
            let has_deadline = job.deadline.is_some() || job.timeout_us > 0;
            let (priority, timeout_us) = (job.priority, job.timeout_us);
            if let Err(QueueFull(_)) = state.queue.push(job, priority, timeout_us, Instant::now()) {
                return Err(Status::exhausted(
                    "the queue of this priority level is full (max_queue_size), retry later",
                ));
            }
            state.next_seq += 1;
            was_empty || has_deadline || state.queue.rows() >= state.queue.fill_target()
        };
        self.shared.stats.pending_add(1);
        if wake {
            self.shared.wake.notify_one();
        }
        Ok(())
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.wake.notify_all();
    }
}

/// Most requests queued per model version, whatever the policy says.
pub const MAX_QUEUED: usize = 8192;

fn instance_thread(mut session: InstanceSession, shared: Arc<Shared>) {
    let mut state = shared.lock();
    loop {
        let now = Instant::now();
        for (job, why) in state.queue.expire(now) {
            shared.stats.pending_add(-1);
            let status = match why {
                // The request path counted it when its caller went away.
                DropReason::Cancelled => Status::new(Code::Cancelled, "the request was cancelled"),
                DropReason::TimedOut => Status::new(Code::DeadlineExceeded, "request timeout expired while queued"),
            };
            shared.delivery.skip(job.seq);
            let _ = job.reply.send(Err(status));
        }
        // Once closed, nothing more will join: run what is left without waiting.
        let decide_at = if state.closed { now + Duration::from_secs(86_400) } else { now };
        match state.queue.next_batch(decide_at) {
            Decision::Dispatch(batch) => {
                if !state.queue.is_empty() {
                    // More is queued: another idle instance may take it.
                    shared.wake.notify_one();
                }
                drop(state);
                run_batch(&mut session, batch, now, &shared);
                state = shared.lock();
            }
            Decision::WaitUntil(t) => {
                let until = [Some(t), state.queue.next_timeout(), Some(now + CANCEL_SCAN_INTERVAL)]
                    .into_iter()
                    .flatten()
                    .min()
                    .unwrap_or(t);
                let wait = until.saturating_duration_since(now);
                state = shared.wake.wait_timeout(state, wait).unwrap_or_else(|e| e.into_inner()).0;
            }
            Decision::Idle if state.closed => break,
            Decision::Idle => {
                state = shared.wake.wait(state).unwrap_or_else(|e| e.into_inner());
            }
        }
    }
}

fn run_batch(session: &mut InstanceSession, batch: Vec<Job>, dispatched: Instant, shared: &Shared) {
    for job in &batch {
        shared.stats.record_queue(dispatched.saturating_duration_since(job.arrived));
    }
    shared.stats.pending_add(-(batch.len() as i64));
    let inputs: Vec<JobInputs<'_>> = batch.iter().map(|j| JobInputs { rows: j.rows, inputs: &j.inputs }).collect();
    let wanted = |j: usize, o: usize| batch[j].wanted.get(o).copied().unwrap_or(false);
    let result = session.run(&inputs, &wanted);
    drop(inputs);
    let rows: usize = batch.iter().map(|j| j.rows).sum();
    match result {
        Ok((outputs, times)) => {
            // Count before answering, so a caller that reads statistics sees its batch.
            shared.stats.record_execution(rows, batch.len(), times.input, times.infer, times.output);
            for (job, out) in batch.into_iter().zip(outputs) {
                shared.delivery.send(job.seq, job.reply, Ok(out));
            }
        }
        Err(status) => {
            for job in batch {
                shared.delivery.send(job.seq, job.reply, Err(status.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(tag: i64) -> JobResult {
        Ok(vec![OutputTensor {
            name: "x".into(),
            datatype: nereid_common::DataType::Int64,
            shape: vec![tag],
            data: Bytes::new(),
        }])
    }

    fn tag(rx: &mut oneshot::Receiver<JobResult>) -> Option<i64> {
        rx.try_recv().ok().map(|r| r.unwrap()[0].shape[0])
    }

    #[test]
    fn sequencer_releases_answers_in_arrival_order() {
        let seq = Sequencer::default();
        let (tx0, mut rx0) = oneshot::channel();
        let (tx1, mut rx1) = oneshot::channel();
        let (tx3, mut rx3) = oneshot::channel();
        // 1 and 3 finish first: nothing is released before 0.
        seq.complete(1, Some((tx1, answer(1))));
        seq.complete(3, Some((tx3, answer(3))));
        assert_eq!(tag(&mut rx1), None);
        seq.complete(0, Some((tx0, answer(0))));
        assert_eq!((tag(&mut rx0), tag(&mut rx1)), (Some(0), Some(1)));
        // 2 left the queue without an answer (timeout, cancel): 3 follows at once.
        assert_eq!(tag(&mut rx3), None);
        seq.complete(2, None);
        assert_eq!(tag(&mut rx3), Some(3));
    }
}
