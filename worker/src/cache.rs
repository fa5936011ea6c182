//! Triton's response cache (`--cache-config local,size=BYTES`, per model
//! `response_cache { enable: true }`): a successful response is kept under a key of the model
//! version, the request's inputs (name, datatype, shape, bytes) and the outputs it asked for,
//! and an identical request is answered from it without running the model.
//!
//! The key is a 128-bit digest: two SipHash-1-3 passes over the same bytes, each under its own
//! random key drawn when the cache is made, so a false hit needs a 128-bit collision that no
//! client can aim at (SipHash resists crafted collisions only while its key is secret; a fixed
//! key would let one tenant's request be built to hit another's answer). Entries are bounded by
//! their tensor bytes (each holds a copy of its own, not a slice of a batch's buffer) and
//! evicted least recently used first; a response larger than the whole cache is not kept.

use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, Mutex};

use crate::tensor::{InferRequest, OutputTensor};

/// Bytes an entry is charged beyond its outputs: its key and node in the map and in the
/// recency order, the `Arc` and `Vec` holding its outputs.
const ENTRY_OVERHEAD: usize = 192;
/// Bytes each output is charged beyond its data, name and shape: the tensor itself and the
/// three allocations it holds (name, shape, data), each with an allocator's slack. A response
/// of many small outputs costs about this much per output, not just its bytes.
const OUTPUT_OVERHEAD: usize = std::mem::size_of::<OutputTensor>() + 3 * 16;

/// What an entry for `outputs` is charged against the cache's size.
fn charge(outputs: &[OutputTensor]) -> usize {
    ENTRY_OVERHEAD
        + outputs.iter().map(|o| OUTPUT_OVERHEAD + o.data.len() + o.name.len() + 8 * o.shape.len()).sum::<usize>()
}

/// [`ResponseCache::key`] under `keys`.
fn key(keys: &[RandomState; 2], request: &InferRequest, model: &str, version: i64, generations: [u64; 2]) -> u128 {
    let digest = |state: &RandomState| {
        let mut h = state.build_hasher();
        model.hash(&mut h);
        version.hash(&mut h);
        generations.hash(&mut h);
        // Inputs in name order: the same tensors in another order are the same request.
        let mut inputs: Vec<_> = request.inputs.iter().collect();
        inputs.sort_by(|a, b| a.name.cmp(&b.name));
        inputs.len().hash(&mut h);
        for input in inputs {
            input.name.hash(&mut h);
            input.datatype.wire_name().hash(&mut h);
            input.shape.hash(&mut h);
            input.data.len().hash(&mut h);
            h.write(&input.data);
        }
        let mut outputs: Vec<&str> = request.outputs.iter().map(|o| o.name.as_str()).collect();
        outputs.sort_unstable();
        outputs.hash(&mut h);
        h.finish()
    };
    (u128::from(digest(&keys[0])) << 64) | u128::from(digest(&keys[1]))
}

struct Entry {
    outputs: Arc<Vec<OutputTensor>>,
    bytes: usize,
    used: u64,
}

#[derive(Default)]
struct Lru {
    entries: HashMap<u128, Entry>,
    /// Last use → key, oldest first.
    order: BTreeMap<u64, u128>,
    bytes: usize,
    clock: u64,
}

/// A byte-bounded LRU of responses, shared by every model that enables it.
pub struct ResponseCache {
    capacity: usize,
    inner: Mutex<Lru>,
    /// The digest's two secret keys.
    keys: [RandomState; 2],
}

/// A SipHash key drawn apart from this thread's: std seeds each thread's keys once from the
/// OS and derives every later `RandomState` of that thread from them by a counter, so two made
/// here would differ in one bit of one half. A new thread gets fresh keys.
fn independent_key() -> RandomState {
    std::thread::spawn(RandomState::new).join().unwrap_or_default()
}

impl ResponseCache {
    pub fn new(capacity_bytes: usize) -> Self {
        ResponseCache {
            capacity: capacity_bytes,
            inner: Mutex::new(Lru::default()),
            keys: [RandomState::new(), independent_key()],
        }
    }

    /// The cache key of a request to `model` version `version`; `generations` identify what
    /// the answer was computed with (the load of the model, and for an ensemble the
    /// repository's epoch), so new weights never answer from old responses.
    pub fn key(&self, request: &InferRequest, model: &str, version: i64, generations: [u64; 2]) -> u128 {
        key(&self.keys, request, model, version, generations)
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        self.lock().bytes
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cached outputs for `key`, marking them recently used.
    pub fn get(&self, key: u128) -> Option<Arc<Vec<OutputTensor>>> {
        let mut lru = self.lock();
        lru.clock += 1;
        let now = lru.clock;
        let entry = lru.entries.get_mut(&key)?;
        let previous = std::mem::replace(&mut entry.used, now);
        let outputs = entry.outputs.clone();
        lru.order.remove(&previous);
        lru.order.insert(now, key);
        Some(outputs)
    }

    /// Keeps a copy of `outputs` under `key`, evicting the least recently used entries to make
    /// room. Returns false when the response alone is larger than the cache. Copied: a batched
    /// request's outputs are slices of the whole batch's buffers, which an entry charged only
    /// for its slice would keep alive.
    pub fn insert(&self, key: u128, outputs: &[OutputTensor]) -> bool {
        // Sized before anything is copied: a response too large to keep costs no copy.
        let bytes = charge(outputs);
        if bytes > self.capacity {
            return false;
        }
        let outputs: Arc<Vec<OutputTensor>> = Arc::new(
            outputs
                .iter()
                .map(|o| OutputTensor { data: bytes::Bytes::copy_from_slice(&o.data), ..o.clone() })
                .collect(),
        );
        let mut lru = self.lock();
        if let Some(old) = lru.entries.remove(&key) {
            lru.order.remove(&old.used);
            lru.bytes -= old.bytes;
        }
        while lru.bytes + bytes > self.capacity {
            let Some((_, oldest)) = lru.order.pop_first() else { break };
            if let Some(evicted) = lru.entries.remove(&oldest) {
                lru.bytes -= evicted.bytes;
            }
        }
        lru.clock += 1;
        let used = lru.clock;
        lru.order.insert(used, key);
        lru.entries.insert(key, Entry { outputs, bytes, used });
        lru.bytes += bytes;
        true
    }
}

/// Parses Triton's `--cache-config local,size=BYTES` into the cache size.
pub fn parse_cache_config(values: &[String]) -> Result<Option<usize>, String> {
    let mut size = None;
    for value in values {
        let (kind, setting) = value.split_once(',').ok_or_else(|| {
            format!("--cache-config '{value}': expected <cache>,<key>=<value>, e.g. local,size=1048576")
        })?;
        if kind != "local" {
            return Err(format!("--cache-config '{value}': cache '{kind}' is not supported (Nereid has 'local')"));
        }
        let (k, v) = setting
            .split_once('=')
            .ok_or_else(|| format!("--cache-config '{value}': expected {kind},<key>=<value>"))?;
        match k {
            "size" => {
                let bytes: usize =
                    v.parse().map_err(|_| format!("--cache-config '{value}': size must be a number of bytes"))?;
                if bytes == 0 {
                    return Err(format!("--cache-config '{value}': size must be above 0"));
                }
                size = Some(bytes);
            }
            other => return Err(format!("--cache-config '{value}': unknown setting '{other}' (local takes size)")),
        }
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{InputTensor, RequestedOutput};
    use bytes::Bytes;
    use nereid_common::DataType;

    fn request(inputs: &[(&str, &[u8])], outputs: &[&str]) -> InferRequest {
        InferRequest {
            model_name: "m".into(),
            inputs: inputs
                .iter()
                .map(|(n, d)| InputTensor {
                    name: n.to_string(),
                    datatype: DataType::Uint8,
                    shape: vec![1, d.len() as i64],
                    data: Bytes::copy_from_slice(d),
                })
                .collect(),
            outputs: outputs.iter().map(|n| RequestedOutput { name: n.to_string(), ..Default::default() }).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn keys_depend_on_everything_that_changes_the_answer_and_nothing_else() {
        let cache = ResponseCache::new(1 << 20);
        let key = |r: &InferRequest, m: &str, v: i64, g: [u64; 2]| cache.key(r, m, v, g);
        let base = key(&request(&[("a", b"xy"), ("b", b"z")], &["o"]), "m", 1, [1, 0]);
        assert_eq!(base, key(&request(&[("b", b"z"), ("a", b"xy")], &["o"]), "m", 1, [1, 0]), "input order");
        let mut with_id = request(&[("a", b"xy"), ("b", b"z")], &["o"]);
        with_id.id = "another id".into();
        with_id.priority = 2;
        assert_eq!(base, key(&with_id, "m", 1, [1, 0]), "id and priority do not change the answer");
        assert_ne!(base, key(&request(&[("a", b"xz"), ("b", b"z")], &["o"]), "m", 1, [1, 0]), "data");
        assert_ne!(base, key(&request(&[("a", b"xy"), ("c", b"z")], &["o"]), "m", 1, [1, 0]), "names");
        assert_ne!(base, key(&request(&[("a", b"xy"), ("b", b"z")], &["p"]), "m", 1, [1, 0]), "outputs asked for");
        assert_ne!(base, key(&request(&[("a", b"xy"), ("b", b"z")], &["o"]), "m", 2, [1, 0]), "version");
        assert_ne!(base, key(&request(&[("a", b"xy"), ("b", b"z")], &["o"]), "n", 1, [1, 0]), "model");
        assert_ne!(base, key(&request(&[("a", b"xy"), ("b", b"z")], &["o"]), "m", 1, [2, 0]), "a reload");
        assert_ne!(base, key(&request(&[("a", b"xy"), ("b", b"z")], &["o"]), "m", 1, [1, 1]), "an epoch");
        let mut shaped = request(&[("a", b"xy"), ("b", b"z")], &["o"]);
        shaped.inputs[0].shape = vec![2, 1];
        assert_ne!(base, key(&shaped, "m", 1, [1, 0]), "shape");
        // The split between tensors is part of the key, not just the concatenated bytes.
        assert_ne!(
            key(&request(&[("a", b"x"), ("b", b"yz")], &[]), "m", 1, [1, 0]),
            key(&request(&[("a", b"xy"), ("b", b"z")], &[]), "m", 1, [1, 0])
        );
    }

    /// Each cache draws its own keys: the same request has another key elsewhere, so no
    /// client can compute (and aim a collision at) the keys of a running worker.
    #[test]
    fn keys_are_secret_per_cache() {
        let r = request(&[("a", b"xy")], &["o"]);
        let (one, two) = (ResponseCache::new(1024), ResponseCache::new(1024));
        assert_eq!(one.key(&r, "m", 1, [1, 0]), one.key(&r, "m", 1, [1, 0]));
        assert_ne!(one.key(&r, "m", 1, [1, 0]), two.key(&r, "m", 1, [1, 0]));
    }

    /// An entry holds its own bytes: a slice of a larger (batch) buffer is copied out, so the
    /// cache's size bounds what it keeps alive.
    #[test]
    fn entries_copy_slices_of_larger_buffers() {
        let batch = Bytes::from(vec![1u8; 1 << 20]);
        let slice =
            OutputTensor { name: "o".into(), datatype: DataType::Uint8, shape: vec![16], data: batch.slice(0..16) };
        let cache = ResponseCache::new(4096);
        assert!(cache.insert(1, &[slice]));
        let kept = cache.get(1).unwrap();
        assert_eq!(&kept[0].data[..], &[1u8; 16]);
        assert!(!kept[0].data.as_ptr_range().contains(&batch.as_ptr()), "a copy, not the batch's buffer");
        drop(batch);
    }

    fn outputs(bytes: usize) -> Vec<OutputTensor> {
        vec![OutputTensor {
            name: "o".into(),
            datatype: DataType::Uint8,
            shape: vec![bytes as i64],
            data: Bytes::from(vec![7u8; bytes]),
        }]
    }

    #[test]
    fn least_recently_used_entries_go_first_and_the_size_holds() {
        let entry = ENTRY_OVERHEAD + OUTPUT_OVERHEAD + 1000 + 1 + 8;
        let cache = ResponseCache::new(3 * entry);
        for k in 1..=3 {
            assert!(cache.insert(k, &outputs(1000)));
        }
        assert_eq!(cache.len(), 3);
        assert!(cache.get(1).is_some(), "1 is now the most recently used");
        assert!(cache.insert(4, &outputs(1000)));
        assert!(cache.get(2).is_none(), "2 was the least recently used");
        assert!(cache.get(1).is_some() && cache.get(3).is_some() && cache.get(4).is_some());
        assert!(cache.used() <= cache.capacity());
        assert!(!cache.insert(5, &outputs(4 * entry)), "larger than the whole cache: not kept");
        assert_eq!(cache.len(), 3);
        // Replacing a key keeps one entry.
        assert!(cache.insert(4, &outputs(10)));
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.get(4).unwrap()[0].data.len(), 10);
    }

    #[test]
    fn cache_config_is_parsed_like_tritonserver() {
        assert_eq!(parse_cache_config(&[]), Ok(None));
        assert_eq!(parse_cache_config(&["local,size=1048576".into()]), Ok(Some(1 << 20)));
        for (bad, says) in [
            ("redis,host=x", "cache 'redis' is not supported"),
            ("local", "expected <cache>,<key>=<value>"),
            ("local,size=lots", "size must be a number"),
            ("local,size=0", "above 0"),
            ("local,ttl=3", "unknown setting 'ttl'"),
        ] {
            let e = parse_cache_config(&[bad.into()]).unwrap_err();
            assert!(e.contains("--cache-config") && e.contains(says), "{bad}: {e}");
        }
    }
}
