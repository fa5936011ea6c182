//! A retry budget (after Finagle / Linkerd): retries may add at most `percent`% to the request
//! load over a sliding window, plus a small floor of `min_per_sec` per second so that a quiet
//! gateway can still retry. When the budget is spent a retry is simply not attempted — the
//! original error goes back to the client — so retries can never multiply load during an outage.
//!
//! The window is [`WINDOW_SECS`] one-second buckets on an explicit clock (`now` is passed in),
//! so the budget is tested without sleeping. One short mutex section per call.

use std::sync::Mutex;
use std::time::Instant;

/// Length of the sliding window, in seconds.
pub const WINDOW_SECS: usize = 10;

#[derive(Debug)]
pub struct RetryBudget {
    percent: u64,
    min_per_sec: u64,
    start: Instant,
    inner: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    /// Second (since `start`) of the newest bucket.
    current: u64,
    /// (requests, retries) per second, indexed by second % WINDOW_SECS.
    buckets: [(u64, u64); WINDOW_SECS],
}

impl Window {
    fn advance(&mut self, second: u64) {
        if second <= self.current {
            return;
        }
        let stale = (second - self.current).min(WINDOW_SECS as u64);
        for s in 1..=stale {
            self.buckets[((self.current + s) % WINDOW_SECS as u64) as usize] = (0, 0);
        }
        self.current = second;
    }

    fn totals(&self) -> (u64, u64) {
        self.buckets.iter().fold((0, 0), |(r, t), (br, bt)| (r + br, t + bt))
    }

    fn bucket(&mut self) -> &mut (u64, u64) {
        &mut self.buckets[(self.current % WINDOW_SECS as u64) as usize]
    }
}

impl RetryBudget {
    pub fn new(percent: u32, min_per_sec: u32, start: Instant) -> Self {
        RetryBudget {
            percent: percent.min(100) as u64,
            min_per_sec: min_per_sec as u64,
            start,
            inner: Mutex::new(Window::default()),
        }
    }

    fn second(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.start).as_secs()
    }

    /// Counts one original request (not a retry).
    pub fn deposit(&self, now: Instant) {
        let mut w = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        w.advance(self.second(now));
        w.bucket().0 += 1;
    }

    /// Takes one retry from the budget; `false` when it is spent (do not retry).
    pub fn try_withdraw(&self, now: Instant) -> bool {
        if self.percent == 0 && self.min_per_sec == 0 {
            return false;
        }
        let mut w = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        w.advance(self.second(now));
        let (requests, retries) = w.totals();
        if retries < self.allowed(requests) {
            w.bucket().1 += 1;
            true
        } else {
            false
        }
    }

    /// Retries allowed in a window holding `requests` original requests.
    fn allowed(&self, requests: u64) -> u64 {
        if self.percent == 0 {
            return 0;
        }
        self.min_per_sec * WINDOW_SECS as u64 + requests * self.percent / 100
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

    #[test]
    fn percent_of_requests_plus_floor() {
        let t0 = Instant::now();
        let b = RetryBudget::new(20, 1, t0);
        // Floor: 1/s over a 10 s window = 10 retries with no traffic at all.
        for _ in 0..10 {
            assert!(b.try_withdraw(t0));
        }
        assert!(!b.try_withdraw(t0));
        // 100 requests add 20 more.
        for _ in 0..100 {
            b.deposit(t0);
        }
        for _ in 0..20 {
            assert!(b.try_withdraw(t0));
        }
        assert!(!b.try_withdraw(t0));
        // The window slides: after 10 s everything has expired and the floor is back.
        let later = t0 + Duration::from_secs(WINDOW_SECS as u64);
        assert!(b.try_withdraw(later));
    }

    #[test]
    fn zero_percent_disables_retries() {
        let t0 = Instant::now();
        let b = RetryBudget::new(0, 10, t0);
        b.deposit(t0);
        assert!(!b.try_withdraw(t0));
    }

    proptest! {
        /// Over any sequence of requests and retry attempts on a non-decreasing clock, a retry
        /// is granted exactly when the retries already granted in the window are fewer than the
        /// floor plus `percent`% of the requests in the window (checked against a naive model).
        #[test]
        fn grants_exactly_within_the_budget(
            percent in 1u32..=100,
            floor in 0u32..5,
            steps in proptest::collection::vec((any::<bool>(), 0u64..700), 1..400),
        ) {
            let t0 = Instant::now();
            let b = RetryBudget::new(percent, floor, t0);
            let mut now = t0;
            let mut events: Vec<(u64, bool)> = vec![]; // (second, is_request) of counted events
            for (is_request, dt_ms) in steps {
                now += Duration::from_millis(dt_ms);
                let sec = (now - t0).as_secs();
                let lo = sec.saturating_sub(WINDOW_SECS as u64 - 1);
                let in_window = |req: bool| events.iter().filter(|e| e.0 >= lo && e.1 == req).count() as u64;
                if is_request {
                    b.deposit(now);
                    events.push((sec, true));
                } else {
                    let allowed = floor as u64 * WINDOW_SECS as u64 + in_window(true) * percent as u64 / 100;
                    let expected = in_window(false) < allowed;
                    prop_assert_eq!(b.try_withdraw(now), expected);
                    if expected {
                        events.push((sec, false));
                    }
                }
            }
        }
    }
}
