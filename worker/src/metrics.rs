//! Statistics and Prometheus metrics with Triton's names and labels. One set of atomic
//! counters per model version feeds both the statistics endpoint and `/metrics`, so the two
//! always agree. Labels are the model name and version only (bounded by the repository), plus
//! a closed `reason` set on failures. Counters exist per loaded version only: a request is
//! counted once resolved to a version (the latest READY one when it names none), so one that
//! fails before that (unknown or unloaded model, absent version, unparseable body) counts
//! against no version — there is never a series with an empty `version`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration as StdDuration, SystemTime, UNIX_EPOCH};

use crate::cpu::CpuMonitor;
use crate::gpu::GpuMonitor;
use crate::server::{BatchStats, Duration, ModelStats};

/// Failure reasons, as Triton labels `nv_inference_request_failure`.
pub const FAILURE_REASONS: [&str; 4] = ["REJECTED", "CANCELED", "BACKEND", "OTHER"];

const LATENCY_BUCKETS_US: [u64; 16] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000,
    10_000_000,
];
const BATCH_BUCKETS: [u64; 10] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512];

#[derive(Default)]
struct DurationCell {
    count: AtomicU64,
    ns: AtomicU64,
}

impl DurationCell {
    fn add(&self, d: StdDuration) {
        self.count.fetch_add(1, Relaxed);
        self.ns.fetch_add(d.as_nanos() as u64, Relaxed);
    }
    fn get(&self) -> Duration {
        Duration { count: self.count.load(Relaxed), ns: self.ns.load(Relaxed) }
    }
}

/// A fixed-bucket histogram of integer observations.
struct Histogram {
    bounds: &'static [u64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [u64]) -> Self {
        Histogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum: AtomicU64::new(0),
        }
    }
    fn observe(&self, v: u64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        self.sum.fetch_add(v, Relaxed);
    }
    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (bound, bucket) in self.bounds.iter().zip(&self.buckets) {
            cumulative += bucket.load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        // An observation lands in its bucket before the count: a scrape in between must not
        // show a bucket above +Inf (buckets only grow, or histogram_quantile misreads them).
        let count = self.count.load(Relaxed).max(cumulative);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum.load(Relaxed));
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

#[derive(Default)]
struct BatchCell {
    input: DurationCell,
    infer: DurationCell,
    output: DurationCell,
}

/// One execution of a batch, recorded ([`VersionStats::record_execution`]) when the last
/// answer of the batch is done with — after each of its requests has counted its own figures on
/// success. As in Triton, whose backend reports a batch's request statistics before the batch's
/// own, a scrape never sees an execution whose inferences are still to come (which would put
/// the average batch size below its real value, below one for single requests).
pub struct Execution {
    stats: std::sync::Arc<VersionStats>,
    /// When the batch ended (Unix ms): `last_inference`, whenever the record is made.
    ended_ms: u64,
    rows: usize,
    input: StdDuration,
    infer: StdDuration,
    output: StdDuration,
}

impl Execution {
    pub fn new(
        stats: std::sync::Arc<VersionStats>,
        rows: usize,
        input: StdDuration,
        infer: StdDuration,
        output: StdDuration,
    ) -> std::sync::Arc<Self> {
        let ended_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        std::sync::Arc::new(Execution { stats, ended_ms, rows, input, infer, output })
    }
}

impl Drop for Execution {
    fn drop(&mut self) {
        self.stats.record_execution(self.rows, self.input, self.infer, self.output, self.ended_ms);
    }
}

impl std::fmt::Debug for Execution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Execution({} rows)", self.rows)
    }
}

/// What running one request took (see [`VersionStats::record_ran`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RunFigures {
    /// Rows of the request: its inferences.
    pub rows: usize,
    pub queue: StdDuration,
    pub input: StdDuration,
    pub infer: StdDuration,
    pub output: StdDuration,
}

/// Counters of one model version. Shared by the request path, the batcher and the instances.
pub struct VersionStats {
    pub model: String,
    pub version: String,
    success: DurationCell,
    fail: DurationCell,
    queue: DurationCell,
    compute_input: DurationCell,
    compute_infer: DurationCell,
    compute_output: DurationCell,
    cache_hit: DurationCell,
    cache_miss: DurationCell,
    inference_count: AtomicU64,
    execution_count: AtomicU64,
    last_inference_ms: AtomicU64,
    pending: AtomicI64,
    dispatched: AtomicU64,
    /// The worker-wide pending count this version's changes also go to.
    worker_pending: Arc<AtomicI64>,
    failures: [AtomicU64; 4],
    batches: Mutex<BTreeMap<u64, Arc<BatchCell>>>,
    request_latency: Histogram,
    queue_latency: Histogram,
    batch_size: Histogram,
}

impl VersionStats {
    fn new(model: &str, version: &str, worker_pending: Arc<AtomicI64>) -> Self {
        VersionStats {
            worker_pending,
            model: model.to_string(),
            version: version.to_string(),
            success: Default::default(),
            fail: Default::default(),
            queue: Default::default(),
            compute_input: Default::default(),
            compute_infer: Default::default(),
            compute_output: Default::default(),
            cache_hit: Default::default(),
            cache_miss: Default::default(),
            inference_count: AtomicU64::new(0),
            execution_count: AtomicU64::new(0),
            last_inference_ms: AtomicU64::new(0),
            pending: AtomicI64::new(0),
            dispatched: AtomicU64::new(0),
            failures: Default::default(),
            batches: Mutex::new(BTreeMap::new()),
            request_latency: Histogram::new(&LATENCY_BUCKETS_US),
            queue_latency: Histogram::new(&LATENCY_BUCKETS_US),
            batch_size: Histogram::new(&BATCH_BUCKETS),
        }
    }

    /// A request finished successfully after `total` (receipt to response).
    pub fn record_success(&self, total: StdDuration) {
        self.success.add(total);
        self.request_latency.observe(total.as_micros() as u64);
    }

    /// What running a request that succeeded took: its rows (inferences), its wait in the
    /// queue and its share of compute. Counted when the request succeeds, not when its batch
    /// ran — as Triton's, these figures are those of successful requests only (a request whose
    /// output then does not fit its shared-memory region, or whose caller left meanwhile,
    /// adds none), so the queue count always equals the success count.
    pub fn record_ran(&self, figures: &RunFigures) {
        self.record_queue(figures.queue);
        // Triton accounts compute time per request: each request in a batch sees the batch's.
        self.compute_input.add(figures.input);
        self.compute_infer.add(figures.infer);
        self.compute_output.add(figures.output);
        self.inference_count.fetch_add(figures.rows as u64, Relaxed);
    }

    /// A request answered from the response cache: `lookup` is the time the lookup took. It
    /// counts as a success of `total`, and in the queue figures (Triton's queue statistics
    /// include cache hits; it waited in no queue here); not as inferences or executions
    /// (Triton's `inference_count` leaves cache hits out).
    pub fn record_cache_hit(&self, lookup: StdDuration, total: StdDuration) {
        self.cache_hit.add(lookup);
        self.queue.add(StdDuration::ZERO);
        self.record_success(total);
    }

    /// Requests handed to an instance (whatever becomes of them): for diagnostics and tests,
    /// not a Triton statistic.
    pub fn record_dispatch(&self, requests: usize) {
        self.dispatched.fetch_add(requests as u64, Relaxed);
    }

    pub fn dispatched(&self) -> u64 {
        self.dispatched.load(Relaxed)
    }

    /// A cacheable request that was not in the response cache: `lookup` is the time spent
    /// looking it up and storing its answer.
    pub fn record_cache_miss(&self, lookup: StdDuration) {
        self.cache_miss.add(lookup);
    }

    /// A request failed after `total`; `reason` is one of [`FAILURE_REASONS`].
    pub fn record_failure(&self, total: StdDuration, reason: &str) {
        self.fail.add(total);
        let i = FAILURE_REASONS.iter().position(|r| *r == reason).unwrap_or(3);
        self.failures[i].fetch_add(1, Relaxed);
    }

    /// A request that succeeds left the queue for an instance after waiting `waited`.
    fn record_queue(&self, waited: StdDuration) {
        self.queue.add(waited);
        self.queue_latency.observe(waited.as_micros() as u64);
    }

    /// An instance executed a batch of `rows` rows, each phase taking the time given, ending
    /// at `ended_ms` (Unix milliseconds): the execution count, the batch statistics and
    /// `last_inference` (which, as Triton's, moves with executions — not with cache hits).
    /// Called by [`Execution`]'s drop, after the requests' own figures
    /// ([`record_ran`](Self::record_ran)).
    pub fn record_execution(
        &self,
        rows: usize,
        input: StdDuration,
        infer: StdDuration,
        output: StdDuration,
        ended_ms: u64,
    ) {
        self.batch_size.observe(rows as u64);
        let cell = {
            let mut batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
            self.execution_count.fetch_add(1, Relaxed);
            batches.entry(rows as u64).or_default().clone()
        };
        cell.input.add(input);
        cell.infer.add(infer);
        cell.output.add(output);
        // Two batches finishing together must not move it back.
        self.last_inference_ms.fetch_max(ended_ms, Relaxed);
    }

    pub fn pending_add(&self, delta: i64) {
        self.pending.fetch_add(delta, Relaxed);
        self.worker_pending.fetch_add(delta, Relaxed);
    }

    pub fn pending(&self) -> i64 {
        self.pending.load(Relaxed)
    }

    pub fn snapshot(&self) -> ModelStats {
        let batches = self.batches.lock().unwrap_or_else(|e| e.into_inner());
        ModelStats {
            name: self.model.clone(),
            version: self.version.clone(),
            last_inference_ms: self.last_inference_ms.load(Relaxed),
            inference_count: self.inference_count.load(Relaxed),
            execution_count: self.execution_count.load(Relaxed),
            success: self.success.get(),
            fail: self.fail.get(),
            queue: self.queue.get(),
            compute_input: self.compute_input.get(),
            compute_infer: self.compute_infer.get(),
            compute_output: self.compute_output.get(),
            cache_hit: self.cache_hit.get(),
            cache_miss: self.cache_miss.get(),
            batch_stats: batches
                .iter()
                .map(|(&batch_size, c)| BatchStats {
                    batch_size,
                    compute_input: c.input.get(),
                    compute_infer: c.infer.get(),
                    compute_output: c.output.get(),
                })
                .collect(),
        }
    }
}

/// What the etcd agent ([`crate::fleet`]) did, for operators: sessions (registrations) and the
/// leases granted for them (a session reconnects under the lease it holds; only a lost lease
/// needs a new one), full reads of this worker's placement versus watches resumed from the
/// last seen revision, placement values rejected as invalid, and whether a session is up now.
#[derive(Debug, Default)]
pub struct FleetCounters {
    pub sessions: AtomicU64,
    pub leases: AtomicU64,
    pub placement_reads: AtomicU64,
    pub watch_resumes: AtomicU64,
    /// Placement keys or values read that were invalid (a malformed key, a value that is not
    /// JSON or of an unknown schema version).
    pub invalid_placements: AtomicU64,
    pub connected: AtomicI64,
}

impl FleetCounters {
    fn render(&self, out: &mut String) {
        for (name, kind, help, value) in [
            (
                "nereid_worker_etcd_sessions_total",
                "counter",
                "etcd sessions started (each registers again, under the lease it holds)",
                self.sessions.load(Relaxed) as i64,
            ),
            (
                "nereid_worker_etcd_leases_granted_total",
                "counter",
                "Leases granted to register under (the first, then one for each lease lost)",
                self.leases.load(Relaxed) as i64,
            ),
            (
                "nereid_worker_etcd_placement_reads_total",
                "counter",
                "Full reads of this worker's placement (first session, or after a compacted revision)",
                self.placement_reads.load(Relaxed) as i64,
            ),
            (
                "nereid_worker_etcd_watch_resumes_total",
                "counter",
                "Placement watches resumed from the last seen revision after a lost session",
                self.watch_resumes.load(Relaxed) as i64,
            ),
            (
                "nereid_worker_etcd_connected",
                "gauge",
                "1 while an etcd session is up, else 0",
                self.connected.load(Relaxed),
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        }
        // Named and labelled as the gateway's counter of the same rejections.
        let name = "nereid_worker_etcd_invalid_values_total";
        let _ = writeln!(
            out,
            "# HELP {name} Values read from etcd that were rejected (placement: the assignment is kept by its key)\n\
             # TYPE {name} counter\n{name}{{kind=\"placement\"}} {}",
            self.invalid_placements.load(Relaxed)
        );
    }
}

/// Every model version's counters, plus the GPUs' readings where there are any, for `/metrics`.
#[derive(Default)]
pub struct Metrics {
    versions: Mutex<BTreeMap<(String, String), Arc<VersionStats>>>,
    gpu: Option<GpuMonitor>,
    /// The host's CPU and memory (`nv_cpu_*`), when on (`--allow-cpu-metrics`).
    cpu: Option<CpuMonitor>,
    /// The etcd agent's counters, rendered once a fleet agent asked for them.
    fleet: std::sync::OnceLock<Arc<FleetCounters>>,
    /// Requests waiting in every model's queue: the load figure reported in-band to gateways.
    pending: Arc<AtomicI64>,
    /// The bytes of input requests hold (`--max-queued-bytes`), once the repository set it.
    memory: Mutex<Option<Arc<crate::scheduler::MemoryBudget>>>,
}

impl Metrics {
    /// Renders `budget` with the rest (the repository's memory budget).
    pub fn show_memory_budget(&self, budget: Arc<crate::scheduler::MemoryBudget>) {
        *self.memory.lock().unwrap_or_else(|e| e.into_inner()) = Some(budget);
    }

    /// Requests queued in every model of this worker, now (never negative).
    pub fn pending_total(&self) -> u64 {
        self.pending.load(Relaxed).max(0) as u64
    }

    /// Model metrics only, no GPU series.
    pub fn new() -> Self {
        Self::default()
    }

    /// Model metrics plus, when `gpu` is `Some`, Triton's `nv_gpu_*` series sampled at scrape
    /// time (see [`GpuMonitor::new`], which is `None` where there is no GPU).
    pub fn with_gpu(gpu: Option<GpuMonitor>) -> Self {
        Metrics { gpu, ..Self::default() }
    }

    /// Adds Triton's `nv_cpu_*` series, when `cpu` is `Some`.
    pub fn with_cpu(mut self, cpu: Option<CpuMonitor>) -> Self {
        self.cpu = cpu;
        self
    }

    /// The etcd agent's counters (from then on part of `/metrics`).
    pub fn fleet(&self) -> Arc<FleetCounters> {
        self.fleet.get_or_init(Default::default).clone()
    }

    /// The counters of `model`/`version`, created on first use and kept across reloads.
    pub fn version(&self, model: &str, version: i64) -> Arc<VersionStats> {
        let key = (model.to_string(), version.to_string());
        let mut versions = self.versions.lock().unwrap_or_else(|e| e.into_inner());
        versions
            .entry(key)
            .or_insert_with(|| Arc::new(VersionStats::new(model, &version.to_string(), self.pending.clone())))
            .clone()
    }

    /// Forgets a version's counters (after unload), as Triton drops an unloaded model's metrics.
    pub fn remove(&self, model: &str, version: i64) {
        let mut versions = self.versions.lock().unwrap_or_else(|e| e.into_inner());
        versions.remove(&(model.to_string(), version.to_string()));
    }

    /// Drops every series of `model` but those of the versions in `keep` (what a failed load
    /// created for versions that never served).
    pub fn retain_versions(&self, model: &str, keep: &[i64]) {
        let keep: Vec<String> = keep.iter().map(i64::to_string).collect();
        let mut versions = self.versions.lock().unwrap_or_else(|e| e.into_inner());
        versions.retain(|(m, v), _| m != model || keep.contains(v));
    }

    /// Prometheus text exposition format.
    pub fn render(&self) -> String {
        let all: Vec<Arc<VersionStats>> =
            self.versions.lock().unwrap_or_else(|e| e.into_inner()).values().cloned().collect();
        let mut out = String::with_capacity(4096 + all.len() * 4096);
        let labels = |s: &VersionStats| format!("model=\"{}\",version=\"{}\"", escape(&s.model), escape(&s.version));

        type Getter = fn(&ModelStats) -> u64;
        let counters: [(&str, &str, Getter); 13] = [
            ("nv_inference_request_success", "Number of successful inference requests, all batch sizes", |s| {
                s.success.count
            }),
            (
                "nv_inference_count",
                "Number of inferences performed by successful requests (a request of n rows counts n; \
                 cache hits excluded)",
                |s| s.inference_count,
            ),
            ("nv_inference_exec_count", "Number of model executions performed (batches)", |s| s.execution_count),
            // Triton sums successful requests only (as the statistics' `success` duration);
            // failures are counted by `nv_inference_request_failure`.
            (
                "nv_inference_request_duration_us",
                "Cumulative duration of successful inference requests in microseconds",
                |s| s.success.ns / 1000,
            ),
            ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds", |s| {
                s.queue.ns / 1000
            }),
            ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds", |s| {
                s.compute_input.ns / 1000
            }),
            ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds", |s| {
                s.compute_infer.ns / 1000
            }),
            ("nv_inference_compute_output_duration_us", "Cumulative compute output duration in microseconds", |s| {
                s.compute_output.ns / 1000
            }),
            ("nv_inference_last_inference_ms", "Milliseconds since the epoch of the last successful inference", |s| {
                s.last_inference_ms
            }),
            ("nv_cache_num_hits_per_model", "Number of response cache hits per model", |s| s.cache_hit.count),
            ("nv_cache_num_misses_per_model", "Number of response cache misses per model", |s| s.cache_miss.count),
            ("nv_cache_hit_duration_per_model", "Cumulative response cache hit lookup duration in microseconds", |s| {
                s.cache_hit.ns / 1000
            }),
            (
                "nv_cache_miss_duration_per_model",
                "Cumulative response cache miss lookup and insertion duration in microseconds",
                |s| s.cache_miss.ns / 1000,
            ),
        ];
        let snapshots: Vec<(String, ModelStats)> = all.iter().map(|s| (labels(s), s.snapshot())).collect();
        for (name, help, get) in counters {
            let kind = if name == "nv_inference_last_inference_ms" { "gauge" } else { "counter" };
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (l, snap) in &snapshots {
                let _ = writeln!(out, "{name}{{{l}}} {}", get(snap));
            }
        }
        let _ = writeln!(
            out,
            "# HELP nv_inference_request_failure Number of failed inference requests, all batch sizes\n\
             # TYPE nv_inference_request_failure counter"
        );
        for s in &all {
            for (i, reason) in FAILURE_REASONS.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "nv_inference_request_failure{{{},reason=\"{reason}\"}} {}",
                    labels(s),
                    s.failures[i].load(Relaxed)
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution\n\
             # TYPE nv_inference_pending_request_count gauge"
        );
        for s in &all {
            let _ = writeln!(out, "nv_inference_pending_request_count{{{}}} {}", labels(s), s.pending());
        }
        if let Some(f) = self.fleet.get() {
            f.render(&mut out);
        }
        if let Some(memory) = self.memory.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            memory.render(&mut out);
        }
        for (name, help, pick) in [
            ("nereid_inference_request_latency_us", "End-to-end request latency in microseconds", 0),
            ("nereid_inference_queue_latency_us", "Time requests waited in the batcher queue, in microseconds", 1),
            ("nereid_inference_batch_size", "Rows per executed batch", 2),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
            for s in &all {
                let h = match pick {
                    0 => &s.request_latency,
                    1 => &s.queue_latency,
                    _ => &s.batch_size,
                };
                h.render(&mut out, name, &labels(s));
            }
        }
        if let Some(gpu) = &self.gpu {
            gpu.render(&mut out);
        }
        if let Some(cpu) = &self.cpu {
            cpu.render(&mut out);
        }
        out
    }
}

pub(crate) fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch of 4 rows from 3 requests of which one (a row) had left before the batch
    /// answered it, plus a rejected request: the inference count holds only the successful requests'
    /// rows, the request duration only their time, and statistics and metrics agree.
    #[test]
    fn statistics_and_metrics_agree() {
        let m = Metrics::new();
        let s = m.version("mlp", 1);
        let (input, infer, output) =
            (StdDuration::from_micros(1), StdDuration::from_micros(20), StdDuration::from_micros(2));
        s.record_execution(4, input, infer, output, 1);
        // Of the batch's requests (2 rows, 1 row, 1 row whose caller left), two succeed.
        for rows in [2, 1] {
            s.record_ran(&RunFigures { rows, queue: StdDuration::from_micros(30), input, infer, output });
            s.record_success(StdDuration::from_micros(100));
        }
        s.record_failure(StdDuration::from_micros(40), "CANCELED");
        s.record_failure(StdDuration::from_micros(5), "REJECTED");
        let snap = s.snapshot();
        assert_eq!(snap.success.count, 2);
        assert_eq!(snap.inference_count, 3);
        assert_eq!(snap.execution_count, 1);
        assert_eq!((snap.compute_infer.count, snap.queue.count), (2, 2));
        assert_eq!(snap.batch_stats[0].batch_size, 4);
        let text = m.render();
        assert!(text.contains("nv_inference_request_success{model=\"mlp\",version=\"1\"} 2"), "{text}");
        assert!(text.contains("nv_inference_count{model=\"mlp\",version=\"1\"} 3"));
        assert!(text.contains("nv_inference_exec_count{model=\"mlp\",version=\"1\"} 1"));
        assert!(text.contains("nv_inference_request_failure{model=\"mlp\",version=\"1\",reason=\"REJECTED\"} 1"));
        assert!(text.contains("nv_inference_request_failure{model=\"mlp\",version=\"1\",reason=\"CANCELED\"} 1"));
        assert!(text.contains("nv_inference_request_duration_us{model=\"mlp\",version=\"1\"} 200"), "{text}");
        assert_eq!(snap.success.ns / 1000, 200, "the statistics' success duration is the metric's");
        assert!(text.contains("nereid_inference_batch_size_bucket{model=\"mlp\",version=\"1\",le=\"4\"} 1"));
    }

    #[test]
    fn fleet_counters_render_with_the_gateway_s_name_for_invalid_values() {
        let m = Metrics::new();
        let fleet = m.fleet();
        fleet.invalid_placements.fetch_add(2, Relaxed);
        fleet.leases.fetch_add(1, Relaxed);
        let text = m.render();
        assert!(text.contains("# TYPE nereid_worker_etcd_invalid_values_total counter\n"), "{text}");
        assert!(text.contains("\nnereid_worker_etcd_invalid_values_total{kind=\"placement\"} 2\n"), "{text}");
        assert!(text.contains("\nnereid_worker_etcd_leases_granted_total 1\n"), "{text}");
    }

    /// A batch's execution is recorded when the last of its answers lets it go — after every
    /// request of it counted its own figures — with the time the batch ended.
    #[test]
    fn an_execution_is_recorded_once_every_answer_is_done_with() {
        let m = Metrics::new();
        let s = m.version("b", 1);
        let z = StdDuration::ZERO;
        let first = Execution::new(s.clone(), 2, z, z, z);
        let second = first.clone();
        drop(first);
        assert_eq!(s.snapshot().execution_count, 0, "one answer still holds it");
        drop(second);
        let snap = s.snapshot();
        assert_eq!((snap.execution_count, snap.batch_stats[0].batch_size), (1, 2));
        assert!(snap.last_inference_ms > 0);
    }

    /// A cache hit is a success of no inference (Triton leaves cache hits out of the count).
    #[test]
    fn cache_hits_count_no_inferences() {
        let m = Metrics::new();
        let s = m.version("c", 1);
        s.record_cache_hit(StdDuration::from_micros(3), StdDuration::from_micros(10));
        let snap = s.snapshot();
        assert_eq!((snap.success.count, snap.inference_count, snap.execution_count), (1, 0, 0));
        assert_eq!(snap.last_inference_ms, 0, "last_inference moves with executions only");
    }

    #[test]
    fn a_failed_load_s_series_can_be_dropped_keeping_the_served_ones() {
        let m = Metrics::new();
        for (model, v) in [("a", 1), ("a", 2), ("a", 3), ("b", 2)] {
            m.version(model, v).record_success(StdDuration::from_micros(1));
        }
        m.retain_versions("a", &[1]);
        let text = m.render();
        assert!(text.contains("nv_inference_request_success{model=\"a\",version=\"1\"} 1"), "{text}");
        assert!(!text.contains("model=\"a\",version=\"2\"") && !text.contains("model=\"a\",version=\"3\""));
        assert!(text.contains("nv_inference_request_success{model=\"b\",version=\"2\"} 1"), "other models stay");
        m.retain_versions("b", &[]);
        assert!(!m.render().contains("model=\"b\""));
    }

    #[test]
    fn metrics_without_gpu_have_no_gpu_series() {
        for m in [Metrics::new(), Metrics::with_gpu(None)] {
            m.version("mlp", 1).record_success(StdDuration::from_micros(10));
            let text = m.render();
            assert!(text.contains("nv_inference_request_success{model=\"mlp\",version=\"1\"} 1"), "{text}");
            assert!(!text.contains("nv_gpu_"), "{text}");
            assert!(!text.contains("nv_energy_consumption"), "{text}");
        }
    }

    #[test]
    fn metrics_render_appends_gpu_series() {
        let gpu = GpuMonitor::from_sampler(|| {
            vec![crate::gpu::GpuSample {
                uuid: "GPU-1234".into(),
                utilization: Some(0.5),
                memory_total_bytes: Some(1024),
                memory_used_bytes: Some(512),
                ..Default::default()
            }]
        });
        let text = Metrics::with_gpu(Some(gpu)).render();
        assert!(
            text.contains("# TYPE nv_gpu_utilization gauge\nnv_gpu_utilization{gpu_uuid=\"GPU-1234\"} 0.5\n"),
            "{text}"
        );
        assert!(text.contains("nv_gpu_memory_used_bytes{gpu_uuid=\"GPU-1234\"} 512\n"), "{text}");
        assert!(!text.contains("nv_gpu_power_usage"), "{text}");
    }
}
