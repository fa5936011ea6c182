//! Runs a sweep: for each variant the search proposes, build its config, load it through the
//! repository API, measure it with nereid-perf's driver (one load level) while sampling the
//! worker's RSS, record the result and rewrite the checkpoint.
//!
//! Failure handling: an invalid config is skipped with its reason; a load the server refuses
//! is recorded with the server's message and the sweep goes on; a server that stops answering
//! (or a started worker that exits) ends the sweep as [`Stop::ServerLost`], keeping every
//! result so far in the checkpoint. Ctrl-C ends it after the current window.

use std::path::PathBuf;
use std::time::Duration;

use nereid_common::config::config_to_json;
use nereid_proto::inference::ModelConfig;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::checkpoint::{Checkpoint, CheckpointError};
use super::config::variant_config;
use super::frontier::{Constraints, Objective, best_level, score};
use super::quick::{Outcome, QuickSearch};
use super::result::{Measured, SeriesMeasured, ServerTime, VariantResult, VariantStatus, WithinLimit};
use super::server::{RepositoryClient, RepositoryError, RssSampler, WorkerProcess};
use super::space::{Point, SearchSpace, Variant};
use crate::client::{Protocol, Target, Tls};
use crate::driver::{self, Load, Measurement, RunConfig};
use crate::error::{PerfError, exit};
use crate::report::{Progress, combined_breakdown};
use crate::schedule::{Distribution, LoadLevel};
use crate::workload::{Entry, InputData, InputSource, Origin, Workload};

/// Liveness checks before the server is declared lost, and the pause between them.
const LIVENESS_PROBES: u32 = 3;
const LIVENESS_PROBE_INTERVAL: Duration = Duration::from_millis(200);

/// How the variants are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Strategy {
    /// Every variant of the space, in order.
    Brute,
    /// Hill climbing (see [`QuickSearch`]), at most `max_variants` measured.
    Quick { max_variants: usize },
}

/// The load each variant is measured under: one level, or several (`--concurrency-range`,
/// `--request-rate-range`) of which the variant is credited with its best (see
/// [`best_level`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadSpec {
    Concurrency(Vec<u32>),
    RequestRate { rates: Vec<f64>, distribution: Distribution },
}

impl LoadSpec {
    /// How many load levels each variant is measured at.
    pub fn levels(&self) -> usize {
        match self {
            LoadSpec::Concurrency(c) => c.len(),
            LoadSpec::RequestRate { rates, .. } => rates.len(),
        }
    }
}

/// nereid-perf settings shared by every variant.
#[derive(Clone, Debug, Serialize)]
pub struct LoadSettings {
    pub protocol: Protocol,
    /// `--shared-memory system`: tensors through registered shared memory, with this many
    /// bytes per model output.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared_memory: Option<u64>,
    pub load: LoadSpec,
    /// Rows per request.
    pub batch_size: u32,
    /// `--input-data`: zero, random, or an input data file (read and checked already);
    /// serialized as nereid-perf's flag value.
    #[serde(serialize_with = "serialize_input_data")]
    pub input_data: InputSource,
    /// `--api-key`: sent by every entry without its own key (never written to the outputs).
    #[serde(skip)]
    pub api_key: Option<String>,
    /// Goodput's latency SLO (workload entries may set their own).
    pub slo_p99_ms: Option<f64>,
    /// `--workload`: the requests each variant is measured with, instead of one entry of
    /// `batch_size` rows.
    #[serde(skip)]
    pub workload: Option<Workload>,
    /// Its path, for reports and the checkpoint's load description.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workload_file: Option<String>,
    /// [`content_digest`] of every file the requests come from (the workload file, the input
    /// data files), by path: part of the checkpoint's settings, so that editing one (a class's
    /// `slo_ms`, the data) makes a resume measure everything again.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub input_digests: std::collections::BTreeMap<String, String>,
    /// `--max-p99-ms`: the driver also counts the successes within it, exactly, for the p99
    /// constraint ([`Measured::within_limit`]). Not a setting the numbers depend on: a resume
    /// under another limit reuses them (judged from their percentiles and failures).
    #[serde(skip)]
    pub latency_limit_ms: Option<f64>,
    pub measurement: Measurement,
    pub seed: u64,
}

/// A digest of a file's contents (64-bit FNV-1a, hex): stable across runs and builds, to tell
/// whether an input changed between a checkpoint and a resume.
pub fn content_digest(bytes: &[u8]) -> String {
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x0000_0100_0000_01b3));
    format!("fnv1a64:{hash:016x}")
}

/// `zero`, `random`, or the input data file's path: the `--input-data` value.
fn serialize_input_data<S: serde::Serializer>(source: &InputSource, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&input_data_arg(source))
}

fn input_data_arg(source: &InputSource) -> String {
    match source {
        InputSource::Generated(InputData::Zero) => "zero".into(),
        InputSource::Generated(InputData::Random) => "random".into(),
        InputSource::File(file) => file.path.clone(),
    }
}

impl LoadSettings {
    /// `concurrency 4`, `concurrency 1, 4, 16 (each variant at its best level)`, `100 req/s
    /// (constant)`: what the checkpoint records and a resume compares.
    pub fn describe(&self) -> String {
        let list = |v: Vec<String>| v.join(", ");
        let mut load = match &self.load {
            LoadSpec::Concurrency(c) => format!("concurrency {}", list(c.iter().map(u32::to_string).collect())),
            LoadSpec::RequestRate { rates, distribution } => format!(
                "{} req/s ({})",
                list(rates.iter().map(f64::to_string).collect()),
                if *distribution == Distribution::Poisson { "poisson" } else { "constant" }
            ),
        };
        if self.load.levels() > 1 {
            load.push_str(" (each variant at its best level)");
        }
        if self.shared_memory.is_some() {
            load.push_str(", through shared memory");
        }
        if let InputSource::File(_) = &self.input_data {
            load.push_str(&format!(", input data {}", input_data_arg(&self.input_data)));
        }
        if let Some(file) = &self.workload_file {
            return format!("{load}, workload {file}");
        }
        if self.batch_size > 1 { format!("{load}, batch {}", self.batch_size) } else { load }
    }

    /// nereid-perf's run config for `model` on `server` (its URL, TLS and metrics URL).
    pub fn run_config(&self, model: &str, server: &ServerHandle) -> Result<RunConfig, PerfError> {
        let mut workload = match &self.workload {
            Some(w) => w.clone(),
            None => {
                let mut entry = Entry::for_model(model);
                entry.batch_size = self.batch_size;
                Workload::new(Origin::Flags, vec![entry], self.slo_p99_ms)?
            }
        };
        // nereid-perf's --api-key: the key of every entry without its own, and of the calls
        // that belong to no entry (metadata, shared-memory registration).
        if let Some(key) = &self.api_key {
            for e in &mut workload.entries {
                e.api_key.get_or_insert_with(|| key.clone());
            }
            workload.default_api_key = Some(key.clone());
        }
        let load = match &self.load {
            LoadSpec::Concurrency(c) => Load::Concurrency(c.clone()),
            LoadSpec::RequestRate { rates, distribution } => {
                Load::RequestRate { rates: rates.clone(), distribution: *distribution }
            }
        };
        Ok(RunConfig {
            // The scraper trusts `tls` too, for an https:// metrics URL.
            target: Target {
                protocol: self.protocol,
                url: server.url.clone(),
                connections: self.connections(),
                tls: server.tls.clone(),
            },
            metrics_url: server.metrics_url.clone(),
            workload,
            input_data: self.input_data.clone(),
            load,
            measurement: self.measurement.clone(),
            seed: self.seed,
            shared_memory: self.shared_memory,
            latency_limit: self.latency_limit_ms.and_then(|ms| Duration::try_from_secs_f64(ms / 1000.0).ok()),
        })
    }

    /// The gRPC channels or HTTP/1.1 connections each variant's measurement opens: what
    /// nereid-perf opens for the same load ([`crate::cli::default_connections`]).
    pub fn connections(&self) -> usize {
        let (closed_loop, outstanding) = match &self.load {
            LoadSpec::Concurrency(c) => (true, c.iter().copied().max().unwrap_or(1) as usize),
            LoadSpec::RequestRate { .. } => (false, self.measurement.max_inflight),
        };
        crate::cli::default_connections(self.protocol, closed_loop, outstanding)
    }
}

/// What a sweep needs, validated.
pub struct Sweep {
    pub model: String,
    pub base: ModelConfig,
    pub space: SearchSpace,
    pub strategy: Strategy,
    pub constraints: Constraints,
    pub objective: Objective,
    pub load: LoadSettings,
    pub checkpoint_path: PathBuf,
    /// With `--resume`: the checkpoint read back (its final results are reused).
    pub resume_from: Option<Checkpoint>,
}

impl Sweep {
    /// What the measurements depend on besides the variant: the load settings (with the
    /// digests of the workload and input data files) and the base config, as JSON
    /// ([`Checkpoint::settings`]). Not the constraints or the objective: a resume may change
    /// them, and [`recredit`]s what it reuses.
    pub fn settings(&self) -> String {
        serde_json::json!({ "load": &self.load, "base": config_to_json(&self.base) }).to_string()
    }
}

/// The server the sweep talks to.
pub struct ServerHandle {
    /// Inference endpoint (`host:port`) of the measurement protocol.
    pub url: String,
    /// TLS to `url` (and to an `https://` metrics URL); `None`: plain TCP.
    pub tls: Option<Tls>,
    pub repository: RepositoryClient,
    pub metrics_url: Option<http::Uri>,
    /// Whose RSS to sample; `None`: memory unknown.
    pub pid: Option<u32>,
    /// The worker this tool started, if it did.
    pub worker: Option<WorkerProcess>,
}

impl ServerHandle {
    /// Whether the server is gone: a started worker that exited, or [`LIVENESS_PROBES`]
    /// failed liveness checks in a row. Returns why.
    async fn gone(&mut self) -> Option<String> {
        if let Some(w) = &mut self.worker
            && let Some(status) = w.exit_status()
        {
            return Some(format!("the worker exited ({status}); see {}", w.log.display()));
        }
        for probe in 0..LIVENESS_PROBES {
            if probe > 0 {
                tokio::time::sleep(LIVENESS_PROBE_INTERVAL).await;
            }
            if self.repository.is_live().await {
                return None;
            }
        }
        Some(format!("{} fails its liveness check {LIVENESS_PROBES} times", self.url))
    }
}

/// Why a sweep ended before its search did.
#[derive(Clone, Debug, PartialEq)]
pub enum Stop {
    ServerLost(String),
    Interrupted,
    /// The checkpoint could not be written.
    Checkpoint(String),
}

impl Stop {
    pub fn exit_code(&self) -> i32 {
        match self {
            Stop::ServerLost(_) => exit::SERVER_LOST,
            Stop::Interrupted => exit::INTERRUPTED,
            Stop::Checkpoint(_) => exit::INTERNAL,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Stop::ServerLost(why) => format!("the server was lost mid-sweep: {why}"),
            Stop::Interrupted => "interrupted".into(),
            Stop::Checkpoint(why) => why.clone(),
        }
    }
}

/// What a sweep produced.
pub struct SweepOutcome {
    /// Every variant the search visited, in order (reused ones included).
    pub results: Vec<VariantResult>,
    /// How many came from the checkpoint instead of being measured.
    pub reused: usize,
    pub stop: Option<Stop>,
    /// How the search ended, in words.
    pub search_end: String,
    pub warnings: Vec<String>,
}

/// Runs the sweep to its end (or a [`Stop`]).
pub async fn run(
    sweep: &Sweep,
    server: &mut ServerHandle,
    progress: &Progress,
    interrupt: &CancellationToken,
) -> SweepOutcome {
    let mut checkpoint = Checkpoint::new(&sweep.model, &sweep.load.describe());
    checkpoint.settings = sweep.settings();
    let mut warnings = Vec::new();
    // The checkpoint whose results are reused, if its settings allow.
    let mut reusable_from = sweep.resume_from.as_ref();
    if let Some(previous) = &sweep.resume_from {
        if !previous.settings.is_empty() && previous.settings != checkpoint.settings {
            reusable_from = None;
            // Numbers measured another way (another protocol, SLO, load, window, base config)
            // cannot be ranked with these: nothing is reused, and the checkpoint starts anew.
            warnings.push(
                "the checkpoint's variants were measured with other settings (protocol, load, SLO, \
                 measurement, seed, base config, or the contents of the workload or input data files): \
                 nothing reused, every variant measured again"
                    .to_string(),
            );
        } else {
            if previous.load != checkpoint.load {
                warnings.push(format!(
                    "the checkpoint's variants were measured under '{}', this sweep uses '{}'; reused results are not comparable",
                    previous.load, checkpoint.load
                ));
            }
            // Keep everything the earlier run recorded, even variants this search may not visit.
            checkpoint.results = previous.results.clone();
        }
    }
    let mut out = SweepOutcome { results: Vec::new(), reused: 0, stop: None, search_end: String::new(), warnings };
    let total = match sweep.strategy {
        Strategy::Brute => sweep.space.len(),
        Strategy::Quick { max_variants } => max_variants.min(sweep.space.len()),
    };
    let mut search = Search::new(sweep);
    let mut n = 0usize;
    while let Some(point) = search.next() {
        n += 1;
        let variant = sweep.space.variant(point);
        let reused = reusable_from
            .and_then(|c| c.reusable(&variant.key()))
            .map(|r| recredit(r.clone(), &sweep.constraints, sweep.objective));
        let (result, stop) = match reused {
            Some(r) => {
                progress.note(&format!("[{n}/{total}] {}: {} (from the checkpoint)", r.key, r.status.label()));
                out.reused += 1;
                (r, None)
            }
            None => {
                progress.note(&format!("[{n}/{total}] {}: {variant}", variant.key()));
                let (r, stop) = measure_variant(sweep, server, &variant, progress, interrupt).await;
                progress.note(&format!("[{n}/{total}] {}: {}", r.key, summary_line(&r)));
                (r, stop)
            }
        };
        search.record(point, outcome_of(&result, &sweep.constraints, sweep.objective));
        checkpoint.record(result.clone());
        out.results.push(result);
        if let Err(e) = checkpoint.write(&sweep.checkpoint_path) {
            out.stop = Some(Stop::Checkpoint(e.to_string()));
            break;
        }
        if let Some(stop) = stop {
            out.stop = Some(stop);
            break;
        }
        if interrupt.is_cancelled() {
            out.stop = Some(Stop::Interrupted);
            break;
        }
    }
    out.search_end = search.end(out.stop.is_some());
    out
}

/// A reused result credited anew with its best level under this sweep's constraints and
/// objective (the checkpoint does not record those it was chosen under); a result measured at
/// one level, or not measured, is unchanged.
pub fn recredit(mut r: VariantResult, constraints: &Constraints, objective: Objective) -> VariantResult {
    if r.status != VariantStatus::Measured || r.levels.len() < 2 {
        return r;
    }
    if let Some(i) = best_level(&r.levels, constraints, objective) {
        r.reason = r.levels[i].distrust().map(|why| format!("not recommended: {why}"));
        r.measured = Some(r.levels[i].clone());
    }
    r
}

/// One line about a finished variant, for progress.
fn summary_line(r: &VariantResult) -> String {
    match (&r.measured, &r.reason) {
        (Some(m), _) if r.status == VariantStatus::Measured => format!(
            "{:.1} infer/s, p99 {:.3} ms, {}{}",
            m.throughput_infer_per_sec,
            m.p99_ms,
            m.memory_mb.map(|x| format!("{x:.1} MiB")).unwrap_or_else(|| "memory unknown".into()),
            r.reason.as_ref().map(|why| format!("; {why}")).unwrap_or_default()
        ),
        (_, Some(reason)) => format!("{}: {reason}", r.status.label()),
        _ => r.status.label().into(),
    }
}

/// The search's view of a result. A measurement that cannot be trusted (unstable, or the
/// open-loop schedule not kept) counts as failed: the climb neither stands on it nor credits it.
pub fn outcome_of(r: &VariantResult, constraints: &Constraints, objective: Objective) -> Outcome {
    match (r.status, r.usable()) {
        (VariantStatus::Skipped, _) => Outcome::Skipped,
        (_, Some(m)) => Outcome::Scored(score(m, constraints, objective)),
        _ => Outcome::Failed,
    }
}

/// Brute or quick, behind one `next`/`record` interface.
enum Search {
    Brute { points: std::vec::IntoIter<Point> },
    Quick(Box<QuickSearch>),
}

impl Search {
    fn new(sweep: &Sweep) -> Search {
        match sweep.strategy {
            Strategy::Brute => Search::Brute { points: sweep.space.points().into_iter() },
            Strategy::Quick { max_variants } => {
                Search::Quick(Box::new(QuickSearch::new(sweep.space.clone(), max_variants)))
            }
        }
    }

    fn next(&mut self) -> Option<Point> {
        match self {
            Search::Brute { points } => points.next(),
            Search::Quick(q) => q.next_point(),
        }
    }

    fn record(&mut self, p: Point, outcome: Outcome) {
        if let Search::Quick(q) = self {
            q.record(p, outcome);
        }
    }

    fn end(&self, stopped: bool) -> String {
        if stopped {
            return "stopped early".into();
        }
        match self {
            Search::Brute { .. } => "every variant visited".into(),
            Search::Quick(q) => match q.finish() {
                Some(super::quick::Finish::LocalOptimum) => {
                    format!("local optimum after {} measured variants", q.measured())
                }
                Some(super::quick::Finish::Budget) => format!("--max-variants reached ({} measured)", q.measured()),
                Some(super::quick::Finish::Exhausted) => "every reachable variant visited".into(),
                None => "unfinished".into(),
            },
        }
    }
}

/// Loads and measures one variant; a `Stop` when the sweep cannot go on.
async fn measure_variant(
    sweep: &Sweep,
    server: &mut ServerHandle,
    variant: &Variant,
    progress: &Progress,
    interrupt: &CancellationToken,
) -> (VariantResult, Option<Stop>) {
    let mut result = VariantResult::new(*variant, VariantStatus::Skipped);
    let config = match variant_config(&sweep.base, &sweep.model, variant) {
        Ok(c) => c,
        Err(reason) => {
            result.reason = Some(reason.0);
            return (result, None);
        }
    };
    let json = config_to_json(&config);
    let text = json.to_string();
    result.config = Some(json);

    // Unload first so the previous variant's memory is released before this one loads.
    let loaded = match server.repository.unload(&sweep.model).await {
        Err(RepositoryError::Unreachable(e)) => Err(RepositoryError::Unreachable(e)),
        _ => server.repository.load(&sweep.model, &text).await,
    };
    match loaded {
        Ok(()) => {}
        // A refusal may also be a server dying mid-call (gRPC answers `Unknown: transport
        // error` when the connection breaks): only a server still alive refused the variant.
        // Otherwise the variant is not final, so that `--resume` tries it again.
        Err(RepositoryError::Refused(reason) | RepositoryError::Unreachable(reason)) => {
            if let Some(why) = server.gone().await {
                result.status = VariantStatus::Failed;
                result.reason = Some(format!("loading: {reason}"));
                return (result, Some(Stop::ServerLost(why)));
            }
            result.status = VariantStatus::LoadFailed;
            result.reason = Some(reason);
            return (result, None);
        }
    }

    let run_config = match sweep.load.run_config(&sweep.model, server) {
        Ok(c) => c,
        Err(e) => {
            result.status = VariantStatus::Failed;
            result.reason = Some(e.to_string());
            return (result, None);
        }
    };
    let sampler = server.pid.map(RssSampler::start);
    let report = driver::run(run_config, progress, interrupt.child_token()).await;
    let memory_mb = match (sampler, server.pid) {
        (Some(s), Some(pid)) => s.finish(pid),
        _ => None,
    };
    result.status = VariantStatus::Failed;
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            result.reason = Some(e.to_string());
            let stop = server.gone().await.map(Stop::ServerLost);
            return (result, stop);
        }
    };
    // nereid-perf's verdict: server lost (3) and interrupted (130) end the sweep; its
    // untrustworthy levels (5: unstable, or the open-loop schedule not kept) are judged per
    // level below, from the numbers each level carries.
    let stop = match report.verdict.exit_code {
        exit::SERVER_LOST => Some(Stop::ServerLost(report.stopped.clone().unwrap_or_else(|| "no answer".into()))),
        exit::INTERRUPTED => Some(Stop::Interrupted),
        _ => None,
    };
    if report.levels.is_empty() {
        result.reason = Some("nothing was measured".into());
        return (result, stop.or(interrupt.is_cancelled().then_some(Stop::Interrupted)));
    }
    let levels: Vec<Measured> =
        report.levels.iter().map(|level| measured_of(level, memory_mb, sweep.load.latency_limit_ms)).collect();
    let complete = report.levels.iter().all(|l| l.complete);
    let chosen = best_level(&levels, &sweep.constraints, sweep.objective);
    if stop.is_some() || !complete {
        result.reason = Some(report.stopped.clone().unwrap_or_else(|| "the measurement did not complete".into()));
        result.measured = levels.last().cloned();
    } else if let Some(i) = chosen {
        result.status = VariantStatus::Measured;
        // Kept and reported, but neither on the frontier nor recommended (see `usable`).
        result.reason = levels[i].distrust().map(|why| format!("not recommended: {why}"));
        result.measured = Some(levels[i].clone());
    } else {
        let t = &report.levels[report.levels.len() - 1].total;
        let errors: Vec<String> = t.errors_by_status.iter().map(|(k, v)| format!("{k} ×{v}")).collect();
        result.reason = Some(format!("no request succeeded ({})", errors.join(", ")));
        result.measured = levels.last().cloned();
    }
    if levels.len() > 1 {
        result.levels = levels;
    }
    (result, stop)
}

/// One load level's numbers (`memory_mb`: the peak over the variant's whole measurement;
/// `limit_ms`: the `--max-p99-ms` the driver counted successes within).
fn measured_of(level: &driver::LevelResult, memory_mb: Option<f64>, limit_ms: Option<f64>) -> Measured {
    let t = &level.total;
    let ms = |us: u64| us as f64 / 1000.0;
    let breakdown = combined_breakdown(level);
    Measured {
        throughput_infer_per_sec: t.infer_per_sec,
        requests_per_sec: t.requests_per_sec,
        goodput_infer_per_sec: t.goodput_infer_per_sec,
        p50_ms: ms(t.latency.p50_us),
        p90_ms: Some(ms(t.latency.p90_us)),
        p99_ms: ms(t.latency.p99_us),
        p999_ms: Some(ms(t.latency.p999_us)),
        avg_ms: ms(t.latency.avg_us),
        requests: t.requests,
        errors: t.errors,
        stable: level.stable,
        sends: t.sends,
        late_sends: t.late_sends,
        slo_met: level.slo_met,
        within_limit: limit_ms.zip(level.ok_within_limit).map(|(limit_ms, ok)| WithinLimit { limit_ms, ok }),
        memory_mb,
        gpu_memory_mb: level.gpu_memory_mib,
        server_avg_batch_size: breakdown.and_then(|b| b.avg_batch_size),
        server_time: breakdown.map(|b| ServerTime {
            queue_us: b.avg_queue_us,
            compute_input_us: b.avg_compute_input_us,
            compute_infer_us: b.avg_compute_infer_us,
            compute_output_us: b.avg_compute_output_us,
        }),
        concurrency: match level.level {
            LoadLevel::Concurrency(c) => Some(c),
            _ => None,
        },
        request_rate: match level.level {
            LoadLevel::RequestRate { rate, .. } => Some(rate),
            _ => None,
        },
        series: if level.series.len() > 1 {
            level
                .series
                .iter()
                .map(|s| SeriesMeasured {
                    name: s.name.clone(),
                    throughput_infer_per_sec: s.summary.infer_per_sec,
                    goodput_infer_per_sec: s.summary.goodput_infer_per_sec,
                    p50_ms: ms(s.summary.latency.p50_us),
                    p99_ms: ms(s.summary.latency.p99_us),
                    requests: s.summary.requests,
                    errors: s.summary.errors,
                    slo_ms: s.slo_ms,
                })
                .collect()
        } else {
            Vec::new()
        },
    }
}

/// Reads the checkpoint for `--resume` (absent: start afresh).
pub fn read_checkpoint(path: &std::path::Path, model: &str) -> Result<Option<Checkpoint>, CheckpointError> {
    Checkpoint::read(path, model)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analyze::frontier::tests::measured;
    use crate::analyze::report::tests::settings;

    #[test]
    fn a_reused_variant_is_credited_under_the_resumed_sweeps_constraints() {
        // Measured at two levels without a p99 limit: credited with the faster, slower one.
        let levels = vec![measured(1000.0, 1000.0, 4.0, None), measured(1500.0, 1500.0, 30.0, None)];
        let mut r = VariantResult::new(Variant::batching(1, 8, 0, 0), VariantStatus::Measured);
        r.measured = Some(levels[1].clone());
        r.levels = levels.clone();
        // Resumed with --max-p99-ms 10: the level meeting it.
        let limit = Constraints { max_p99_ms: Some(10.0), ..Constraints::default() };
        let again = recredit(r.clone(), &limit, Objective::Goodput);
        assert_eq!(again.measured.as_ref(), Some(&levels[0]));
        assert_eq!(again.reason, None);
        // Resumed with --objective latency and no limit: the lower p99.
        assert_eq!(
            recredit(r.clone(), &Constraints::default(), Objective::Latency).measured.as_ref(),
            Some(&levels[0])
        );
        assert_eq!(
            recredit(r.clone(), &Constraints::default(), Objective::Goodput).measured.as_ref(),
            Some(&levels[1])
        );
        // One level, or not measured: unchanged.
        let mut single = r.clone();
        single.levels.clear();
        assert_eq!(recredit(single.clone(), &limit, Objective::Goodput), single);
        let failed = VariantResult { status: VariantStatus::Failed, ..r };
        assert_eq!(recredit(failed.clone(), &limit, Objective::Goodput), failed);
    }

    #[test]
    fn connections_are_nereid_perfs() {
        let mut s = settings();
        s.protocol = Protocol::Http { binary: false };
        s.load = LoadSpec::Concurrency(vec![64, 512]);
        assert_eq!(s.connections(), 512, "one per concurrent request, as nereid-perf opens");
        s.load = LoadSpec::RequestRate { rates: vec![100.0], distribution: Distribution::Constant };
        assert_eq!(s.connections(), crate::cli::OPEN_LOOP_HTTP_CONNECTIONS.min(s.measurement.max_inflight));
        s.protocol = Protocol::Grpc;
        s.load = LoadSpec::Concurrency(vec![512]);
        assert_eq!(s.connections(), crate::cli::MAX_GRPC_CHANNELS);
    }

    #[test]
    fn content_digests_are_stable_and_tell_contents_apart() {
        // FNV-1a's published test vectors: the same in every build.
        assert_eq!(content_digest(b""), "fnv1a64:cbf29ce484222325");
        assert_eq!(content_digest(b"a"), "fnv1a64:af63dc4c8601ec8c");
        assert_ne!(content_digest(br#"{"slo_ms": 5}"#), content_digest(br#"{"slo_ms": 6}"#));
    }
}
