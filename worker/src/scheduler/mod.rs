//! Per-model-version scheduling: a dynamic batcher task feeding an instance group.
//!
//! - The **batcher** is one tokio task that owns the [`policy::BatchQueue`]. Requests arrive
//!   on a bounded channel (full → `RESOURCE_EXHAUSTED` at once). Whenever an instance is idle it
//!   asks the policy for a batch; a batch therefore forms while instances are busy and grows
//!   under load. A timer wakes it for queue delays and request timeouts, so timeouts fire when
//!   they expire. Entries whose caller has gone are dropped before their batch forms.
//! - Each **instance** is an OS thread owning one ONNX Runtime session; compute never runs on
//!   the async runtime. It runs a batch, answers each request on its `oneshot`, and reports
//!   itself idle.
//! - With `preserve_ordering`, answers are released in arrival order through a [`Sequencer`].

pub mod policy;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use nereid_common::{Code, Status};
use tokio::sync::{mpsc, oneshot};

use crate::backend::{InstanceSession, JobInputs};
use crate::metrics::VersionStats;
use crate::tensor::OutputTensor;
use policy::{BatchPolicy, BatchQueue, Decision, DropReason, Pending, QueueFull};

/// Bound of the channel between request handlers and the batcher.
pub const SUBMIT_QUEUE_CAPACITY: usize = 8192;

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
    pub inputs: Vec<(Vec<i64>, Bytes)>,
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
        inputs: Vec<(Vec<i64>, Bytes)>,
        wanted: Vec<bool>,
        priority: u64,
        timeout_us: u64,
        reply: oneshot::Sender<JobResult>,
    ) -> Self {
        Job { rows, shape_key, inputs, wanted, priority, timeout_us, arrived: Instant::now(), deadline: None, reply, seq: 0 }
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

/// Handle to one model version's batcher. Dropping every handle drains the queue, then stops
/// the batcher and the instance threads.
pub struct Scheduler {
    tx: mpsc::Sender<Job>,
}

impl Scheduler {
    /// Starts the batcher task and one thread per instance session.
    pub fn start(
        label: &str,
        policy: BatchPolicy,
        preserve_ordering: bool,
        sessions: Vec<InstanceSession>,
        stats: Arc<VersionStats>,
    ) -> std::io::Result<Scheduler> {
        let (tx, rx) = mpsc::channel(SUBMIT_QUEUE_CAPACITY);
        let (idle_tx, idle_rx) = mpsc::channel(sessions.len().max(1));
        let delivery = if preserve_ordering { Delivery::Ordered(Arc::default()) } else { Delivery::Direct };
        let mut instances = Vec::with_capacity(sessions.len());
        for (i, session) in sessions.into_iter().enumerate() {
            let (batch_tx, batch_rx) = std::sync::mpsc::sync_channel::<Vec<Job>>(1);
            let idle_tx = idle_tx.clone();
            let stats = stats.clone();
            let delivery = delivery.clone();
            std::thread::Builder::new()
                .name(format!("{label}#{i}"))
                .spawn(move || instance_thread(i, session, batch_rx, idle_tx, stats, delivery))?;
            instances.push(batch_tx);
        }
        tokio::spawn(batcher_task(rx, BatchQueue::new(policy), instances, idle_rx, stats, delivery));
        Ok(Scheduler { tx })
    }

    /// Queues a job. Fails at once with `RESOURCE_EXHAUSTED` if the batcher's intake is full.
    pub fn submit(&self, job: Job) -> Result<(), Status> {
        self.tx.try_send(job).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => {
                Status::exhausted("the model's request queue is full, retry later")
            }
            mpsc::error::TrySendError::Closed(_) => Status::unavailable("the model is unloading"),
        })
    }
}

async fn batcher_task(
    mut rx: mpsc::Receiver<Job>,
    mut queue: BatchQueue<Job>,
    instances: Vec<std::sync::mpsc::SyncSender<Vec<Job>>>,
    mut idle_rx: mpsc::Receiver<usize>,
    stats: Arc<VersionStats>,
    delivery: Delivery,
) {
    let mut idle: Vec<usize> = (0..instances.len()).rev().collect();
    let mut wake: Option<Instant> = None;
    let mut intake_open = true;
    let mut next_seq = 0u64;
    let far = || tokio::time::Instant::now() + std::time::Duration::from_secs(3600);
    loop {
        let sleep_to = wake.map(tokio::time::Instant::from_std).unwrap_or_else(far);
        tokio::select! {
            biased;
            Some(i) = idle_rx.recv() => idle.push(i),
            job = rx.recv(), if intake_open => match job {
                Some(job) => enqueue(&mut queue, job, &mut next_seq, &stats, &delivery),
                None => intake_open = false,
            },
            _ = tokio::time::sleep_until(sleep_to), if wake.is_some() => {}
        }
        // Take everything else that is already there before deciding.
        while let Ok(i) = idle_rx.try_recv() {
            idle.push(i);
        }
        while intake_open {
            match rx.try_recv() {
                Ok(job) => enqueue(&mut queue, job, &mut next_seq, &stats, &delivery),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => intake_open = false,
            }
        }
        let now = Instant::now();
        for (job, why) in queue.expire(now) {
            stats.pending_add(-1);
            let status = match why {
                DropReason::Cancelled => {
                    // No one is left to count it on the request path.
                    stats.record_failure(now.saturating_duration_since(job.arrived), "CANCELED");
                    Status::new(Code::Cancelled, "the request was cancelled")
                }
                DropReason::TimedOut => {
                    Status::new(Code::DeadlineExceeded, "request timeout expired while queued")
                }
            };
            delivery.skip(job.seq);
            let _ = job.reply.send(Err(status));
        }
        wake = None;
        while let Some(&instance) = idle.last() {
            match queue.next_batch(now) {
                Decision::Dispatch(batch) => {
                    idle.pop();
                    for job in &batch {
                        stats.record_queue(now.saturating_duration_since(job.arrived));
                    }
                    stats.pending_add(-(batch.len() as i64));
                    if let Err(std::sync::mpsc::SendError(batch)) = instances[instance].send(batch) {
                        for job in batch {
                            delivery.skip(job.seq);
                            let _ = job.reply.send(Err(Status::internal("model instance stopped")));
                        }
                    }
                }
                Decision::WaitUntil(t) => {
                    wake = Some(t);
                    break;
                }
                Decision::Idle => break,
            }
        }
        wake = [wake, queue.next_timeout(), (!queue.is_empty()).then(|| now + CANCEL_SCAN_INTERVAL)]
            .into_iter()
            .flatten()
            .min();
        if !intake_open && queue.is_empty() {
            break;
        }
    }
}

fn enqueue(queue: &mut BatchQueue<Job>, mut job: Job, next_seq: &mut u64, stats: &VersionStats, delivery: &Delivery) {
    job.seq = *next_seq;
    *next_seq += 1;
    let (priority, timeout_us) = (job.priority, job.timeout_us);
    match queue.push(job, priority, timeout_us, Instant::now()) {
        Ok(()) => stats.pending_add(1),
        Err(QueueFull(job)) => {
            delivery.skip(job.seq);
            let _ = job.reply.send(Err(Status::exhausted(
                "the queue of this priority level is full (max_queue_size), retry later",
            )));
        }
    }
}

fn instance_thread(
    index: usize,
    mut session: InstanceSession,
    batches: std::sync::mpsc::Receiver<Vec<Job>>,
    idle: mpsc::Sender<usize>,
    stats: Arc<VersionStats>,
    delivery: Delivery,
) {
    while let Ok(batch) = batches.recv() {
        let inputs: Vec<JobInputs<'_>> =
            batch.iter().map(|j| JobInputs { rows: j.rows, inputs: &j.inputs }).collect();
        let wanted = |j: usize, o: usize| batch[j].wanted.get(o).copied().unwrap_or(false);
        let result = session.run(&inputs, &wanted);
        drop(inputs);
        let rows: usize = batch.iter().map(|j| j.rows).sum();
        match result {
            Ok((outputs, times)) => {
                // Count before answering, so a caller that reads statistics sees its batch.
                stats.record_execution(rows, batch.len(), times.input, times.infer, times.output);
                for (job, out) in batch.into_iter().zip(outputs) {
                    delivery.send(job.seq, job.reply, Ok(out));
                }
            }
            Err(status) => {
                for job in batch {
                    delivery.send(job.seq, job.reply, Err(status.clone()));
                }
            }
        }
        if idle.blocking_send(index).is_err() {
            break;
        }
    }
}
