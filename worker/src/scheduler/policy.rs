//! Batch formation for the dynamic batcher, as a pure data structure: time is an argument, so
//! every rule is property-tested without a runtime (see the tests at the bottom).
//!
//! Rules (Triton's dynamic batcher semantics):
//! - Requests wait in one FIFO queue per priority level (1 = highest). A batch takes requests in
//!   priority order, then arrival order, and stops at the first request whose non-batch shapes
//!   differ from the head's or whose rows would exceed `max_batch_size` (so nobody is overtaken
//!   by a later request of the same level, and `preserve_ordering` holds).
//! - A batch is dispatched at once when it is full, when it reaches the largest
//!   `preferred_batch_size`, when nothing more can join it, when `max_queue_delay` is zero, or
//!   when its oldest request has waited `max_queue_delay`; otherwise the batcher waits until the
//!   oldest request's delay runs out.
//! - Queue policy per level: `max_queue_size` rejects at once when the level is full; a request
//!   whose timeout passes is rejected (`REJECT`) or moved behind every request that has not
//!   timed out (`DELAY`).
//! - Entries whose caller has gone are dropped before any batch forms.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What the policy needs to know about a queued request.
pub trait Pending {
    /// Rows (the batch dimension) this request contributes.
    fn rows(&self) -> usize;
    /// Non-batch shapes of all inputs; only equal keys batch together.
    fn shape_key(&self) -> &[i64];
    /// True when the caller no longer waits for the answer.
    fn is_cancelled(&self) -> bool;
    /// The caller's own deadline (e.g. `grpc-timeout`): past it the request is dropped as
    /// timed out whatever the queue policy says, since no one would read the answer.
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
        if priority == 0 || priority as usize > self.levels.len() { self.default_level } else { priority as usize }
    }

    /// The queue timeout for a request at `level` that asked for `requested` (0 = none).
    pub fn timeout_for(&self, level: usize, requested_us: u64) -> Option<Duration> {
        let policy = &self.levels[level - 1];
        if requested_us > 0 && (policy.allow_timeout_override || policy.default_timeout.is_none()) {
            // Triton: a request timeout applies when overriding is allowed; with no default it
            // is the only timeout there is.
            return Some(Duration::from_micros(requested_us));
        }
        policy.default_timeout
    }
}

/// Why an entry left the queue without running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// The caller went away.
    Cancelled,
    /// Its timeout passed under `TimeoutAction::Reject`.
    TimedOut,
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
    level: usize,
}

/// The pending requests of one model version.
pub struct BatchQueue<T> {
    policy: BatchPolicy,
    levels: Vec<VecDeque<Entry<T>>>,
    /// Requests whose timeout passed under `DELAY`: served after every other request.
    delayed: VecDeque<Entry<T>>,
    len: usize,
    /// Rows over every queued entry (whatever their shapes).
    rows: usize,
}

impl<T: Pending> BatchQueue<T> {
    pub fn new(policy: BatchPolicy) -> Self {
        let levels = (0..policy.levels.len()).map(|_| VecDeque::new()).collect();
        BatchQueue { policy, levels, delayed: VecDeque::new(), len: 0, rows: 0 }
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

    /// Rows at which waiting for more cannot help: the largest preferred size, else the
    /// maximum batch size. A batcher that sleeps until the delay ends needs waking only when
    /// the queue reaches this (or when it was empty).
    pub fn fill_target(&self) -> usize {
        self.policy.preferred_batch_sizes.last().copied().unwrap_or(self.policy.max_batch_size)
    }

    /// Queues `item` at the level for `priority`, with its timeout. Fails at once if the
    /// level's `max_queue_size` is reached.
    pub fn push(&mut self, item: T, priority: u64, timeout_us: u64, now: Instant) -> Result<(), QueueFull<T>> {
        let level = self.policy.level_for(priority);
        let policy = &self.policy.levels[level - 1];
        let at_level = self.levels[level - 1].len() + self.delayed.iter().filter(|e| e.level == level).count();
        if policy.max_queue_size > 0 && at_level >= policy.max_queue_size {
            return Err(QueueFull(item));
        }
        let timeout_at = self.policy.timeout_for(level, timeout_us).map(|t| now + t);
        self.rows += item.rows();
        self.levels[level - 1].push_back(Entry { item, arrived: now, timeout_at, level });
        self.len += 1;
        Ok(())
    }

    /// Removes cancelled entries and applies timeouts due at `now`. Returns what was dropped.
    pub fn expire(&mut self, now: Instant) -> Vec<(T, DropReason)> {
        let mut dropped = Vec::new();
        for level in 0..self.levels.len() {
            let action = self.policy.levels[level].timeout_action;
            let queue = std::mem::take(&mut self.levels[level]);
            for entry in queue {
                if entry.item.is_cancelled() {
                    dropped.push((entry.item, DropReason::Cancelled));
                } else if entry.item.deadline().is_some_and(|d| d <= now) {
                    dropped.push((entry.item, DropReason::TimedOut));
                } else if entry.timeout_at.is_some_and(|t| t <= now) {
                    match action {
                        TimeoutAction::Reject => dropped.push((entry.item, DropReason::TimedOut)),
                        TimeoutAction::Delay => self.delayed.push_back(Entry { timeout_at: None, ..entry }),
                    }
                } else {
                    self.levels[level].push_back(entry);
                }
            }
        }
        let delayed = std::mem::take(&mut self.delayed);
        for entry in delayed {
            if entry.item.is_cancelled() {
                dropped.push((entry.item, DropReason::Cancelled));
            } else if entry.item.deadline().is_some_and(|d| d <= now) {
                dropped.push((entry.item, DropReason::TimedOut));
            } else {
                self.delayed.push_back(entry);
            }
        }
        self.len -= dropped.len();
        self.rows -= dropped.iter().map(|(item, _)| item.rows()).sum::<usize>();
        dropped
    }

    /// The earliest instant at which a queued request's timeout fires.
    pub fn next_timeout(&self) -> Option<Instant> {
        let own = self.levels.iter().flatten().filter_map(|e| e.timeout_at);
        let callers = self.ordered().filter_map(|e| e.item.deadline());
        own.chain(callers).min()
    }

    fn ordered(&self) -> impl Iterator<Item = &Entry<T>> {
        self.levels.iter().flatten().chain(self.delayed.iter())
    }

    /// Decides what a free instance should run at `now`. Call [`BatchQueue::expire`] first.
    pub fn next_batch(&mut self, now: Instant) -> Decision<T> {
        let Some(head) = self.ordered().next() else {
            return Decision::Idle;
        };
        let key = head.item.shape_key().to_vec();
        let oldest = head.arrived;
        // Walk the candidate batch without removing anything yet.
        let largest_preferred = self.policy.preferred_batch_sizes.last().copied();
        let mut rows = 0usize;
        let mut count = 0usize;
        let mut closed = false; // waiting cannot make this batch better
        for entry in self.ordered() {
            let r = entry.item.rows();
            if count == self.policy.max_requests
                || entry.item.shape_key() != key.as_slice()
                || rows + r > self.policy.max_batch_size
            {
                closed = true;
                break;
            }
            rows += r;
            count += 1;
            if Some(rows) == largest_preferred || rows == self.policy.max_batch_size {
                closed = true;
                break;
            }
        }
        if count == 0 {
            // The head alone exceeds max_batch_size (validation prevents this): run it alone.
            count = 1;
            closed = true;
        }
        let deadline = oldest + self.policy.max_queue_delay;
        if !closed && count < self.policy.max_requests && deadline > now {
            return Decision::WaitUntil(deadline);
        }
        let take = count;
        Decision::Dispatch(self.take_front(take))
    }

    fn take_front(&mut self, mut n: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(n);
        for level in self.levels.iter_mut().chain(std::iter::once(&mut self.delayed)) {
            while n > 0 {
                match level.pop_front() {
                    Some(e) => {
                        out.push(e.item);
                        n -= 1;
                    }
                    None => break,
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
    fn largest_preferred_dispatches_at_once() {
        let t0 = Instant::now();
        let mut q = BatchQueue::new(policy(64, vec![2, 4], 1_000_000, 1));
        for i in 0..3 {
            q.push(req(i, 1), 0, 0, t0).unwrap();
        }
        assert!(matches!(q.next_batch(t0), Decision::WaitUntil(_)));
        q.push(req(3, 1), 0, 0, t0).unwrap();
        q.push(req(4, 1), 0, 0, t0).unwrap();
        match q.next_batch(t0) {
            Decision::Dispatch(b) => assert_eq!(b.len(), 4),
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
        let mut q = BatchQueue::new(p);
        q.push(req(0, 1), 2, 0, t0).unwrap();
        assert!(q.push(req(1, 1), 2, 0, t0).is_err(), "level 2 holds one");
        q.push(req(2, 1), 1, 10, t0).unwrap(); // times out at 10 µs, delayed
        q.push(req(3, 1), 1, 0, t0).unwrap();
        let dropped = q.expire(t0 + Duration::from_micros(60));
        assert_eq!(dropped.iter().map(|(r, why)| (r.id, *why)).collect::<Vec<_>>(), vec![(0, DropReason::TimedOut)]);
        match q.next_batch(t0 + Duration::from_micros(2000)) {
            Decision::Dispatch(b) => assert_eq!(b.iter().map(|r| r.id).collect::<Vec<_>>(), vec![3, 2]),
            other => panic!("{other:?}"),
        }
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
            ops in proptest::collection::vec((0u8..4, 1usize..5, 0u64..4, 0i64..2, 0u64..300, any::<bool>()), 1..80),
        ) {
            let mut preferred: Vec<usize> = preferred_raw.into_iter().filter(|&p| p <= max).collect();
            preferred.sort();
            preferred.dedup();
            let t0 = Instant::now();
            let mut q = BatchQueue::new(policy(max, preferred.clone(), delay_us, levels));
            let mut now = t0;
            let mut arrivals: std::collections::HashMap<usize, (Instant, usize)> = Default::default();
            let mut next_id = 0;
            let mut dispatched = 0usize;
            let mut pushed = 0usize;
            for (op, rows, prio, key, advance_us, cancel) in ops {
                now += Duration::from_micros(advance_us);
                match op {
                    0 | 1 => {
                        let r = Req { id: next_id, rows: rows.min(max), key: vec![key], cancelled: cancel && op == 1 };
                        arrivals.insert(next_id, (now, q.policy().level_for(prio)));
                        q.push(r, prio, 0, now).unwrap();
                        next_id += 1;
                        pushed += 1;
                    }
                    _ => {
                        let dropped = q.expire(now);
                        for (r, why) in &dropped {
                            prop_assert!(r.cancelled, "only cancelled entries drop without timeouts");
                            prop_assert_eq!(*why, DropReason::Cancelled);
                        }
                        dispatched += dropped.len();
                        match q.next_batch(now) {
                            Decision::Dispatch(batch) => {
                                prop_assert!(!batch.is_empty());
                                let total: usize = batch.iter().map(|r| r.rows).sum();
                                prop_assert!(total <= max, "batch of {} rows exceeds {}", total, max);
                                prop_assert!(batch.iter().all(|r| !r.cancelled), "cancelled entry batched");
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
