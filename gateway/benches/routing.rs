//! Routing-decision micro-benchmark: the cost of one `balance::pick` (resolve the model version
//! in the current snapshot + power of two choices among its holders) on a synthetic table of
//! 1 000 workers × 100 models, every worker holding every model READY (1 000 holders per
//! version: the worst case for the balancer). Also the cost of rebuilding that snapshot, which
//! membership pays per etcd change (never on the request path).
//!
//!     cargo bench -p nereid-gateway --bench routing [-- --json FILE]
//!
//! Each call is timed on its own (`Instant` around one pick); percentiles over 200 000 calls.

use std::time::{Duration, Instant};

use nereid_gateway::balance::pick;
use nereid_gateway::call::{CallDeadline, InferCall};
use nereid_gateway::config::OutlierConfig;
use nereid_gateway::routing::{self, RoutingTable, WorkerState, WorkerView};
use nereid_gateway::upstream::Upstream;
use nereid_gateway::wire::InferRequest;
use nereid_proto::inference::ModelInferRequest;
use nereid_proto::inference::repository_index_response::ModelIndex;
use std::sync::Arc;

const WORKERS: usize = 1000;
const MODELS: usize = 100;
const CALLS: usize = 200_000;

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_nanos() as f64 / 1000.0
}

fn views() -> Vec<WorkerView> {
    (0..WORKERS)
        .map(|w| WorkerView {
            upstream: Arc::new(
                Upstream::new(&format!("10.0.{}.{}:8001", w / 250, w % 250 + 1), OutlierConfig::default()).unwrap(),
            ),
            state: WorkerState::Ready,
            models: (0..MODELS)
                .map(|m| ModelIndex {
                    name: format!("model-{m}"),
                    version: "1".into(),
                    state: "READY".into(),
                    reason: String::new(),
                })
                .collect(),
        })
        .collect()
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let json_out = std::env::args().skip_while(|a| a != "--json").nth(1);
    let (publisher, routes) = routing::routes(Instant::now());
    let t0 = Instant::now();
    let table = RoutingTable::build(views(), Instant::now());
    let build = t0.elapsed();
    publisher.publish(table);

    let calls: Vec<InferCall> = (0..MODELS)
        .map(|m| {
            InferCall::new(
                InferRequest::encode(&ModelInferRequest { model_name: format!("model-{m}"), ..Default::default() }),
                None,
                CallDeadline { at: Instant::now() + Duration::from_secs(60), is_gateways: true },
            )
        })
        .collect();
    // Warm-up, then timed calls; some workers carry load so p2c has something to compare.
    let snapshot = routes.snapshot();
    let _busy: Vec<_> = (0..WORKERS).step_by(3).map(|i| snapshot.upstream(i).start_request()).collect();
    for i in 0..20_000 {
        std::hint::black_box(pick(&routes, &calls[i % MODELS], Instant::now()).unwrap());
    }
    let mut samples = Vec::with_capacity(CALLS);
    for i in 0..CALLS {
        let call = &calls[(i * 7) % MODELS];
        let t = Instant::now();
        let chosen = pick(&routes, call, t);
        samples.push(t.elapsed());
        std::hint::black_box(chosen.unwrap());
    }
    samples.sort_unstable();
    let (p50, p99, p999) = (percentile(&samples, 0.50), percentile(&samples, 0.99), percentile(&samples, 0.999));
    let max = samples.last().unwrap().as_nanos() as f64 / 1000.0;
    println!("routing decision, {WORKERS} workers x {MODELS} models ({CALLS} calls):");
    println!("  p50 {p50:.2} µs   p99 {p99:.2} µs   p99.9 {p999:.2} µs   max {max:.1} µs   (target p99 <= 10 µs)");
    println!("  snapshot rebuild ({} index rows): {:.1} ms", WORKERS * MODELS, build.as_secs_f64() * 1e3);
    if let Some(path) = json_out {
        let report = serde_json::json!({
            "workers": WORKERS, "models": MODELS, "calls": CALLS,
            "p50_us": p50, "p99_us": p99, "p999_us": p999, "max_us": max,
            "target_p99_us": 10.0, "meets_target": p99 <= 10.0,
            "snapshot_rebuild_ms": build.as_secs_f64() * 1e3,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap()).expect("write --json");
    }
}
