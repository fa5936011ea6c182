//! Balance: picks the worker for an [`InferCall`] from the current routing table — among the
//! ready workers holding the model version READY, minus those the call already failed on and
//! those ejected as outliers — by the power of two choices ([`p2c`]) on each worker's load: the
//! requests this gateway has outstanding on it plus the queue the worker last reported in-band
//! ([`Upstream::load`]).
//!
//! With many holders the two candidates are sampled directly (constant time, no allocation);
//! when sampling finds fewer than two usable ones, every holder is scanned.
//!
//! Ejected workers, in order of preference: a version's healthy ready holders; then its
//! healthy not-ready (draining) holders — a draining worker that serves beats one known to be
//! failing; then ejected ones after all (trying a suspect worker beats failing at once). And as
//! Envoy's panic threshold: with more than half of the holders ejected, ejection is ignored —
//! that many failing at once says more about the load than about them, and ejecting them would
//! pile the whole traffic on the rest. No eligible worker → [`RouteError`] (NOT_FOUND or
//! UNAVAILABLE), answered at once: the balancer never waits for one to appear.

mod layer;
mod p2c;
mod service;

use std::sync::Arc;
use std::time::Instant;

use rand::{Rng, RngExt};

pub use self::layer::BalanceLayer;
pub use self::p2c::p2c;
pub use self::service::Balance;
use crate::call::InferCall;
use crate::routing::{Route, RouteError, Routes, RoutingTable};
use crate::upstream::{Upstream, UpstreamId};

/// Up to this many holders, every one is scanned.
const SCAN_BELOW: usize = 8;
/// Random draws tried before falling back to a scan.
const SAMPLE_DRAWS: usize = 8;
/// Added to an ejected worker's load past the panic threshold: more than any real load.
const EJECTED_PENALTY: u64 = 1 << 40;

/// Chooses a worker among `holders` (indices into `table`), skipping `excluded`, and ejected
/// workers unless every remaining one is ejected (or more than half of `holders` are: the
/// panic threshold).
pub fn choose<'t, R: Rng + ?Sized>(
    table: &'t RoutingTable,
    holders: &[usize],
    excluded: &[UpstreamId],
    now: Instant,
    rng: &mut R,
) -> Option<&'t Arc<Upstream>> {
    choose_among(table, holders, excluded, now, rng, Ejected::AsLastResort)
}

/// What [`choose_among`] does with ejected workers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ejected {
    /// Skipped (unless the panic threshold is reached while a healthy one remains); `None`
    /// when only ejected ones remain, so that the caller tries other holders first.
    Skip,
    /// Skipped while a healthy one remains.
    AsLastResort,
}

fn choose_among<'t, R: Rng + ?Sized>(
    table: &'t RoutingTable,
    holders: &[usize],
    excluded: &[UpstreamId],
    now: Instant,
    rng: &mut R,
    ejected: Ejected,
) -> Option<&'t Arc<Upstream>> {
    if holders.len() > SCAN_BELOW {
        // Sample: two distinct usable holders in a few draws → the less loaded one. A draw
        // landing on an ejected worker sends the choice to the scan below, which counts the
        // ejected holders for the panic threshold (ejections are rare: the sampled path stays
        // the common one).
        let mut first: Option<(usize, &Arc<Upstream>)> = None;
        for _ in 0..SAMPLE_DRAWS {
            let i = rng.random_range(0..holders.len());
            let u = table.upstream(holders[i]);
            if excluded.contains(&u.id) {
                continue;
            }
            if u.is_ejected(now) {
                break;
            }
            match first {
                None => first = Some((i, u)),
                Some((j, f)) if j != i => return Some(if u.load(now) < f.load(now) { u } else { f }),
                Some(_) => {}
            }
        }
    }
    // One look at each holder's ejection: the panic threshold counts every holder, the pools
    // only those the call has not failed on.
    let mut ejected_holders = 0;
    let mut eligible: Vec<&Arc<Upstream>> = Vec::with_capacity(holders.len());
    let mut healthy: Vec<&Arc<Upstream>> = Vec::with_capacity(holders.len());
    for u in holders.iter().map(|&i| table.upstream(i)) {
        let is_ejected = u.is_ejected(now);
        ejected_holders += usize::from(is_ejected);
        if excluded.contains(&u.id) {
            continue;
        }
        eligible.push(u);
        if !is_ejected {
            healthy.push(u);
        }
    }
    let panic = ejected_holders * 2 > holders.len();
    let pool = match (healthy.is_empty(), ejected, panic) {
        (true, Ejected::Skip, _) => return None,
        (true, Ejected::AsLastResort, _) | (false, _, true) => eligible,
        (false, _, false) => healthy,
    };
    // Past the panic threshold an ejected worker is chosen only when both candidates are: by
    // load alone it would win nearly every time (a worker that refuses connections fails at
    // once, so it has nothing outstanding), taking most of the traffic off the healthy ones.
    let loads: Vec<u64> = pool
        .iter()
        .map(|u| u.load(now).saturating_add(if panic && u.is_ejected(now) { EJECTED_PENALTY } else { 0 }))
        .collect();
    p2c(&loads, rng).map(|i| pool[i])
}

/// Resolves the call's model version and picks its worker in one snapshot of the table: the
/// worker and the version resolved.
/// [`choose`] among the route's ready holders, else (all of them excluded or ejected) among
/// the healthy not-ready ones that still hold the version, else among the ejected ones.
pub fn choose_route<'t, R: Rng + ?Sized>(
    table: &'t RoutingTable,
    route: &Route<'_>,
    excluded: &[UpstreamId],
    now: Instant,
    rng: &mut R,
) -> Option<&'t Arc<Upstream>> {
    choose_among(table, route.holders, excluded, now, rng, Ejected::Skip)
        .or_else(|| choose_among(table, route.fallback, excluded, now, rng, Ejected::Skip))
        .or_else(|| choose(table, route.holders, excluded, now, rng))
        .or_else(|| choose(table, route.fallback, excluded, now, rng))
}

pub fn pick(routes: &Routes, call: &InferCall, now: Instant) -> Result<(Arc<Upstream>, i64), RouteError> {
    let table = routes.snapshot();
    let route = table.resolve(call.model(), call.version)?;
    choose_route(&table, &route, &call.excluded, now, &mut rand::rng())
        .map(|u| (u.clone(), route.version))
        .ok_or_else(|| RouteError::NoReadyWorker { model: call.model().to_string(), version: call.version })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outlier::Outcome;
    use crate::routing::WorkerState;
    use crate::routing::tests::{row, view};
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    /// A retry that excludes the only ready holder goes to a draining worker that still holds
    /// the version, rather than nowhere.
    #[tokio::test]
    async fn with_every_ready_holder_excluded_a_draining_holder_takes_the_call() {
        let t = RoutingTable::build(
            vec![
                view("a:1", WorkerState::Ready, vec![row("m", "1", "READY")]),
                view("d:1", WorkerState::NotReady, vec![row("m", "1", "READY")]),
            ],
            Instant::now(),
        );
        let (mut rng, now) = (StdRng::seed_from_u64(1), Instant::now());
        let route = t.resolve("m", None).unwrap();
        assert_eq!((route.holders, route.fallback), (&[0usize][..], &[1usize][..]));
        let a: UpstreamId = "a:1".into();
        assert_eq!(&*choose_route(&t, &route, &[], now, &mut rng).unwrap().id, "a:1");
        assert_eq!(&*choose_route(&t, &route, std::slice::from_ref(&a), now, &mut rng).unwrap().id, "d:1");
        assert!(choose_route(&t, &route, &[a, "d:1".into()], now, &mut rng).is_none());
    }

    #[tokio::test]
    async fn skips_excluded_and_ejected_workers_unless_all_are_ejected() {
        let t = RoutingTable::build(
            vec![
                view("a:1", WorkerState::Ready, vec![row("m", "1", "READY")]),
                view("b:1", WorkerState::Ready, vec![row("m", "1", "READY")]),
            ],
            Instant::now(),
        );
        let mut rng = StdRng::seed_from_u64(3);
        let now = Instant::now();
        let holders = t.resolve("m", None).unwrap().holders.to_vec();
        let a: UpstreamId = "a:1".into();
        let b: UpstreamId = "b:1".into();
        for _ in 0..20 {
            assert_eq!(choose(&t, &holders, std::slice::from_ref(&a), now, &mut rng).unwrap().id, b);
        }
        assert!(choose(&t, &holders, &[a.clone(), b.clone()], now, &mut rng).is_none());

        // Eject b: everything goes to a.
        for _ in 0..5 {
            t.upstream(1).record(Outcome::Failure, now, now);
        }
        assert!(t.upstream(1).is_ejected(now));
        for _ in 0..20 {
            assert_eq!(choose(&t, &holders, &[], now, &mut rng).unwrap().id, a);
        }
        // Only b is left (a excluded) and it is ejected: it is tried anyway.
        assert_eq!(choose(&t, &holders, std::slice::from_ref(&a), now, &mut rng).unwrap().id, b);
    }

    /// A ready holder known to be failing (ejected) loses to a healthy draining one that still
    /// serves the version; ejected holders are tried only when nothing healthy is left.
    #[tokio::test]
    async fn a_healthy_draining_holder_is_preferred_to_an_ejected_ready_one() {
        let t = RoutingTable::build(
            vec![
                view("a:1", WorkerState::Ready, vec![row("m", "1", "READY")]),
                view("d:1", WorkerState::NotReady, vec![row("m", "1", "READY")]),
            ],
            Instant::now(),
        );
        let (mut rng, now) = (StdRng::seed_from_u64(2), Instant::now());
        for _ in 0..5 {
            t.upstream(0).record(Outcome::Failure, now, now);
        }
        assert!(t.upstream(0).is_ejected(now));
        let route = t.resolve("m", Some(1)).unwrap();
        for _ in 0..20 {
            assert_eq!(&*choose_route(&t, &route, &[], now, &mut rng).unwrap().id, "d:1");
        }
        // The draining one failed this call already: the ejected one is tried after all.
        let d: UpstreamId = "d:1".into();
        assert_eq!(&*choose_route(&t, &route, std::slice::from_ref(&d), now, &mut rng).unwrap().id, "a:1");
    }

    /// As Envoy's panic threshold: with more than half of the holders ejected, ejection is
    /// ignored — the one healthy worker left does not take the whole traffic.
    #[tokio::test]
    async fn past_half_of_the_holders_ejected_ejection_is_ignored() {
        // (Sampled above 8 holders: 12 of 20 ejected must count as well as 19 of 20.)
        for (n, ejected) in [(3usize, 2usize), (20, 19), (20, 12)] {
            let views =
                (0..n).map(|i| view(&format!("w{i}:1"), WorkerState::Ready, vec![row("m", "1", "READY")])).collect();
            let t = RoutingTable::build(views, Instant::now());
            let holders = t.resolve("m", None).unwrap().holders.to_vec();
            let now = Instant::now();
            for i in n - ejected..n {
                for _ in 0..5 {
                    t.upstream(i).record(Outcome::Failure, now, now);
                }
            }
            let mut rng = StdRng::seed_from_u64(4);
            let to_ejected =
                (0..400).filter(|_| choose(&t, &holders, &[], now, &mut rng).unwrap().is_ejected(now)).count();
            assert!(to_ejected > 100, "{ejected} of {n} ejected: {to_ejected} of 400 picks went to ejected ones");
            // Only when both candidates are ejected: the healthy ones, busier as they may be,
            // keep their share (an ejected worker's empty queue does not win the comparison).
            let both = (ejected * (ejected - 1)) as f64 / (n * (n - 1)) as f64;
            for i in 0..n - ejected {
                let _busy: Vec<_> = (0..50).map(|_| t.upstream(i).start_request()).collect();
                let to_ejected =
                    (0..400).filter(|_| choose(&t, &holders, &[], now, &mut rng).unwrap().is_ejected(now)).count();
                let expected = 400.0 * both;
                assert!(
                    (to_ejected as f64) < expected * 1.3 + 20.0,
                    "{ejected} of {n} ejected, healthy w{i} busy: {to_ejected} of 400 picks went to ejected ones (expected about {expected:.0})"
                );
            }
            // Half of them ejected, not more: the healthy half takes everything.
            let views =
                (0..n).map(|i| view(&format!("v{i}:1"), WorkerState::Ready, vec![row("m", "1", "READY")])).collect();
            let t = RoutingTable::build(views, Instant::now());
            for i in 0..n / 2 {
                for _ in 0..5 {
                    t.upstream(i).record(Outcome::Failure, now, now);
                }
            }
            for _ in 0..100 {
                assert!(!choose(&t, &holders, &[], now, &mut rng).unwrap().is_ejected(now));
            }
        }
    }

    #[tokio::test]
    async fn prefers_the_less_loaded_worker() {
        let t = RoutingTable::build(
            vec![
                view("a:1", WorkerState::Ready, vec![row("m", "1", "READY")]),
                view("b:1", WorkerState::Ready, vec![row("m", "1", "READY")]),
            ],
            Instant::now(),
        );
        let _busy: Vec<_> = (0..3).map(|_| t.upstream(0).start_request()).collect();
        let mut rng = StdRng::seed_from_u64(5);
        for _ in 0..20 {
            assert_eq!(&*choose(&t, &[0, 1], &[], Instant::now(), &mut rng).unwrap().id, "b:1");
        }
        drop(_busy);
        assert_eq!(t.upstream(0).outstanding(), 0);

        // A worker's in-band queue report counts as load, while it is recent.
        t.upstream(1).report_queue(10);
        for _ in 0..20 {
            assert_eq!(&*choose(&t, &[0, 1], &[], Instant::now(), &mut rng).unwrap().id, "a:1");
        }
        let later = Instant::now() + crate::upstream::QUEUE_REPORT_TTL * 2;
        assert_eq!(t.upstream(1).reported_queue(later), 0, "stale reports are not believed");
    }

    #[tokio::test]
    async fn many_holders_sampled_skipping_excluded_and_ejected() {
        let views =
            (0..40).map(|i| view(&format!("w{i}:1"), WorkerState::Ready, vec![row("m", "1", "READY")])).collect();
        let t = RoutingTable::build(views, Instant::now());
        let holders = t.resolve("m", None).unwrap().holders.to_vec();
        let now = Instant::now();
        // All but w7 excluded or ejected: the scan fallback finds it.
        let excluded: Vec<UpstreamId> =
            (0..20).map(|i| UpstreamId::from(format!("w{i}:1"))).filter(|id| &**id != "w7:1").collect();
        for i in 20..40 {
            for _ in 0..5 {
                t.upstream(i).record(Outcome::Failure, now, now);
            }
        }
        let mut rng = StdRng::seed_from_u64(9);
        for _ in 0..50 {
            assert_eq!(&*choose(&t, &holders, &excluded, now, &mut rng).unwrap().id, "w7:1");
        }
        // Load steers sampling: the busy half is picked less than a quarter of the time.
        let t = RoutingTable::build(
            (0..40).map(|i| view(&format!("v{i}:1"), WorkerState::Ready, vec![row("m", "1", "READY")])).collect(),
            now,
        );
        for i in 0..20 {
            t.upstream(i).report_queue(100);
        }
        let busy = (0..4000)
            .filter(|_| {
                let id = choose(&t, &holders, &[], Instant::now(), &mut rng).unwrap().id.clone();
                id[1..id.len() - 2].parse::<usize>().unwrap() < 20
            })
            .count();
        assert!(busy < 1200, "busy workers picked {busy} of 4000 times (random choice: ~2000, p2c: ~975)");
    }
}
