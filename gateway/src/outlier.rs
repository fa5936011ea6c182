//! Outlier ejection for one worker: a pure state machine on an explicit clock.
//!
//! A worker that fails `consecutive_failures` requests in a row — connection refused or reset,
//! an UNAVAILABLE answer (draining, unloading), or a timeout when the gateway's own limit
//! (`--request-timeout-ms`) set the deadline, not a client's tighter one — is *ejected*: the balancer skips it for
//! `base_ejection × 2^k` (capped at `max_ejection`), `k` being the ejections in a row before
//! this one. When the period ends the worker is on *probation*: it takes traffic again; its
//! first success re-admits it fully (and resets `k`), its first failure ejects it again for
//! twice as long. Outcomes reported while it is ejected, and failures on probation of requests
//! sent before it (stragglers that were already in flight), change nothing. Any answer other than UNAVAILABLE — even an error such as
//! INVALID_ARGUMENT — shows the worker is up and counts as a success; except INTERNAL, UNKNOWN
//! and DATA_LOSS, which may say the worker is broken (a GPU fault, a dead backend answering
//! every request at once — and, with little load, drawing most of the traffic) or only that a
//! request was (an input that makes the model fail): only [`CLIENT_TIMEOUT_FACTOR`] ×
//! `consecutive_failures` of them in a row, with no success between, eject it.
//!
//! A timeout a client's own, tighter deadline set is no failure by itself (the client may ask
//! for less than the model takes under load; a stream's deadline times out all its requests at
//! once), but a worker that has answered nothing for `hung_after` while
//! [`CLIENT_TIMEOUT_FACTOR`] × `consecutive_failures` requests in a row ran into such deadlines
//! is hung (a stuck model still answers PINGs and readiness polls): ejected the same way, and
//! again, on probation, only by the same rule (never by one client timeout).
//!
//! The balancer ignores ejections when every worker holding a model is ejected (better to try a
//! suspect worker than to fail the request outright), as Envoy's panic threshold does.

use std::time::{Duration, Instant};

use crate::config::OutlierConfig;

/// What a finished request says about the worker's health.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The worker answered (whatever the status, except UNAVAILABLE).
    Success,
    /// Connection failure, UNAVAILABLE, or the gateway's own timeout.
    Failure,
    /// The client's own deadline passed while the worker held the request.
    ClientTimeout,
    /// The worker answered INTERNAL, UNKNOWN or DATA_LOSS.
    ServerError,
    /// Says nothing about the worker (e.g. the client cancelled or its deadline passed).
    Neutral,
}

/// How many more client timeouts (or server errors) than failures in a row eject a worker.
pub const CLIENT_TIMEOUT_FACTOR: u32 = 4;

#[derive(Clone, Debug)]
pub struct OutlierDetector {
    config: OutlierConfig,
    consecutive_failures: u32,
    /// Client timeouts since the last answer.
    consecutive_client_timeouts: u32,
    /// Server errors since the last success.
    consecutive_server_errors: u32,
    /// Since when the worker has answered nothing while the current run of client timeouts
    /// waited: the later of its last answer and the first of those requests' send times.
    run_started: Option<Instant>,
    /// When the worker last answered.
    last_answer: Option<Instant>,
    /// Ejections in a row without a success in between (drives the backoff).
    ejections_in_a_row: u32,
    /// Set while ejected; kept once the period is over (probation) until the next outcome.
    ejected_until: Option<Instant>,
}

impl OutlierDetector {
    pub fn new(config: OutlierConfig) -> Self {
        OutlierDetector {
            config,
            consecutive_failures: 0,
            consecutive_client_timeouts: 0,
            consecutive_server_errors: 0,
            run_started: None,
            last_answer: None,
            ejections_in_a_row: 0,
            ejected_until: None,
        }
    }

    /// Whether the balancer should skip this worker at `now`.
    pub fn is_ejected(&self, now: Instant) -> bool {
        self.ejected_until.is_some_and(|until| now < until)
    }

    /// Records a request sent at `started` that finished at `now`; returns `true` when this
    /// outcome ejected the worker.
    pub fn record(&mut self, outcome: Outcome, started: Instant, now: Instant) -> bool {
        if self.is_ejected(now) {
            return false;
        }
        let on_probation = self.ejected_until.is_some();
        // On probation, only requests sent since it began say how the worker does now: one
        // sent before the ejection (a straggler, up to the request timeout late) would renew
        // it, and ever longer, for a failure that was already counted.
        let failing = matches!(outcome, Outcome::Failure | Outcome::ClientTimeout);
        if on_probation && failing && self.ejected_until.is_some_and(|until| started < until) {
            return false;
        }
        match outcome {
            Outcome::Neutral => false,
            Outcome::ClientTimeout => {
                // Silent since the run's first request was sent — not since the last answer,
                // which may be long ago on a lightly loaded worker that a burst now finds —
                // and, with long client deadlines, not before the last answer either.
                let since = self.last_answer.map_or(started, |answered| answered.max(started));
                let run_started = *self.run_started.get_or_insert(since);
                self.consecutive_client_timeouts += 1;
                let limit = self.config.consecutive_failures.saturating_mul(CLIENT_TIMEOUT_FACTOR);
                if self.consecutive_client_timeouts >= limit
                    && now.saturating_duration_since(run_started) >= self.config.hung_after
                {
                    self.eject(now);
                    true
                } else {
                    false
                }
            }
            Outcome::ServerError => {
                // An answer: the worker is not hung.
                self.consecutive_client_timeouts = 0;
                self.run_started = None;
                self.last_answer = Some(now);
                self.consecutive_server_errors += 1;
                let limit = self.config.consecutive_failures.saturating_mul(CLIENT_TIMEOUT_FACTOR);
                if self.consecutive_server_errors >= limit {
                    self.eject(now);
                    true
                } else {
                    false
                }
            }
            Outcome::Success => {
                self.consecutive_failures = 0;
                self.consecutive_client_timeouts = 0;
                self.consecutive_server_errors = 0;
                self.run_started = None;
                self.last_answer = Some(now);
                if on_probation {
                    self.ejected_until = None;
                    self.ejections_in_a_row = 0;
                }
                false
            }
            Outcome::Failure => {
                self.consecutive_failures += 1;
                if on_probation || self.consecutive_failures >= self.config.consecutive_failures {
                    self.eject(now);
                    true
                } else {
                    false
                }
            }
        }
    }

    /// The ejection period for the next ejection.
    pub fn next_ejection(&self) -> Duration {
        let factor = 1u32.checked_shl(self.ejections_in_a_row.min(31)).unwrap_or(u32::MAX);
        self.config.base_ejection.saturating_mul(factor).min(self.config.max_ejection)
    }

    fn eject(&mut self, now: Instant) {
        self.ejected_until = Some(now + self.next_ejection());
        self.ejections_in_a_row = self.ejections_in_a_row.saturating_add(1);
        self.consecutive_failures = 0;
        self.consecutive_client_timeouts = 0;
        self.consecutive_server_errors = 0;
        self.run_started = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn config() -> OutlierConfig {
        OutlierConfig {
            consecutive_failures: 3,
            base_ejection: Duration::from_secs(1),
            max_ejection: Duration::from_secs(5),
            hung_after: Duration::from_secs(10),
        }
    }

    /// A worker answering INTERNAL to everything is ejected after 4 × `consecutive_failures`
    /// of them in a row; a success between (other requests doing fine: a bad input, not a
    /// broken worker) starts the count over.
    #[test]
    fn server_errors_in_a_row_eject_and_a_success_between_forgives() {
        let t0 = Instant::now();
        let mut d = OutlierDetector::new(config());
        let limit = 3 * CLIENT_TIMEOUT_FACTOR;
        for _ in 0..limit - 1 {
            assert!(!d.record(Outcome::ServerError, t0, t0));
        }
        assert!(!d.record(Outcome::Success, t0, t0));
        for _ in 0..limit - 1 {
            assert!(!d.record(Outcome::ServerError, t0, t0));
        }
        assert!(d.record(Outcome::ServerError, t0, t0), "the twelfth in a row ejects");
        assert!(d.is_ejected(t0));
    }

    #[test]
    fn ejects_after_consecutive_failures_and_readmits_after_the_period() {
        let t0 = Instant::now();
        let mut d = OutlierDetector::new(config());
        assert!(!d.record(Outcome::Failure, t0, t0));
        assert!(!d.record(Outcome::Failure, t0, t0));
        // A success in between resets the count.
        assert!(!d.record(Outcome::Success, t0, t0));
        assert!(!d.record(Outcome::Failure, t0, t0));
        assert!(!d.record(Outcome::Failure, t0, t0));
        assert!(!d.is_ejected(t0));
        assert!(d.record(Outcome::Failure, t0, t0), "third failure in a row ejects");
        assert!(d.is_ejected(t0));
        assert!(d.is_ejected(t0 + Duration::from_millis(999)));
        // Stragglers while ejected change nothing.
        assert!(!d.record(Outcome::Failure, t0, t0 + Duration::from_millis(500)));
        assert!(!d.record(Outcome::Success, t0, t0 + Duration::from_millis(500)));
        // Re-admitted (on probation) once the period is over.
        let t1 = t0 + Duration::from_secs(1);
        assert!(!d.is_ejected(t1));
        // A failure on probation ejects again at once, for twice as long.
        assert!(d.record(Outcome::Failure, t1, t1));
        assert!(d.is_ejected(t1 + Duration::from_millis(1999)));
        let t2 = t1 + Duration::from_secs(2);
        assert!(!d.is_ejected(t2));
        // A success on probation re-admits fully: the backoff starts over.
        assert!(!d.record(Outcome::Success, t2, t2));
        assert_eq!(d.next_ejection(), Duration::from_secs(1));
        assert!(!d.record(Outcome::Failure, t2, t2), "no longer on probation: one failure is not enough");
    }

    /// On probation, a failure of a request sent before the ejection ended (a straggler: up to
    /// the request timeout late) neither renews nor doubles it; one sent since does.
    #[test]
    fn stragglers_failing_on_probation_do_not_renew_the_ejection() {
        let t0 = Instant::now();
        let mut d = OutlierDetector::new(config());
        for _ in 0..3 {
            d.record(Outcome::Failure, t0, t0);
        }
        let t1 = t0 + Duration::from_secs(1);
        assert!(!d.is_ejected(t1), "on probation");
        // Sent at t0, failing only now.
        assert!(!d.record(Outcome::Failure, t0, t1 + Duration::from_secs(30)));
        assert!(!d.is_ejected(t1 + Duration::from_secs(30)));
        // Sent on probation, failing: ejected again, for twice as long.
        let t2 = t1 + Duration::from_secs(31);
        assert!(d.record(Outcome::Failure, t1 + Duration::from_secs(30), t2));
        assert!(d.is_ejected(t2 + Duration::from_millis(1999)));
    }

    #[test]
    fn backoff_is_capped() {
        let mut now = Instant::now();
        let mut d = OutlierDetector::new(config());
        for _ in 0..3 {
            d.record(Outcome::Failure, now, now);
        }
        let mut periods = vec![];
        for _ in 0..6 {
            let start = now;
            while d.is_ejected(now) {
                now += Duration::from_millis(100);
            }
            periods.push((now - start).as_millis());
            assert!(d.record(Outcome::Failure, now, now));
        }
        assert_eq!(periods, vec![1000, 2000, 4000, 5000, 5000, 5000]);
    }

    #[test]
    fn neutral_outcomes_count_for_nothing() {
        let t0 = Instant::now();
        let mut d = OutlierDetector::new(config());
        d.record(Outcome::Failure, t0, t0);
        d.record(Outcome::Failure, t0, t0);
        d.record(Outcome::Neutral, t0, t0);
        assert!(d.record(Outcome::Failure, t0, t0));
    }

    /// A hung worker (every request runs into its client's own deadline, nothing answered for
    /// `hung_after`) is ejected after CLIENT_TIMEOUT_FACTOR times as many as failures would
    /// take. Any answer starts over; a burst of timeouts at once — a stream's deadline, a load
    /// spike, even on a worker idle for long before — does not span `hung_after` and ejects
    /// nothing; nor does one client timeout on probation.
    #[test]
    fn client_timeouts_eject_only_a_worker_that_answers_nothing_for_a_while() {
        let t0 = Instant::now();
        let hung = config().hung_after;
        let limit = config().consecutive_failures * CLIENT_TIMEOUT_FACTOR;
        let second = Duration::from_secs(1);
        let mut d = OutlierDetector::new(config());
        assert!(!d.record(Outcome::Success, t0, t0));
        // Idle for a minute, then a burst: every request sent within its 1 s deadline.
        let t1 = t0 + hung * 6;
        for _ in 0..limit * 10 {
            assert!(!d.record(Outcome::ClientTimeout, t1 - second, t1));
        }
        // An answer starts over; then a run of timeouts spanning `hung_after`: ejected once
        // both hold.
        let t2 = t1 + second;
        assert!(!d.record(Outcome::Success, t2, t2));
        let sent = |k: u32| t2 + (hung / limit) * k;
        for k in 0..limit {
            assert!(!d.record(Outcome::ClientTimeout, sent(k), sent(k) + second / 2), "timeout {k}");
        }
        let t3 = sent(0) + hung;
        assert!(d.record(Outcome::ClientTimeout, t3 - second / 2, t3));
        assert!(d.is_ejected(t3));
        // On probation, one client timeout is not enough: the same rule, from scratch.
        let t4 = t3 + second;
        assert!(!d.is_ejected(t4));
        for k in 0..limit {
            assert!(!d.record(Outcome::ClientTimeout, t4, t4 + (hung / limit) * k), "probation timeout {k}");
        }
        assert!(d.record(Outcome::ClientTimeout, t4, t4 + hung));
        // Long client deadlines: requests sent before the last answer time out right after it;
        // the silence runs from that answer.
        let t5 = t4 + hung * 3;
        let mut d = OutlierDetector::new(config());
        assert!(!d.record(Outcome::Success, t5, t5));
        for _ in 0..limit * 2 {
            assert!(!d.record(Outcome::ClientTimeout, t5 - hung * 3, t5 + second));
        }
        assert!(d.record(Outcome::ClientTimeout, t5 - hung * 3, t5 + hung));
        // Never answered at all: silent since the first request that timed out was sent.
        let mut fresh = OutlierDetector::new(config());
        for _ in 0..limit {
            assert!(!fresh.record(Outcome::ClientTimeout, t0, t0 + second));
        }
        assert!(fresh.record(Outcome::ClientTimeout, t0 + second, t0 + hung));
    }

    proptest! {
        /// Whatever the outcomes: an ejection lasts between the base and the max period, and a
        /// worker is never ejected without `consecutive_failures` failures in a row (or one on
        /// probation) right before, or CLIENT_TIMEOUT_FACTOR times as many client timeouts over
        /// at least `hung_after` of silence (from the later of the last answer and the run's
        /// first send).
        #[test]
        fn ejections_are_bounded(steps in proptest::collection::vec((0u8..5, 0u64..3000, 0u64..20_000), 1..300)) {
            let cfg = config();
            let mut now = Instant::now() + Duration::from_secs(60);
            let mut d = OutlierDetector::new(cfg);
            let (mut run, mut timeouts, mut server_errors) = (0u32, 0u32, 0u32);
            // The model's own account of the silence a run of client timeouts spans.
            let (mut last_success, mut silent_since): (Option<Instant>, Option<Instant>) = (None, None);
            for (o, dt, back) in steps {
                now += Duration::from_millis(dt);
                // Sent up to 20 s before it finished (a client's deadline).
                let started = now - Duration::from_millis(back);
                let outcome = [Outcome::Success, Outcome::Failure, Outcome::Neutral, Outcome::ClientTimeout, Outcome::ServerError][o as usize];
                let was_ejected = d.is_ejected(now);
                let on_probation = d.ejected_until.is_some() && !was_ejected;
                let straggler = on_probation
                    && matches!(outcome, Outcome::Failure | Outcome::ClientTimeout)
                    && d.ejected_until.is_some_and(|until| started < until);
                if !was_ejected && !straggler {
                    match outcome {
                        Outcome::Failure => run += 1,
                        Outcome::ClientTimeout => {
                            timeouts += 1;
                            silent_since.get_or_insert(last_success.map_or(started, |s| s.max(started)));
                        }
                        Outcome::Success => {
                            (run, timeouts, server_errors) = (0, 0, 0);
                            silent_since = None;
                            last_success = Some(now);
                        }
                        // An answer (the worker is not silent), but no success.
                        Outcome::ServerError => {
                            server_errors += 1;
                            timeouts = 0;
                            silent_since = None;
                            last_success = Some(now);
                        }
                        Outcome::Neutral => {}
                    }
                }
                let ejected = d.record(outcome, started, now);
                if ejected {
                    prop_assert!(!was_ejected);
                    let by_failures = run >= cfg.consecutive_failures || (on_probation && outcome == Outcome::Failure);
                    let by_server_errors = outcome == Outcome::ServerError
                        && server_errors >= cfg.consecutive_failures * CLIENT_TIMEOUT_FACTOR;
                    if !by_failures && !by_server_errors {
                        // By client timeouts: enough of them, spanning `hung_after` of silence.
                        prop_assert_eq!(outcome, Outcome::ClientTimeout);
                        prop_assert!(timeouts >= cfg.consecutive_failures * CLIENT_TIMEOUT_FACTOR);
                        prop_assert!(silent_since.is_some_and(|since| now.saturating_duration_since(since) >= cfg.hung_after));
                    }
                    (run, timeouts, server_errors) = (0, 0, 0);
                    silent_since = None;
                    let until = d.ejected_until.unwrap();
                    prop_assert!(until - now >= cfg.base_ejection && until - now <= cfg.max_ejection);
                    prop_assert!(d.is_ejected(now));
                    prop_assert!(!d.is_ejected(now + cfg.max_ejection));
                }
            }
        }
    }
}
