//! The search space of a sweep: instance count × max_batch_size × preferred_batch_size ×
//! max_queue_delay_microseconds, each a sorted list of values, and the variants it holds.
//!
//! Pure: enumeration (brute search) and grid neighbours (quick search) work on indices into
//! the four lists, so a point is always inside the space.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Dimensions of the space, in the order of a [`Point`].
pub const DIMENSIONS: [&str; 4] = ["instance_count", "max_batch_size", "preferred_batch_size", "max_queue_delay_us"];

/// Largest space a sweep accepts (a brute search measures every variant).
pub const MAX_SPACE: usize = 10_000;

/// One model configuration to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Variant {
    /// `instance_group [ { count } ]`.
    pub instance_count: u32,
    /// `max_batch_size` (0: the model does not batch).
    pub max_batch_size: u32,
    /// `dynamic_batching.preferred_batch_size` (0: none).
    pub preferred_batch_size: u32,
    /// `dynamic_batching.max_queue_delay_microseconds`.
    pub max_queue_delay_us: u64,
}

impl Variant {
    /// A stable, file-name-safe key: what checkpoints and `--resume` match on.
    pub fn key(&self) -> String {
        format!(
            "i{}_b{}_p{}_d{}",
            self.instance_count, self.max_batch_size, self.preferred_batch_size, self.max_queue_delay_us
        )
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let preferred =
            if self.preferred_batch_size == 0 { "-".to_string() } else { self.preferred_batch_size.to_string() };
        write!(
            f,
            "instances {}, max batch {}, preferred {preferred}, queue delay {} µs",
            self.instance_count, self.max_batch_size, self.max_queue_delay_us
        )
    }
}

/// Indices into the four dimensions' value lists.
pub type Point = [usize; 4];

/// A search space that is not usable; the message names the flag.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SpaceError(pub String);

/// The values of each dimension, sorted ascending without duplicates.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SearchSpace {
    pub instance_counts: Vec<u32>,
    pub max_batch_sizes: Vec<u32>,
    pub preferred_batch_sizes: Vec<u32>,
    pub max_queue_delays_us: Vec<u64>,
}

impl SearchSpace {
    /// Sorts and deduplicates each list; every list must be non-empty, instance counts at
    /// least 1, and the whole space at most [`MAX_SPACE`] variants.
    pub fn new(
        mut instance_counts: Vec<u32>,
        mut max_batch_sizes: Vec<u32>,
        mut preferred_batch_sizes: Vec<u32>,
        mut max_queue_delays_us: Vec<u64>,
    ) -> Result<SearchSpace, SpaceError> {
        fn tidy<T: Ord>(v: &mut Vec<T>, flag: &str) -> Result<(), SpaceError> {
            v.sort_unstable();
            v.dedup();
            if v.is_empty() { Err(SpaceError(format!("{flag}: give at least one value"))) } else { Ok(()) }
        }
        tidy(&mut instance_counts, "--instance-counts")?;
        tidy(&mut max_batch_sizes, "--max-batch-sizes")?;
        tidy(&mut preferred_batch_sizes, "--preferred-batch-sizes")?;
        tidy(&mut max_queue_delays_us, "--max-queue-delays-us")?;
        if instance_counts[0] == 0 {
            return Err(SpaceError("--instance-counts: every count must be at least 1".into()));
        }
        let space = SearchSpace { instance_counts, max_batch_sizes, preferred_batch_sizes, max_queue_delays_us };
        if space.len() > MAX_SPACE {
            return Err(SpaceError(format!(
                "the search space has {} variants, more than {MAX_SPACE}; give fewer values",
                space.len()
            )));
        }
        Ok(space)
    }

    /// Number of values per dimension.
    pub fn shape(&self) -> [usize; 4] {
        [
            self.instance_counts.len(),
            self.max_batch_sizes.len(),
            self.preferred_batch_sizes.len(),
            self.max_queue_delays_us.len(),
        ]
    }

    /// Number of variants.
    pub fn len(&self) -> usize {
        self.shape().iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The variant at `p` (indices must be in range).
    pub fn variant(&self, p: Point) -> Variant {
        Variant {
            instance_count: self.instance_counts[p[0]],
            max_batch_size: self.max_batch_sizes[p[1]],
            preferred_batch_size: self.preferred_batch_sizes[p[2]],
            max_queue_delay_us: self.max_queue_delays_us[p[3]],
        }
    }

    /// Every point, instance count outermost, queue delay innermost (the brute search's order).
    pub fn points(&self) -> Vec<Point> {
        let s = self.shape();
        let mut out = Vec::with_capacity(self.len());
        for a in 0..s[0] {
            for b in 0..s[1] {
                for c in 0..s[2] {
                    for d in 0..s[3] {
                        out.push([a, b, c, d]);
                    }
                }
            }
        }
        out
    }

    /// Every variant, in [`points`](Self::points) order.
    pub fn variants(&self) -> Vec<Variant> {
        self.points().into_iter().map(|p| self.variant(p)).collect()
    }

    /// The grid neighbours of `p`: one step down or up along each dimension, queue delay
    /// included (Model Analyzer's quick search leaves it out). At most 8.
    pub fn neighbours(&self, p: Point) -> Vec<Point> {
        let s = self.shape();
        let mut out = Vec::with_capacity(8);
        for dim in 0..4 {
            if p[dim] > 0 {
                let mut q = p;
                q[dim] -= 1;
                out.push(q);
            }
            if p[dim] + 1 < s[dim] {
                let mut q = p;
                q[dim] += 1;
                out.push(q);
            }
        }
        out
    }
}

/// Parses a comma-separated list of non-negative integers (`1,2,8`) for `flag`.
pub fn parse_list<T: std::str::FromStr>(flag: &str, text: &str) -> Result<Vec<T>, SpaceError> {
    text.split(',')
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<T>().map_err(|_| SpaceError(format!("{flag} '{text}': '{s}' is not a non-negative integer")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn space(i: &[u32], b: &[u32], p: &[u32], d: &[u64]) -> SearchSpace {
        SearchSpace::new(i.to_vec(), b.to_vec(), p.to_vec(), d.to_vec()).unwrap()
    }

    #[test]
    fn enumerates_every_combination_once_in_order() {
        let s = space(&[2, 1, 2], &[8, 1], &[0], &[1000, 0, 100]);
        assert_eq!(s.instance_counts, vec![1, 2], "sorted and deduplicated");
        assert_eq!(s.len(), 2 * 2 * 3);
        let v = s.variants();
        assert_eq!(v.len(), 12);
        assert_eq!(v.iter().collect::<BTreeSet<_>>().len(), 12);
        assert_eq!(
            v[0],
            Variant { instance_count: 1, max_batch_size: 1, preferred_batch_size: 0, max_queue_delay_us: 0 }
        );
        assert_eq!(v[1].max_queue_delay_us, 100, "queue delay varies fastest");
        assert_eq!(
            v[11],
            Variant { instance_count: 2, max_batch_size: 8, preferred_batch_size: 0, max_queue_delay_us: 1000 }
        );
        assert_eq!(v[5].key(), "i1_b8_p0_d1000");
    }

    #[test]
    fn bad_spaces_name_the_flag() {
        let e = SearchSpace::new(vec![], vec![1], vec![0], vec![0]).unwrap_err();
        assert!(e.0.contains("--instance-counts"));
        let e = SearchSpace::new(vec![0, 1], vec![1], vec![0], vec![0]).unwrap_err();
        assert!(e.0.contains("at least 1"));
        let many: Vec<u32> = (1..=100).collect();
        let e = SearchSpace::new(many.clone(), many.clone(), vec![0, 1], vec![0]).unwrap_err();
        assert!(e.0.contains("more than"), "{e}");
        assert_eq!(parse_list::<u32>("--x", "1, 2,8").unwrap(), vec![1, 2, 8]);
        assert!(parse_list::<u32>("--x", "1,-2").unwrap_err().0.contains("--x"));
    }

    #[test]
    fn neighbours_step_one_along_each_dimension() {
        let s = space(&[1, 2, 4], &[1, 8], &[0], &[0, 100, 1000]);
        let n = s.neighbours([1, 0, 0, 1]);
        assert_eq!(n, vec![[0, 0, 0, 1], [2, 0, 0, 1], [1, 1, 0, 1], [1, 0, 0, 0], [1, 0, 0, 2]]);
        assert!(n.iter().any(|p| p[3] != 1), "queue delay is a move");
    }

    proptest! {
        #[test]
        fn neighbours_are_in_the_space_and_one_step_away(
            shape in prop::array::uniform4(1usize..5),
            seed in prop::array::uniform4(0usize..5),
        ) {
            let s = SearchSpace::new(
                (1..=shape[0] as u32).collect(),
                (0..shape[1] as u32).collect(),
                (0..shape[2] as u32).collect(),
                (0..shape[3] as u64).collect(),
            ).unwrap();
            let p = [seed[0] % shape[0], seed[1] % shape[1], seed[2] % shape[2], seed[3] % shape[3]];
            let all: BTreeSet<Point> = s.points().into_iter().collect();
            prop_assert_eq!(all.len(), s.len());
            for q in s.neighbours(p) {
                prop_assert!(all.contains(&q));
                let diff: usize = (0..4).map(|d| p[d].abs_diff(q[d])).sum();
                prop_assert_eq!(diff, 1);
            }
        }
    }
}
