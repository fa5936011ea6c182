//! The power of two choices (Mitzenmacher, "The Power of Two Choices in Randomized Load
//! Balancing", 2001; as in tower's and Linkerd's p2c balancers): sample two distinct candidates
//! uniformly at random and take the less loaded. It keeps the maximum load within O(log log n)
//! of the mean, needs no global ordering, and — unlike "always the least loaded" — does not herd
//! every gateway onto the same worker between load updates.

use rand::{Rng, RngExt};

/// The index (into `loads`) of the chosen candidate, or `None` when there is none. Ties go to
/// the first of the two sampled, which is itself uniformly random.
pub fn p2c<R: Rng + ?Sized>(loads: &[u64], rng: &mut R) -> Option<usize> {
    match loads.len() {
        0 => None,
        1 => Some(0),
        n => {
            let a = rng.random_range(0..n);
            // A second index distinct from `a`, uniform over the other n - 1.
            let b = (a + 1 + rng.random_range(0..n - 1)) % n;
            Some(if loads[b] < loads[a] { b } else { a })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    proptest! {
        /// The choice is a valid index and, with two or more candidates, never the unique
        /// most-loaded one: some other candidate is at least as loaded.
        #[test]
        fn picks_a_valid_not_most_loaded_candidate(loads in proptest::collection::vec(0u64..50, 0..20), seed: u64) {
            let mut rng = StdRng::seed_from_u64(seed);
            match p2c(&loads, &mut rng) {
                None => prop_assert!(loads.is_empty()),
                Some(i) => {
                    prop_assert!(i < loads.len());
                    if loads.len() >= 2 {
                        let max = *loads.iter().max().unwrap();
                        let n_max = loads.iter().filter(|&&l| l == max).count();
                        prop_assert!(!(loads[i] == max && n_max == 1), "picked the unique maximum");
                        prop_assert!(loads.iter().enumerate().any(|(j, &l)| j != i && l >= loads[i]));
                    }
                }
            }
        }

        /// Equal loads: every candidate is chosen sometimes (no index is starved).
        #[test]
        fn equal_loads_spread_over_every_candidate(n in 2usize..8, seed: u64) {
            let mut rng = StdRng::seed_from_u64(seed);
            let loads = vec![3u64; n];
            let mut hits = vec![0u32; n];
            for _ in 0..(200 * n) {
                hits[p2c(&loads, &mut rng).unwrap()] += 1;
            }
            prop_assert!(hits.iter().all(|&h| h > 0), "{hits:?}");
        }
    }

    #[test]
    fn two_candidates_always_the_less_loaded() {
        let mut rng = StdRng::seed_from_u64(7);
        for _ in 0..100 {
            assert_eq!(p2c(&[5, 2], &mut rng), Some(1));
            assert_eq!(p2c(&[0, 9], &mut rng), Some(0));
        }
    }

    /// Mean over time of (max load − mean load) when `choose` places each arriving request and
    /// requests leave in arrival order, 100 in flight over 10 workers.
    fn imbalance(mut choose: impl FnMut(&[u64]) -> usize) -> f64 {
        let mut loads = vec![0u64; 10];
        let mut in_flight = std::collections::VecDeque::new();
        let mut total = 0.0;
        for _ in 0..20_000 {
            let i = choose(&loads);
            loads[i] += 1;
            in_flight.push_back(i);
            if in_flight.len() > 100 {
                loads[in_flight.pop_front().unwrap()] -= 1;
            }
            let mean = loads.iter().sum::<u64>() as f64 / loads.len() as f64;
            total += *loads.iter().max().unwrap() as f64 - mean;
        }
        total / 20_000.0
    }

    #[test]
    fn keeps_load_far_more_even_than_random_choice() {
        let mut rng = StdRng::seed_from_u64(1);
        let p2c_imbalance = imbalance(|loads| p2c(loads, &mut rng).unwrap());
        let mut rng = StdRng::seed_from_u64(1);
        let random_imbalance = imbalance(|loads| rng.random_range(0..loads.len()));
        assert!(p2c_imbalance * 2.0 < random_imbalance, "p2c {p2c_imbalance:.2} vs random {random_imbalance:.2}");
    }
}
