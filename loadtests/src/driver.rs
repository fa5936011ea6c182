//! Drives a run: connects, prepares every request once, then for each load level generates
//! load (closed loop or open loop), measures windows until stable, and scrapes the server's
//! breakdown around each window.
//!
//! Bounds: a level lasts at most warm-up + `max_trials` windows (count windows at most
//! [`MAX_COUNT_WINDOW`] each) + one request timeout to drain; every request has a timeout; open
//! loop holds at most `max_inflight` requests outstanding, and a send that has to wait for one
//! counts as late. A window with no success and a server that no longer answers its liveness
//! check ends the run as [`Stop::ServerLost`], keeping what was measured.
//!
//! Levels come from a fixed sweep (which stops at the first level missing the SLO) or, with
//! `--binary-search`, from [`search::BinarySearch`](crate::search::BinarySearch), which picks
//! each next level from the SLO verdicts of the previous ones.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::client::shm::ShmRun;
use crate::client::{Client, Prepared, Target};
use crate::data_file::{DataRequest, ExpectedOutput};
use crate::error::{PerfError, exit};
use crate::measure::{Failure, Recorder, STABILITY_WINDOWS, Summary, Window, is_stable};
use crate::report::Progress;
use crate::schedule::{Arrivals, Distribution, LoadLevel, level_seed, trace_rate};
use crate::search::{BinarySearch, SearchAxis, SearchOutcome, SearchReport, SearchSpace, SearchStatus};
use crate::server_stats::{self, Breakdown, Scraper, Snapshot};
use crate::workload::{
    Group, InputSource, ModelInfo, Picker, Series, TensorSpec, Workload, WorkloadError, resolve_requests,
};

/// A send that starts later than this after its scheduled time counts as late.
pub const LATE_BOUND: Duration = Duration::from_millis(1);
/// Longest a count window may run before it closes short of its count.
pub const MAX_COUNT_WINDOW: Duration = Duration::from_secs(60);
/// Closed-loop senders pause this long after a connection failure instead of spinning.
pub const CONNECTION_BACKOFF: Duration = Duration::from_millis(10);
/// Liveness checks before the server is declared lost, and the pause between them.
pub const LIVENESS_PROBES: u32 = 3;
pub const LIVENESS_PROBE_INTERVAL: Duration = Duration::from_millis(200);
/// Largest share of late open-loop sends a trustworthy level may have.
pub const MAX_LATE_FRACTION: f64 = 0.01;
/// Share of completed requests that must succeed within the SLO for a level to meet it
/// (a p99 SLO, with failures counted as misses).
pub const SLO_QUANTILE: f64 = 0.99;

/// What load to offer.
#[derive(Clone, Debug)]
pub enum Load {
    Concurrency(Vec<u32>),
    RequestRate {
        rates: Vec<f64>,
        distribution: Distribution,
    },
    Trace(Arc<[Duration]>),
    /// `--binary-search`: the highest load in the space that meets the SLO.
    BinarySearch {
        axis: SearchAxis,
        space: SearchSpace,
    },
}

impl Load {
    /// One line for the report: what was offered.
    pub fn describe(&self) -> String {
        let list = |v: Vec<String>| v.join(", ");
        match self {
            Load::Concurrency(c) => format!("concurrency {}", list(c.iter().map(|c| c.to_string()).collect())),
            Load::RequestRate { rates, distribution } => format!(
                "request rate {} req/s ({})",
                list(rates.iter().map(|r| r.to_string()).collect()),
                distribution_name(*distribution)
            ),
            Load::Trace(t) => format!("trace replay of {} arrivals ({:.1} req/s)", t.len(), trace_rate(t)),
            Load::BinarySearch { axis, space } => format!(
                "binary search for the highest {} meeting the SLO between {} and {} (precision {})",
                axis.noun(),
                axis.level(space.low),
                axis.level(space.high),
                space.precision
            ),
        }
    }
}

fn distribution_name(d: Distribution) -> &'static str {
    match d {
        Distribution::Constant => "constant",
        Distribution::Poisson => "poisson",
    }
}

/// How a window ends.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WindowMode {
    Time { ms: u64 },
    Count { requests: u64 },
}

/// Measurement settings (perf_analyzer's names where they exist).
#[derive(Clone, Debug, Serialize)]
pub struct Measurement {
    pub window: WindowMode,
    pub warmup_ms: u64,
    pub stability_percentage: f64,
    pub max_trials: u32,
    pub request_timeout_ms: u64,
    pub max_inflight: usize,
}

/// Everything a run needs, validated.
#[derive(Clone, Debug)]
pub struct RunConfig {
    pub target: Target,
    /// `/metrics` to scrape; `None` skips the server-side breakdown.
    pub metrics_url: Option<http::Uri>,
    pub workload: Workload,
    /// Input contents of entries without their own `data`.
    pub input_data: InputSource,
    pub load: Load,
    pub measurement: Measurement,
    pub seed: u64,
    /// `--shared-memory system`: tensors through registered POSIX shared memory, with this
    /// many bytes for each model output (`--output-shared-memory-size`); `None`: in the requests.
    pub shared_memory: Option<u64>,
    /// Also count the successes within this latency, whatever each entry's SLO
    /// ([`LevelResult::ok_within_limit`]): nereid-analyze's `--max-p99-ms`. `None` for nereid-perf.
    pub latency_limit: Option<Duration>,
}

/// One series at one level.
#[derive(Clone, Debug, Serialize)]
pub struct SeriesResult {
    pub name: String,
    pub slo_ms: Option<f64>,
    /// `None` without an SLO, and also when no request of the series completed: no data, no
    /// verdict (the level is then untrustworthy rather than a miss).
    pub slo_met: Option<bool>,
    pub summary: Summary,
}

/// One load level's result.
#[derive(Clone, Debug, Serialize)]
pub struct LevelResult {
    pub level: LoadLevel,
    /// Every window measured, in order.
    pub windows: Vec<Summary>,
    /// Whether the last windows agreed (always true for a trace, which is one window).
    pub stable: bool,
    /// False when the run stopped during this level.
    pub complete: bool,
    /// How many of the last windows `total` and `series` merge.
    pub merged_windows: usize,
    pub total: Summary,
    pub series: Vec<SeriesResult>,
    /// Every request of each model (`model[:version]`), whatever its class or tenant; goodput
    /// counts each request against its own entry's SLO.
    pub by_model: Vec<SeriesResult>,
    /// Every request of each tenant (empty when the workload names no tenant).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub by_tenant: Vec<SeriesResult>,
    /// Server-side averages per model over the merged windows.
    pub server: BTreeMap<String, Breakdown>,
    /// `Some(false)` when a series missed its SLO; else `Some(true)` when every series with
    /// an SLO met it; `None` without an SLO, or when a series with an SLO completed no request
    /// (no verdict: the level is untrustworthy, see [`LevelResult::no_data_series`]).
    pub slo_met: Option<bool>,
    /// With [`RunConfig::latency_limit`]: the successes of the merged windows within it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ok_within_limit: Option<u64>,
    /// What the level's numbers leave out (a server-side window dropped over a counter reset).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// Most GPU memory the server reported in use (`nv_gpu_memory_used_bytes`, summed over its
    /// GPUs) at the level's scrapes, in MiB; `None` without GPU series or scrapes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_memory_mib: Option<f64>,
}

impl LevelResult {
    /// The per-model and per-tenant breakdowns that say something the series do not: those
    /// with more than one group, named differently from the series. Each with its label.
    pub fn extra_breakdowns(&self) -> Vec<(&'static str, &[SeriesResult])> {
        let names = |rs: &[SeriesResult]| rs.iter().map(|r| r.name.clone()).collect::<Vec<_>>();
        [("model", self.by_model.as_slice()), ("tenant", self.by_tenant.as_slice())]
            .into_iter()
            .filter(|(_, rs)| rs.len() > 1 && names(rs) != names(&self.series))
            .collect()
    }

    /// The series with an SLO that completed no request in the merged windows: their SLO
    /// cannot be judged.
    pub fn no_data_series(&self) -> Vec<&str> {
        self.series.iter().filter(|s| s.slo_ms.is_some() && s.summary.requests == 0).map(|s| s.name.as_str()).collect()
    }
}

/// A level's SLO verdict from its series' (see [`LevelResult::slo_met`]): a miss if any
/// missed; no verdict if a series with an SLO has no data; else whether every one met it.
pub fn level_slo_met(series: &[SeriesResult]) -> Option<bool> {
    if series.iter().any(|s| s.slo_met == Some(false)) {
        return Some(false);
    }
    if series.iter().any(|s| s.slo_ms.is_some() && s.summary.requests == 0) {
        return None;
    }
    series.iter().filter_map(|s| s.slo_met).reduce(|a, b| a && b)
}

/// The run's answer and why it may not be trustworthy.
#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub exit_code: i32,
    /// Human sentences; empty when all is well.
    pub problems: Vec<String>,
    /// The highest level that met the SLO, when there is an SLO.
    pub best_level_meeting_slo: Option<LoadLevel>,
}

/// Everything a run measured.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    pub tool: &'static str,
    pub version: &'static str,
    pub url: String,
    pub protocol: crate::client::Protocol,
    /// `--shared-memory system`: tensors went through registered shared memory.
    pub shared_memory: bool,
    pub metrics_url: Option<String>,
    pub seed: u64,
    pub measurement: Measurement,
    /// What load was offered (the sweep's levels, the trace, or the search's range).
    pub load: String,
    pub models: Vec<ModelInfo>,
    pub series: Vec<Series>,
    /// Every level measured, in order (a binary search's probes included).
    pub levels: Vec<LevelResult>,
    /// With `--binary-search`: its answer and probes.
    pub binary_search: Option<SearchReport>,
    pub warnings: Vec<String>,
    /// Why the run ended early, if it did.
    pub stopped: Option<String>,
    pub verdict: Verdict,
}

/// Why a level ended the run.
#[derive(Debug)]
enum Stop {
    ServerLost(String),
    /// The user interrupted the run (Ctrl-C).
    Interrupted,
}

/// What every level shares.
struct Context {
    client: Client,
    requests: Arc<[EntryRequests]>,
    picker: Picker,
    /// Per workload entry (the recorder's slots).
    slos: Vec<Option<Duration>>,
    /// [`RunConfig::latency_limit`].
    latency_limit: Option<Duration>,
    /// Entries grouped as the report shows them: by series, by model, by tenant.
    series: Vec<Group>,
    by_model: Vec<Group>,
    by_tenant: Vec<Group>,
    /// Model label → (model, version) for the breakdown.
    models: Vec<(String, String, Option<String>)>,
    scraper: Option<Scraper>,
    measurement: Measurement,
    interrupt: CancellationToken,
}

/// Connects, prepares the workload, and measures every load level.
///
/// Returns `Err` only when nothing could be measured (bad workload, unreachable server,
/// unknown model); a server lost mid-run, an unmet SLO or an unstable measurement come back
/// as a report whose verdict says so.
///
/// Cancelling `interrupt` (Ctrl-C) ends the current window early, keeps what was measured and
/// skips the remaining levels.
pub async fn run(config: RunConfig, progress: &Progress, interrupt: CancellationToken) -> Result<RunReport, PerfError> {
    let client = Client::connect_with_key(&config.target, config.workload.default_api_key.as_deref()).await?;
    let mut warnings = Vec::new();
    let PreparedWorkload { models: infos, requests, shm, expected } = prepare(&client, &config).await?;
    if expected.iter().flatten().any(|e| !e.is_empty()) {
        let variants: Vec<&[Prepared]> = requests.iter().map(EntryRequests::variants).collect();
        let models: Vec<String> = config.workload.entries.iter().map(|e| e.model.clone()).collect();
        let protocol = config.target.protocol;
        match crate::validation::check(&client, protocol, &variants, &expected, &models, shm.as_ref()).await {
            Ok(n) => progress.note(&format!("validation_data: the outputs of {n} distinct requests match")),
            Err(e) => {
                if let Some(shm) = shm {
                    shm.release(&client).await;
                }
                return Err(PerfError::WrongOutput(e));
            }
        }
    }

    let scraper = match &config.metrics_url {
        None => None,
        Some(uri) => {
            let scraper = Scraper::new(uri.clone(), config.target.tls.as_ref());
            let first = match &scraper {
                Ok(s) => s.scrape().await.map(|_| ()),
                Err(e) => Err(e.clone()),
            };
            match first {
                Ok(()) => scraper.ok(),
                Err(e) => {
                    warnings.push(format!("server-side breakdown unavailable: {e}"));
                    None
                }
            }
        }
    };

    let ctx = Context {
        client,
        requests: requests.into(),
        picker: Picker::new(config.workload.entries.iter().map(|e| e.weight)),
        // SLOs are validated to at most an hour; saturate anyway rather than panic.
        slos: (0..config.workload.entries.len())
            .map(|i| {
                config
                    .workload
                    .entry_slo_ms(i)
                    .map(|ms| Duration::try_from_secs_f64(ms / 1000.0).unwrap_or(Duration::MAX))
            })
            .collect(),
        latency_limit: config.latency_limit,
        series: config.workload.series_groups(),
        by_model: config.workload.model_groups(),
        by_tenant: config.workload.tenant_groups(),
        models: infos
            .iter()
            .map(|((m, v), _)| {
                let label = match v {
                    Some(v) => format!("{m}:{v}"),
                    None => m.clone(),
                };
                (label, m.clone(), v.clone())
            })
            .collect(),
        scraper,
        measurement: config.measurement.clone(),
        interrupt,
    };

    let mut plan = Plan::new(&config.load);
    let has_slo = config.workload.has_slo();
    let trace = match &config.load {
        Load::Trace(t) => Some(t.clone()),
        _ => None,
    };
    let mut results = Vec::new();
    let mut stopped = None;
    let mut server_lost = None;
    let mut interrupted = false;
    while let Some(level) = plan.next_level() {
        let index = results.len();
        let (result, stop) =
            run_level(&ctx, &level, level_seed(config.seed, 1_000 + index), trace.clone(), progress).await;
        let missed = result.slo_met == Some(false);
        progress.level_done(&result);
        warnings.extend(result.warnings.iter().map(|w| format!("{level}: {w}")));
        let complete = stop.is_none();
        plan.record(&result, complete, progress);
        results.push(result);
        match stop {
            Some(Stop::ServerLost(why)) => {
                stopped = Some(format!("the server stopped answering during {level}: {why}"));
                server_lost = stopped.clone();
                break;
            }
            Some(Stop::Interrupted) => {
                stopped = Some(format!("interrupted during {level}"));
                interrupted = true;
                break;
            }
            None => {}
        }
        if has_slo && missed && plan.stops_at_a_miss() {
            stopped = Some(format!("{level} missed the SLO; higher load levels were skipped"));
            break;
        }
    }

    if let Some(shm) = shm {
        // After a lost server this fails too: the objects are unlinked either way.
        if server_lost.is_none() {
            warnings.extend(shm.release(&ctx.client).await);
        }
    }
    let mut verdict = verdict(&results, has_slo, server_lost);
    let binary_search = plan.search_report();
    if let Some(search) = &binary_search
        && search.outcome == SearchStatus::NothingMeets
    {
        verdict.problems.push(format!("binary search: {}", search.summary));
    }
    if interrupted {
        verdict.exit_code = exit::INTERRUPTED;
        verdict.problems.insert(0, "interrupted; results so far were kept".into());
    }
    Ok(RunReport {
        tool: "nereid-perf",
        version: env!("CARGO_PKG_VERSION"),
        url: config.target.url.clone(),
        protocol: config.target.protocol,
        shared_memory: config.shared_memory.is_some(),
        metrics_url: ctx.scraper.as_ref().map(|s| s.uri().to_string()),
        seed: config.seed,
        measurement: config.measurement.clone(),
        load: config.load.describe(),
        models: infos.into_iter().map(|(_, i)| i).collect(),
        series: config.workload.series.clone(),
        levels: results,
        binary_search,
        warnings,
        stopped,
        verdict,
    })
}

/// One workload entry's requests, encoded once: a single one for generated data, or one per
/// distinct request of an input data file, sent in turn across all senders.
#[derive(Debug)]
pub struct EntryRequests {
    variants: Box<[Prepared]>,
    next: AtomicUsize,
}

impl EntryRequests {
    pub fn new(variants: Vec<Prepared>) -> Self {
        assert!(!variants.is_empty(), "an entry has at least one request");
        EntryRequests { variants: variants.into(), next: AtomicUsize::new(0) }
    }

    /// Every distinct request, in the order they are sent.
    pub fn variants(&self) -> &[Prepared] {
        &self.variants
    }

    /// The index of the request to send next (round robin; one shared counter per entry).
    pub fn next_index(&self) -> usize {
        if self.variants.len() == 1 {
            return 0;
        }
        self.next.fetch_add(1, Ordering::Relaxed) % self.variants.len()
    }

    pub fn get(&self, index: usize) -> &Prepared {
        &self.variants[index % self.variants.len()]
    }
}

/// What [`prepare`] builds before any load: each model's metadata and every entry's requests.
pub struct PreparedWorkload {
    /// `(model, version)` → metadata, in first-use order.
    pub models: Vec<((String, Option<String>), ModelInfo)>,
    /// `requests[i]`: workload entry `i`'s requests.
    pub requests: Vec<EntryRequests>,
    /// With `--shared-memory system`: the registered regions holding the inputs and outputs.
    pub shm: Option<ShmRun>,
    /// `expected[i][k]`: what entry `i`'s `k`-th request must answer (`validation_data`).
    pub expected: Vec<Vec<Vec<ExpectedOutput>>>,
}

/// Looks up every model's metadata and encodes every entry's requests once, checking input
/// data files value by value against the models: nothing is sent before this succeeds.
/// Errors name the entry (`entries[1]` in a workload file) and, for data files, the file's
/// entry and input. With shared memory, the inputs are written into a region registered with
/// the server (unregistered again if a later step fails).
pub async fn prepare(client: &Client, config: &RunConfig) -> Result<PreparedWorkload, PerfError> {
    let mut infos: Vec<((String, Option<String>), ModelInfo)> = Vec::new();
    for (model, version) in config.workload.models() {
        let info = client.model_info(&model, version.as_deref()).await?;
        infos.push(((model, version), info));
    }
    let named = |i: usize, msg: String| {
        let name = config.workload.entry_name(i);
        PerfError::Workload(WorkloadError(if name.is_empty() { msg } else { format!("{name}: {msg}") }))
    };
    let mut resolved = Vec::with_capacity(config.workload.entries.len());
    for (i, entry) in config.workload.entries.iter().enumerate() {
        let source = config.workload.data[i].as_ref().unwrap_or(&config.input_data);
        let info = info_of(&infos, entry);
        resolved.push(resolve_requests(entry, info, source, level_seed(config.seed, i)).map_err(|e| named(i, e.0))?);
    }

    let mut shm = match config.shared_memory {
        None => None,
        Some(output_size) => {
            let bytes = ShmRun::input_bytes(resolved.iter().flatten().map(|r| &r.inputs[..]));
            let outputs: Vec<(String, Vec<TensorSpec>)> =
                infos.iter().map(|((m, _), info)| (m.clone(), info.outputs.clone())).collect();
            Some(ShmRun::create(client, bytes, &outputs, output_size).await?)
        }
    };
    let encoded = encode_requests(client, config, &resolved, &infos, &named, shm.as_mut());
    let expected = resolved.iter().map(|built| built.iter().map(|r| r.expected.clone()).collect()).collect();
    match encoded {
        Ok(requests) => Ok(PreparedWorkload { models: infos, requests, shm, expected }),
        Err(e) => {
            if let Some(shm) = shm {
                shm.release(client).await;
            }
            Err(e)
        }
    }
}

type ModelInfos = [((String, Option<String>), ModelInfo)];

fn info_of<'a>(infos: &'a ModelInfos, entry: &crate::workload::Entry) -> &'a ModelInfo {
    &infos.iter().find(|(k, _)| k.0 == entry.model && k.1 == entry.version).expect("every model was looked up").1
}

/// Each entry's requests, encoded for the client (their inputs placed in `shm` first, if any).
fn encode_requests(
    client: &Client,
    config: &RunConfig,
    resolved: &[Vec<DataRequest>],
    infos: &ModelInfos,
    named: &dyn Fn(usize, String) -> PerfError,
    mut shm: Option<&mut ShmRun>,
) -> Result<Vec<EntryRequests>, PerfError> {
    let mut requests = Vec::with_capacity(resolved.len());
    for (i, (entry, built)) in config.workload.entries.iter().zip(resolved).enumerate() {
        let source = config.workload.data[i].as_ref().unwrap_or(&config.input_data);
        let mut variants = Vec::with_capacity(built.len());
        for request in built {
            let slices = match shm.as_deref_mut() {
                Some(run) => Some(run.place(&entry.model, &request.inputs, &info_of(infos, entry).outputs)?),
                None => None,
            };
            let prepared = client.prepare(entry, &request.inputs, i, slices.as_ref());
            variants.push(match (prepared, source) {
                (Ok(p), _) => p,
                (Err(e), InputSource::File(file)) => {
                    return Err(named(i, format!("input data file {}: {}: {e}", file.path, request.source)));
                }
                (Err(e), InputSource::Generated(_)) => return Err(e.into()),
            });
        }
        requests.push(EntryRequests::new(variants));
    }
    Ok(requests)
}

/// Where the next level comes from.
enum Plan {
    /// A fixed list of levels (a sweep, or one trace); the sweep stops at the first SLO miss.
    Levels(std::vec::IntoIter<LoadLevel>),
    /// `--binary-search`: each probe follows from the SLO verdicts so far.
    Search { axis: SearchAxis, search: BinarySearch, stopped: bool },
}

impl Plan {
    fn new(load: &Load) -> Plan {
        let levels: Vec<LoadLevel> = match load {
            Load::Concurrency(c) => c.iter().map(|n| LoadLevel::Concurrency(*n)).collect(),
            Load::RequestRate { rates, distribution } => {
                rates.iter().map(|r| LoadLevel::RequestRate { rate: *r, distribution: *distribution }).collect()
            }
            Load::Trace(t) => vec![LoadLevel::Trace { arrivals: t.len(), offered_rate: trace_rate(t) }],
            Load::BinarySearch { axis, space } => {
                return Plan::Search { axis: *axis, search: BinarySearch::new(*space), stopped: false };
            }
        };
        Plan::Levels(levels.into_iter())
    }

    fn next_level(&mut self) -> Option<LoadLevel> {
        match self {
            Plan::Levels(levels) => levels.next(),
            Plan::Search { stopped: true, .. } => None,
            Plan::Search { axis, search, .. } => search.next_probe().map(|v| axis.level(v)),
        }
    }

    /// Feeds a measured level back; a search probe that did not complete ends the search.
    fn record(&mut self, result: &LevelResult, complete: bool, progress: &Progress) {
        if let Plan::Search { axis, search, stopped } = self {
            if !complete {
                *stopped = true;
                return;
            }
            // No verdict (a class with an SLO completed nothing): neither a hit nor a miss, so
            // the search cannot go on from it; the verdict calls the level untrustworthy.
            let Some(met) = result.slo_met else {
                *stopped = true;
                progress.note(&format!(
                    "binary search probe {}: {} has no SLO verdict (no request of {} completed); the search stops",
                    search.probes().len() + 1,
                    result.level,
                    result.no_data_series().join(", ")
                ));
                return;
            };
            search.record(result.level.value(), met);
            let space = search.space();
            let bracket = match search.outcome() {
                SearchOutcome::Unfinished { best, first_miss } => format!(
                    "meets at {}, misses at {}",
                    best.map(|b| axis.level(b).to_string()).unwrap_or_else(|| "-".into()),
                    first_miss.map(|m| axis.level(m).to_string()).unwrap_or_else(|| "-".into())
                ),
                _ => "done".into(),
            };
            progress.note(&format!(
                "binary search probe {}/{}: {} {} the SLO ({bracket})",
                search.probes().len(),
                space.max_probes(),
                result.level,
                if met { "meets" } else { "misses" },
            ));
        }
    }

    /// A sweep skips the levels above a miss; a search goes on bisecting.
    fn stops_at_a_miss(&self) -> bool {
        match self {
            Plan::Levels(rest) => rest.len() > 0,
            Plan::Search { .. } => false,
        }
    }

    fn search_report(&self) -> Option<SearchReport> {
        match self {
            Plan::Levels(_) => None,
            Plan::Search { axis, search, .. } => Some(SearchReport::of(*axis, search)),
        }
    }
}

/// Decides the exit code: server lost (3) before untrustworthy (5) before SLO not met (4).
pub fn verdict(levels: &[LevelResult], has_slo: bool, server_lost: Option<String>) -> Verdict {
    let mut problems = Vec::new();
    let mut exit_code = exit::OK;
    let raise = |code: i32, current: &mut i32| {
        if severity(code) > severity(*current) {
            *current = code;
        }
    };
    if let Some(why) = server_lost {
        problems.push(format!("{why}; results so far were kept"));
        raise(exit::SERVER_LOST, &mut exit_code);
    }
    for l in levels {
        if l.complete && !l.stable {
            problems.push(format!(
                "{}: no stable measurement within {} windows (throughput and latency did not settle within the stability percentage); try a longer --measurement-interval",
                l.level,
                l.windows.len()
            ));
            raise(exit::UNTRUSTWORTHY, &mut exit_code);
        }
        if l.level.is_open_loop() && l.total.late_fraction() > MAX_LATE_FRACTION {
            problems.push(format!(
                "{}: the generator could not keep the schedule: {:.1}% of sends started more than {} ms late (limit {}%); latencies include the delay but the offered load was lower than asked",
                l.level,
                100.0 * l.total.late_fraction(),
                LATE_BOUND.as_millis(),
                MAX_LATE_FRACTION * 100.0
            ));
            raise(exit::UNTRUSTWORTHY, &mut exit_code);
        }
        let no_data = l.no_data_series();
        if l.complete && l.total.requests > 0 && !no_data.is_empty() {
            problems.push(format!(
                "{}: no request of {} completed in the measured windows, so its SLO cannot be judged at this level; \
                 try longer windows or a larger weight",
                l.level,
                no_data.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ")
            ));
            raise(exit::UNTRUSTWORTHY, &mut exit_code);
        }
        if l.complete && l.total.ok == 0 {
            let errors: Vec<String> = l.total.errors_by_status.iter().map(|(k, v)| format!("{k} ×{v}")).collect();
            problems.push(format!(
                "{}: no request succeeded ({})",
                l.level,
                if errors.is_empty() { "no responses".into() } else { errors.join(", ") }
            ));
            raise(exit::UNTRUSTWORTHY, &mut exit_code);
        }
    }
    // A level cut short (Ctrl-C, the time bound) proves nothing about the SLO.
    let best = levels
        .iter()
        .filter(|l| l.complete && l.slo_met == Some(true))
        .max_by(|a, b| a.level.value().total_cmp(&b.level.value()))
        .map(|l| l.level.clone());
    if has_slo && best.is_none() && !levels.is_empty() {
        problems.push("no load level met the SLO".into());
        raise(exit::SLO_NOT_MET, &mut exit_code);
    }
    Verdict { exit_code, problems, best_level_meeting_slo: best }
}

/// How bad an exit code is, for picking the one to report.
fn severity(code: i32) -> u8 {
    match code {
        exit::SERVER_LOST => 3,
        exit::UNTRUSTWORTHY => 2,
        exit::SLO_NOT_MET => 1,
        _ => 0,
    }
}

/// Runs one level: starts its load, warms up, measures windows until stable or out of trials,
/// then stops the load and drains it.
async fn run_level(
    ctx: &Context,
    level: &LoadLevel,
    seed: u64,
    trace: Option<Arc<[Duration]>>,
    progress: &Progress,
) -> (LevelResult, Option<Stop>) {
    let m = &ctx.measurement;
    let timeout = Duration::from_millis(m.request_timeout_ms);
    let recorder = Arc::new(Recorder::with_limit(ctx.slos.clone(), ctx.latency_limit));
    let stop = CancellationToken::new();
    let tracker = TaskTracker::new();

    // Without warm-up the first window opens before the first request goes out, so a short
    // trace is measured whole.
    let mut snapshots: Vec<Option<Snapshot>> = Vec::new();
    let mut started = Instant::now();
    if m.warmup_ms == 0 {
        snapshots.push(scrape(ctx).await);
        recorder.open_window();
        started = Instant::now();
    }

    // Start the load.
    let mut generator = JoinSet::new();
    match level {
        LoadLevel::Concurrency(n) => {
            for i in 0..*n as usize {
                let worker = ClosedLoopWorker {
                    lane_index: i,
                    client: ctx.client.clone(),
                    requests: ctx.requests.clone(),
                    picker: ctx.picker.clone(),
                    rng: StdRng::seed_from_u64(level_seed(seed, i)),
                    recorder: recorder.clone(),
                    stop: stop.clone(),
                    timeout,
                };
                generator.spawn(worker.run());
            }
        }
        LoadLevel::RequestRate { rate, distribution } => {
            let arrivals = Arrivals::new(*distribution, *rate, seed);
            let dispatcher = Dispatcher::new(ctx, seed, &recorder, &stop, &tracker, timeout);
            generator.spawn_blocking(move || dispatcher.run(arrivals));
        }
        LoadLevel::Trace { .. } => {
            let offsets = trace.unwrap_or_else(|| Arc::from(Vec::new()));
            let arrivals = (0..offsets.len()).map(move |i| offsets[i]);
            let dispatcher = Dispatcher::new(ctx, seed, &recorder, &stop, &tracker, timeout);
            generator.spawn_blocking(move || dispatcher.run(arrivals));
        }
    }

    // Warm up, then measure.
    if m.warmup_ms > 0 {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(m.warmup_ms)) => {}
            _ = ctx.interrupt.cancelled() => {}
        }
        snapshots.push(scrape(ctx).await);
        recorder.open_window();
        started = Instant::now();
    }
    let mut windows: Vec<Window> = Vec::new();
    let mut summaries: Vec<Summary> = Vec::new();
    let stability_windows = STABILITY_WINDOWS.min(m.max_trials.max(1) as usize);
    let is_trace = matches!(level, LoadLevel::Trace { .. });
    let mut stable = false;
    let mut stop_reason = None;
    for trial in 0..m.max_trials.max(1) {
        let window_over = async {
            if is_trace {
                // The whole trace is one window: it ends when every arrival has been sent and
                // answered (each request is bounded by the timeout).
                while generator.join_next().await.is_some() {}
                tracker.close();
                tracker.wait().await;
            } else {
                wait_window(m.window, &recorder).await;
            }
        };
        let interrupted = tokio::select! {
            _ = window_over => false,
            _ = ctx.interrupt.cancelled() => true,
        };
        if interrupted {
            stop_reason = Some(Stop::Interrupted);
        }
        let window = recorder.close_window(started.elapsed(), true);
        started = Instant::now();
        snapshots.push(scrape(ctx).await);
        let total = window.total();
        let connection_failures = total.errors.get(&Failure::Connection).copied().unwrap_or(0);
        let summary = Summary::of(&total, window.duration);
        windows.push(window);
        summaries.push(summary);
        stable = is_trace || is_stable(&summaries, m.stability_percentage, stability_windows);
        progress.window(level, trial + 1, m.max_trials, summaries.last().expect("just pushed"), stable);
        let last = summaries.last().expect("just pushed");
        // Broken connections, or nothing but failures: is the server still there?
        if (connection_failures > 0 || (last.ok == 0 && last.errors > 0)) && server_gone(&ctx.client).await {
            let errors: Vec<String> = last.errors_by_status.iter().map(|(k, v)| format!("{k} ×{v}")).collect();
            stop_reason = Some(Stop::ServerLost(format!(
                "it fails its liveness check; the last window had {} successes and {} failures ({})",
                last.ok,
                last.errors,
                errors.join(", ")
            )));
            break;
        }
        if stable || interrupted {
            break;
        }
    }

    // Stop the load and drain what is in flight (bounded by the request timeout).
    stop.cancel();
    let drain = async {
        while generator.join_next().await.is_some() {}
        tracker.close();
        tracker.wait().await;
    };
    if tokio::time::timeout(timeout + Duration::from_secs(1), drain).await.is_err() {
        generator.abort_all();
    }
    // Open loop: requests sent in the last window and answered after it closed (recorded in the
    // window reopened then) are that window's — dropped, a server that stalls at the level's
    // end would not show (coordinated omission at the boundary). Earlier windows' late answers
    // land in the window after them; the last one counts its own too (at most the requests in
    // flight at its end, besides its own throughput).
    if matches!(level, LoadLevel::RequestRate { .. }) {
        let tail = recorder.close_window(Duration::ZERO, false);
        if let (Some(last), Some(summary)) = (windows.last_mut(), summaries.last_mut()) {
            last.absorb_answers(&tail);
            *summary = Summary::of(&last.total(), last.duration);
        }
    }

    let merged_windows = if stable { stability_windows.min(windows.len()) } else { windows.len() };
    let from = windows.len() - merged_windows;
    let merged = Window::merge(&windows[from..]);
    let merged_total = merged.total();
    let total = Summary::of(&merged_total, merged.duration);
    let results = |groups: &[Group]| -> Vec<SeriesResult> {
        groups
            .iter()
            .map(|g| {
                let stats = merged.merged(g.entries.iter().copied());
                let summary = Summary::of(&stats, merged.duration);
                // Nothing completed: no data, no verdict (not a miss).
                let slo_met =
                    (g.has_slo && summary.requests > 0).then(|| meets_slo(stats.ok_within_slo, summary.requests));
                SeriesResult { name: g.name.clone(), slo_ms: g.slo_ms, slo_met, summary }
            })
            .collect()
    };
    let series = results(&ctx.series);
    let by_model = results(&ctx.by_model);
    let by_tenant = results(&ctx.by_tenant);
    let slo_met = level_slo_met(&series);
    // The scrapes around the merged windows (before the first, after each).
    let merged_snapshots = snapshots.get(from..).unwrap_or_default();
    let mut server = BTreeMap::new();
    let mut warnings = Vec::new();
    for (label, model, version) in &ctx.models {
        let (breakdown, resets) = server_stats::breakdown_over(merged_snapshots, model, version.as_deref());
        if let Some(b) = breakdown {
            server.insert(label.clone(), b);
        }
        if resets > 0 {
            warnings.push(format!(
                "server-side breakdown of {label}: {resets} window{} left out, its counters were reset in it \
                 (a model reload or server restart)",
                if resets == 1 { "" } else { "s" }
            ));
        }
    }
    let gpu_memory_mib = snapshots.iter().flatten().filter_map(Snapshot::gpu_memory_used_mib).reduce(f64::max);
    let result = LevelResult {
        level: level.clone(),
        windows: summaries,
        stable,
        complete: stop_reason.is_none(),
        merged_windows,
        total,
        series,
        by_model,
        by_tenant,
        server,
        slo_met,
        ok_within_limit: ctx.latency_limit.map(|_| merged_total.ok_within_limit),
        warnings,
        gpu_memory_mib,
    };
    (result, stop_reason)
}

/// Whether the server fails [`LIVENESS_PROBES`] liveness checks in a row.
async fn server_gone(client: &Client) -> bool {
    for probe in 0..LIVENESS_PROBES {
        if probe > 0 {
            tokio::time::sleep(LIVENESS_PROBE_INTERVAL).await;
        }
        if client.is_live().await {
            return false;
        }
    }
    true
}

/// Whether `good` of `requests` completed requests meets a p99 SLO (failures count as misses).
pub fn meets_slo(good: u64, requests: u64) -> bool {
    requests > 0 && good as f64 >= SLO_QUANTILE * requests as f64
}

async fn scrape(ctx: &Context) -> Option<Snapshot> {
    match &ctx.scraper {
        Some(s) => s.scrape().await.ok(),
        None => None,
    }
}

/// Waits until the open window is due to close.
async fn wait_window(mode: WindowMode, recorder: &Recorder) {
    match mode {
        WindowMode::Time { ms } => tokio::time::sleep(Duration::from_millis(ms)).await,
        WindowMode::Count { requests } => {
            let deadline = Instant::now() + MAX_COUNT_WINDOW;
            let mut tick = tokio::time::interval(Duration::from_millis(5));
            while recorder.completed() < requests && Instant::now() < deadline {
                tick.tick().await;
            }
        }
    }
}

/// One closed-loop sender: sends, waits for the answer, records, repeats until stopped.
struct ClosedLoopWorker {
    lane_index: usize,
    client: Client,
    requests: Arc<[EntryRequests]>,
    picker: Picker,
    rng: StdRng,
    recorder: Arc<Recorder>,
    stop: CancellationToken,
    timeout: Duration,
}

impl ClosedLoopWorker {
    async fn run(mut self) {
        let mut lane = self.client.lane(self.lane_index);
        while !self.stop.is_cancelled() {
            let entry = &self.requests[self.picker.pick(self.rng.random())];
            let req = entry.get(entry.next_index());
            let sent = Instant::now();
            let outcome = lane.send(req, self.timeout).await;
            self.recorder.record(req.series, sent.elapsed(), outcome, req.batch_size);
            if outcome == Err(Failure::Connection) {
                tokio::select! {
                    _ = tokio::time::sleep(CONNECTION_BACKOFF) => {}
                    _ = self.stop.cancelled() => {}
                }
            }
        }
    }
}

/// Open-loop arrivals go out up to this much before their time instead of sleeping for less
/// (an OS sleep overshoots by tens of microseconds); an early request's latency runs from its
/// actual send.
pub const EARLY_RELEASE: Duration = Duration::from_micros(200);
/// How often a sleeping open-loop dispatcher checks whether the level was stopped.
const STOP_POLL: Duration = Duration::from_millis(10);

/// Open-loop dispatch state, moved onto the dispatcher's own thread.
struct Dispatcher {
    runtime: tokio::runtime::Handle,
    client: Client,
    requests: Arc<[EntryRequests]>,
    picker: Picker,
    rng: StdRng,
    recorder: Arc<Recorder>,
    stop: CancellationToken,
    tracker: TaskTracker,
    inflight: Arc<Semaphore>,
    timeout: Duration,
}

impl Dispatcher {
    fn new(
        ctx: &Context,
        seed: u64,
        recorder: &Arc<Recorder>,
        stop: &CancellationToken,
        tracker: &TaskTracker,
        timeout: Duration,
    ) -> Self {
        Dispatcher {
            runtime: tokio::runtime::Handle::current(),
            client: ctx.client.clone(),
            requests: ctx.requests.clone(),
            picker: ctx.picker.clone(),
            rng: StdRng::seed_from_u64(level_seed(seed, usize::MAX)),
            recorder: recorder.clone(),
            stop: stop.clone(),
            tracker: tracker.clone(),
            // Over HTTP/1.1 a request beyond the connections would wait inside the client for
            // one, unseen by the lateness count: bound the sends by the connections instead, so
            // a generator held back by them is reported as late.
            inflight: Arc::new(Semaphore::new(
                ctx.measurement
                    .max_inflight
                    .min(ctx.client.max_in_flight().unwrap_or(usize::MAX))
                    .clamp(1, Semaphore::MAX_PERMITS),
            )),
            timeout,
        }
    }

    /// Sends each arrival at its offset from now, never waiting for answers; returns when the
    /// arrivals run out or the level stops. Runs on a blocking thread: the OS sleep is
    /// precise to tens of microseconds where the runtime's timer ticks in milliseconds.
    /// Latency runs from the scheduled time (or the send, if that was earlier), so a server or
    /// generator that falls behind shows in the latencies; a send more than [`LATE_BOUND`]
    /// after its time is counted as late.
    fn run(mut self, arrivals: impl Iterator<Item = Duration>) {
        let start = std::time::Instant::now();
        for (n, offset) in arrivals.enumerate() {
            let scheduled = start + offset;
            loop {
                if self.stop.is_cancelled() {
                    return;
                }
                let now = std::time::Instant::now();
                if now + EARLY_RELEASE >= scheduled {
                    break;
                }
                std::thread::sleep((scheduled - now - EARLY_RELEASE).min(STOP_POLL));
            }
            // A free slot at once, else wait for one (the wait makes this send late).
            let permit = match self.inflight.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => {
                    let (inflight, stop) = (self.inflight.clone(), self.stop.clone());
                    let waited = self.runtime.block_on(async move {
                        tokio::select! {
                            p = inflight.acquire_owned() => p.ok(),
                            _ = stop.cancelled() => None,
                        }
                    });
                    match waited {
                        Some(p) => p,
                        None => return,
                    }
                }
            };
            let index = self.picker.pick(self.rng.random());
            let variant = self.requests[index].next_index();
            let sent = std::time::Instant::now();
            self.recorder.record_send(self.requests[index].get(variant).series, sent > scheduled + LATE_BOUND);
            let (requests, recorder, timeout) = (self.requests.clone(), self.recorder.clone(), self.timeout);
            let mut lane = self.client.lane(n);
            self.tracker.spawn_on(
                async move {
                    let req = requests[index].get(variant);
                    let outcome = lane.send(req, timeout).await;
                    recorder.record(req.series, scheduled.min(sent).elapsed(), outcome, req.batch_size);
                    drop(permit);
                },
                &self.runtime,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::measure::SeriesStats;

    fn level(level: LoadLevel, ok: u64, stable: bool, slo_met: Option<bool>) -> LevelResult {
        let mut s = SeriesStats::default();
        for _ in 0..ok {
            s.record(Duration::from_millis(1), Ok(()), 1, None);
        }
        let total = Summary::of(&s, Duration::from_secs(1));
        LevelResult {
            level,
            windows: vec![total.clone()],
            stable,
            complete: true,
            merged_windows: 1,
            total,
            series: vec![],
            by_model: vec![],
            by_tenant: vec![],
            server: BTreeMap::new(),
            slo_met,
            ok_within_limit: None,
            warnings: Vec::new(),
            gpu_memory_mib: None,
        }
    }

    #[test]
    fn verdicts_rank_lost_over_untrustworthy_over_slo() {
        let ok = level(LoadLevel::Concurrency(1), 10, true, Some(true));
        let miss = level(LoadLevel::Concurrency(2), 10, true, Some(false));
        let v = verdict(&[ok.clone(), miss.clone()], true, None);
        assert_eq!(v.exit_code, exit::OK);
        assert_eq!(v.best_level_meeting_slo, Some(LoadLevel::Concurrency(1)));
        let v = verdict(std::slice::from_ref(&miss), true, None);
        assert_eq!(v.exit_code, exit::SLO_NOT_MET);
        assert!(v.problems.iter().any(|p| p == "no load level met the SLO"));
        let unstable = level(LoadLevel::Concurrency(1), 10, false, Some(false));
        assert_eq!(verdict(std::slice::from_ref(&unstable), true, None).exit_code, exit::UNTRUSTWORTHY);
        assert_eq!(verdict(&[unstable], true, Some("gone".into())).exit_code, exit::SERVER_LOST);
        let failed = level(LoadLevel::Concurrency(1), 0, true, None);
        let v = verdict(&[failed], false, None);
        assert_eq!(v.exit_code, exit::UNTRUSTWORTHY);
        assert!(v.problems[0].contains("no request succeeded"));
    }

    #[test]
    fn late_open_loop_sends_make_a_level_untrustworthy() {
        let mut l = level(LoadLevel::RequestRate { rate: 100.0, distribution: Distribution::Poisson }, 10, true, None);
        l.total.sends = 1000;
        l.total.late_sends = 10;
        assert_eq!(verdict(&[l.clone()], false, None).exit_code, exit::OK, "exactly 1% is allowed");
        l.total.late_sends = 11;
        let v = verdict(std::slice::from_ref(&l), false, None);
        assert_eq!(v.exit_code, exit::UNTRUSTWORTHY);
        assert!(v.problems[0].contains("could not keep the schedule"), "{:?}", v.problems);
        // An unstable level that met it still counts (the verdict flags it untrustworthy).
        let unstable = level(LoadLevel::Concurrency(4), 10, false, Some(true));
        let v = verdict(&[unstable], true, None);
        assert_eq!(v.best_level_meeting_slo, Some(LoadLevel::Concurrency(4)));
        assert_eq!(v.exit_code, exit::UNTRUSTWORTHY);
    }

    fn series(name: &str, slo_ms: Option<f64>, ok: u64, slo_met: Option<bool>) -> SeriesResult {
        let summary = level(LoadLevel::Concurrency(1), ok, true, None).total;
        SeriesResult { name: name.into(), slo_ms, slo_met, summary }
    }

    #[test]
    fn a_class_with_no_requests_has_no_verdict_and_makes_the_level_untrustworthy() {
        // Two classes with an SLO; "rare" completed nothing in the merged windows.
        let both = |rare_met: Option<bool>| {
            vec![series("common", Some(5.0), 100, Some(true)), series("rare", Some(5.0), 0, rare_met)]
        };
        assert_eq!(level_slo_met(&both(None)), None, "no data: no verdict, not a miss");
        let mut l = level(LoadLevel::Concurrency(4), 100, true, level_slo_met(&both(None)));
        l.series = both(None);
        assert_eq!(l.no_data_series(), vec!["rare"]);
        let v = verdict(std::slice::from_ref(&l), true, None);
        assert_eq!(v.exit_code, exit::UNTRUSTWORTHY, "{:?}", v.problems);
        assert!(v.problems[0].contains("no request of 'rare' completed"), "{:?}", v.problems);
        // A miss elsewhere is still a miss; classes that all met, met.
        let missed = vec![series("common", Some(5.0), 100, Some(false)), series("rare", Some(5.0), 0, None)];
        assert_eq!(level_slo_met(&missed), Some(false));
        let met = vec![series("common", Some(5.0), 100, Some(true)), series("free", None, 0, None)];
        assert_eq!(level_slo_met(&met), Some(true), "a class without an SLO needs no data");
        assert_eq!(level_slo_met(&[series("free", None, 10, None)]), None, "no SLO at all");

        // A binary-search probe without a verdict ends the search (inconclusive), recording
        // neither a hit nor a miss.
        let space = SearchSpace::new(1.0, 8.0, 1.0, true).unwrap();
        let mut plan = Plan::new(&Load::BinarySearch { axis: SearchAxis::Concurrency, space });
        let first = plan.next_level().unwrap();
        let mut probe = level(first, 100, true, None);
        probe.series = both(None);
        plan.record(&probe, true, &Progress::new(false));
        assert_eq!(plan.next_level(), None);
        assert_eq!(plan.search_report().unwrap().outcome, SearchStatus::Unfinished);
        assert!(plan.search_report().unwrap().probes.is_empty());
    }

    #[test]
    fn slo_is_a_share_of_completed_requests() {
        assert!(meets_slo(99, 100));
        assert!(!meets_slo(98, 100));
        assert!(!meets_slo(0, 0));
    }
}
