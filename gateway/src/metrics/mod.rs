//! The gateway's Prometheus metrics, names as constants here. Labels are bounded: `model` is a
//! name from the routing table, [`crate::routing::UNKNOWN_MODEL_LABEL`] or
//! [`layer::UNREAD_MODEL_LABEL`] (refused before the request naming it was read), `version` a version
//! the table knows for that model (or empty when none could be resolved), `code` a canonical
//! gRPC code name, `state` a worker state.

mod layer;

use std::time::Instant;

use prometheus::{
    Gauge, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

use crate::routing::{RoutingTable, WorkerState};
pub use layer::{Refusals, RequestMetricsLayer, UNREAD_MODEL_LABEL};

pub const REQUESTS_TOTAL: &str = "nereid_gateway_requests_total";
pub const REQUEST_DURATION_US: &str = "nereid_gateway_request_duration_us";
pub const RETRIES_TOTAL: &str = "nereid_gateway_retries_total";
pub const EJECTIONS_TOTAL: &str = "nereid_gateway_ejections_total";
pub const UPSTREAM_CONNECTS_TOTAL: &str = "nereid_gateway_upstream_connects_total";
pub const ROUTING_TABLE_AGE_SECONDS: &str = "nereid_gateway_routing_table_age_seconds";
pub const WORKERS: &str = "nereid_gateway_workers";
pub const ETCD_WATCH_CONNECTED: &str = "nereid_gateway_etcd_watch_connected";
pub const ETCD_INVALID_VALUES_TOTAL: &str = "nereid_gateway_etcd_invalid_values_total";
pub const ETCD_RESYNCS_TOTAL: &str = "nereid_gateway_etcd_resyncs_total";
pub const PLACEMENT_LEADER: &str = "nereid_gateway_placement_leader";
pub const PLACEMENT_UNPLACED: &str = "nereid_gateway_placement_unplaced_replicas";
pub const PLACEMENT_OVERCOMMITTED: &str = "nereid_gateway_placement_overcommitted_workers";
pub const PLACEMENT_WRITES_TOTAL: &str = "nereid_gateway_placement_writes_total";
pub const PLACEMENT_PLANS_TOTAL: &str = "nereid_gateway_placement_plans_total";
pub const PLACEMENT_RESTARTS_TOTAL: &str = "nereid_gateway_placement_restarts_total";

/// Worker states as the `nereid_gateway_workers{state}` gauge reports them: the membership
/// state, with `ejected` for ready workers that outlier detection currently skips.
pub const WORKER_STATES: [&str; 4] = ["ready", "ejected", "not_ready", "unreachable"];

const LATENCY_BUCKETS_US: [f64; 17] = [
    50.0,
    100.0,
    250.0,
    500.0,
    1_000.0,
    2_500.0,
    5_000.0,
    10_000.0,
    25_000.0,
    50_000.0,
    100_000.0,
    250_000.0,
    500_000.0,
    1_000_000.0,
    2_500_000.0,
    10_000_000.0,
    60_000_000.0,
];

#[derive(Clone)]
pub struct GatewayMetrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub duration_us: HistogramVec,
    /// Retries sent to another worker, by model and version (labelled as `requests`).
    pub retries: IntCounterVec,
    pub ejections: IntCounter,
    /// Attempts to connect to a worker for inference, by `result` (`ok` / `failed`): a
    /// climbing count means connections keep breaking (a flapping worker or network).
    pub upstream_connects: IntCounterVec,
    table_age: Gauge,
    workers: IntGaugeVec,
    /// 1 while the etcd watch is established (etcd membership only).
    pub etcd_watch_connected: IntGauge,
    /// Values in etcd rejected as invalid, by key kind (`worker`, `model`, `status`, …).
    pub etcd_invalid_values: IntCounterVec,
    /// Full re-reads of etcd (start, and after a watch fell behind a compaction).
    pub etcd_resyncs: IntCounter,
    /// 1 while this gateway is the placement controller's leader.
    pub placement_leader: IntGauge,
    /// Replicas declared but not placed (no worker with room), as of the last plan.
    pub placement_unplaced: IntGauge,
    /// Workers whose placements exceed their declared capacity (it shrank under them).
    pub placement_overcommitted: IntGauge,
    /// Placement transactions committed by this gateway as leader.
    pub placement_writes: IntCounter,
    /// Placement plans computed as leader (whether or not they changed anything).
    pub placement_plans: IntCounter,
    /// Times the placement controller failed (panicked) and was started again.
    pub placement_restarts: IntCounter,
}

impl GatewayMetrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                REQUESTS_TOTAL,
                "Inference requests through the gateway, by model, version served or resolved (empty: none could be) and final gRPC status code",
            ),
            &["model", "version", "code"],
        )
        .expect("valid metric");
        let duration_us = HistogramVec::new(
            HistogramOpts::new(REQUEST_DURATION_US, "Inference request latency through the gateway, in microseconds")
                .buckets(LATENCY_BUCKETS_US.to_vec()),
            &["model", "version"],
        )
        .expect("valid metric");
        let retries = IntCounterVec::new(
            Opts::new(RETRIES_TOTAL, "Inference retries sent to another worker, by model and version"),
            &["model", "version"],
        )
        .expect("valid metric");
        let ejections = IntCounter::new(EJECTIONS_TOTAL, "Workers ejected by outlier detection").expect("valid metric");
        let upstream_connects = IntCounterVec::new(
            Opts::new(UPSTREAM_CONNECTS_TOTAL, "Connection attempts to workers for inference, by result (ok, failed)"),
            &["result"],
        )
        .expect("valid metric");
        let table_age = Gauge::new(ROUTING_TABLE_AGE_SECONDS, "Seconds since the routing table was last rebuilt")
            .expect("valid metric");
        let workers =
            IntGaugeVec::new(Opts::new(WORKERS, "Member workers by state"), &["state"]).expect("valid metric");
        let etcd_watch_connected =
            IntGauge::new(ETCD_WATCH_CONNECTED, "1 while the etcd membership watch is established")
                .expect("valid metric");
        let etcd_invalid_values = IntCounterVec::new(
            Opts::new(
                ETCD_INVALID_VALUES_TOTAL,
                "Values read from etcd that were rejected (the last good value is kept)",
            ),
            &["kind"],
        )
        .expect("valid metric");
        let etcd_resyncs =
            IntCounter::new(ETCD_RESYNCS_TOTAL, "Full re-reads of the fleet state from etcd").expect("valid metric");
        let placement_leader = IntGauge::new(PLACEMENT_LEADER, "1 while this gateway leads the placement controller")
            .expect("valid metric");
        let placement_unplaced =
            IntGauge::new(PLACEMENT_UNPLACED, "Declared model replicas no worker has room for").expect("valid metric");
        let placement_overcommitted = IntGauge::new(
            PLACEMENT_OVERCOMMITTED,
            "Workers whose placements exceed their declared capacity (kept, nothing new placed there)",
        )
        .expect("valid metric");
        let placement_writes = IntCounter::new(PLACEMENT_WRITES_TOTAL, "Placement transactions committed as leader")
            .expect("valid metric");
        let placement_plans =
            IntCounter::new(PLACEMENT_PLANS_TOTAL, "Placement plans computed as leader").expect("valid metric");
        let placement_restarts =
            IntCounter::new(PLACEMENT_RESTARTS_TOTAL, "Times the placement controller failed and was started again")
                .expect("valid metric");
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(placement_plans.clone()),
            Box::new(placement_restarts.clone()),
            Box::new(etcd_watch_connected.clone()),
            Box::new(etcd_invalid_values.clone()),
            Box::new(etcd_resyncs.clone()),
            Box::new(placement_leader.clone()),
            Box::new(placement_unplaced.clone()),
            Box::new(placement_overcommitted.clone()),
            Box::new(placement_writes.clone()),
            Box::new(duration_us.clone()),
            Box::new(retries.clone()),
            Box::new(ejections.clone()),
            Box::new(upstream_connects.clone()),
            Box::new(table_age.clone()),
            Box::new(workers.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        GatewayMetrics {
            registry,
            requests,
            duration_us,
            retries,
            ejections,
            upstream_connects,
            table_age,
            workers,
            etcd_watch_connected,
            etcd_invalid_values,
            etcd_resyncs,
            placement_leader,
            placement_unplaced,
            placement_overcommitted,
            placement_writes,
            placement_plans,
            placement_restarts,
        }
    }

    /// The text exposition, with the gauges derived from `table` as of `now`.
    pub fn render(&self, table: &RoutingTable, now: Instant) -> String {
        self.table_age.set(table.age(now).as_secs_f64());
        let mut counts = [0i64; WORKER_STATES.len()];
        for w in table.workers() {
            let i = match w.state {
                WorkerState::Ready if w.upstream.is_ejected(now) => 1,
                WorkerState::Ready => 0,
                WorkerState::NotReady => 2,
                WorkerState::Unreachable => 3,
            };
            counts[i] += 1;
        }
        for (state, n) in WORKER_STATES.iter().zip(counts) {
            self.workers.with_label_values(&[state]).set(n);
        }
        TextEncoder::new().encode_to_string(&self.registry.gather()).unwrap_or_else(|e| {
            tracing::warn!("metrics encoding failed: {e}");
            String::new()
        })
    }
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        Self::new()
    }
}
