//! The search space of a sweep: instance count × max_batch_size × preferred_batch_size ×
//! max_queue_delay_microseconds × (optionally) the queue policy's max_queue_size ×
//! default_timeout_microseconds × priority_levels, each a sorted list of values, and the
//! variants it holds.
//!
//! Pure: enumeration (brute search) and grid neighbours (quick search) work on indices into
//! the seven lists, so a point is always inside the space. The queue-policy and priority lists
//! default to `[0]` (not set), which leaves the space — its order, neighbours and keys — as it
//! is without them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Dimensions of the space, in the order of a [`Point`].
pub const DIMENSIONS: [&str; 7] = [
    "instance_count",
    "max_batch_size",
    "preferred_batch_size",
    "max_queue_delay_us",
    "max_queue_size",
    "queue_timeout_us",
    "priority_levels",
];

/// Largest space a sweep accepts (a brute search measures every variant).
pub const MAX_SPACE: usize = 10_000;

fn is_zero<T: Default + PartialEq>(x: &T) -> bool {
    *x == T::default()
}

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
    /// `dynamic_batching.default_queue_policy.max_queue_size` (0: the base config's, unbounded
    /// unless it sets one). Absent from JSON when 0, so checkpoints from before queue-policy
    /// sweeps still load and plain sweeps write what they always wrote.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub max_queue_size: u32,
    /// `dynamic_batching.default_queue_policy.default_timeout_microseconds` with
    /// `timeout_action: REJECT` (0: the base config's, none unless it sets one).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub queue_timeout_us: u64,
    /// `dynamic_batching.priority_levels`, with `default_priority_level` the lowest (0: the
    /// base config's). With 2 or more levels the queue policy applies to every level but the
    /// top one (`priority_queue_policy`), so the top priority is never shed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority_levels: u32,
}

impl Variant {
    /// A variant of the four batching dimensions, without a queue policy.
    pub fn batching(
        instance_count: u32,
        max_batch_size: u32,
        preferred_batch_size: u32,
        max_queue_delay_us: u64,
    ) -> Self {
        Variant {
            instance_count,
            max_batch_size,
            preferred_batch_size,
            max_queue_delay_us,
            max_queue_size: 0,
            queue_timeout_us: 0,
            priority_levels: 0,
        }
    }

    /// A stable, file-name-safe key: what checkpoints and `--resume` match on. The queue
    /// policy is appended only when set (`i1_b8_p0_d100_q64_t5000`), so keys of variants
    /// without one are those of sweeps that could not set it.
    pub fn key(&self) -> String {
        let mut key = format!(
            "i{}_b{}_p{}_d{}",
            self.instance_count, self.max_batch_size, self.preferred_batch_size, self.max_queue_delay_us
        );
        if self.max_queue_size > 0 {
            key.push_str(&format!("_q{}", self.max_queue_size));
        }
        if self.queue_timeout_us > 0 {
            key.push_str(&format!("_t{}", self.queue_timeout_us));
        }
        if self.priority_levels > 0 {
            key.push_str(&format!("_l{}", self.priority_levels));
        }
        key
    }

    /// Whether the variant sets part of the default queue policy.
    pub fn has_queue_policy(&self) -> bool {
        self.max_queue_size > 0 || self.queue_timeout_us > 0
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
        )?;
        if self.max_queue_size > 0 {
            write!(f, ", max queue {}", self.max_queue_size)?;
        }
        if self.queue_timeout_us > 0 {
            write!(f, ", queue timeout {} µs (reject)", self.queue_timeout_us)?;
        }
        if self.priority_levels > 0 {
            write!(f, ", {} priority levels", self.priority_levels)?;
        }
        Ok(())
    }
}

/// Indices into the seven dimensions' value lists.
pub type Point = [usize; 7];

/// A search space that is not usable; the message names the flag.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SpaceError(pub String);

fn no_policy<T: Default>() -> Vec<T> {
    vec![T::default()]
}

fn is_no_policy<T: Default + PartialEq>(v: &[T]) -> bool {
    matches!(v, [x] if *x == T::default())
}

/// The values of each dimension, sorted ascending without duplicates.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SearchSpace {
    pub instance_counts: Vec<u32>,
    pub max_batch_sizes: Vec<u32>,
    pub preferred_batch_sizes: Vec<u32>,
    pub max_queue_delays_us: Vec<u64>,
    /// `[0]` unless queue policy is swept (then written to JSON).
    #[serde(default = "no_policy", skip_serializing_if = "is_no_policy")]
    pub max_queue_sizes: Vec<u32>,
    /// `[0]` unless queue policy is swept (then written to JSON).
    #[serde(default = "no_policy", skip_serializing_if = "is_no_policy")]
    pub queue_timeouts_us: Vec<u64>,
    /// `[0]` unless priority levels are swept (then written to JSON).
    #[serde(default = "no_policy", skip_serializing_if = "is_no_policy")]
    pub priority_levels: Vec<u32>,
}

fn tidy<T: Ord>(v: &mut Vec<T>, flag: &str) -> Result<(), SpaceError> {
    v.sort_unstable();
    v.dedup();
    if v.is_empty() { Err(SpaceError(format!("{flag}: give at least one value"))) } else { Ok(()) }
}

impl SearchSpace {
    /// Sorts and deduplicates each list; every list must be non-empty, instance counts at
    /// least 1, and the whole space at most [`MAX_SPACE`] variants. No queue policy is swept
    /// (see [`with_queue_policy`](Self::with_queue_policy)).
    pub fn new(
        mut instance_counts: Vec<u32>,
        mut max_batch_sizes: Vec<u32>,
        mut preferred_batch_sizes: Vec<u32>,
        mut max_queue_delays_us: Vec<u64>,
    ) -> Result<SearchSpace, SpaceError> {
        tidy(&mut instance_counts, "--instance-counts")?;
        tidy(&mut max_batch_sizes, "--max-batch-sizes")?;
        tidy(&mut preferred_batch_sizes, "--preferred-batch-sizes")?;
        tidy(&mut max_queue_delays_us, "--max-queue-delays-us")?;
        if instance_counts[0] == 0 {
            return Err(SpaceError("--instance-counts: every count must be at least 1".into()));
        }
        SearchSpace {
            instance_counts,
            max_batch_sizes,
            preferred_batch_sizes,
            max_queue_delays_us,
            max_queue_sizes: no_policy(),
            queue_timeouts_us: no_policy(),
            priority_levels: no_policy(),
        }
        .checked()
    }

    /// The space with the default queue policy's `max_queue_size` and timeout (REJECT) swept
    /// too; `0` in a list means "not set". Same rules as [`new`](Self::new).
    pub fn with_queue_policy(
        self,
        mut max_queue_sizes: Vec<u32>,
        mut queue_timeouts_us: Vec<u64>,
    ) -> Result<SearchSpace, SpaceError> {
        tidy(&mut max_queue_sizes, "--max-queue-sizes")?;
        tidy(&mut queue_timeouts_us, "--queue-timeouts-us")?;
        SearchSpace { max_queue_sizes, queue_timeouts_us, ..self }.checked()
    }

    /// The space with `dynamic_batching.priority_levels` swept too (`0`: the base config's).
    pub fn with_priority_levels(self, mut priority_levels: Vec<u32>) -> Result<SearchSpace, SpaceError> {
        tidy(&mut priority_levels, "--priority-levels")?;
        SearchSpace { priority_levels, ..self }.checked()
    }

    /// Whether priority levels are swept (a list other than `[0]`).
    pub fn sweeps_priority_levels(&self) -> bool {
        !is_no_policy(&self.priority_levels)
    }

    fn checked(self) -> Result<SearchSpace, SpaceError> {
        if self.len() > MAX_SPACE {
            return Err(SpaceError(format!(
                "the search space has {} variants, more than {MAX_SPACE}; give fewer values",
                self.len()
            )));
        }
        Ok(self)
    }

    /// Whether the queue policy is swept (a list other than `[0]`).
    pub fn sweeps_queue_policy(&self) -> bool {
        !is_no_policy(&self.max_queue_sizes) || !is_no_policy(&self.queue_timeouts_us)
    }

    /// Number of values per dimension.
    pub fn shape(&self) -> [usize; 7] {
        [
            self.instance_counts.len(),
            self.max_batch_sizes.len(),
            self.preferred_batch_sizes.len(),
            self.max_queue_delays_us.len(),
            self.max_queue_sizes.len(),
            self.queue_timeouts_us.len(),
            self.priority_levels.len(),
        ]
    }

    /// Number of variants (saturating: an absurd space is simply larger than [`MAX_SPACE`]).
    pub fn len(&self) -> usize {
        self.shape().iter().fold(1usize, |n, &d| n.saturating_mul(d))
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
            max_queue_size: self.max_queue_sizes[p[4]],
            queue_timeout_us: self.queue_timeouts_us[p[5]],
            priority_levels: self.priority_levels[p[6]],
        }
    }

    /// Every point, instance count outermost, priority levels innermost (the brute search's
    /// order; without a queue policy or priority levels, queue delay is innermost).
    pub fn points(&self) -> Vec<Point> {
        let s = self.shape();
        let mut out = Vec::with_capacity(self.len());
        if s.contains(&0) {
            return out;
        }
        // An odometer: the last dimension turns fastest.
        let mut p: Point = [0; 7];
        loop {
            out.push(p);
            let mut dim = s.len();
            loop {
                if dim == 0 {
                    return out;
                }
                dim -= 1;
                p[dim] += 1;
                if p[dim] < s[dim] {
                    break;
                }
                p[dim] = 0;
            }
        }
    }

    /// Every variant, in [`points`](Self::points) order.
    pub fn variants(&self) -> Vec<Variant> {
        self.points().into_iter().map(|p| self.variant(p)).collect()
    }

    /// The grid neighbours of `p`: one step down or up along each dimension, queue delay and
    /// queue policy and priority levels included (Model Analyzer's quick search leaves the
    /// queue delay out). At most 14.
    pub fn neighbours(&self, p: Point) -> Vec<Point> {
        let s = self.shape();
        let mut out = Vec::with_capacity(2 * s.len());
        for dim in 0..s.len() {
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

    fn v(i: u32, b: u32, p: u32, d: u64) -> Variant {
        Variant::batching(i, b, p, d)
    }

    #[test]
    fn enumerates_every_combination_once_in_order() {
        let s = space(&[2, 1, 2], &[8, 1], &[0], &[1000, 0, 100]);
        assert_eq!(s.instance_counts, vec![1, 2], "sorted and deduplicated");
        assert_eq!(s.len(), 2 * 2 * 3);
        assert!(!s.sweeps_queue_policy());
        let all = s.variants();
        assert_eq!(all.len(), 12);
        assert_eq!(all.iter().collect::<BTreeSet<_>>().len(), 12);
        assert_eq!(all[0], v(1, 1, 0, 0));
        assert_eq!(all[1].max_queue_delay_us, 100, "queue delay varies fastest");
        assert_eq!(all[11], v(2, 8, 0, 1000));
        assert_eq!(all[5].key(), "i1_b8_p0_d1000");
        assert_eq!(all[5].to_string(), "instances 1, max batch 8, preferred -, queue delay 1000 µs");
    }

    #[test]
    fn the_queue_policy_adds_two_innermost_dimensions() {
        let s = space(&[1, 2], &[8], &[0], &[0, 100]).with_queue_policy(vec![64, 0], vec![0, 5000]).unwrap();
        assert!(s.sweeps_queue_policy());
        assert_eq!(s.shape(), [2, 1, 1, 2, 2, 2, 1]);
        assert_eq!(s.len(), 16);
        let all = s.variants();
        assert_eq!(all.iter().map(Variant::key).collect::<BTreeSet<_>>().len(), 16, "keys are unique");
        assert_eq!(all[0], v(1, 8, 0, 0), "no policy first");
        assert_eq!(all[0].key(), "i1_b8_p0_d0", "no policy: the key of a plain sweep");
        assert_eq!(all[1].key(), "i1_b8_p0_d0_t5000", "queue timeout varies fastest");
        assert_eq!(all[2].key(), "i1_b8_p0_d0_q64");
        assert_eq!(all[3].key(), "i1_b8_p0_d0_q64_t5000");
        assert_eq!(all[4].key(), "i1_b8_p0_d100");
        assert_eq!(
            all[3].to_string(),
            "instances 1, max batch 8, preferred -, queue delay 0 µs, max queue 64, queue timeout 5000 µs (reject)"
        );
        // Only [0] lists: the same space as without.
        let plain = space(&[1, 2], &[8], &[0], &[0, 100]);
        assert_eq!(plain.clone().with_queue_policy(vec![0, 0], vec![0]).unwrap(), plain);
    }

    #[test]
    fn priority_levels_are_the_innermost_dimension() {
        let s = space(&[1], &[8], &[0], &[0, 100]).with_priority_levels(vec![2, 0]).unwrap();
        assert!(s.sweeps_priority_levels() && !s.sweeps_queue_policy());
        assert_eq!(s.len(), 4);
        let keys: Vec<String> = s.variants().iter().map(Variant::key).collect();
        assert_eq!(keys, ["i1_b8_p0_d0", "i1_b8_p0_d0_l2", "i1_b8_p0_d100", "i1_b8_p0_d100_l2"]);
        assert!(s.variants()[1].to_string().ends_with(", 2 priority levels"));
        let text = serde_json::to_string(&s.variants()[1]).unwrap();
        assert!(text.contains("\"priority_levels\":2"), "{text}");
        assert_eq!(serde_json::from_str::<SearchSpace>(&serde_json::to_string(&s).unwrap()).unwrap(), s);
        assert!(!serde_json::to_string(&space(&[1], &[8], &[0], &[0])).unwrap().contains("priority"));
        let e = s.with_priority_levels(vec![]).unwrap_err();
        assert!(e.0.contains("--priority-levels"), "{e}");
    }

    #[test]
    fn variants_without_a_queue_policy_serialize_as_before() {
        let old = r#"{"instance_count":2,"max_batch_size":8,"preferred_batch_size":0,"max_queue_delay_us":100}"#;
        let parsed: Variant = serde_json::from_str(old).unwrap();
        assert_eq!(parsed, v(2, 8, 0, 100), "an old checkpoint's variant still loads");
        assert_eq!(serde_json::to_string(&parsed).unwrap(), old, "and is written the same");
        let q = Variant { max_queue_size: 4, queue_timeout_us: 250, ..parsed };
        let text = serde_json::to_string(&q).unwrap();
        assert!(text.contains("\"max_queue_size\":4") && text.contains("\"queue_timeout_us\":250"), "{text}");
        assert_eq!(serde_json::from_str::<Variant>(&text).unwrap(), q);
        // The space in results.json likewise.
        let s = space(&[1], &[8], &[0], &[0]);
        let text = serde_json::to_string(&s).unwrap();
        assert!(!text.contains("max_queue_sizes") && !text.contains("queue_timeouts_us"), "{text}");
        assert_eq!(serde_json::from_str::<SearchSpace>(&text).unwrap(), s);
        let s = s.with_queue_policy(vec![0, 4], vec![0]).unwrap();
        assert_eq!(serde_json::from_str::<SearchSpace>(&serde_json::to_string(&s).unwrap()).unwrap(), s);
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
        let ok = space(&[1, 2], &[8], &[0], &[0]);
        let e = ok.clone().with_queue_policy(vec![], vec![0]).unwrap_err();
        assert!(e.0.contains("--max-queue-sizes"), "{e}");
        let e = ok.clone().with_queue_policy(vec![0], vec![]).unwrap_err();
        assert!(e.0.contains("--queue-timeouts-us"), "{e}");
        let e = ok.with_queue_policy(many.clone(), (0..100).collect()).unwrap_err();
        assert!(e.0.contains("20000 variants, more than"), "the queue policy counts: {e}");
        assert_eq!(parse_list::<u32>("--x", "1, 2,8").unwrap(), vec![1, 2, 8]);
        assert!(parse_list::<u32>("--x", "1,-2").unwrap_err().0.contains("--x"));
    }

    #[test]
    fn neighbours_step_one_along_each_dimension() {
        let s = space(&[1, 2, 4], &[1, 8], &[0], &[0, 100, 1000]);
        let n = s.neighbours([1, 0, 0, 1, 0, 0, 0]);
        assert_eq!(
            n,
            vec![
                [0, 0, 0, 1, 0, 0, 0],
                [2, 0, 0, 1, 0, 0, 0],
                [1, 1, 0, 1, 0, 0, 0],
                [1, 0, 0, 0, 0, 0, 0],
                [1, 0, 0, 2, 0, 0, 0]
            ]
        );
        assert!(n.iter().any(|p| p[3] != 1), "queue delay is a move");
        let s = s.with_queue_policy(vec![0, 8, 64], vec![0, 1000]).unwrap();
        let n = s.neighbours([1, 1, 0, 1, 1, 1, 0]);
        // Two steps along instances, delay and queue size; one along batch and timeout.
        assert_eq!(n.len(), 8);
        assert!(n.contains(&[1, 1, 0, 1, 0, 1, 0]) && n.contains(&[1, 1, 0, 1, 2, 1, 0]), "queue size is a move");
        assert!(n.contains(&[1, 1, 0, 1, 1, 0, 0]), "queue timeout is a move");
        let s = s.with_priority_levels(vec![0, 2]).unwrap();
        assert!(s.neighbours([1, 1, 0, 1, 1, 1, 0]).contains(&[1, 1, 0, 1, 1, 1, 1]), "priority levels are a move");
    }

    proptest! {
        #[test]
        fn neighbours_are_in_the_space_and_one_step_away(
            shape in prop::array::uniform7(1usize..4),
            seed in prop::array::uniform7(0usize..4),
        ) {
            let s = SearchSpace::new(
                (1..=shape[0] as u32).collect(),
                (0..shape[1] as u32).collect(),
                (0..shape[2] as u32).collect(),
                (0..shape[3] as u64).collect(),
            ).unwrap().with_queue_policy(
                (0..shape[4] as u32).collect(),
                (0..shape[5] as u64).collect(),
            ).unwrap().with_priority_levels((0..shape[6] as u32).collect()).unwrap();
            let p: Point = std::array::from_fn(|d| seed[d] % shape[d]);
            let points = s.points();
            let all: BTreeSet<Point> = points.iter().copied().collect();
            prop_assert_eq!(all.len(), s.len());
            prop_assert_eq!(points.len(), s.len());
            prop_assert!(points.windows(2).all(|w| w[0] < w[1]), "points are in lexicographic order");
            let neighbours = s.neighbours(p);
            prop_assert!(neighbours.len() <= 14);
            let expected: usize = (0..7).map(|d| usize::from(p[d] > 0) + usize::from(p[d] + 1 < shape[d])).sum();
            prop_assert_eq!(neighbours.len(), expected);
            for q in neighbours {
                prop_assert!(all.contains(&q));
                let diff: usize = (0..7).map(|d| p[d].abs_diff(q[d])).sum();
                prop_assert_eq!(diff, 1);
            }
        }
    }
}
