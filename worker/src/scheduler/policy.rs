//! Batch formation for the dynamic batcher, as a pure data structure: time is an argument, so
//! every rule is property-tested without a runtime (see the tests at the bottom).
//!
//! Rules (Triton's dynamic batcher semantics):
//! - Requests wait in one FIFO queue per priority level (1 = highest), each followed by that
//!   level's *delayed* queue (see `DELAY` below). A batch takes requests in that order — level 1,
//!   level 1 delayed, level 2, level 2 delayed, … — and stops at the first request whose
//!   non-batch shapes differ from the head's or whose rows would exceed `max_batch_size` (so
//!   nobody is overtaken by a later request of the same level, and `preserve_ordering` holds).
//! - While walking that order the policy remembers the largest `preferred_batch_size` the rows
//!   reach. Before the oldest request's `max_queue_delay` has passed (and always when the
//!   delay is zero, which Triton never counts as passed), a batch is dispatched at once with
//!   exactly that many requests when one was reached (the largest *reachable* one, not only the
//!   largest configured one, as Triton does), or up to the request that would take it past the
//!   largest preferred size; otherwise at once when it is full (`max_batch_size` rows, the
//!   request limit) or nothing more can join it. Once the delay has passed (or when it is zero
//!   and no preferred size applies), whatever can form — up to `max_batch_size` — is
//!   dispatched. Otherwise the batcher waits until the oldest request's delay runs out.
//! - Queue policy per level: `max_queue_size` rejects at once when the level (its queue and its
//!   delayed queue) is full. A request's queue timeout is the level's
//!   `default_timeout_microseconds`, which the request's own `timeout` may only *shorten*, and
//!   only with `allow_timeout_override`. A request whose timeout passes is rejected (`REJECT`)
//!   or moved to its level's delayed queue (`DELAY`): behind every request of its level that has
//!   not timed out, still ahead of every lower-priority level.
//! - Entries whose caller has gone are dropped before any batch forms; entries whose caller's
//!   own deadline passed are dropped whatever the queue policy says.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How far ahead the batcher plans when a delay is too large to represent: it simply asks
/// again then.
const FAR: Duration = Duration::from_secs(86_400);

/// What the policy needs to know about a queued request.
pub trait Pending {
    /// Rows (the batch dimension) this request contributes.
    fn rows(&self) -> usize;
    /// Non-batch shapes of all inputs; only equal keys batch together.
    fn shape_key(&self) -> &[i64];
    /// True when the caller no longer waits for the answer.
    fn is_cancelled(&self) -> bool;
    /// The caller's own deadline (e.g. `grpc-timeout`): past it the request is dropped as
    /// [`DropReason::DeadlineExceeded`] whatever the queue policy says, since no one would read
    /// the answer.
    fn deadline(&self) -> Option<Instant> {
        None
    }
}

/// What happens to a request whose queue timeout expires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeoutAction {
    Reject,
    Delay,
}

/// Queue policy of one priority level (`ModelQueuePolicy`).
#[derive(Clone, Debug, PartialEq)]
pub struct LevelPolicy {
    pub timeout_action: TimeoutAction,
    pub default_timeout: Option<Duration>,
    pub allow_timeout_override: bool,
    /// 0 = unbounded by the policy (the batcher's own bound still applies).
    pub max_queue_size: usize,
}

impl Default for LevelPolicy {
    fn default() -> Self {
        LevelPolicy {
            timeout_action: TimeoutAction::Reject,
            default_timeout: None,
            allow_timeout_override: false,
            max_queue_size: 0,
        }
    }
}

/// Batching parameters of one model version.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchPolicy {
    /// Most rows in one batch (1 for models without batching).
    pub max_batch_size: usize,
    /// Most requests in one batch (1 without `dynamic_batching`).
    pub max_requests: usize,
    /// Sorted ascending, each ≤ `max_batch_size`.
    pub preferred_batch_sizes: Vec<usize>,
    pub max_queue_delay: Duration,
    /// Index 0 is priority level 1. Never empty.
    pub levels: Vec<LevelPolicy>,
    /// Level (1-based) for requests that name none or an out-of-range one.
    pub default_level: usize,
}

impl BatchPolicy {
    /// One request at a time, no delay: the policy of a model without `dynamic_batching`.
    pub fn direct() -> Self {
        BatchPolicy {
            max_batch_size: usize::MAX,
            max_requests: 1,
            preferred_batch_sizes: vec![],
            max_queue_delay: Duration::ZERO,
            levels: vec![LevelPolicy::default()],
            default_level: 1,
        }
    }

    /// The 1-based level a request with `priority` lands in.
    pub fn level_for(&self, priority: u64) -> usize {
        let level =
            if priority == 0 || priority as usize > self.levels.len() { self.default_level } else { priority as usize };
        // A level that does not exist would index past the queues.
        level.clamp(1, self.levels.len().max(1))
    }

    /// The queue timeout for a request at `level` that asked for `requested_us` (0 = none).
    ///
    /// Triton's rule: the level's `default_timeout_microseconds` applies, except that with
    /// `allow_timeout_override` a non-zero request timeout replaces it when it is *shorter*.
    /// Without a default (0: never) there is nothing shorter than: the request's timeout does
    /// not apply either (Triton's `PolicyQueue`). A request can therefore never extend the
    /// operator's bound, and without `allow_timeout_override` its `timeout` parameter has no
    /// effect on the queue at all.
    pub fn timeout_for(&self, level: usize, requested_us: u64) -> Option<Duration> {
        let policy = &self.levels[level - 1];
        let requested =
            (requested_us > 0 && policy.allow_timeout_override).then(|| Duration::from_micros(requested_us));
        match (requested, policy.default_timeout) {
            (Some(r), Some(d)) if r < d => Some(r),
            (_, default) => default,
        }
    }
}

/// Why an entry left the queue without running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// The caller went away.
    Cancelled,
    /// Its queue timeout passed under `TimeoutAction::Reject`: Triton answers UNAVAILABLE
    /// "Request timeout expired" and counts it as a REJECTED failure.
    Rejected,
    /// The caller's own deadline ([`Pending::deadline`]) passed while it waited.
    DeadlineExceeded,
}

/// The answer to "an instance is free: what now?".
#[derive(Debug, PartialEq)]
pub enum Decision<T> {
    /// Run these now, in this order.
    Dispatch(Vec<T>),
    /// Ask again at this instant (or on the next arrival).
    WaitUntil(Instant),
    /// Nothing queued.
    Idle,
}

/// The queue is full at the request's level.
#[derive(Debug, PartialEq, Eq)]
pub struct QueueFull<T>(pub T);

struct Entry<T> {
    item: T,
    arrived: Instant,
    timeout_at: Option<Instant>,
}

impl<T: Pending> Entry<T> {
    /// The earliest instant at which the queue must look at this entry again: its queue timeout
    /// or its caller's deadline.
    fn due(&self) -> Option<Instant> {
        match (self.timeout_at, self.item.deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// One priority level: its FIFO, then the requests whose timeout passed under `DELAY`. Triton
/// keeps the delayed requests per level, so a delayed request still goes before every request
/// of a lower-priority level.
struct Level<T> {
    queue: VecDeque<Entry<T>>,
    delayed: VecDeque<Entry<T>>,
}

impl<T> Level<T> {
    fn new() -> Self {
        Level { queue: VecDeque::new(), delayed: VecDeque::new() }
    }
    fn len(&self) -> usize {
        self.queue.len() + self.delayed.len()
    }
}

/// The pending requests of one model version.
pub struct BatchQueue<T> {
    policy: BatchPolicy,
    levels: Vec<Level<T>>,
    len: usize,
    /// Rows over every queued entry (whatever their shapes).
    rows: usize,
}

impl<T: Pending> BatchQueue<T> {
    pub fn new(policy: BatchPolicy) -> Self {
        let levels = (0..policy.levels.len()).map(|_| Level::new()).collect();
        BatchQueue { policy, levels, len: 0, rows: 0 }
    }

    pub fn policy(&self) -> &BatchPolicy {
        &self.policy
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows queued over all entries.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Entries moved to a delayed queue (`DELAY`) that are still waiting, over all levels.
    pub fn delayed_len(&self) -> usize {
        self.levels.iter().map(|l| l.delayed.len()).sum()
    }

    /// Rows from which an early dispatch may have become possible: the smallest preferred
    /// size (any preferred size the queue reaches dispatches at once), else the maximum batch
    /// size. A batcher that sleeps until the delay ends needs waking on an arrival only once
    /// the queue holds this many rows, when it was empty, or when the arrival's shape differs
    /// from the head's (which may close the head's batch). Rows of every shape count, so this
    /// can only wake too often, never too rarely.
    pub fn wake_threshold(&self) -> usize {
        self.policy.preferred_batch_sizes.first().copied().unwrap_or(self.policy.max_batch_size)
    }

    /// The shape key of the request that would head the next batch.
    pub fn head_shape_key(&self) -> Option<&[i64]> {
        self.ordered().next().map(|e| e.item.shape_key())
    }

    /// Whether a request with `priority` would be refused now: its level's `max_queue_size`
    /// is reached.
    pub fn is_full_for(&self, priority: u64) -> bool {
        let level = self.policy.level_for(priority);
        let max = self.policy.levels[level - 1].max_queue_size;
        max > 0 && self.levels[level - 1].len() >= max
    }

    /// Makes room for a request with `priority` in a queue that is full as a whole (the
    /// worker's own bound, beyond Triton's per-level `max_queue_size`): takes out the newest
    /// request of the lowest-priority level holding any, when that level is below the new
    /// request's — a flood of low-priority traffic must not lock out higher priorities. The
    /// newest, so nobody older is overtaken; its delayed queue first (it would run last).
    /// `None` when every queued request has the new one's priority or a higher one.
    pub fn make_room_for(&mut self, priority: u64) -> Option<T> {
        let level = self.policy.level_for(priority);
        let lowest = self.levels.iter().rposition(|l| l.len() > 0)?;
        if lowest < level {
            return None; // index `lowest` is level `lowest + 1`: not below `level`
        }
        let victim = &mut self.levels[lowest];
        let entry = victim.delayed.pop_back().or_else(|| victim.queue.pop_back())?;
        self.len -= 1;
        self.rows -= entry.item.rows();
        Some(entry.item)
    }

    /// Queues `item` at the level for `priority`, with its timeout. Fails at once if the
    /// level's `max_queue_size` is reached (its delayed requests count). On success, returns
    /// the instant its queue timeout fires, if it has one, so a timer sleeping past that
    /// instant can be woken. (A caller's deadline is not reported: the caller's own wait ends
    /// at it, and the entry is dropped at the next expiry.)
    pub fn push(
        &mut self,
        item: T,
        priority: u64,
        timeout_us: u64,
        now: Instant,
    ) -> Result<Option<Instant>, QueueFull<T>> {
        if self.is_full_for(priority) {
            return Err(QueueFull(item));
        }
        let level = self.policy.level_for(priority);
        // A timeout too large for `Instant` never fires.
        let timeout_at = self.policy.timeout_for(level, timeout_us).and_then(|t| now.checked_add(t));
        self.rows += item.rows();
        self.levels[level - 1].queue.push_back(Entry { item, arrived: now, timeout_at });
        self.len += 1;
        Ok(timeout_at)
    }

    /// Removes cancelled entries and applies timeouts and deadlines due at `now`. Returns what
    /// was dropped; entries timed out under `DELAY` move to their level's delayed queue.
    pub fn expire(&mut self, now: Instant) -> Vec<(T, DropReason)> {
        let mut dropped = Vec::new();
        let gone = |e: &Entry<T>| e.item.is_cancelled() || e.item.deadline().is_some_and(|d| d <= now);
        for (index, level) in self.levels.iter_mut().enumerate() {
            // Most calls find nothing due: a level is rebuilt only when something in it is (a
            // full queue under overload is looked at often; copying it each time would hold
            // the lock for as long as it takes to copy thousands of entries).
            let due = level.delayed.iter().any(gone)
                || level.queue.iter().any(|e| gone(e) || e.timeout_at.is_some_and(|t| t <= now));
            if !due {
                continue;
            }
            let action = self.policy.levels[index].timeout_action;
            // Delayed entries first, so entries delayed now go behind those delayed before.
            for entry in std::mem::take(&mut level.delayed) {
                if entry.item.is_cancelled() {
                    dropped.push((entry.item, DropReason::Cancelled));
                } else if entry.item.deadline().is_some_and(|d| d <= now) {
                    dropped.push((entry.item, DropReason::DeadlineExceeded));
                } else {
                    level.delayed.push_back(entry);
                }
            }
            for entry in std::mem::take(&mut level.queue) {
                if entry.item.is_cancelled() {
                    dropped.push((entry.item, DropReason::Cancelled));
                } else if entry.item.deadline().is_some_and(|d| d <= now) {
                    dropped.push((entry.item, DropReason::DeadlineExceeded));
                } else if entry.timeout_at.is_some_and(|t| t <= now) {
                    match action {
                        TimeoutAction::Reject => dropped.push((entry.item, DropReason::Rejected)),
                        TimeoutAction::Delay => level.delayed.push_back(Entry { timeout_at: None, ..entry }),
                    }
                } else {
                    level.queue.push_back(entry);
                }
            }
        }
        self.len -= dropped.len();
        self.rows -= dropped.iter().map(|(item, _)| item.rows()).sum::<usize>();
        dropped
    }

    /// The earliest instant at which a queued request's timeout or its caller's deadline
    /// fires. After [`BatchQueue::expire`]`(now)` it is always later than `now`, so a timer
    /// that sleeps until it never spins.
    pub fn next_timeout(&self) -> Option<Instant> {
        self.ordered().filter_map(Entry::due).min()
    }

    /// Every entry in dispatch order: per level, its queue then its delayed queue.
    fn ordered(&self) -> impl Iterator<Item = &Entry<T>> {
        self.levels.iter().flat_map(|l| l.queue.iter().chain(l.delayed.iter()))
    }

    /// Decides what a free instance should run at `now`. Call [`BatchQueue::expire`] first.
    pub fn next_batch(&mut self, now: Instant) -> Decision<T> {
        let Some(head) = self.ordered().next() else {
            return Decision::Idle;
        };
        let key = head.item.shape_key().to_vec();
        // Walk the candidate batch without removing anything yet.
        let mut rows = 0usize;
        let mut count = 0usize;
        // The delay runs from the oldest request in the batch (as Triton's does), not from the
        // head: a higher-priority request that just arrived does not restart a lower one's wait.
        let mut oldest = head.arrived;
        // Where a batch goes before its delay has passed: requests up to the largest preferred
        // size reached so far (sizes only grow along the walk, so the last one reached is the
        // largest), or — when none was reached — up to where the next request would take the
        // batch past the largest preferred size.
        let mut preferred_count = None;
        let mut closed = false; // waiting cannot make this batch bigger
        // As Triton's batcher: the walk goes on past the largest preferred size (up to
        // `max_batch_size`), but only a batch whose delay has passed takes more than that.
        let max_preferred = self.policy.preferred_batch_sizes.last().copied();
        for entry in self.ordered() {
            let r = entry.item.rows();
            if entry.item.shape_key() != key.as_slice() || rows + r > self.policy.max_batch_size {
                closed = true;
                break;
            }
            if count > 0 && preferred_count.is_none() && max_preferred.is_some_and(|largest| rows + r > largest) {
                preferred_count = Some(count);
            }
            rows += r;
            count += 1;
            oldest = oldest.min(entry.arrived);
            if self.policy.preferred_batch_sizes.binary_search(&rows).is_ok() {
                preferred_count = Some(count);
            }
            if count == self.policy.max_requests || rows == self.policy.max_batch_size {
                closed = true;
                break;
            }
        }
        if count == 0 {
            // The head alone exceeds max_batch_size (validation prevents this): run it alone.
            return Decision::Dispatch(self.take_front(1));
        }
        // Already past the largest preferred size (a first request larger than all of them,
        // alone in the queue): as in Triton, it goes now, not after the delay — waiting cannot
        // bring the batch to a preferred size.
        if preferred_count.is_none() && max_preferred.is_some_and(|largest| rows > largest) {
            preferred_count = Some(count);
        }
        // A delay too large for `Instant` never passes; wait a day at a time.
        let deadline = oldest.checked_add(self.policy.max_queue_delay).unwrap_or(now + FAR);
        // A zero delay sends at once, but — as in Triton, where a zero delay is never
        // "exceeded" — still at the largest preferred size formed, if any.
        let no_delay = self.policy.max_queue_delay.is_zero();
        let delay_passed = !no_delay && deadline <= now;
        if !delay_passed && let Some(n) = preferred_count {
            return Decision::Dispatch(self.take_front(n));
        }
        if closed || delay_passed || no_delay {
            return Decision::Dispatch(self.take_front(count));
        }
        Decision::WaitUntil(deadline)
    }

    fn take_front(&mut self, mut n: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(n);
        'levels: for level in &mut self.levels {
            for queue in [&mut level.queue, &mut level.delayed] {
                while n > 0 {
                    match queue.pop_front() {
                        Some(e) => {
                            out.push(e.item);
                            n -= 1;
                        }
                        None => break,
                    }
                }
                if n == 0 {
                    break 'levels;
                }
            }
        }
        self.len -= out.len();
        self.rows -= out.iter().map(Pending::rows).sum::<usize>();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone, PartialEq)]
    struct Req {
        id: usize,
        rows: usize,
        key: Vec<i64>,
        cancelled: bool,
    }

    impl Pending for Req {
        fn rows(&self) -> usize {
            self.rows
        }
        fn shape_key(&self) -> &[i64] {
            &self.key
        }
        fn is_cancelled(&self) -> bool {
            self.cancelled
        }
    }

    fn policy(max: usize, preferred: Vec<usize>, delay_us: u64, levels: usize) -> BatchPolicy {
        BatchPolicy {
            max_batch_size: max,
            max_requests: usize::MAX,
            preferred_batch_sizes: preferred,
            max_queue_delay: Duration::from_micros(delay_us),
            levels: vec![LevelPolicy::default(); levels],
            default_level: 1,
        }
    }

    fn req(id: usize, rows: usize) -> Req {
        Req { id, rows, key: vec![4], cancelled: false }
    }

    #[test]
    fn waits_for_delay_then_dispatches() {
        let t0 = Instant::now();
        let mut q = BatchQueue::new(policy(8, vec![], 100, 1));
        q.push(req(0, 1), 0, 0, t0).unwrap();
        q.push(req(1, 2), 0, 0, t0).unwrap();
        assert_eq!(q.next_batch(t0), Decision::WaitUntil(t0 + Duration::from_micros(100)));
        match q.next_batch(t0 + Duration::from_micros(100)) {
            Decision::Dispatch(b) => assert_eq!(b.iter().map(|r| r.id).collect::<Vec<_>>(), vec![0, 1]),
            other => panic!("{other:?}"),
        }
        assert_eq!(q.next_batch(t0), Decision::Idle);
    }

    /// The delay runs from the oldest request in the batch: a high-priority request arriving
    /// late goes with the low-priority one that has waited the delay already.
    #[test]
    fn the_delay_runs_from_the_oldest_request_in_the_batch() {
        let t0 = Instant::now();
        let mut q = BatchQueue::new(policy(8, vec![], 100, 2));
        q.push(req(0, 1), 2, 0, t0).unwrap();
        let t90 = t0 + Duration::from_micros(90);
        q.push(req(1, 1), 1, 0, t90).unwrap();
        assert_eq!(q.next_batch(t90), Decision::WaitUntil(t0 + Duration::from_micros(100)));
        match q.next_batch(t0 + Duration::from_micros(100)) {
            Decision::Dispatch(b) => assert_eq!(b.iter().map(|r| r.id).collect::<Vec<_>>(), vec![1, 0]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn full_batch_dispatches_at_once() {
        let t0 = Instant::now();
        let mut q = BatchQueue::new(policy(4, vec![], 1_000_000, 1));
        for i in 0..5 {
            q.push(req(i, 1), 0, 0, t0).unwrap();
        }
        match q.next_batch(t0) {
            Decision::Dispatch(b) => assert_eq!(b.len(), 4),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn largest_reachable_preferred_dispatches_at_once() {
        let t0 = Instant::now();
        let mut q = BatchQueue::new(policy(64, vec![2, 4], 1_000_000, 1));
        q.push(req(0, 1), 0, 0, t0).unwrap();
        assert!(matches!(q.next_batch(t0), Decision::WaitUntil(_)));
        for i in 1..3 {
            q.push(req(i, 1), 0, 0, t0).unwrap();
        }
        // 3 queued: 2 is the largest preferred size they reach.
        match q.next_batch(t0) {
            Decision::Dispatch(b) => assert_eq!(b.len(), 2),
            other => panic!("{other:?}"),
        }
        for i in 3..7 {
            q.push(req(i, 1), 0, 0, t0).unwrap();
        }
        // 5 queued: 4 is reached, so 4 go, not 2.
        match q.next_batch(t0) {
            Decision::Dispatch(b) => assert_eq!(b.iter().map(|r| r.id).collect::<Vec<_>>(), vec![2, 3, 4, 5]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn different_shapes_do_not_mix() {
        let t0 = Instant::now();
        let mut q = BatchQueue::new(policy(8, vec![], 0, 1));
        q.push(req(0, 1), 0, 0, t0).unwrap();
        q.push(Req { id: 1, rows: 1, key: vec![5], cancelled: false }, 0, 0, t0).unwrap();
        q.push(req(2, 1), 0, 0, t0).unwrap();
        let ids = |d: Decision<Req>| match d {
            Decision::Dispatch(b) => b.into_iter().map(|r| r.id).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        assert_eq!(ids(q.next_batch(t0)), vec![0]);
        assert_eq!(ids(q.next_batch(t0)), vec![1]);
        assert_eq!(ids(q.next_batch(t0)), vec![2]);
    }

    #[test]
    fn queue_size_and_timeouts() {
        let t0 = Instant::now();
        let mut p = policy(8, vec![], 1000, 2);
        p.levels[1] = LevelPolicy {
            timeout_action: TimeoutAction::Reject,
            default_timeout: Some(Duration::from_micros(50)),
            allow_timeout_override: false,
            max_queue_size: 1,
        };
        p.levels[0].timeout_action = TimeoutAction::Delay;
        p.levels[0].allow_timeout_override = true;
        p.levels[0].default_timeout = Some(Duration::from_secs(3600));
        let mut q = BatchQueue::new(p);
        q.push(req(0, 1), 2, 0, t0).unwrap();
        assert!(q.push(req(1, 1), 2, 0, t0).is_err(), "level 2 holds one");
        q.push(req(2, 1), 1, 10, t0).unwrap(); // times out at 10 µs, delayed
        q.push(req(3, 1), 1, 0, t0).unwrap();
        let dropped = q.expire(t0 + Duration::from_micros(60));
        assert_eq!(dropped.iter().map(|(r, why)| (r.id, *why)).collect::<Vec<_>>(), vec![(0, DropReason::Rejected)]);
        match q.next_batch(t0 + Duration::from_micros(2000)) {
            Decision::Dispatch(b) => assert_eq!(b.iter().map(|r| r.id).collect::<Vec<_>>(), vec![3, 2]),
            other => panic!("{other:?}"),
        }
    }

    fn ids(d: Decision<Req>) -> Vec<usize> {
        match d {
            Decision::Dispatch(b) => b.into_iter().map(|r| r.id).collect(),
            other => panic!("expected a dispatch, got {other:?}"),
        }
    }

    /// The audit's case: preferred [2, 8], a 2 s delay, 2 requests queued → a batch of 2 goes
    /// at once, not only when the largest preferred size (8) is reached.
    #[test]
    fn a_smaller_preferred_size_dispatches_at_once() {
        let t0 = Instant::now();
        let mut q = BatchQueue::new(policy(8, vec![2, 8], 2_000_000, 1));
        q.push(req(0, 1), 0, 0, t0).unwrap();
        assert_eq!(q.next_batch(t0), Decision::WaitUntil(t0 + Duration::from_secs(2)));
        q.push(req(1, 1), 0, 0, t0).unwrap();
        assert_eq!(ids(q.next_batch(t0)), vec![0, 1]);
        // Three queued: the largest reachable preferred size is 2, so exactly 2 go.
        for i in 2..5 {
            q.push(req(i, 1), 0, 0, t0).unwrap();
        }
        assert_eq!(ids(q.next_batch(t0)), vec![2, 3]);
        // One left, below every preferred size: it waits for its delay, then goes alone.
        assert!(matches!(q.next_batch(t0), Decision::WaitUntil(_)));
        assert_eq!(ids(q.next_batch(t0 + Duration::from_secs(2))), vec![4]);
    }

    /// A lone request larger than the largest preferred size goes at once (as in Triton),
    /// rather than waiting out the delay for company it could not batch with anyway.
    #[test]
    fn a_lone_request_past_the_largest_preferred_size_goes_at_once() {
        let t0 = Instant::now();
        let mut q = BatchQueue::new(policy(16, vec![4, 8], 100_000, 1));
        q.push(req(0, 12), 0, 0, t0).unwrap();
        assert_eq!(ids(q.next_batch(t0)), vec![0]);
        // Below the largest preferred size it still waits.
        q.push(req(1, 6), 0, 0, t0).unwrap();
        assert_eq!(q.next_batch(t0), Decision::WaitUntil(t0 + Duration::from_millis(100)));
    }

    /// As Triton's batcher: before its delay has passed, a batch does not grow past the
    /// largest preferred size — the request that would take it past sends it at once (a batch
    /// of 5-row requests with preferred [8, 16] and max 32: 15 rows go now, not 20 after the
    /// delay); with no delay at all likewise. Once the delay has passed, everything that fits
    /// in `max_batch_size` goes (Triton sends the whole pending batch then).
    #[test]
    fn a_batch_stops_at_the_largest_preferred_size_until_its_delay_passes() {
        let t0 = Instant::now();
        let mut q = BatchQueue::new(policy(32, vec![8, 16], 100_000, 1));
        for i in 0..4 {
            q.push(req(i, 5), 0, 0, t0).unwrap();
        }
        assert_eq!(ids(q.next_batch(t0)), vec![0, 1, 2], "closed by the 4th, before the delay");
        let mut q = BatchQueue::new(policy(8, vec![2], 1000, 1));
        for i in 0..3 {
            q.push(req(i, 1), 0, 0, t0).unwrap();
        }
        assert_eq!(ids(q.next_batch(t0 + Duration::from_micros(999))), vec![0, 1], "before the delay");
        let mut q = BatchQueue::new(policy(8, vec![2], 1000, 1));
        for i in 0..3 {
            q.push(req(i, 1), 0, 0, t0).unwrap();
        }
        assert_eq!(ids(q.next_batch(t0 + Duration::from_micros(1000))), vec![0, 1, 2], "after the delay");
        // No delay: the largest preferred size formed goes (6 queued, preferred [4], max 8).
        let mut q = BatchQueue::new(policy(8, vec![4], 0, 1));
        for i in 0..6 {
            q.push(req(i, 1), 0, 0, t0).unwrap();
        }
        assert_eq!(ids(q.next_batch(t0)), vec![0, 1, 2, 3]);
        assert_eq!(ids(q.next_batch(t0)), vec![4, 5], "then what is left, at once");
    }

    #[test]
    fn request_timeout_only_shortens_the_default_and_only_when_allowed() {
        let ms = Duration::from_millis;
        let mut p = policy(8, vec![], 0, 1);
        let set = |p: &mut BatchPolicy, allow: bool, default: Option<Duration>| {
            p.levels[0].allow_timeout_override = allow;
            p.levels[0].default_timeout = default;
        };
        set(&mut p, true, Some(ms(100)));
        assert_eq!(p.timeout_for(1, 10_000), Some(ms(10)), "shorter: replaces the default");
        assert_eq!(p.timeout_for(1, 60_000_000), Some(ms(100)), "longer: the default stands");
        assert_eq!(p.timeout_for(1, 0), Some(ms(100)), "none asked: the default");
        set(&mut p, true, None);
        assert_eq!(p.timeout_for(1, 10_000), None, "no default (never): Triton applies no request timeout either");
        assert_eq!(p.timeout_for(1, 0), None);
        set(&mut p, false, Some(ms(100)));
        assert_eq!(p.timeout_for(1, 10_000), Some(ms(100)), "override not allowed: ignored");
        set(&mut p, false, None);
        assert_eq!(p.timeout_for(1, 10_000), None, "override not allowed, no default: no timeout");
    }

    #[test]
    fn delayed_requests_stay_ahead_of_lower_priority_levels() {
        let t0 = Instant::now();
        let mut p = policy(1, vec![], 0, 2);
        for level in &mut p.levels {
            level.timeout_action = TimeoutAction::Delay;
            level.allow_timeout_override = true;
            level.default_timeout = Some(Duration::from_secs(3600));
        }
        let mut q = BatchQueue::new(p);
        q.push(req(0, 1), 1, 10, t0).unwrap(); // level 1, times out → level 1 delayed
        q.push(req(1, 1), 1, 0, t0).unwrap(); // level 1
        q.push(req(2, 1), 2, 10, t0).unwrap(); // level 2, times out → level 2 delayed
        q.push(req(3, 1), 2, 0, t0).unwrap(); // level 2
        assert!(q.expire(t0 + Duration::from_micros(20)).is_empty());
        assert_eq!(q.delayed_len(), 2);
        let order: Vec<usize> = (0..4).flat_map(|_| ids(q.next_batch(t0))).collect();
        assert_eq!(order, vec![1, 0, 3, 2], "level 1, level 1 delayed, level 2, level 2 delayed");
    }

    #[test]
    fn a_callers_deadline_is_not_a_queue_rejection() {
        #[derive(Debug)]
        struct Deadlined(Instant);
        impl Pending for Deadlined {
            fn rows(&self) -> usize {
                1
            }
            fn shape_key(&self) -> &[i64] {
                &[]
            }
            fn is_cancelled(&self) -> bool {
                false
            }
            fn deadline(&self) -> Option<Instant> {
                Some(self.0)
            }
        }
        let t0 = Instant::now();
        let mut p = policy(8, vec![], 1_000_000, 1);
        p.levels[0].default_timeout = Some(Duration::from_micros(50));
        let mut q = BatchQueue::new(p);
        let due = q.push(Deadlined(t0 + Duration::from_micros(10)), 0, 0, t0).unwrap();
        assert_eq!(due, Some(t0 + Duration::from_micros(50)), "push reports the queue timeout");
        q.push(Deadlined(t0 + Duration::from_micros(500)), 0, 0, t0).unwrap();
        assert_eq!(q.next_timeout(), Some(t0 + Duration::from_micros(10)));
        let dropped: Vec<DropReason> = q.expire(t0 + Duration::from_micros(60)).into_iter().map(|(_, w)| w).collect();
        assert_eq!(dropped, vec![DropReason::DeadlineExceeded, DropReason::Rejected]);
        assert_eq!(q.next_timeout(), None);
    }

    #[test]
    fn huge_delays_and_timeouts_do_not_overflow() {
        let t0 = Instant::now();
        let mut p = policy(8, vec![], u64::MAX, 1);
        p.levels[0].default_timeout = Some(Duration::from_micros(u64::MAX));
        let mut q = BatchQueue::new(p);
        // Whether or not `Instant` can hold t0 + u64::MAX µs on this platform, nothing panics.
        q.push(req(0, 1), 0, 0, t0).unwrap();
        assert!(matches!(q.next_batch(t0), Decision::WaitUntil(t) if t > t0));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, .. ProptestConfig::default() })]

        /// Random arrivals, priorities, shapes, cancellations and polls: every invariant holds.
        #[test]
        fn batches_respect_every_rule(
            max in 1usize..16,
            delay_us in 0u64..500,
            levels in 1usize..4,
            preferred_raw in proptest::collection::vec(1usize..16, 0..3),
            ops in proptest::collection::vec((0u8..4, 1usize..5, 0u64..4, 0i64..2, 0u64..300, any::<bool>(), 0u64..600), 1..80),
            level_timeouts in proptest::collection::vec((proptest::option::of(1u64..600), any::<bool>()), 3),
        ) {
            let mut preferred: Vec<usize> = preferred_raw.into_iter().filter(|&p| p <= max).collect();
            preferred.sort();
            preferred.dedup();
            let t0 = Instant::now();
            // Every level REJECTs on timeout (DELAY's ordering has its own property below).
            let mut p = policy(max, preferred.clone(), delay_us, levels);
            for (level, (default_us, allow)) in p.levels.iter_mut().zip(&level_timeouts) {
                level.default_timeout = default_us.map(Duration::from_micros);
                level.allow_timeout_override = *allow;
            }
            let mut q = BatchQueue::new(p);
            // When each request's queue timeout fires, if it has one.
            let mut timeouts: std::collections::HashMap<usize, Option<Instant>> = Default::default();
            let mut now = t0;
            let mut arrivals: std::collections::HashMap<usize, (Instant, usize)> = Default::default();
            let mut next_id = 0;
            let mut dispatched = 0usize;
            let mut pushed = 0usize;
            for (op, rows, prio, key, advance_us, cancel, timeout_us) in ops {
                now += Duration::from_micros(advance_us);
                match op {
                    0 | 1 => {
                        let r = Req { id: next_id, rows: rows.min(max), key: vec![key], cancelled: cancel && op == 1 };
                        let level = q.policy().level_for(prio);
                        arrivals.insert(next_id, (now, level));
                        timeouts.insert(next_id, q.policy().timeout_for(level, timeout_us).map(|t| now + t));
                        q.push(r, prio, timeout_us, now).unwrap();
                        next_id += 1;
                        pushed += 1;
                    }
                    _ => {
                        let dropped = q.expire(now);
                        for (r, why) in &dropped {
                            match why {
                                DropReason::Cancelled => prop_assert!(r.cancelled),
                                DropReason::Rejected => prop_assert!(
                                    timeouts[&r.id].is_some_and(|t| t <= now),
                                    "rejected before its timeout"
                                ),
                                DropReason::DeadlineExceeded => prop_assert!(false, "no caller deadlines here"),
                            }
                        }
                        dispatched += dropped.len();
                        match q.next_batch(now) {
                            Decision::Dispatch(batch) => {
                                prop_assert!(!batch.is_empty());
                                let total: usize = batch.iter().map(|r| r.rows).sum();
                                prop_assert!(total <= max, "batch of {} rows exceeds {}", total, max);
                                prop_assert!(batch.iter().all(|r| !r.cancelled), "cancelled entry batched");
                                prop_assert!(
                                    batch.iter().all(|r| timeouts[&r.id].is_none_or(|t| t > now)),
                                    "timed-out entry batched"
                                );
                                prop_assert!(batch.iter().all(|r| r.key == batch[0].key), "shapes mixed");
                                // Priority order, then arrival order within a level.
                                let order: Vec<(usize, usize)> = batch.iter().map(|r| (arrivals[&r.id].1, r.id)).collect();
                                let mut sorted = order.clone();
                                sorted.sort();
                                prop_assert_eq!(&order, &sorted);
                                dispatched += batch.len();
                            }
                            Decision::WaitUntil(t) => {
                                prop_assert!(t > now, "asked to wait for the past");
                                // Never hold a request past its delay.
                                let oldest = arrivals.values().map(|(a, _)| *a).min();
                                prop_assert!(oldest.is_some());
                                prop_assert!(t <= now + Duration::from_micros(delay_us));
                            }
                            Decision::Idle => prop_assert!(q.is_empty()),
                        }
                    }
                }
            }
            // Drain: everything is eventually dispatched or dropped, nothing twice.
            now += Duration::from_secs(1);
            for _ in 0..10_000 {
                dispatched += q.expire(now).len();
                match q.next_batch(now) {
                    Decision::Dispatch(b) => dispatched += b.len(),
                    Decision::Idle => break,
                    Decision::WaitUntil(_) => prop_assert!(false, "waiting after every delay passed"),
                }
            }
            prop_assert_eq!(dispatched, pushed);
            prop_assert!(q.is_empty());
            prop_assert_eq!(q.rows(), 0);
        }

        /// Before the delay passes, the batch is exactly the longest prefix of the walk whose
        /// rows equal a preferred size (the largest reachable one), or — none reached — the
        /// prefix before the request that would take it past the largest preferred size;
        /// without either, a batch goes only when full or closed (a different shape, or
        /// `max_batch_size`); after the delay, the whole prefix that fits goes.
        #[test]
        fn largest_reachable_preferred_size_goes_at_once(
            max in 1usize..16,
            preferred_raw in proptest::collection::vec(1usize..16, 0..4),
            reqs in proptest::collection::vec((1usize..5, 0i64..2), 1..20),
            delay_passed in any::<bool>(),
        ) {
            let mut preferred: Vec<usize> = preferred_raw.into_iter().filter(|&p| p <= max).collect();
            preferred.sort();
            preferred.dedup();
            let t0 = Instant::now();
            let delay = Duration::from_secs(2);
            let mut q = BatchQueue::new(policy(max, preferred.clone(), delay.as_micros() as u64, 1));
            for (i, &(rows, key)) in reqs.iter().enumerate() {
                q.push(Req { id: i, rows: rows.min(max), key: vec![key], cancelled: false }, 0, 0, t0).unwrap();
            }
            // The oracle: walk the arrival order as the rules say.
            let (mut rows, mut count, mut best, mut closed) = (0, 0, None, false);
            let largest = preferred.last().copied();
            for &(r, key) in &reqs {
                let r = r.min(max);
                if key != reqs[0].1 || rows + r > max { closed = true; break; }
                if count > 0 && best.is_none() && largest.is_some_and(|l| rows + r > l) { best = Some(count); }
                rows += r;
                count += 1;
                if preferred.contains(&rows) { best = Some(count); }
                if rows == max { closed = true; break; }
            }
            // A walk already past the largest preferred size (its first request alone) goes too.
            if best.is_none() && largest.is_some_and(|l| rows > l) { best = Some(count); }
            let now = if delay_passed { t0 + delay } else { t0 };
            let expected = match (delay_passed, best) {
                (false, Some(n)) => Some(n),
                _ if closed || delay_passed => Some(count),
                _ => None,
            };
            match (q.next_batch(now), expected) {
                (Decision::Dispatch(b), Some(n)) => {
                    prop_assert_eq!(b.iter().map(|r| r.id).collect::<Vec<_>>(), (0..n).collect::<Vec<_>>());
                    if !delay_passed && best.is_some() {
                        let total: usize = b.iter().map(|r| r.rows).sum();
                        // (A first request larger than every preferred size goes alone.)
                        prop_assert!(largest.is_some_and(|l| total <= l) || b.len() == 1, "{} rows past the largest preferred size", total);
                    }
                }
                (Decision::WaitUntil(t), None) => prop_assert_eq!(t, t0 + delay),
                (got, want) => prop_assert!(false, "got {:?}, expected a batch of {:?}", got, want),
            }
        }

        /// With `DELAY`, whatever times out runs after the rest of its own level and before
        /// every lower-priority level: level 1, level 1 delayed, level 2, level 2 delayed, …
        #[test]
        fn delayed_entries_keep_their_level(
            levels in 1usize..4,
            reqs in proptest::collection::vec((1u64..4, any::<bool>()), 1..30),
        ) {
            let t0 = Instant::now();
            let mut p = policy(1, vec![], 0, levels);
            for level in &mut p.levels {
                level.timeout_action = TimeoutAction::Delay;
                level.allow_timeout_override = true;
                // A request's timeout applies only below a default (Triton's rule).
                level.default_timeout = Some(Duration::from_secs(3600));
            }
            let mut q = BatchQueue::new(p);
            let mut expected: Vec<(usize, bool, usize)> = vec![];
            for (i, &(prio, times_out)) in reqs.iter().enumerate() {
                q.push(req(i, 1), prio, if times_out { 10 } else { 0 }, t0).unwrap();
                expected.push((q.policy().level_for(prio), times_out, i));
            }
            prop_assert!(q.expire(t0 + Duration::from_micros(10)).is_empty());
            expected.sort();
            let mut order = vec![];
            for _ in 0..reqs.len() {
                order.extend(ids(q.next_batch(t0)));
            }
            prop_assert_eq!(order, expected.into_iter().map(|(_, _, i)| i).collect::<Vec<_>>());
            prop_assert!(q.is_empty());
        }

        /// A request's timeout never outlives the level's default, and counts only when
        /// overriding is allowed.
        #[test]
        fn timeout_override_only_shortens(
            allow in any::<bool>(),
            default_us in proptest::option::of(1u64..1_000_000),
            requested_us in 0u64..2_000_000,
        ) {
            let mut p = policy(8, vec![], 0, 1);
            p.levels[0].allow_timeout_override = allow;
            p.levels[0].default_timeout = default_us.map(Duration::from_micros);
            let got = p.timeout_for(1, requested_us);
            let default = p.levels[0].default_timeout;
            if let (Some(g), Some(d)) = (got, default) {
                prop_assert!(g <= d, "{:?} extends the default {:?}", g, d);
            }
            if !allow || requested_us == 0 {
                prop_assert_eq!(got, default);
            } else {
                let r = Duration::from_micros(requested_us);
                // Only shorter than a default; without one, none applies (Triton's rule).
                prop_assert_eq!(got, default.map(|d| d.min(r)));
            }
        }

        /// Highest-priority requests go first whatever arrives later.
        #[test]
        fn higher_priority_first(n_low in 1usize..6, n_high in 1usize..6) {
            let t0 = Instant::now();
            let mut q = BatchQueue::new(policy(1, vec![], 0, 2));
            for i in 0..n_low { q.push(req(i, 1), 2, 0, t0).unwrap(); }
            for i in 0..n_high { q.push(req(100 + i, 1), 1, 0, t0).unwrap(); }
            for i in 0..n_high {
                match q.next_batch(t0) {
                    Decision::Dispatch(b) => prop_assert_eq!(b[0].id, 100 + i),
                    other => prop_assert!(false, "{:?}", other),
                }
            }
        }
    }
}
