//! What parsing a hostile HTTP inference request costs in memory: requests made of many tiny
//! entries (empty input objects, long shapes, parameter arrays, many keys) are refused without
//! the parser building anything much larger than the body. Measured with a counting global
//! allocator, so this binary holds this one test only.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use nereid_worker::http::infer::parse_infer_request;

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: defers to the system allocator; only counts what is live.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout is passed on unchanged.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The most the parser may hold beyond the body itself while refusing `body`.
fn peak_while_refusing(body: String) -> (usize, String) {
    let body = Bytes::from(body);
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let result = parse_infer_request("m", None, body, None, 64 << 20, None);
    let peak = PEAK.load(Ordering::Relaxed) - before;
    match result {
        Ok(_) => panic!("a hostile request was accepted"),
        Err(e) => (peak, e.message),
    }
}

#[test]
fn hostile_requests_are_refused_within_a_small_multiple_of_their_size() {
    const BODY: usize = 4 << 20;
    let repeat = |prefix: &str, item: &str, suffix: &str| {
        let n = (BODY - prefix.len() - suffix.len()) / (item.len() + 1);
        format!("{prefix}{}{suffix}", vec![item; n].join(","))
    };
    let cases = [
        ("empty inputs", repeat(r#"{"inputs":["#, "{}", "]}"), "at most 4096 inputs"),
        ("named outputs", repeat(r#"{"inputs":[],"outputs":["#, r#"{"name":""}"#, "]}"), "at most 4096 outputs"),
        (
            "a long shape",
            repeat(r#"{"inputs":[{"name":"x","datatype":"FP32","shape":["#, "1", r#"],"data":[1]}]}"#),
            "more than 64 dimensions",
        ),
        ("a parameter array", repeat(r#"{"inputs":[],"parameters":{"p":["#, "0", "]}}"), "is an array"),
        (
            "many parameters",
            {
                let keys = (0..BODY / 8).map(|i| format!(r#""{i}":0"#)).collect::<Vec<_>>().join(",");
                format!(r#"{{"inputs":[],"parameters":{{{keys}}}}}"#)
            },
            "at most 256 entries",
        ),
    ];
    for (what, body, reason) in cases {
        let (peak, message) = peak_while_refusing(body);
        assert!(message.contains(reason), "{what}: {message}");
        // The body is held by the caller; what the parser adds stays well under it.
        assert!(peak < BODY / 2, "{what}: the parser held {peak} bytes for a {BODY}-byte body ({message})");
    }
}
