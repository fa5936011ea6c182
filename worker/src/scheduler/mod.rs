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
//!   when that can change its decision: the queue was empty, or it reached a size that may
//!   dispatch early (a preferred batch size or `max_batch_size`).
//! - One **timer** thread per scheduler applies queue timeouts (the queue policy's
//!   `default_timeout_microseconds` / a request's shorter `timeout`) when they expire, whether
//!   or not an instance is free: Triton rejects a timed-out request at its timeout even while
//!   every instance is busy. It sleeps until the queue's next timeout (indefinitely when there
//!   is none) and a push wakes it only when it brings that instant forward, so it never spins
//!   and requests without a queue timeout never touch it. It stops when the scheduler closes.
//! - A caller's own deadline ends the caller's wait by itself (the request path waits with
//!   that deadline); the entry leaves the queue at the next expiry. Idle instances apply expiry
//!   before each decision and at least every [`CANCEL_SCAN_INTERVAL`] while they wait, so a
//!   batch never takes an entry that timed out, whose deadline passed or whose caller has gone.
//! - With `preserve_ordering`, answers are released in the order their requests were taken into
//!   batches, through a [`Sequencer`] (as Triton's batcher reserves a response's place when it
//!   dequeues the request). A request still queued holds back no answer (a low-priority or
//!   DELAYed one would otherwise hold every later answer, and their memory, for as long as it
//!   waits); a request refused or dropped from the queue is answered at once.

pub mod policy;

use std::collections::BTreeMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nereid_common::{Code, Status};
use tokio::sync::oneshot;

use crate::backend::{InstanceSession, JobInputs, PhaseTimes};
use crate::metrics::{Execution, RunFigures, VersionStats};
use crate::tensor::OutputTensor;
use policy::{BatchPolicy, BatchQueue, Decision, DropReason, Pending, QueueFull};

/// While requests wait, an idle instance looks for callers that went away at least this often,
/// so a cancelled request leaves the queue (and the pending gauge) promptly, not when its batch
/// forms.
pub const CANCEL_SCAN_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

pub type JobResult = Result<Answer, Status>;

/// A job's outputs, and what running it took — counted by the request path once the request
/// has succeeded (see [`VersionStats::record_ran`]). The batch's execution is recorded once
/// every answer of it is dropped ([`Execution`]): hold `execution` until the request's own
/// figures are counted.
#[derive(Debug)]
pub struct Answer {
    pub outputs: Vec<OutputTensor>,
    pub figures: RunFigures,
    pub execution: Option<Arc<Execution>>,
}

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
    /// Its inputs' place in the worker's memory budget, given back when the job is done with.
    pub reserved: Option<Reserved>,
    pub reply: oneshot::Sender<JobResult>,
    seq: u64,
}

/// The bytes of input the worker's requests may hold at once, queued or running, over every
/// model (`--max-queued-bytes`): past it a request is refused at once (RESOURCE_EXHAUSTED, so
/// a client or gateway retries it elsewhere) instead of the queues growing until the process
/// runs out of memory — each model's queue is bounded by count, and 8192 requests of 64 MiB
/// would be half a terabyte.
#[derive(Debug)]
pub struct MemoryBudget {
    /// 0: no limit.
    limit: u64,
    held: std::sync::atomic::AtomicU64,
    /// Requests refused for want of room.
    refused: std::sync::atomic::AtomicU64,
}

impl MemoryBudget {
    pub fn new(limit: u64) -> Arc<MemoryBudget> {
        Arc::new(MemoryBudget { limit, held: Default::default(), refused: Default::default() })
    }

    /// The budget as Prometheus series: bytes held, the limit, and the refusals.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        use std::sync::atomic::Ordering::Relaxed;
        let series = [
            ("nereid_queued_input_bytes", "gauge", "Bytes of input held by queued and running requests", self.held()),
            ("nereid_queued_input_bytes_limit", "gauge", "--max-queued-bytes (0: no bound)", self.limit),
            (
                "nereid_queued_input_refusals_total",
                "counter",
                "Requests refused because their inputs would pass --max-queued-bytes",
                self.refused.load(Relaxed),
            ),
        ];
        for (name, kind, help, value) in series {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        }
    }

    /// A place for `bytes`, or RESOURCE_EXHAUSTED when they do not fit. A request larger than
    /// the whole budget still runs when nothing else is held (it was let in by the request
    /// limit; refusing it would refuse it everywhere, for ever).
    pub fn reserve(self: &Arc<Self>, bytes: u64) -> Result<Reserved, Status> {
        use std::sync::atomic::Ordering;
        if self.limit > 0 {
            let fits = |held: u64| held == 0 || held.saturating_add(bytes) <= self.limit;
            if let Err(held) = self.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                fits(held).then(|| held.saturating_add(bytes))
            }) {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return Err(Status::exhausted(format!(
                    "{} ({held} bytes of inputs queued or running, {bytes} more would pass --max-queued-bytes \
                     {}), retry later",
                    nereid_common::status::MEMORY_FULL_MESSAGE_PREFIX,
                    self.limit
                )));
            }
        } else {
            self.held.fetch_add(bytes, Ordering::AcqRel);
        }
        Ok(Reserved { budget: self.clone(), bytes })
    }

    /// Bytes held now.
    pub fn held(&self) -> u64 {
        self.held.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// A job's bytes in the [`MemoryBudget`], given back when dropped.
#[derive(Debug)]
pub struct Reserved {
    budget: Arc<MemoryBudget>,
    bytes: u64,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, std::sync::atomic::Ordering::AcqRel);
    }
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
            reserved: None,
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

/// Releases answers in dispatch order (`preserve_ordering`).
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
        // An answer whose caller has gone is not held (its outputs would wait for nothing).
        let reply = reply.filter(|(tx, _)| !tx.is_closed());
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
}

/// What an instance thread runs a batch on: an ONNX Runtime session in production; tests use
/// a stand-in they can hold busy.
pub trait Instance: Send + 'static {
    /// Runs one batch: `jobs` in order, `wanted(job, output)` saying which outputs each wants.
    /// Returns one output list per job, and the time spent in each phase.
    fn run(
        &mut self,
        jobs: &[JobInputs<'_>],
        wanted: &dyn Fn(usize, usize) -> bool,
    ) -> Result<(Vec<Vec<OutputTensor>>, PhaseTimes), Status>;

    /// Called once on the instance's own thread before its first batch.
    fn prepare_thread(&mut self) {}
}

impl Instance for InstanceSession {
    fn prepare_thread(&mut self) {
        InstanceSession::prepare_thread(self);
    }

    fn run(
        &mut self,
        jobs: &[JobInputs<'_>],
        wanted: &dyn Fn(usize, usize) -> bool,
    ) -> Result<(Vec<Vec<OutputTensor>>, PhaseTimes), Status> {
        InstanceSession::run(self, jobs, wanted)
    }
}

/// State shared by request handlers, instance threads and the timer thread.
struct Shared {
    state: Mutex<QueueState>,
    /// Wakes idle instances (an arrival, a queue change that may alter their decision).
    wake: Condvar,
    /// Wakes the timer (an arrival whose queue timeout is earlier than its plan; close).
    timer: Condvar,
    stats: Arc<VersionStats>,
    delivery: Delivery,
}

struct QueueState {
    queue: BatchQueue<Job>,
    next_seq: u64,
    /// The last handle is gone: drain what is queued, then stop.
    closed: bool,
    /// When the timer thread will look at the queue next without being woken; `None` while it
    /// sleeps with nothing to wait for. A push wakes the timer only when its queue timeout is
    /// earlier than this.
    timer_at: Option<Instant>,
    /// When a push last found the queue full and looked for entries to drop: at most once per
    /// [`FULL_QUEUE_SCAN_INTERVAL`], so that refusing a flood of requests under overload does
    /// not scan the whole queue, under the lock, once for each.
    full_scan_at: Option<Instant>,
}

/// How often a full queue is scanned for dropped entries on a push (see
/// [`QueueState::full_scan_at`]); instances and the timer scan it besides.
const FULL_QUEUE_SCAN_INTERVAL: std::time::Duration = std::time::Duration::from_millis(1);

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
    /// Starts one thread per instance session, and the queue's timer thread.
    pub fn start<I: Instance>(
        label: &str,
        policy: BatchPolicy,
        preserve_ordering: bool,
        sessions: Vec<I>,
        stats: Arc<VersionStats>,
    ) -> std::io::Result<Scheduler> {
        let delivery = if preserve_ordering { Delivery::Ordered(Arc::default()) } else { Delivery::Direct };
        let shared = Arc::new(Shared {
            state: Mutex::new(QueueState {
                queue: BatchQueue::new(policy),
                next_seq: 0,
                closed: false,
                timer_at: None,
                full_scan_at: None,
            }),
            wake: Condvar::new(),
            timer: Condvar::new(),
            stats,
            delivery,
        });
        // Constructed first, so that a failed spawn below stops the threads already started.
        let scheduler = Scheduler { shared: shared.clone() };
        for (i, session) in sessions.into_iter().enumerate() {
            let shared = shared.clone();
            std::thread::Builder::new().name(format!("{label}#{i}")).spawn(move || instance_thread(session, shared))?;
        }
        let timer_shared = shared.clone();
        std::thread::Builder::new().name(format!("{label}/timer")).spawn(move || timer_thread(timer_shared))?;
        Ok(scheduler)
    }

    /// Queues a job. Fails at once with `RESOURCE_EXHAUSTED` when the queue (or the job's
    /// priority level, `max_queue_size`) is full.
    pub fn submit(&self, job: Job) -> Result<(), Status> {
        let (wake, wake_timer) = {
            let mut state = self.shared.lock();
            // Requests whose callers went away hold their places until an idle instance or the
            // timer looks; a full queue looks now, before refusing anyone.
            let full = |q: &policy::BatchQueue<Job>| q.len() >= MAX_QUEUED || q.is_full_for(job.priority);
            if full(&state.queue) {
                let now = Instant::now();
                if state.full_scan_at.is_none_or(|at| now.saturating_duration_since(at) >= FULL_QUEUE_SCAN_INTERVAL) {
                    state.full_scan_at = Some(now);
                    let dropped = state.queue.expire(now);
                    // What the scan dropped may have made a batch ready (a new head).
                    if !dropped.is_empty() {
                        self.shared.wake.notify_one();
                    }
                    answer_dropped(&self.shared, dropped);
                }
            }
            // The request's own level being full refuses it before anyone else's place is taken
            // for it below.
            if state.queue.is_full_for(job.priority) {
                return Err(Status::exhausted(nereid_common::status::LEVEL_QUEUE_FULL_MESSAGE));
            }
            if state.queue.len() >= MAX_QUEUED {
                let full = || {
                    Status::exhausted(format!(
                        "{} ({MAX_QUEUED} requests), retry later",
                        nereid_common::status::QUEUE_FULL_MESSAGE_PREFIX
                    ))
                };
                // A lower-priority request gives up its place (it never ran: a client or the
                // gateway may retry it) rather than lock out a higher priority.
                let Some(victim) = state.queue.make_room_for(job.priority) else {
                    return Err(full());
                };
                self.shared.stats.pending_add(-1);
                let _ = victim.reply.send(Err(full()));
            }
            let was_empty = state.queue.is_empty();
            // Another shape behind the head's closes the head's batch: it may go now.
            let other_shape = state.queue.head_shape_key().is_some_and(|key| key != job.shape_key.as_slice());
            let (priority, timeout_us) = (job.priority, job.timeout_us);
            let now = Instant::now();
            let due = match state.queue.push(job, priority, timeout_us, now) {
                Ok(due) => due,
                Err(QueueFull(_)) => {
                    return Err(Status::exhausted(nereid_common::status::LEVEL_QUEUE_FULL_MESSAGE));
                }
            };
            // Counted before the lock goes: an instance may take the job (and count it out)
            // the moment it does.
            self.shared.stats.pending_add(1);
            // The timer must look by this entry's queue timeout.
            let wake_timer = due.is_some_and(|due| state.timer_at.is_none_or(|planned| due < planned));
            if wake_timer {
                // It re-plans from the whole queue once it runs; until then, later pushes need
                // not wake it again.
                state.timer_at = Some(now);
            }
            (was_empty || other_shape || state.queue.rows() >= state.queue.wake_threshold(), wake_timer)
        };
        if wake {
            self.shared.wake.notify_one();
        }
        if wake_timer {
            self.shared.timer.notify_one();
        }
        Ok(())
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.wake.notify_all();
        self.shared.timer.notify_all();
    }
}

/// Most requests queued per model version, whatever the queue policy says.
///
/// A safety bound, not a Triton setting: without `max_queue_size` Triton's queue is unbounded,
/// but an unbounded queue lets a burst of clients hold unbounded memory (every queued request
/// keeps its input tensors) and makes every request in it wait longer than any client would.
/// Past this many queued requests of one model version, a new request is refused at once with
/// `RESOURCE_EXHAUSTED` (HTTP 429), like a full `max_queue_size`, and may be retried. A
/// `max_queue_size` per priority level still applies below it.
pub const MAX_QUEUED: usize = 8192;

/// Answers entries that left the queue without running. Called with the queue locked, so the
/// pending gauge and the queue agree.
fn answer_dropped(shared: &Shared, dropped: Vec<(Job, DropReason)>) {
    for (job, why) in dropped {
        shared.stats.pending_add(-1);
        let status = match why {
            // The request path counts it (CANCELED) when its caller goes away; no one reads this.
            DropReason::Cancelled => Status::new(Code::Cancelled, "the request was cancelled"),
            // Triton's answer to a queue-policy timeout under REJECT (UNAVAILABLE, counted as
            // a REJECTED failure), distinct from the caller's own deadline below.
            DropReason::Rejected => Status::queue_timeout(),
            DropReason::DeadlineExceeded => {
                Status::new(Code::DeadlineExceeded, "the request's deadline passed while it was queued")
            }
        };
        // Never dispatched, so it holds no place in the answer order (preserve_ordering): as in
        // Triton, a request leaving the queue without running is answered at once — its memory
        // given back first.
        let Job { reply, reserved, .. } = job;
        drop(reserved);
        let _ = reply.send(Err(status));
    }
}

/// Applies queue timeouts as they fall due, whether or not an instance is free (and, while
/// it is at it, callers' deadlines and cancellations); see the module documentation. Exits when
/// the scheduler closes (the instances then drain what is left, applying expiry themselves).
fn timer_thread(shared: Arc<Shared>) {
    let mut state = shared.lock();
    while !state.closed {
        let now = Instant::now();
        let delayed_before = state.queue.delayed_len();
        let dropped = state.queue.expire(now);
        // A removed or delayed entry can change what an idle instance would dispatch (a new
        // head, a preferred size now reachable): let one look again.
        let changed = !dropped.is_empty() || state.queue.delayed_len() != delayed_before;
        answer_dropped(&shared, dropped);
        if changed {
            shared.wake.notify_one();
        }
        // Everything due at `now` is gone, so the next due instant is later than `now`.
        let next = state.queue.next_timeout();
        state.timer_at = next;
        // Waiting releases the lock atomically, so a push cannot slip between planning and
        // sleeping and have its wake-up lost.
        state = match next {
            Some(at) => {
                let wait = at.saturating_duration_since(now);
                shared.timer.wait_timeout(state, wait).unwrap_or_else(|e| e.into_inner()).0
            }
            None => shared.timer.wait(state).unwrap_or_else(|e| e.into_inner()),
        };
    }
}

fn instance_thread<I: Instance>(mut session: I, shared: Arc<Shared>) {
    session.prepare_thread();
    let mut isolation = Isolation::default();
    let mut state = shared.lock();
    loop {
        let now = Instant::now();
        let dropped = state.queue.expire(now);
        answer_dropped(&shared, dropped);
        // Once closed, nothing more will join: run what is left without waiting.
        let decide_at = if state.closed { now + Duration::from_secs(86_400) } else { now };
        match state.queue.next_batch(decide_at) {
            Decision::Dispatch(mut batch) => {
                // Places in the answer order are taken here, under the lock, so they follow the
                // order batches leave the queue across instances.
                for job in &mut batch {
                    job.seq = state.next_seq;
                    state.next_seq += 1;
                }
                if !state.queue.is_empty() {
                    // More is queued: another idle instance may take it.
                    shared.wake.notify_one();
                }
                drop(state);
                run_batch(&mut session, batch, now, &shared, &mut isolation);
                state = shared.lock();
            }
            Decision::WaitUntil(t) => {
                // Queue timeouts are the timer's (it wakes us if they change the queue); look
                // for deadlines and callers that went away ourselves.
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

/// What a panic said (its message, when it has one).
pub fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// What an instance remembers of its last failed batch run again one request at a time.
#[derive(Default)]
struct Isolation {
    /// Every request of that round failed on its own too: the model, not one request's values,
    /// is failing. Until a run succeeds again, failed batches are not run again (a broken model
    /// would otherwise cost a run per request of every batch).
    futile: bool,
}

fn run_batch<I: Instance>(
    session: &mut I,
    batch: Vec<Job>,
    dispatched: Instant,
    shared: &Shared,
    isolation: &mut Isolation,
) {
    shared.stats.record_dispatch(batch.len());
    shared.stats.pending_add(-(batch.len() as i64));
    let (result, panicked) = run_guarded(session, &batch);
    if result.is_ok() {
        isolation.futile = false;
    }
    if let Err(failed) = &result
        && batch.len() > 1
        && !panicked
        && !isolation.futile
    {
        // One request's values can fail the run of the whole batch (a token id past a
        // vocabulary, an index out of range): each request runs again on its own, so that only
        // the one at fault fails and every other caller is answered as if it had run alone.
        // Not after a panic (a bug, not the data), and not for callers already gone.
        tracing::debug!(requests = batch.len(), "a batch failed; running its requests one at a time");
        let mut succeeded = false;
        for job in batch {
            let solo = vec![job];
            let gone = solo[0].reply.is_closed() || solo[0].deadline.is_some_and(|d| d <= Instant::now());
            let result = if gone { Err(failed.clone()) } else { run_guarded(session, &solo).0 };
            succeeded |= result.is_ok();
            deliver(solo, result, dispatched, shared);
        }
        isolation.futile = !succeeded;
    } else {
        deliver(batch, result, dispatched, shared);
    }
}

/// Runs `batch` on `session`, saying whether it panicked. A panic while running (a bug, or a
/// model answering what nothing expected) fails this batch only: unwound past here it would
/// end the instance thread, and with it every later batch (and, under preserve_ordering, every
/// later answer).
fn run_guarded<I: Instance>(session: &mut I, batch: &[Job]) -> (RunResult, bool) {
    let inputs: Vec<JobInputs<'_>> = batch.iter().map(|j| JobInputs { rows: j.rows, inputs: &j.inputs }).collect();
    let wanted = |j: usize, o: usize| batch[j].wanted.get(o).copied().unwrap_or(false);
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| session.run(&inputs, &wanted))) {
        Ok(result) => (result, false),
        Err(panic) => {
            let what = panic_text(panic.as_ref());
            tracing::error!(error = %what, "an instance panicked running a batch; the batch fails, the instance goes on");
            (Err(Status::internal(format!("the model's run failed unexpectedly: {what}"))), true)
        }
    }
}

/// What an instance's run of a batch gives: each job's outputs, and the phases' times.
type RunResult = Result<(Vec<Vec<OutputTensor>>, PhaseTimes), Status>;

/// Answers every job of `batch` from the run's `result`.
fn deliver(batch: Vec<Job>, result: RunResult, dispatched: Instant, shared: &Shared) {
    let rows: usize = batch.iter().map(|j| j.rows).sum();
    match result {
        Ok((outputs, times)) => {
            // Recorded when the last of its answers is done with (after the requests' own
            // figures); a failed batch is no execution.
            // Held by the answers only (the last job takes this thread's own reference): the
            // execution is recorded as soon as they are all done with.
            let mut execution =
                Some(Execution::new(shared.stats.clone(), rows, times.input, times.infer, times.output));
            // One answer per job whatever the instance returned: under preserve_ordering a job
            // left unanswered would hold every later answer for ever.
            let mut outputs = outputs.into_iter();
            let last = batch.len().saturating_sub(1);
            for (i, mut job) in batch.into_iter().enumerate() {
                // Given back before the caller hears: what it sends next finds the room.
                drop(job.reserved.take());
                let execution = if i == last { execution.take() } else { execution.clone() };
                let figures = RunFigures {
                    rows: job.rows,
                    queue: dispatched.saturating_duration_since(job.arrived),
                    input: times.input,
                    infer: times.infer,
                    output: times.output,
                };
                let result = outputs
                    .next()
                    .map(|outputs| Answer { outputs, figures, execution })
                    .ok_or_else(|| Status::internal("the model's run returned fewer answers than requests"));
                shared.delivery.send(job.seq, job.reply, result);
            }
        }
        Err(status) => {
            for mut job in batch {
                drop(job.reserved.take());
                shared.delivery.send(job.seq, job.reply, Err(status.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(tag: i64) -> JobResult {
        let outputs = vec![OutputTensor {
            name: "x".into(),
            datatype: nereid_common::DataType::Int64,
            shape: vec![tag],
            data: Bytes::new(),
        }];
        Ok(Answer { outputs, figures: RunFigures::default(), execution: None })
    }

    fn tag(rx: &mut oneshot::Receiver<JobResult>) -> Option<i64> {
        rx.try_recv().ok().map(|r| r.unwrap().outputs[0].shape[0])
    }

    /// An instance that reports each batch it starts and then stays busy until the test opens
    /// its gate (bounded: after [`GATE_LIMIT`] it gives up and records that it did).
    struct GatedInstance {
        started: std::sync::mpsc::Sender<usize>,
        gate: std::sync::mpsc::Receiver<()>,
        gave_up: Arc<std::sync::atomic::AtomicBool>,
    }

    /// A bound so a broken timer fails the test instead of hanging it; never reached when the
    /// scheduler works.
    const GATE_LIMIT: Duration = Duration::from_secs(60);

    impl Instance for GatedInstance {
        fn run(
            &mut self,
            jobs: &[JobInputs<'_>],
            _wanted: &dyn Fn(usize, usize) -> bool,
        ) -> Result<(Vec<Vec<OutputTensor>>, PhaseTimes), Status> {
            let _ = self.started.send(jobs.len());
            if self.gate.recv_timeout(GATE_LIMIT).is_err() {
                self.gave_up.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            Ok((jobs.iter().map(|_| vec![]).collect(), PhaseTimes::default()))
        }
    }

    struct Harness {
        scheduler: Scheduler,
        started: std::sync::mpsc::Receiver<usize>,
        gate: std::sync::mpsc::Sender<()>,
        gave_up: Arc<std::sync::atomic::AtomicBool>,
        stats: Arc<crate::metrics::VersionStats>,
    }

    fn harness(policy: BatchPolicy) -> Harness {
        harness_with(policy, false)
    }

    fn harness_with(policy: BatchPolicy, preserve: bool) -> Harness {
        let (started_tx, started) = std::sync::mpsc::channel();
        let (gate, gate_rx) = std::sync::mpsc::channel();
        let gave_up = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let instance = GatedInstance { started: started_tx, gate: gate_rx, gave_up: gave_up.clone() };
        let stats = crate::metrics::Metrics::new().version("m", 1);
        let scheduler =
            Scheduler::start("test", policy, preserve, vec![instance], stats.clone()).expect("threads start");
        Harness { scheduler, started, gate, gave_up, stats }
    }

    fn job(timeout_us: u64) -> (Job, oneshot::Receiver<JobResult>) {
        let (tx, rx) = oneshot::channel();
        (Job::new(1, vec![], vec![], vec![], 0, timeout_us, tx), rx)
    }

    /// The direct policy with two priority levels.
    fn two_levels() -> BatchPolicy {
        let mut policy = BatchPolicy::direct();
        policy.levels = vec![policy::LevelPolicy::default(); 2];
        policy
    }

    /// Submits a one-row job of `priority`: whether it was queued, and where its answer comes.
    fn submit_at(scheduler: &Scheduler, priority: u64) -> (Result<(), Status>, oneshot::Receiver<JobResult>) {
        let (tx, rx) = oneshot::channel();
        (scheduler.submit(Job::new(1, vec![], vec![], vec![], priority, 0, tx)), rx)
    }

    /// The instance busy with one request of priority 2, and the queue full of such: where
    /// the running one's answer comes, and the queued ones'.
    fn busy_and_full_of_low_priority(h: &Harness) -> (oneshot::Receiver<JobResult>, Vec<oneshot::Receiver<JobResult>>) {
        let (running, running_rx) = submit_at(&h.scheduler, 2);
        running.expect("queued");
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1), "the instance is busy");
        let low = (0..MAX_QUEUED)
            .map(|_| {
                let (queued, rx) = submit_at(&h.scheduler, 2);
                queued.expect("room");
                rx
            })
            .collect();
        (running_rx, low)
    }

    fn timeout_policy(action: policy::TimeoutAction, default_ms: u64) -> BatchPolicy {
        let mut p = BatchPolicy::direct();
        p.max_batch_size = 4;
        p.max_requests = usize::MAX;
        p.levels[0] = policy::LevelPolicy {
            timeout_action: action,
            default_timeout: Some(Duration::from_millis(default_ms)),
            allow_timeout_override: false,
            max_queue_size: 0,
        };
        p
    }

    /// An instance that panics on its first batch and answers the ones after.
    struct PanicsOnce {
        panicked: bool,
    }

    impl Instance for PanicsOnce {
        fn run(
            &mut self,
            jobs: &[JobInputs<'_>],
            _wanted: &dyn Fn(usize, usize) -> bool,
        ) -> Result<(Vec<Vec<OutputTensor>>, PhaseTimes), Status> {
            if !std::mem::replace(&mut self.panicked, true) {
                panic!("index out of bounds");
            }
            Ok((jobs.iter().map(|_| vec![]).collect(), PhaseTimes::default()))
        }
    }

    /// A panic while running a batch fails that batch with INTERNAL; the instance thread lives
    /// on and serves the next one (with preserve_ordering, whose answers would otherwise wait
    /// for ever behind the lost one).
    #[test]
    fn a_panicking_batch_fails_alone_and_the_instance_goes_on() {
        let stats = crate::metrics::Metrics::new().version("m", 1);
        let instance = PanicsOnce { panicked: false };
        let scheduler = Scheduler::start("test", BatchPolicy::direct(), true, vec![instance], stats.clone())
            .expect("threads start");
        let (first, first_rx) = job(0);
        scheduler.submit(first).expect("queued");
        let status = first_rx.blocking_recv().expect("answered").expect_err("failed");
        assert_eq!(status.code, nereid_common::Code::Internal);
        assert!(status.message.contains("index out of bounds"), "{}", status.message);
        // A failed batch is no execution.
        assert_eq!(stats.snapshot().execution_count, 0);
        let (second, second_rx) = job(0);
        scheduler.submit(second).expect("queued");
        assert_eq!(second_rx.blocking_recv().expect("answered").expect("ran").figures.rows, 1);
        assert_eq!(stats.snapshot().execution_count, 1);
    }

    #[test]
    fn the_memory_budget_is_held_until_dropped_and_a_lone_request_always_fits() {
        let budget = MemoryBudget::new(100);
        let a = budget.reserve(60).expect("fits");
        let e = budget.reserve(41).expect_err("60 + 41 > 100");
        assert_eq!(e.code, Code::ResourceExhausted);
        assert!(e.message.starts_with(nereid_common::status::MEMORY_FULL_MESSAGE_PREFIX), "{}", e.message);
        let b = budget.reserve(40).expect("60 + 40 fits");
        drop(a);
        assert_eq!(budget.held(), 40);
        drop(b);
        assert_eq!(budget.held(), 0);
        let lone = budget.reserve(1000).expect("nothing held: a request past the whole budget runs");
        assert!(budget.reserve(1).is_err());
        drop(lone);
        let mut text = String::new();
        budget.render(&mut text);
        assert!(text.contains("nereid_queued_input_bytes 0\n"), "{text}");
        assert!(text.contains("nereid_queued_input_bytes_limit 100\n"), "{text}");
        assert!(text.contains("nereid_queued_input_refusals_total 2\n"), "{text}");
        let unbounded = MemoryBudget::new(0);
        let _all = [unbounded.reserve(u64::MAX / 2).unwrap(), unbounded.reserve(u64::MAX / 2).unwrap()];
    }

    /// An instance that counts its runs, is held on its first (until the test opens the gate),
    /// and fails every batch `fails` picks out.
    struct HeldThenFails {
        runs: Arc<std::sync::atomic::AtomicUsize>,
        started: std::sync::mpsc::Sender<usize>,
        gate: Option<std::sync::mpsc::Receiver<()>>,
        fails: fn(&[JobInputs<'_>]) -> bool,
    }

    impl Instance for HeldThenFails {
        fn run(
            &mut self,
            jobs: &[JobInputs<'_>],
            _wanted: &dyn Fn(usize, usize) -> bool,
        ) -> Result<(Vec<Vec<OutputTensor>>, PhaseTimes), Status> {
            self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = self.started.send(jobs.len());
            if let Some(gate) = self.gate.take() {
                let _ = gate.recv_timeout(GATE_LIMIT);
            }
            if (self.fails)(jobs) {
                return Err(Status::internal("index 70000 is out of bounds of the vocabulary"));
            }
            Ok((jobs.iter().map(|_| vec![]).collect(), PhaseTimes::default()))
        }
    }

    /// A scheduler over one [`HeldThenFails`] instance, batching up to `max_batch_size` rows:
    /// the scheduler, its run count, where batch sizes are reported, the gate, the statistics.
    #[allow(clippy::type_complexity)]
    fn held_then_failing(
        fails: fn(&[JobInputs<'_>]) -> bool,
        max_batch_size: usize,
    ) -> (
        Scheduler,
        Arc<std::sync::atomic::AtomicUsize>,
        std::sync::mpsc::Receiver<usize>,
        std::sync::mpsc::Sender<()>,
        Arc<VersionStats>,
    ) {
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (started_tx, started) = std::sync::mpsc::channel();
        let (gate, gate_rx) = std::sync::mpsc::channel();
        let instance = HeldThenFails { runs: runs.clone(), started: started_tx, gate: Some(gate_rx), fails };
        let mut policy = BatchPolicy::direct();
        policy.max_batch_size = max_batch_size;
        policy.max_requests = usize::MAX;
        let stats = crate::metrics::Metrics::new().version("m", 1);
        let scheduler = Scheduler::start("test", policy, false, vec![instance], stats.clone()).expect("threads start");
        (scheduler, runs, started, gate, stats)
    }

    fn submit_rows(scheduler: &Scheduler, rows: usize) -> oneshot::Receiver<JobResult> {
        let (tx, rx) = oneshot::channel();
        scheduler.submit(Job::new(rows, vec![], vec![], vec![], 0, 0, tx)).expect("queued");
        rx
    }

    /// A batch failed by one request's values: its other requests run again, alone, and are
    /// answered; only the one at fault fails.
    #[test]
    fn a_batch_failed_by_one_request_fails_that_request_alone() {
        // A request of two rows stands for one whose values the model refuses.
        let (scheduler, _, started, gate, stats) = held_then_failing(|jobs| jobs.iter().any(|j| j.rows == 2), 8);
        let submit = |rows: usize| submit_rows(&scheduler, rows);
        let first = submit(1);
        assert_eq!(started.recv_timeout(GATE_LIMIT), Ok(1), "the first request holds the instance");
        let (good, bad, also_good) = (submit(1), submit(2), submit(1));
        gate.send(()).expect("instance waits");
        assert!(first.blocking_recv().expect("answered").is_ok());
        assert_eq!(started.recv_timeout(GATE_LIMIT), Ok(3), "the three queued ones batch together");
        assert_eq!(good.blocking_recv().expect("answered").expect("ran alone").figures.rows, 1);
        let refused = bad.blocking_recv().expect("answered").expect_err("its own values fail it");
        assert!(refused.message.contains("out of bounds of the vocabulary"), "{}", refused.message);
        assert_eq!(also_good.blocking_recv().expect("answered").expect("ran alone").figures.rows, 1);
        assert_eq!((1..=3).map(|_| started.recv_timeout(GATE_LIMIT)).collect::<Vec<_>>(), vec![Ok(1); 3]);
        // Executions that answered: the first and the two good ones.
        assert_eq!(stats.snapshot().execution_count, 3);
    }

    /// A model whose every run fails is not run request by request for every batch: once a
    /// round of solo runs failed throughout, later failed batches are answered as they are.
    #[test]
    fn a_model_failing_every_run_is_not_rerun_request_by_request_for_ever() {
        let (scheduler, runs, started, gate, _) = held_then_failing(|_| true, 3);
        let first = submit_rows(&scheduler, 1);
        assert_eq!(started.recv_timeout(GATE_LIMIT), Ok(1), "the first request holds the instance");
        let later: Vec<_> = (0..6).map(|_| submit_rows(&scheduler, 1)).collect();
        gate.send(()).expect("instance waits");
        for rx in std::iter::once(first).chain(later) {
            assert!(rx.blocking_recv().expect("answered").is_err());
        }
        // The first alone; the first batch of three, then each of its three alone (all fail);
        // the second batch of three, not run again.
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1 + 1 + 3 + 1);
    }

    /// Callers that went away while every instance is busy do not keep a full queue full: the
    /// next request looks for them before it is refused.
    #[test]
    fn a_full_queue_of_requests_whose_callers_left_takes_a_new_one() {
        let mut policy = timeout_policy(policy::TimeoutAction::Reject, 60_000);
        policy.levels[0].max_queue_size = 2;
        let h = harness(policy);
        let (running, running_rx) = job(0);
        h.scheduler.submit(running).expect("queued");
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1), "the instance is busy");
        for _ in 0..2 {
            let (queued, rx) = job(0);
            h.scheduler.submit(queued).expect("queued");
            drop(rx); // the caller goes away
        }
        let (next, next_rx) = job(0);
        h.scheduler.submit(next).expect("room made by the callers that left");
        let (second, _second_rx) = job(0);
        h.scheduler.submit(second).expect("queued");
        let (over, _over_rx) = job(0);
        let refused = h.scheduler.submit(over).expect_err("the level is full of live requests");
        assert_eq!(refused.code, nereid_common::Code::ResourceExhausted);
        assert_eq!(h.stats.pending(), 2, "the two live queued ones");
        for _ in 0..3 {
            h.gate.send(()).expect("instance waits");
        }
        assert!(running_rx.blocking_recv().expect("answered").is_ok());
        assert!(next_rx.blocking_recv().expect("answered").is_ok());
    }

    /// The audit's case: the only instance is busy; a request queued behind it with a 100 ms
    /// timeout is rejected while the instance is still busy — by the timer, not when the
    /// instance next asks for work. Asserted by ordering: the gate is still shut when the
    /// rejection arrives.
    #[test]
    fn queue_timeout_fires_while_every_instance_is_busy() {
        let h = harness(timeout_policy(policy::TimeoutAction::Reject, 100));
        let (long, long_rx) = job(0);
        h.scheduler.submit(long).expect("queued");
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1), "the long request runs");
        let (short, short_rx) = job(0);
        h.scheduler.submit(short).expect("queued");
        let answer = short_rx.blocking_recv().expect("answered");
        let status = answer.expect_err("rejected");
        assert_eq!(status, Status::queue_timeout());
        assert!(!h.gave_up.load(std::sync::atomic::Ordering::SeqCst), "rejected only after the instance freed up");
        h.gate.send(()).expect("instance waits");
        assert!(long_rx.blocking_recv().expect("answered").is_ok());
        assert_eq!(h.scheduler.shared.lock().queue.len(), 0);
    }

    /// The model's queue full of low-priority requests does not lock out a higher priority:
    /// the newest low-priority one gives up its place (RESOURCE_EXHAUSTED, never run); a
    /// request of the lowest priority present is still refused.
    #[test]
    fn a_full_queue_makes_room_for_a_higher_priority() {
        let h = harness(two_levels());
        let submit = |priority: u64| submit_at(&h.scheduler, priority);
        let (_running_rx, mut low) = busy_and_full_of_low_priority(&h);
        let (refused, _) = submit(2);
        assert_eq!(refused.expect_err("full").code, Code::ResourceExhausted);
        let (high, _high_rx) = submit(1);
        high.expect("a higher priority takes the newest low one's place");
        let newest = low.pop().unwrap().try_recv().expect("answered at once").expect_err("refused");
        assert_eq!(newest.code, Code::ResourceExhausted);
        assert!(newest.message.starts_with(nereid_common::status::QUEUE_FULL_MESSAGE_PREFIX), "{}", newest.message);
        assert!(low.iter_mut().all(|rx| rx.try_recv().is_err()), "the older ones keep their places");
        assert_eq!(h.stats.pending(), MAX_QUEUED as i64);
        assert_eq!(h.scheduler.shared.lock().queue.len(), MAX_QUEUED);
        drop(low);
        h.gate.send(()).expect("instance waits");
    }

    /// Under preserve_ordering a request refused by its queue timeout never ran, so it holds
    /// no place in the answer order: it is answered at its timeout, while the request before
    /// it still runs (as in Triton, which orders the answers of dispatched requests only).
    #[test]
    fn with_preserve_ordering_a_queue_timeout_is_answered_at_once() {
        let h = harness_with(timeout_policy(policy::TimeoutAction::Reject, 100), true);
        let (first, first_rx) = job(0);
        h.scheduler.submit(first).expect("queued");
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1), "the first request runs");
        let (second, second_rx) = job(0);
        h.scheduler.submit(second).expect("queued");
        assert_eq!(second_rx.blocking_recv().expect("answered").unwrap_err(), Status::queue_timeout());
        assert!(!h.gave_up.load(std::sync::atomic::Ordering::SeqCst), "answered while the first still ran");
        h.gate.send(()).expect("instance waits");
        assert!(first_rx.blocking_recv().expect("answered").is_ok());
    }

    /// Under preserve_ordering a low-priority request still queued holds back no answer: a
    /// higher-priority request that arrived after it, and ran before it, is answered before
    /// it even starts.
    #[test]
    fn with_preserve_ordering_a_queued_low_priority_request_holds_back_nothing() {
        let h = harness_with(two_levels(), true);
        let submit = |priority: u64| {
            let (queued, rx) = submit_at(&h.scheduler, priority);
            queued.expect("queued");
            rx
        };
        let first = submit(1);
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1), "the first request runs");
        let mut low = submit(2);
        let mut high = submit(1);
        h.gate.send(()).expect("instance waits");
        assert!(first.blocking_recv().expect("answered").is_ok());
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1), "the high-priority request runs next");
        h.gate.send(()).expect("instance waits");
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1), "then the low-priority one");
        // The low-priority request is running (its gate shut): the high one's answer is out.
        assert!(high.try_recv().expect("answered before the low one ran").is_ok());
        assert!(low.try_recv().is_err());
        h.gate.send(()).expect("instance waits");
        assert!(low.blocking_recv().expect("answered").is_ok());
    }

    /// A full queue is scanned for requests whose callers went away before a push is refused,
    /// but at most once per [`FULL_QUEUE_SCAN_INTERVAL`]: within it, a push is refused without
    /// a scan (a flood of refusals under overload must not copy the queue once each).
    #[test]
    fn a_full_queue_drops_departed_callers_at_most_once_per_interval() {
        let h = harness(two_levels());
        let submit = |priority: u64| submit_at(&h.scheduler, priority);
        let (_running_rx, low) = busy_and_full_of_low_priority(&h);
        // Every queued caller goes away; a scan just happened (as far as the queue knows).
        drop(low);
        h.scheduler.shared.lock().full_scan_at = Some(Instant::now() + Duration::from_secs(3600));
        let (refused, _) = submit(2);
        assert_eq!(refused.expect_err("no scan within the interval").code, Code::ResourceExhausted);
        assert_eq!(h.scheduler.shared.lock().queue.len(), MAX_QUEUED);
        h.scheduler.shared.lock().full_scan_at = None;
        let (queued, _rx) = submit(2);
        queued.expect("the scan dropped the departed callers' places");
        assert_eq!(h.scheduler.shared.lock().queue.len(), 1);
        assert_eq!(h.stats.pending(), 1);
        h.gate.send(()).expect("instance waits");
    }

    /// A request refused because its own priority level is full takes nobody's place: the
    /// lower-priority requests queued keep theirs even when the whole queue is full.
    #[test]
    fn a_request_refused_by_its_own_level_evicts_nobody() {
        let mut policy = two_levels();
        policy.levels[0].max_queue_size = 1;
        let h = harness(policy);
        let submit = |priority: u64| submit_at(&h.scheduler, priority);
        let (running, _running_rx) = submit(2);
        running.expect("queued");
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1), "the instance is busy");
        let (high, _high_rx) = submit(1);
        high.expect("room at level 1");
        let mut low = Vec::new();
        for _ in 0..MAX_QUEUED - 1 {
            let (queued, rx) = submit(2);
            queued.expect("room");
            low.push(rx);
        }
        let (refused, _) = submit(1);
        assert_eq!(refused.expect_err("level 1 is full").code, Code::ResourceExhausted);
        assert!(low.iter_mut().all(|rx| rx.try_recv().is_err()), "no low-priority request lost its place");
        assert_eq!(h.scheduler.shared.lock().queue.len(), MAX_QUEUED);
        drop(low);
        h.gate.send(()).expect("instance waits");
    }

    /// Under `DELAY` a timed-out request is not answered by the timer: it still runs once the
    /// instance is free.
    #[test]
    fn delayed_requests_wait_for_the_busy_instance_and_run() {
        let h = harness(timeout_policy(policy::TimeoutAction::Delay, 1));
        let (long, long_rx) = job(0);
        h.scheduler.submit(long).expect("queued");
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1));
        let (short, mut short_rx) = job(0);
        h.scheduler.submit(short).expect("queued");
        // Wait (bounded) until the timer has moved it to the delayed queue.
        let moved = (0..6000).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            h.scheduler.shared.lock().queue.delayed_len() == 1
        });
        assert!(moved, "the timer never applied DELAY");
        assert!(short_rx.try_recv().is_err(), "a delayed request is not answered");
        h.gate.send(()).expect("instance waits");
        assert!(long_rx.blocking_recv().expect("answered").is_ok());
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1), "the delayed request runs next");
        h.gate.send(()).expect("instance waits");
        assert!(short_rx.blocking_recv().expect("answered").is_ok());
    }

    /// A batch whose caller left while it ran is an execution all the same; a request's rows,
    /// queue and compute figures travel with its answer, for the request path to count when
    /// (and only if) the request succeeds — the scheduler counts no inferences itself.
    #[test]
    fn executions_are_counted_here_and_each_request_s_figures_go_with_its_answer() {
        let h = harness(timeout_policy(policy::TimeoutAction::Reject, 60_000));
        let (left, left_rx) = job(0);
        h.scheduler.submit(left).expect("queued");
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1));
        drop(left_rx);
        h.gate.send(()).expect("instance waits");
        let (stays, stays_rx) = job(0);
        h.scheduler.submit(stays).expect("queued");
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1));
        h.gate.send(()).expect("instance waits");
        let answer = stays_rx.blocking_recv().expect("answered").expect("ran");
        assert_eq!(answer.figures.rows, 1);
        // The batch's execution is recorded once its answer is done with (after the request
        // path counted the request's own figures).
        assert_eq!(h.stats.snapshot().execution_count, 1);
        drop(answer);
        let s = h.stats.snapshot();
        assert_eq!((s.execution_count, s.inference_count, s.queue.count), (2, 0, 0));
    }

    /// A caller's own deadline is DEADLINE_EXCEEDED (counted CANCELED), not a queue
    /// rejection; the entry leaves the queue without waiting for the 60 s batch delay.
    #[test]
    fn a_callers_deadline_is_deadline_exceeded() {
        let mut policy = timeout_policy(policy::TimeoutAction::Reject, 60_000);
        policy.max_queue_delay = Duration::from_secs(60);
        let h = harness(policy);
        let (mut j, rx) = job(0);
        j.deadline = Some(Instant::now() + Duration::from_millis(20));
        h.scheduler.submit(j).expect("queued");
        let status = rx.blocking_recv().expect("answered").expect_err("expired");
        assert_eq!(status.code, Code::DeadlineExceeded);
        assert!(h.started.try_recv().is_err(), "it never ran");
    }

    /// Dropping the scheduler stops the instance and timer threads (each holds the shared
    /// state; once both are gone, nothing does).
    #[test]
    fn threads_stop_with_the_scheduler() {
        let h = harness(timeout_policy(policy::TimeoutAction::Reject, 100));
        let weak = Arc::downgrade(&h.scheduler.shared);
        let (j, rx) = job(0);
        h.scheduler.submit(j).expect("queued");
        assert_eq!(h.started.recv_timeout(GATE_LIMIT), Ok(1));
        h.gate.send(()).expect("instance waits");
        assert!(rx.blocking_recv().expect("answered").is_ok());
        drop(h.scheduler);
        let stopped = (0..6000).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            weak.strong_count() == 0
        });
        assert!(stopped, "a scheduler thread outlived the scheduler");
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
