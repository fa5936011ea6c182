//! Triton's classification extension: an output requested with `classification: N` comes back
//! as the top N classes of each batch row instead of the model's scores — a `BYTES` tensor of
//! shape `[rows, N]` (`[N]` for a model that does not batch) whose elements read
//! `<value>:<index>[:<label>]`. Classes are ranked by value, highest first, compared in the
//! output's own type; equal values keep index order. The label is line `<index>` of the
//! output's `label_filename` (a file in the model's directory), where it has one.

use std::cmp::Ordering;

use nereid_common::{DataType, Status};

use crate::tensor::OutputTensor;

/// One score, in a form that orders and prints as Triton's (C++ `std::to_string`) do: integers
/// exactly, floating point with six decimals. 16 bytes (one per element of the output: an
/// `i128` for every integer type made it 32).
#[derive(Clone, Copy, Debug)]
enum Score {
    Int(i64),
    Uint(u64),
    Float(f64),
}

impl Score {
    /// Highest first; a NaN ranks below every number.
    fn rank(a: &Score, b: &Score) -> Ordering {
        match (a, b) {
            (Score::Int(x), Score::Int(y)) => y.cmp(x),
            (Score::Uint(x), Score::Uint(y)) => y.cmp(x),
            (Score::Float(x), Score::Float(y)) => match (x.is_nan(), y.is_nan()) {
                (true, true) => Ordering::Equal,
                (true, false) => Ordering::Greater,
                (false, true) => Ordering::Less,
                (false, false) => y.partial_cmp(x).unwrap_or(Ordering::Equal),
            },
            // One tensor has one type.
            _ => Ordering::Equal,
        }
    }

    fn text(self) -> String {
        match self {
            Score::Int(v) => v.to_string(),
            Score::Uint(v) => v.to_string(),
            Score::Float(v) if v.is_nan() => "nan".into(),
            Score::Float(v) if v.is_infinite() => if v > 0.0 { "inf" } else { "-inf" }.into(),
            Score::Float(v) => format!("{v:.6}"),
        }
    }
}

/// Reads one element (its little-endian bytes) as a score.
type ReadScore = fn(&[u8]) -> Score;

/// How wide one element of `datatype` is and how to read it as a score; `None` for a type
/// that has no order to rank by.
fn reader(datatype: DataType) -> Option<(usize, ReadScore)> {
    macro_rules! read {
        ($t:ty, $to:expr) => {
            (std::mem::size_of::<$t>(), |c: &[u8]| {
                let bytes: [u8; std::mem::size_of::<$t>()] = c.try_into().unwrap_or_default();
                $to(<$t>::from_le_bytes(bytes))
            })
        };
    }
    Some(match datatype {
        DataType::Uint8 => read!(u8, |v| Score::Uint(u64::from(v))),
        DataType::Uint16 => read!(u16, |v| Score::Uint(u64::from(v))),
        DataType::Uint32 => read!(u32, |v| Score::Uint(u64::from(v))),
        DataType::Uint64 => read!(u64, Score::Uint),
        DataType::Int8 => read!(i8, |v| Score::Int(i64::from(v))),
        DataType::Int16 => read!(i16, |v| Score::Int(i64::from(v))),
        DataType::Int32 => read!(i32, |v| Score::Int(i64::from(v))),
        DataType::Int64 => read!(i64, Score::Int),
        DataType::Fp16 => read!(u16, |v| Score::Float(f64::from(half::f16::from_bits(v)))),
        DataType::Bf16 => read!(u16, |v| Score::Float(f64::from(half::bf16::from_bits(v)))),
        DataType::Fp32 => read!(f32, |v| Score::Float(f64::from(v))),
        DataType::Fp64 => read!(f64, Score::Float),
        DataType::Bool | DataType::Bytes => return None,
    })
}

/// A class and its score, ordered best first: highest score, equal scores in index order (a
/// total order, so keeping the best `k` of a row as it is read gives what sorting the whole
/// row would).
struct Ranked {
    score: Score,
    index: usize,
}

impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> Ordering {
        Score::rank(&self.score, &other.score).then(self.index.cmp(&other.index))
    }
}

impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Ranked {}

/// Most classes one classified output may hold (rows × classes asked for): some 40 bytes
/// apiece while they are chosen and written.
pub const MAX_CLASSES: usize = 1 << 22;

/// `output` as its top `count` classes per batch row (`batching`: the model's first dimension
/// is the batch). Fewer classes than asked for give as many as there are. Each row is read
/// once, keeping only its best `count` classes so far: the memory it takes is that of the
/// answer, however large the output (`classification: 1` of a 512 MB output takes nothing
/// more).
pub fn classify(
    output: &OutputTensor,
    count: u32,
    batching: bool,
    labels: Option<&[String]>,
) -> Result<OutputTensor, Status> {
    let (width, read) = reader(output.datatype).ok_or_else(|| {
        Status::invalid(format!(
            "output '{}': classification needs numeric scores, but the output is {}",
            output.name,
            output.datatype.wire_name()
        ))
    })?;
    let elements = output.data.len() / width;
    let rows = match (batching, output.shape.first()) {
        (true, Some(&rows)) => usize::try_from(rows).unwrap_or(0),
        _ => 1,
    };
    let per_row = elements.checked_div(rows).unwrap_or(0);
    let k = per_row.min(count as usize);
    // Each class is a string of its own in the answer (and a heap entry while its row is read).
    if rows.saturating_mul(k) > MAX_CLASSES {
        return Err(Status::invalid(format!(
            "output '{}': {rows} row(s) of {k} classes is more than the {MAX_CLASSES} classes one answer may hold: \
             ask for fewer (classification)",
            output.name
        )));
    }
    // Serialized as it goes (BYTES: a 4-byte length, then the text), one buffer for all.
    let mut data: Vec<u8> = Vec::with_capacity(rows.saturating_mul(k).saturating_mul(16));
    let mut class = String::new();
    // The best `k` of the row so far, the worst on top (a max-heap in best-first order).
    let mut best: std::collections::BinaryHeap<Ranked> = std::collections::BinaryHeap::with_capacity(k);
    let row_bytes = per_row * width;
    for row in output.data.chunks_exact(row_bytes.max(1)).take(if k == 0 { 0 } else { rows }) {
        best.clear();
        for (index, element) in row.chunks_exact(width).enumerate() {
            let candidate = Ranked { score: read(element), index };
            if best.len() < k {
                best.push(candidate);
            } else if best.peek().is_some_and(|worst| candidate < *worst) {
                best.pop();
                best.push(candidate);
            }
        }
        for Ranked { score, index } in std::mem::take(&mut best).into_sorted_vec() {
            use std::fmt::Write;
            class.clear();
            let _ = write!(class, "{}:{index}", score.text());
            // An empty label line gives no label part.
            if let Some(label) = labels.and_then(|l| l.get(index)).filter(|l| !l.is_empty()) {
                class.push(':');
                class.push_str(label);
            }
            data.extend_from_slice(&(class.len() as u32).to_le_bytes());
            data.extend_from_slice(class.as_bytes());
        }
    }
    let shape = if batching { vec![rows as i64, k as i64] } else { vec![k as i64] };
    Ok(OutputTensor { name: output.name.clone(), datatype: DataType::Bytes, shape, data: data.into() })
}

/// Labels from a `label_filename` file: one per line, line N naming class N.
pub fn parse_labels(text: &str) -> Vec<String> {
    text.lines().map(str::to_string).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::split_bytes_elements;

    /// Scores of a large output are held once per element while a row is ranked: kept small.
    #[test]
    fn a_score_takes_16_bytes() {
        assert_eq!(std::mem::size_of::<Score>(), 16);
    }

    fn tensor(datatype: DataType, shape: &[i64], data: Vec<u8>) -> OutputTensor {
        OutputTensor { name: "OUT".into(), datatype, shape: shape.to_vec(), data: data.into() }
    }

    fn fp32(shape: &[i64], values: &[f32]) -> OutputTensor {
        tensor(DataType::Fp32, shape, values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }

    fn strings(t: &OutputTensor) -> Vec<String> {
        split_bytes_elements("OUT", &t.data)
            .unwrap()
            .into_iter()
            .map(|e| String::from_utf8(e.to_vec()).unwrap())
            .collect()
    }

    #[test]
    fn top_classes_per_row_highest_first_with_labels() {
        let out = fp32(&[2, 4], &[1.0, 5.0, 10.0, 4.0, 0.5, -1.0, 0.25, 3.0]);
        let labels: Vec<String> = ["zero", "one", "two"].map(String::from).to_vec();
        let c = classify(&out, 2, true, Some(&labels)).unwrap();
        assert_eq!((c.datatype, c.shape.clone()), (DataType::Bytes, vec![2, 2]));
        // Index 3 has no label line: no label part.
        assert_eq!(strings(&c), ["10.000000:2:two", "5.000000:1:one", "3.000000:3", "0.500000:0:zero"]);
    }

    #[test]
    fn a_model_that_does_not_batch_ranks_its_whole_output() {
        let out = fp32(&[2, 2], &[0.1, 0.4, 0.3, 0.2]);
        let c = classify(&out, 3, false, None).unwrap();
        assert_eq!(c.shape, vec![3]);
        assert_eq!(strings(&c), ["0.400000:1", "0.300000:2", "0.200000:3"]);
    }

    #[test]
    fn more_classes_than_there_are_gives_them_all() {
        let c = classify(&fp32(&[1, 2], &[1.0, 2.0]), 5, true, None).unwrap();
        assert_eq!(c.shape, vec![1, 2]);
        assert_eq!(strings(&c), ["2.000000:1", "1.000000:0"]);
    }

    /// An answer of millions of classes (a huge count on a large output) is refused before any
    /// row is read; the same count on a small output gives what there is.
    #[test]
    fn answers_past_the_class_bound_are_refused() {
        let wide = tensor(DataType::Uint8, &[2, (MAX_CLASSES / 2 + 1) as i64], vec![0; MAX_CLASSES + 2]);
        let e = classify(&wide, u32::MAX, true, None).unwrap_err();
        assert!(e.message.contains("more than the 4194304 classes"), "{}", e.message);
        assert_eq!(classify(&wide, 3, true, None).unwrap().shape, vec![2, 3]);
        assert_eq!(classify(&fp32(&[1, 2], &[1.0, 2.0]), u32::MAX, true, None).unwrap().shape, vec![1, 2]);
    }

    #[test]
    fn integers_compare_and_print_exactly_and_ties_keep_index_order() {
        let values: [i64; 4] = [i64::MAX - 1, 7, i64::MAX, 7];
        let out = tensor(DataType::Int64, &[1, 4], values.iter().flat_map(|v| v.to_le_bytes()).collect());
        let c = classify(&out, 4, true, None).unwrap();
        assert_eq!(strings(&c), [format!("{}:2", i64::MAX), format!("{}:0", i64::MAX - 1), "7:1".into(), "7:3".into()]);
    }

    #[test]
    fn half_precision_and_nan_rank_sensibly() {
        let values = [half::f16::from_f32(0.5), half::f16::NAN, half::f16::from_f32(2.0)];
        let out = tensor(DataType::Fp16, &[1, 3], values.iter().flat_map(|v| v.to_le_bytes()).collect());
        let c = classify(&out, 3, true, None).unwrap();
        assert_eq!(strings(&c), ["2.000000:2", "0.500000:0", "nan:1"]);
    }

    #[test]
    fn bytes_and_bool_outputs_cannot_be_classified() {
        for datatype in [DataType::Bytes, DataType::Bool] {
            let e = classify(&tensor(datatype, &[1, 1], vec![0; 5]), 1, true, None).unwrap_err();
            assert!(e.message.contains("output 'OUT': classification needs numeric scores"), "{}", e.message);
        }
    }

    #[test]
    fn an_empty_batch_gives_no_classes() {
        let c = classify(&fp32(&[0, 4], &[]), 2, true, None).unwrap();
        assert_eq!((c.shape.clone(), c.data.len()), (vec![0, 0], 0));
    }

    /// The top k of a long row come out as sorting the whole row would give them (ties by
    /// index), and an empty label line adds no label part.
    #[test]
    fn top_k_of_a_long_row_with_ties_and_an_empty_label() {
        let values: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 100) as f32).collect();
        let labels: Vec<String> = (0..1000).map(|i| if i % 2 == 0 { String::new() } else { format!("c{i}") }).collect();
        let c = classify(&fp32(&[1, 1000], &values), 25, true, Some(&labels)).unwrap();
        let mut expected: Vec<usize> = (0..1000).collect();
        expected.sort_by(|&a, &b| values[b].partial_cmp(&values[a]).unwrap().then(a.cmp(&b)));
        let want: Vec<String> = expected[..25]
            .iter()
            .map(|&i| {
                let text = format!("{:.6}:{i}", values[i]);
                if i % 2 == 0 { text } else { format!("{text}:c{i}") }
            })
            .collect();
        assert_eq!(strings(&c), want);
    }

    /// Keeping the best k as a row is read gives exactly what sorting the whole row does,
    /// ties (many equal scores) and NaNs included, for every k.
    #[test]
    fn the_kept_best_match_a_full_sort() {
        let values: Vec<f32> =
            (0..97u32).map(|i| [(i % 7) as f32, f32::NAN, -(i as f32) / 3.0][(i % 3) as usize]).collect();
        let out = fp32(&[1, 97], &values);
        let full: Vec<String> = {
            let mut order: Vec<usize> = (0..values.len()).collect();
            let score = |i: usize| Score::Float(f64::from(values[i]));
            order.sort_by(|a, b| Score::rank(&score(*a), &score(*b)).then(a.cmp(b)));
            order.into_iter().map(|i| format!("{}:{i}", score(i).text())).collect()
        };
        for k in [1, 2, 7, 50, 96, 97, 200] {
            let c = classify(&out, k, true, None).unwrap();
            assert_eq!(strings(&c), full[..(k as usize).min(97)], "k = {k}");
        }
    }

    #[test]
    fn labels_are_lines() {
        assert_eq!(parse_labels("cat\r\ndog\n\nbird"), ["cat", "dog", "", "bird"]);
    }
}
