//! The sweep's report: every variant with its config and numbers, the Pareto frontier, the
//! recommendation and the verdict — as a table on stdout, `results.json`, `results.csv`,
//! `recommended/config.pbtxt` and `variants/<key>/config.pbtxt` for every variant that has a
//! config (ready configs in Triton's text format, each checked to parse back).
//!
//! A measured variant whose numbers cannot be trusted (unstable, or an open-loop generator
//! that fell behind its schedule) is kept in every output, flagged and with its reason, but is
//! neither on the frontier nor recommended.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use nereid_common::config::{config_to_text, parse_model_config, parse_model_config_json};
use serde::Serialize;

use super::frontier::{Constraints, Objective, Objectives, pareto_frontier, recommend};
use super::result::{Measured, VariantResult};
use super::space::SearchSpace;
use super::sweep::{LoadSettings, Stop, Strategy, SweepOutcome};
use crate::error::exit;

/// File names inside `--output-dir`.
pub const RESULTS_JSON: &str = "results.json";
pub const RESULTS_CSV: &str = "results.csv";
pub const REPORT_HTML: &str = "report.html";
pub const RECOMMENDED_DIR: &str = "recommended";
/// `variants/<key>/config.pbtxt`: every variant's config.
pub const VARIANTS_DIR: &str = "variants";
pub const CHECKPOINT_JSON: &str = "checkpoint.json";

/// One variant in the report: its result plus what the analysis says about it.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    #[serde(flatten)]
    pub result: VariantResult,
    /// `None` when not measured.
    pub meets_constraints: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub constraint_violation: Option<String>,
    /// Whether the measurement can be trusted (stable, open-loop schedule kept); `None` when
    /// not measured. An untrusted variant is neither on the frontier nor recommended.
    pub trusted: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub untrusted_reason: Option<String>,
    pub on_frontier: bool,
    pub recommended: bool,
    /// Where its config.pbtxt was written (`variants/<key>/config.pbtxt`; absent when it has
    /// no config, i.e. skipped, or until written).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config_pbtxt: Option<PathBuf>,
}

/// The recommended variant.
#[derive(Clone, Debug, Serialize)]
pub struct Recommendation {
    pub key: String,
    pub measured: Measured,
    /// Where its config.pbtxt was written (absent until written).
    pub config_pbtxt: Option<PathBuf>,
}

/// Exit code and the sentences that explain it.
#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub exit_code: i32,
    pub problems: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct AnalyzeReport {
    pub tool: &'static str,
    pub version: &'static str,
    pub model: String,
    pub url: String,
    pub load: LoadSettings,
    pub load_description: String,
    pub space: SearchSpace,
    pub search: Strategy,
    pub search_end: String,
    pub constraints: Constraints,
    pub objective: Objective,
    /// Results reused from the checkpoint (`--resume`).
    pub reused: usize,
    pub rows: Vec<Row>,
    /// Keys of the Pareto-optimal variants (throughput ↑, p99 ↓, memory ↓).
    pub frontier: Vec<String>,
    pub recommended: Option<Recommendation>,
    pub warnings: Vec<String>,
    pub stopped: Option<String>,
    pub verdict: Verdict,
}

/// The parts of a report that are not results.
pub struct ReportContext<'a> {
    pub model: &'a str,
    pub url: &'a str,
    pub load: &'a LoadSettings,
    pub space: &'a SearchSpace,
    pub search: Strategy,
    pub constraints: Constraints,
    pub objective: Objective,
}

impl AnalyzeReport {
    /// Analyses a sweep's results: frontier, recommendation, verdict. The exit code is the
    /// stop's (server lost 3, interrupted 130, checkpoint unwritable 1), else — when nothing
    /// is recommended — 5 if a variant met the constraints with numbers that cannot be
    /// trusted, else 4; else 0. Untrusted variants are named in a warning either way.
    pub fn new(ctx: ReportContext<'_>, outcome: SweepOutcome) -> AnalyzeReport {
        let results = outcome.results;
        let usable: Vec<(usize, Objectives)> =
            results.iter().enumerate().filter_map(|(i, r)| r.usable().map(|m| (i, Objectives::of(m)))).collect();
        let points: Vec<Objectives> = usable.iter().map(|(_, o)| *o).collect();
        let frontier_idx: Vec<usize> = pareto_frontier(&points).into_iter().map(|k| usable[k].0).collect();
        let best = recommend(&results, &ctx.constraints, ctx.objective);
        let rows: Vec<Row> = results
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let violation = r.numbers().and_then(|m| ctx.constraints.violation(m));
                let untrusted_reason = r.untrusted_reason();
                Row {
                    result: r.clone(),
                    meets_constraints: r.numbers().map(|_| violation.is_none()),
                    constraint_violation: violation,
                    trusted: r.numbers().map(|_| untrusted_reason.is_none()),
                    untrusted_reason,
                    on_frontier: frontier_idx.contains(&i),
                    recommended: best == Some(i),
                    config_pbtxt: None,
                }
            })
            .collect();
        let recommended = best.map(|i| Recommendation {
            key: results[i].key.clone(),
            measured: results[i].usable().expect("recommended results are usable").clone(),
            config_pbtxt: None,
        });

        let mut problems = Vec::new();
        let mut warnings = outcome.warnings;
        let mut exit_code = exit::OK;
        if let Some(stop) = &outcome.stop {
            problems.push(format!("{}; results so far were kept", stop.describe()));
            exit_code = stop.exit_code();
        }
        let untrusted: Vec<&str> =
            rows.iter().filter(|r| r.trusted == Some(false)).map(|r| r.result.key.as_str()).collect();
        if !untrusted.is_empty() {
            warnings.push(format!(
                "{} measured variant{} left out of the frontier and the recommendation because {} numbers cannot \
                 be trusted (unstable, or the open-loop generator fell behind its schedule; see each reason): {}",
                untrusted.len(),
                if untrusted.len() == 1 { " is" } else { "s are" },
                if untrusted.len() == 1 { "its" } else { "their" },
                untrusted.join(", ")
            ));
        }
        if recommended.is_none() {
            let measured = rows.iter().filter(|r| r.result.usable().is_some()).count();
            // Untrusted variants that would have met the constraints: the answer is unknown,
            // not "nothing fits" (nereid-perf's exit 5).
            let would_meet: Vec<&str> = rows
                .iter()
                .filter(|r| r.trusted == Some(false) && r.meets_constraints == Some(true))
                .map(|r| r.result.key.as_str())
                .collect();
            let code = if would_meet.is_empty() {
                problems.push(if measured == 0 && untrusted.is_empty() {
                    "no variant was measured successfully, so none can be recommended".into()
                } else {
                    format!("no variant met the constraints ({})", describe_constraints(&ctx.constraints))
                });
                exit::SLO_NOT_MET
            } else {
                problems.push(format!(
                    "no trusted variant met the constraints ({}); {} met them with numbers that cannot be trusted \
                     (measure again with a longer --measurement-interval, more --max-trials or a lower request rate)",
                    describe_constraints(&ctx.constraints),
                    would_meet.join(", ")
                ));
                exit::UNTRUSTWORTHY
            };
            if exit_code == exit::OK {
                exit_code = code;
            }
        }
        AnalyzeReport {
            tool: "nereid-analyze",
            version: env!("CARGO_PKG_VERSION"),
            model: ctx.model.into(),
            url: ctx.url.into(),
            load: ctx.load.clone(),
            load_description: ctx.load.describe(),
            space: ctx.space.clone(),
            search: ctx.search,
            search_end: outcome.search_end,
            constraints: ctx.constraints,
            objective: ctx.objective,
            reused: outcome.reused,
            frontier: frontier_idx.iter().map(|&i| results[i].key.clone()).collect(),
            rows,
            recommended,
            warnings,
            stopped: outcome.stop.as_ref().map(Stop::describe),
            verdict: Verdict { exit_code, problems },
        }
    }

    /// The recommended variant's row.
    pub fn recommended_row(&self) -> Option<&Row> {
        self.rows.iter().find(|r| r.recommended)
    }

    /// Whether the queue policy is part of the sweep, so the table and the HTML page show
    /// its columns (without it they look as they did before queue policy could be swept).
    pub fn shows_queue_policy(&self) -> bool {
        self.space.sweeps_queue_policy() || self.rows.iter().any(|r| r.result.variant.has_queue_policy())
    }

    /// Whether any variant has a GPU memory figure (the column is shown).
    pub fn shows_gpu_memory(&self) -> bool {
        self.rows.iter().any(|r| r.result.measured.as_ref().is_some_and(|m| m.gpu_memory_mb.is_some()))
    }

    /// Whether priority levels are part of the sweep (their column is shown).
    pub fn shows_priority_levels(&self) -> bool {
        self.space.sweeps_priority_levels() || self.rows.iter().any(|r| r.result.variant.priority_levels > 0)
    }
}

/// `p99 ≤ 10 ms, memory ≤ 512 MiB`, or `none`.
pub fn describe_constraints(c: &Constraints) -> String {
    let mut parts = Vec::new();
    if let Some(p) = c.max_p99_ms {
        parts.push(format!("p99 ≤ {p} ms"));
    }
    if let Some(m) = c.max_memory_mb {
        parts.push(format!("memory ≤ {m} MiB"));
    }
    if let Some(m) = c.max_gpu_memory_mb {
        parts.push(format!("GPU memory ≤ {m} MiB"));
    }
    if let Some(e) = c.max_error_percent {
        parts.push(format!("errors ≤ {e}%"));
    }
    if parts.is_empty() { "none".into() } else { parts.join(", ") }
}

fn objective_name(o: Objective) -> &'static str {
    match o {
        Objective::Goodput => "goodput",
        Objective::Throughput => "throughput",
        Objective::Latency => "latency",
    }
}

/// The human table and summary.
pub fn table(report: &AnalyzeReport) -> String {
    let mut out = String::new();
    let search = match report.search {
        Strategy::Brute => "brute".to_string(),
        Strategy::Quick { max_variants } => format!("quick (at most {max_variants} variants)"),
    };
    let _ = writeln!(
        out,
        "nereid-analyze: {} at {}, {}; search {search} over {} variants: {}",
        report.model,
        report.url,
        report.load_description,
        report.space.len(),
        report.search_end
    );
    // The queue policy's columns, only when it is swept.
    let queue = report.shows_queue_policy();
    let priority = report.shows_priority_levels();
    let queue_cells = |size: &str, timeout: &str, levels: &str| {
        let mut cells = if queue { format!(" {size:>5} {timeout:>7}") } else { String::new() };
        if priority {
            cells.push_str(&format!(" {levels:>6}"));
        }
        cells
    };
    // The credited load level, only when each variant was measured at several.
    let levels = report.load.load.levels() > 1;
    let level_cell = |level: &str| if levels { format!(" {level:>12}") } else { String::new() };
    let gpu = report.shows_gpu_memory();
    let gpu_cell = |mib: &str| if gpu { format!(" {mib:>8}") } else { String::new() };
    let _ = writeln!(
        out,
        "{:<22} {:>4} {:>5} {:>4} {:>7}{} {:<11}{} {:>10} {:>10} {:>8} {:>8} {:>8}{} {:>6} {:>5}",
        "variant",
        "inst",
        "batch",
        "pref",
        "delay",
        queue_cells("queue", "timeout", "levels"),
        "status",
        level_cell("best level"),
        "infer/s",
        "goodput/s",
        "p50 ms",
        "p99 ms",
        "MiB",
        gpu_cell("GPU MiB"),
        "meets",
        "pareto"
    );
    for row in &report.rows {
        let r = &row.result;
        let v = &r.variant;
        let m = r.measured.as_ref();
        let num =
            |f: fn(&Measured) -> f64, prec: usize| m.map(|m| format!("{:.prec$}", f(m))).unwrap_or_else(|| "-".into());
        let mem = m.and_then(|m| m.memory_mb).map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into());
        let meets = match row.meets_constraints {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "-",
        };
        let mark = if row.recommended {
            "*best"
        } else if row.on_frontier {
            "*"
        } else {
            ""
        };
        let dash_if_zero = |x: u64| if x == 0 { "-".to_string() } else { x.to_string() };
        let _ = writeln!(
            out,
            "{:<22} {:>4} {:>5} {:>4} {:>7}{} {:<11}{} {:>10} {:>10} {:>8} {:>8} {:>8}{} {:>6} {:>5}",
            r.key,
            v.instance_count,
            v.max_batch_size,
            dash_if_zero(v.preferred_batch_size.into()),
            v.max_queue_delay_us,
            queue_cells(
                &dash_if_zero(v.max_queue_size.into()),
                &dash_if_zero(v.queue_timeout_us),
                &dash_if_zero(v.priority_levels.into())
            ),
            if row.trusted == Some(false) { "untrusted" } else { r.status.label() },
            level_cell(&m.map(|m| m.level_label()).unwrap_or_default()),
            num(|m| m.throughput_infer_per_sec, 1),
            num(|m| m.goodput_infer_per_sec, 1),
            num(|m| m.p50_ms, 3),
            num(|m| m.p99_ms, 3),
            mem,
            gpu_cell(&m.and_then(|m| m.gpu_memory_mb).map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into())),
            meets,
            mark
        );
        for s in m.map(|m| m.series.as_slice()).unwrap_or_default() {
            let _ = writeln!(
                out,
                "  {}: {:.1} infer/s, goodput {:.1}/s, p99 {:.3} ms, errors {}",
                s.name, s.throughput_infer_per_sec, s.goodput_infer_per_sec, s.p99_ms, s.errors
            );
        }
        if let Some(reason) = &r.reason {
            let label = if row.trusted == Some(false) { "untrusted" } else { r.status.label() };
            let _ = writeln!(out, "  {label}: {reason}");
        }
        if let Some(v) = &row.constraint_violation {
            let _ = writeln!(out, "  misses the constraints: {v}");
        }
    }
    let _ = writeln!(out, "Pareto frontier (throughput ↑, p99 ↓, memory ↓): {}", list_or_none(&report.frontier));
    match &report.recommended {
        Some(rec) => {
            let m = &rec.measured;
            let at = if levels { format!(" at {}", m.level_label()) } else { String::new() };
            let _ = writeln!(
                out,
                "recommended by {} under constraints ({}): {}{at} — {:.1} infer/s, goodput {:.1}/s, p99 {:.3} ms, memory {}{}",
                objective_name(report.objective),
                describe_constraints(&report.constraints),
                rec.key,
                m.throughput_infer_per_sec,
                m.goodput_infer_per_sec,
                m.p99_ms,
                m.memory_mb.map(|x| format!("{x:.1} MiB")).unwrap_or_else(|| "unknown".into())
                    + &m.gpu_memory_mb.map(|x| format!(", GPU memory {x:.1} MiB")).unwrap_or_default(),
                rec.config_pbtxt.as_ref().map(|p| format!(" → {}", p.display())).unwrap_or_default()
            );
        }
        None => {
            let untrusted = report.rows.iter().any(|r| r.trusted == Some(false) && r.meets_constraints == Some(true));
            let _ = writeln!(
                out,
                "NO RECOMMENDATION: no {}measured variant meets the constraints ({})",
                if untrusted { "trusted " } else { "" },
                describe_constraints(&report.constraints)
            );
        }
    }
    if report.reused > 0 {
        let _ = writeln!(out, "{} variants reused from the checkpoint (--resume)", report.reused);
    }
    for w in &report.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    for p in &report.verdict.problems {
        let _ = writeln!(out, "PROBLEM: {p}");
    }
    out
}

fn list_or_none(keys: &[String]) -> String {
    if keys.is_empty() { "none".into() } else { keys.join(", ") }
}

/// The CSV header. Columns are only ever added at the end.
pub const CSV_COLUMNS: [&str; 38] = [
    "key",
    "instance_count",
    "max_batch_size",
    "preferred_batch_size",
    "max_queue_delay_us",
    "status",
    "reason",
    "throughput_infer_per_sec",
    "goodput_infer_per_sec",
    "requests_per_sec",
    "p50_ms",
    "p99_ms",
    "avg_ms",
    "memory_mb",
    "requests",
    "errors",
    "stable",
    "slo_met",
    "server_avg_batch_size",
    "meets_constraints",
    "constraint_violation",
    "on_frontier",
    "recommended",
    "max_queue_size",
    "queue_timeout_us",
    "concurrency",
    "request_rate",
    "priority_levels",
    "gpu_memory_mb",
    "p90_ms",
    "p999_ms",
    "sends",
    "late_sends",
    "trusted",
    "server_queue_us",
    "server_compute_input_us",
    "server_compute_infer_us",
    "server_compute_output_us",
];

/// One row per variant, in the order visited.
pub fn csv(report: &AnalyzeReport) -> String {
    let mut out = CSV_COLUMNS.join(",");
    out.push('\n');
    for row in &report.rows {
        let r = &row.result;
        let v = &r.variant;
        let m = r.measured.as_ref();
        let f = |x: Option<f64>| x.map(|x| format!("{}", (x * 1000.0).round() / 1000.0)).unwrap_or_default();
        let b = |x: Option<bool>| x.map(|x| x.to_string()).unwrap_or_default();
        let cells = [
            r.key.clone(),
            v.instance_count.to_string(),
            v.max_batch_size.to_string(),
            v.preferred_batch_size.to_string(),
            v.max_queue_delay_us.to_string(),
            r.status.label().replace(' ', "_"),
            csv_field(r.reason.as_deref().unwrap_or("")),
            f(m.map(|m| m.throughput_infer_per_sec)),
            f(m.map(|m| m.goodput_infer_per_sec)),
            f(m.map(|m| m.requests_per_sec)),
            f(m.map(|m| m.p50_ms)),
            f(m.map(|m| m.p99_ms)),
            f(m.map(|m| m.avg_ms)),
            f(m.and_then(|m| m.memory_mb)),
            m.map(|m| m.requests.to_string()).unwrap_or_default(),
            m.map(|m| m.errors.to_string()).unwrap_or_default(),
            b(m.map(|m| m.stable)),
            b(m.and_then(|m| m.slo_met)),
            f(m.and_then(|m| m.server_avg_batch_size)),
            b(row.meets_constraints),
            csv_field(row.constraint_violation.as_deref().unwrap_or("")),
            row.on_frontier.to_string(),
            row.recommended.to_string(),
            v.max_queue_size.to_string(),
            v.queue_timeout_us.to_string(),
            m.and_then(|m| m.concurrency).map(|c| c.to_string()).unwrap_or_default(),
            f(m.and_then(|m| m.request_rate)),
            v.priority_levels.to_string(),
            f(m.and_then(|m| m.gpu_memory_mb)),
            f(m.and_then(|m| m.p90_ms)),
            f(m.and_then(|m| m.p999_ms)),
            m.map(|m| m.sends.to_string()).unwrap_or_default(),
            m.map(|m| m.late_sends.to_string()).unwrap_or_default(),
            b(row.trusted),
            f(m.and_then(|m| m.server_time).map(|t| t.queue_us)),
            f(m.and_then(|m| m.server_time).map(|t| t.compute_input_us)),
            f(m.and_then(|m| m.server_time).map(|t| t.compute_infer_us)),
            f(m.and_then(|m| m.server_time).map(|t| t.compute_output_us)),
        ];
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    out
}

/// Quotes a CSV field when it holds a comma, quote or line break (RFC 4180).
pub fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() }
}

pub fn json(report: &AnalyzeReport) -> String {
    serde_json::to_string_pretty(report).unwrap_or_else(|e| format!("{{\"error\":\"serializing the report: {e}\"}}"))
}

/// `row`'s config in Triton's text format after the `header` comment lines, checked to parse
/// back to the config that was sent; `None` when it has no config (skipped).
fn config_text(row: &Row, header: &str) -> Option<Result<String, String>> {
    let json = row.result.config.as_ref()?;
    let key = &row.result.key;
    Some(
        parse_model_config_json(&json.to_string())
            .map_err(|e| format!("variant {key}: its config does not parse: {e}"))
            .and_then(|config| {
                let text = format!("{header}{}", config_to_text(&config));
                match parse_model_config(&text) {
                    Ok(back) if back == config => Ok(text),
                    Ok(_) => Err(format!("variant {key}: its config.pbtxt does not read back as the config sent")),
                    Err(e) => Err(format!("variant {key}: its config.pbtxt does not parse back: {e}")),
                }
            }),
    )
}

/// `{:.1} infer/s, p99 {:.3} ms`, or why there are no numbers.
fn numbers_line(row: &Row) -> String {
    match (&row.result.measured, &row.result.reason) {
        (Some(m), _) => format!("{:.1} infer/s, p99 {:.3} ms", m.throughput_infer_per_sec, m.p99_ms),
        (None, Some(reason)) => reason.clone(),
        (None, None) => "not measured".into(),
    }
}

/// The recommended variant's config in Triton's text format, checked to parse back.
pub fn recommended_pbtxt(report: &AnalyzeReport) -> Option<Result<String, String>> {
    let row = report.recommended_row()?;
    let header = format!(
        "Recommended by nereid-analyze {} for '{}' ({}; objective {}; constraints: {}):\n{} — {}.\n",
        report.version,
        report.model,
        report.load_description,
        objective_name(report.objective),
        describe_constraints(&report.constraints),
        row.result.variant,
        numbers_line(row),
    );
    config_text(row, &comment(&header))
        .map(|r| r.map_err(|e| format!("the recommended config does not parse back: {e}")))
}

/// A variant's config in Triton's text format with what became of it in comments, checked to
/// parse back; `None` when it has no config (skipped).
pub fn variant_pbtxt(report: &AnalyzeReport, row: &Row) -> Option<Result<String, String>> {
    let r = &row.result;
    let mut verdict = vec![if row.trusted == Some(false) { "untrusted".to_string() } else { r.status.label().into() }];
    match row.meets_constraints {
        Some(true) => verdict.push("meets the constraints".into()),
        Some(false) => verdict.push("misses the constraints".into()),
        None => {}
    }
    if row.on_frontier {
        verdict.push("on the Pareto frontier".into());
    }
    if row.recommended {
        verdict.push("recommended".into());
    }
    let mut header = format!(
        "Variant {} of '{}' by nereid-analyze {} ({}): {}.\n{} — {}.\n",
        r.key,
        report.model,
        report.version,
        report.load_description,
        verdict.join(", "),
        r.variant,
        numbers_line(row),
    );
    if let (Some(reason), Some(_)) = (&r.reason, &r.measured) {
        header.push_str(&format!("{reason}\n"));
    }
    config_text(row, &comment(&header))
}

/// Every line of `text` as a `# ` comment (line breaks in reasons included).
fn comment(text: &str) -> String {
    text.lines().map(|l| format!("# {l}\n")).collect()
}

/// A key as a directory name: keys are `[a-z0-9_]` already; anything else becomes `_`.
fn dir_name(key: &str) -> String {
    let name: String = key.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect();
    if name.is_empty() { "_".into() } else { name }
}

/// Removes `variants/<name>/config.pbtxt` (and the then empty directory) for every `<name>`
/// that is no row of `report` with a config: a re-run in the same directory must not leave
/// configs that look like this sweep's. Anything else found there is left alone.
fn remove_stale_variants(report: &AnalyzeReport, variants: &Path) {
    let Ok(entries) = std::fs::read_dir(variants) else { return };
    let current: std::collections::HashSet<String> = report
        .rows
        .iter()
        .filter(|row| variant_pbtxt(report, row).is_some())
        .map(|row| dir_name(&row.result.key))
        .collect();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if current.contains(&name) || !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if std::fs::remove_file(entry.path().join("config.pbtxt")).is_ok() {
            let _ = std::fs::remove_dir(entry.path());
        }
    }
}

/// Writes `results.json`, `results.csv`, `report.html`, `variants/<key>/config.pbtxt` for every
/// variant with a config and (when there is one) `recommended/config.pbtxt` under `dir`; a
/// stale recommended config is removed when nothing is recommended, and so is every
/// `variants/<key>/config.pbtxt` left by an earlier sweep in `dir` whose variant is not in
/// this report. Returns the errors (each file is attempted).
pub fn write_all(report: &mut AnalyzeReport, dir: &Path) -> Vec<String> {
    let mut errors = Vec::new();
    remove_stale_variants(report, &dir.join(VARIANTS_DIR));
    for i in 0..report.rows.len() {
        let Some(text) = variant_pbtxt(report, &report.rows[i]) else { continue };
        let variant_dir = dir.join(VARIANTS_DIR).join(dir_name(&report.rows[i].result.key));
        let path = variant_dir.join("config.pbtxt");
        let written = text.and_then(|text| {
            std::fs::create_dir_all(&variant_dir)
                .map_err(|e| format!("{}: {e}", variant_dir.display()))
                .and_then(|_| crate::report::write_file(&path, &text).map_err(|e| e.to_string()))
        });
        match written {
            Ok(()) => report.rows[i].config_pbtxt = Some(path),
            Err(e) => errors.push(e),
        }
    }
    let rec_dir = dir.join(RECOMMENDED_DIR);
    let rec_path = rec_dir.join("config.pbtxt");
    match recommended_pbtxt(report) {
        Some(Ok(text)) => {
            let written = std::fs::create_dir_all(&rec_dir)
                .map_err(|e| format!("{}: {e}", rec_dir.display()))
                .and_then(|_| crate::report::write_file(&rec_path, &text).map_err(|e| e.to_string()));
            match written {
                Ok(()) => {
                    if let Some(r) = &mut report.recommended {
                        r.config_pbtxt = Some(rec_path);
                    }
                }
                Err(e) => errors.push(e),
            }
        }
        Some(Err(e)) => errors.push(e),
        None => {
            let _ = std::fs::remove_file(&rec_path);
        }
    }
    type Render = fn(&AnalyzeReport) -> String;
    let outputs: [(&str, Render); 3] = [(RESULTS_JSON, json), (RESULTS_CSV, csv), (REPORT_HTML, super::html::report)];
    for (name, render) in outputs {
        if let Err(e) = crate::report::write_file(&dir.join(name), &render(report)) {
            errors.push(e.to_string());
        }
    }
    errors
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::analyze::result::{ServerTime, VariantStatus};
    use crate::analyze::space::Variant;
    use crate::analyze::sweep::{LoadSpec, SweepOutcome};
    use crate::client::Protocol;
    use crate::driver::{Measurement, WindowMode};
    use crate::workload::{InputData, InputSource};
    use nereid_common::config::{config_to_json, parse_model_config};
    use nereid_proto::inference::ModelConfig;

    /// The cells of a CSV line, quotes undone (RFC 4180).
    pub(crate) fn csv_cells(line: &str) -> Vec<String> {
        let (mut cells, mut cell, mut quoted, mut chars) = (Vec::new(), String::new(), false, line.chars().peekable());
        while let Some(c) = chars.next() {
            match (c, quoted) {
                ('"', true) if chars.peek() == Some(&'"') => {
                    cell.push('"');
                    chars.next();
                }
                ('"', _) => quoted = !quoted,
                (',', false) => cells.push(std::mem::take(&mut cell)),
                _ => cell.push(c),
            }
        }
        cells.push(cell);
        assert_eq!(cells.len(), CSV_COLUMNS.len(), "{line}");
        cells
    }

    /// The cell of `column` in line `row` (0 is the header) of `text`.
    fn csv_cell(text: &str, row: usize, column: &str) -> String {
        let i = CSV_COLUMNS.iter().position(|c| *c == column).unwrap_or_else(|| panic!("no column {column}"));
        csv_cells(text.lines().nth(row).expect("the row"))[i].clone()
    }

    pub(crate) fn settings() -> LoadSettings {
        LoadSettings {
            protocol: Protocol::Grpc,
            shared_memory: None,
            load: LoadSpec::Concurrency(vec![4]),
            batch_size: 1,
            input_data: InputSource::Generated(InputData::Random),
            api_key: None,
            slo_p99_ms: Some(10.0),
            workload: None,
            workload_file: None,
            input_digests: Default::default(),
            latency_limit_ms: Some(10.0),
            measurement: Measurement {
                window: WindowMode::Time { ms: 1000 },
                warmup_ms: 100,
                stability_percentage: 10.0,
                max_trials: 3,
                request_timeout_ms: 1000,
                max_inflight: 64,
            },
            seed: 1,
        }
    }

    fn base() -> ModelConfig {
        parse_model_config(
            "name: \"m\"\nmax_batch_size: 8\ninput [ { name: \"I\" data_type: TYPE_FP32 dims: [ 4 ] } ]\n\
             output [ { name: \"O\" data_type: TYPE_FP32 dims: [ 4 ] } ]\ndynamic_batching { }\n",
        )
        .unwrap()
    }

    fn variant(i: u32, preferred: u32) -> Variant {
        Variant::batching(i, 8, preferred, 0)
    }

    /// `v` measured at `tput` infer/s, `p99` ms and `mem` MiB, with its config.
    fn measured(v: Variant, tput: f64, p99: f64, mem: f64) -> VariantResult {
        let mut r = VariantResult::new(v, VariantStatus::Measured);
        let c = crate::analyze::config::variant_config(&base(), "m", &v).unwrap();
        r.config = Some(config_to_json(&c));
        r.measured = Some(Measured {
            throughput_infer_per_sec: tput,
            requests_per_sec: tput,
            goodput_infer_per_sec: tput * 0.9,
            p50_ms: p99 / 2.0,
            p90_ms: Some(p99 * 0.8),
            p99_ms: p99,
            p999_ms: Some(p99 * 1.5),
            avg_ms: p99 / 2.0,
            requests: 100,
            errors: 0,
            stable: true,
            sends: 0,
            late_sends: 0,
            slo_met: Some(p99 <= 10.0),
            within_limit: None,
            memory_mb: Some(mem),
            gpu_memory_mb: None,
            server_avg_batch_size: Some(1.5),
            server_time: Some(ServerTime {
                queue_us: p99 * 100.0,
                compute_input_us: 5.0,
                compute_infer_us: p99 * 50.0,
                compute_output_us: 4.0,
            }),
            concurrency: Some(4),
            request_rate: None,
            series: Vec::new(),
        });
        r
    }

    pub(crate) fn sample_results() -> Vec<VariantResult> {
        let mk = |i: u32, tput: f64, p99: f64, mem: f64| measured(variant(i, 0), tput, p99, mem);
        let skipped = {
            let mut r = VariantResult::new(variant(1, 16), VariantStatus::Skipped);
            r.reason = Some("preferred_batch_size 16 > max_batch_size 8, \"quoted\"".into());
            r
        };
        vec![mk(1, 1000.0, 4.0, 80.0), mk(2, 1800.0, 6.0, 120.0), mk(3, 1900.0, 14.0, 160.0), skipped]
    }

    pub(crate) fn sample_report(constraints: Constraints, stop: Option<Stop>) -> AnalyzeReport {
        report_of(sample_results(), constraints, stop)
    }

    /// A brute sweep's report over the sample space, by throughput.
    pub(crate) fn report_of(
        results: Vec<VariantResult>,
        constraints: Constraints,
        stop: Option<Stop>,
    ) -> AnalyzeReport {
        let space = SearchSpace::new(vec![1, 2, 3], vec![8], vec![0, 16], vec![0]).unwrap();
        let load = settings();
        let ctx = ReportContext {
            model: "m",
            url: "127.0.0.1:1",
            load: &load,
            space: &space,
            search: Strategy::Brute,
            constraints,
            objective: Objective::Throughput,
        };
        let outcome =
            SweepOutcome { results, reused: 0, stop, search_end: "every variant visited".into(), warnings: vec![] };
        AnalyzeReport::new(ctx, outcome)
    }

    #[test]
    fn gpu_memory_is_reported_where_the_server_has_gpus() {
        let plain = sample_report(Constraints::default(), None);
        assert!(!plain.shows_gpu_memory() && !table(&plain).contains("GPU MiB"));
        assert!(!crate::analyze::html::report(&plain).contains("GPU memory MiB"));

        let mut results = sample_results();
        for (r, gpu) in results.iter_mut().zip([3000.0, 5000.0, 9000.0]) {
            r.measured.as_mut().unwrap().gpu_memory_mb = Some(gpu);
        }
        let r = report_of(results, Constraints { max_gpu_memory_mb: Some(8192.0), ..Constraints::default() }, None);
        // i3 has the most throughput but needs 9000 MiB of GPU memory: i2 wins.
        assert_eq!(r.recommended.as_ref().unwrap().key, "i2_b8_p0_d0");
        assert_eq!(r.rows[2].meets_constraints, Some(false));
        let t = table(&r);
        assert!(t.contains("GPU MiB") && t.contains("9000.0") && t.contains("GPU memory ≤ 8192 MiB"), "{t}");
        assert!(t.contains("GPU memory 5000.0 MiB"), "the recommendation names it: {t}");
        assert_eq!(csv_cell(&csv(&r), 1, "gpu_memory_mb"), "3000", "{}", csv(&r));
        assert!(crate::analyze::html::report(&r).contains("<th>GPU memory MiB</th>"));
    }

    #[test]
    fn analysis_marks_frontier_and_recommendation() {
        let r = sample_report(Constraints { max_p99_ms: Some(10.0), ..Default::default() }, None);
        assert_eq!(r.frontier, vec!["i1_b8_p0_d0", "i2_b8_p0_d0", "i3_b8_p0_d0"]);
        assert_eq!(r.recommended.as_ref().unwrap().key, "i2_b8_p0_d0");
        assert_eq!(r.verdict.exit_code, exit::OK);
        assert_eq!(r.rows[2].meets_constraints, Some(false));
        assert_eq!(r.rows[3].meets_constraints, None);
        let t = table(&r);
        assert!(t.contains("recommended by throughput"), "{t}");
        assert!(t.contains("misses the constraints: p99 14.000 ms > 10 ms"), "{t}");
        let pbtxt = recommended_pbtxt(&r).unwrap().unwrap();
        let back = parse_model_config(&pbtxt).unwrap();
        assert_eq!(back.instance_group[0].count, 2);
        assert_eq!(back.max_batch_size, 8);
    }

    #[test]
    fn nothing_meeting_the_constraints_is_exit_4_and_a_lost_server_wins() {
        let r = sample_report(Constraints { max_p99_ms: Some(1.0), ..Default::default() }, None);
        assert!(r.recommended.is_none());
        assert_eq!(r.verdict.exit_code, exit::SLO_NOT_MET);
        assert!(r.verdict.problems[0].contains("no variant met the constraints (p99 ≤ 1 ms)"));
        assert!(table(&r).contains("NO RECOMMENDATION"));
        assert!(recommended_pbtxt(&r).is_none());
        let r = sample_report(Constraints::default(), Some(Stop::ServerLost("gone".into())));
        assert_eq!(r.verdict.exit_code, exit::SERVER_LOST);
        assert!(r.recommended.is_some(), "what was measured still yields a recommendation");
    }

    #[test]
    fn csv_has_a_row_per_variant_and_quotes_text() {
        let r = sample_report(Constraints::default(), None);
        let text = csv(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1 + 4);
        assert_eq!(lines[0].split(',').count(), CSV_COLUMNS.len());
        assert!(lines[4].contains("\"preferred_batch_size 16 > max_batch_size 8, \"\"quoted\"\"\""), "{}", lines[4]);
        assert!(lines[2].starts_with("i2_b8_p0_d0,2,8,0,0,measured,,1800,"), "{}", lines[2]);
        let json: serde_json::Value = serde_json::from_str(&json(&r)).unwrap();
        assert_eq!(json["rows"].as_array().unwrap().len(), 4);
        assert_eq!(json["rows"][1]["key"], "i2_b8_p0_d0", "results are flattened into rows");
        assert_eq!(json["rows"][1]["variant"]["instance_count"], 2);
    }

    #[test]
    fn writes_every_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = sample_report(Constraints::default(), None);
        assert!(write_all(&mut r, dir.path()).is_empty());
        for f in [RESULTS_JSON, RESULTS_CSV, REPORT_HTML, "recommended/config.pbtxt"] {
            assert!(dir.path().join(f).is_file(), "{f}");
        }
        let text = std::fs::read_to_string(dir.path().join("recommended/config.pbtxt")).unwrap();
        assert_eq!(parse_model_config(&text).unwrap().instance_group[0].count, 3);
        // A later sweep recommending nothing removes the stale config.
        let mut none = sample_report(Constraints { max_p99_ms: Some(0.1), ..Default::default() }, None);
        assert!(write_all(&mut none, dir.path()).is_empty());
        assert!(!dir.path().join("recommended/config.pbtxt").exists());
    }

    #[test]
    fn untrusted_variants_are_listed_with_their_reason_but_never_ranked() {
        let mut results = sample_results();
        // i3 (most throughput) was unstable; i2 (next) had its open-loop generator fall behind.
        results[2].measured.as_mut().unwrap().stable = false;
        let m = results[1].measured.as_mut().unwrap();
        (m.sends, m.late_sends) = (2000, 30);
        for r in &mut results {
            r.reason = r.untrusted_reason().map(|why| format!("not recommended: {why}")).or(r.reason.take());
        }
        let r = report_of(results.clone(), Constraints::default(), None);
        assert_eq!(r.recommended.as_ref().unwrap().key, "i1_b8_p0_d0", "the only trusted one");
        assert_eq!(r.frontier, vec!["i1_b8_p0_d0"], "untrusted points do not dominate or sit on the frontier");
        assert_eq!(r.verdict.exit_code, exit::OK);
        let trusted: Vec<Option<bool>> = r.rows.iter().map(|row| row.trusted).collect();
        assert_eq!(trusted, [Some(true), Some(false), Some(false), None]);
        assert_eq!(r.rows[1].meets_constraints, Some(true), "still judged against the constraints");
        assert!(r.rows[1].untrusted_reason.as_ref().unwrap().contains("1.5% of sends started more than 1 ms late"));
        assert!(r.rows[2].untrusted_reason.as_ref().unwrap().contains("no stable measurement"));
        assert!(
            r.warnings[0].contains("2 measured variants are left out") && r.warnings[0].contains("i2_b8_p0_d0, i3")
        );
        let t = table(&r);
        assert!(t.contains("untrusted: not recommended: the generator could not keep the schedule"), "{t}");
        assert_eq!(t.lines().filter(|l| l.starts_with("i3_b8_p0_d0") && l.contains(" untrusted ")).count(), 1, "{t}");
        let text = csv(&r);
        let trusted: Vec<String> = (1..=4).map(|row| csv_cell(&text, row, "trusted")).collect();
        assert_eq!(trusted, ["true", "false", "false", ""], "{text}");
        assert_eq!(csv_cell(&text, 2, "late_sends"), "30");
        assert_eq!(csv_cell(&text, 2, "sends"), "2000");
        assert!(csv_cell(&text, 2, "reason").contains("could not keep the schedule"), "{text}");
        let json: serde_json::Value = serde_json::from_str(&json(&r)).unwrap();
        assert_eq!(json["rows"][1]["trusted"], false);
        assert_eq!(json["rows"][1]["measured"]["late_sends"], 30);
        assert_eq!(json["rows"][2]["measured"]["stable"], false);

        // Only untrusted variants meet the constraints: nothing is recommended, and the exit
        // says the answer is unknown (5), not that nothing fits (4).
        let c = Constraints { max_p99_ms: Some(10.0), ..Default::default() };
        let mut only_untrusted = results.clone();
        only_untrusted[0].measured.as_mut().unwrap().stable = false;
        let r = report_of(only_untrusted, c, None);
        assert!(r.recommended.is_none() && r.frontier.is_empty());
        assert_eq!(r.verdict.exit_code, exit::UNTRUSTWORTHY);
        assert!(table(&r).contains("NO RECOMMENDATION: no trusted measured variant meets"), "{}", table(&r));
        let p = &r.verdict.problems[0];
        assert!(p.contains("no trusted variant met the constraints") && p.contains("i1_b8_p0_d0, i2_b8_p0_d0"), "{p}");
        // ... while one that would miss them anyway changes nothing: 4.
        let tight = Constraints { max_p99_ms: Some(1.0), ..Default::default() };
        assert_eq!(report_of(results, tight, None).verdict.exit_code, exit::SLO_NOT_MET);
    }

    #[test]
    fn every_variant_with_a_config_gets_a_config_pbtxt_that_parses_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut results = sample_results();
        // A load the server refused still has the config that was sent: worth inspecting.
        results[2].status = VariantStatus::LoadFailed;
        results[2].measured = None;
        results[2].reason = Some("HTTP 400: bad\nsecond line".into());
        let mut r = report_of(results, Constraints::default(), None);
        assert!(write_all(&mut r, dir.path()).is_empty());
        for (i, count) in [(0, 1), (1, 2), (2, 3)] {
            let row = &r.rows[i];
            let path = dir.path().join("variants").join(&row.result.key).join("config.pbtxt");
            assert_eq!(row.config_pbtxt.as_deref(), Some(path.as_path()), "the row points at it");
            let text = std::fs::read_to_string(&path).unwrap();
            let config = parse_model_config(&text).unwrap_or_else(|e| panic!("{}: {e}\n{text}", path.display()));
            assert_eq!(config.instance_group[0].count, count);
            let sent = nereid_common::config::parse_model_config_json(&row.result.config.as_ref().unwrap().to_string());
            assert_eq!(config, sent.unwrap(), "exactly the config that was loaded");
            assert!(text.starts_with(&format!("# Variant {} of 'm'", row.result.key)), "{text}");
        }
        let refused = std::fs::read_to_string(dir.path().join("variants/i3_b8_p0_d0/config.pbtxt")).unwrap();
        assert!(refused.contains("(concurrency 4): load failed.") && refused.contains("\n# second line."), "{refused}");
        let recommended = std::fs::read_to_string(dir.path().join("variants/i2_b8_p0_d0/config.pbtxt")).unwrap();
        assert!(recommended.contains("recommended") && recommended.contains("1800.0 infer/s"), "{recommended}");
        // The skipped variant has no config, so no file.
        assert!(r.rows[3].config_pbtxt.is_none());
        assert!(!dir.path().join("variants").join(&r.rows[3].result.key).exists());
        let json: serde_json::Value = serde_json::from_str(&json(&r)).unwrap();
        // A later sweep in the same directory without the first variant: its config goes, as
        // does the skipped one's left by some earlier sweep; other files stay.
        let stale = dir.path().join("variants").join(&r.rows[3].result.key);
        std::fs::create_dir_all(&stale).unwrap();
        std::fs::write(stale.join("config.pbtxt"), "stale").unwrap();
        std::fs::write(dir.path().join("variants/notes.txt"), "mine").unwrap();
        let mut results = sample_results();
        results.remove(0);
        let mut again = report_of(results, Constraints::default(), None);
        assert!(write_all(&mut again, dir.path()).is_empty());
        assert!(!dir.path().join("variants/i1_b8_p0_d0").exists(), "stale variant removed");
        assert!(!stale.exists(), "stale config of a variant that has none now removed");
        assert!(dir.path().join("variants/i2_b8_p0_d0/config.pbtxt").is_file());
        assert!(dir.path().join("variants/notes.txt").is_file());
        assert!(json["rows"][0]["config_pbtxt"].as_str().unwrap().ends_with("variants/i1_b8_p0_d0/config.pbtxt"));
        assert!(json["rows"][3].get("config_pbtxt").is_none());
    }

    #[test]
    fn a_sweep_without_queue_policy_reports_as_before() {
        let r = sample_report(Constraints::default(), None);
        assert!(!r.shows_queue_policy());
        let t = table(&r);
        assert!(!t.contains("timeout"), "no queue-policy columns: {t}");
        let json = json(&r);
        assert!(!json.contains("max_queue_size") && !json.contains("queue_timeout"), "{json}");
        // The CSV's new columns are at the end, 0 without a policy.
        let text = csv(&r);
        assert!(text.lines().next().unwrap().contains(",on_frontier,recommended,max_queue_size,queue_timeout_us,"));
        assert_eq!(csv_cells(text.lines().nth(2).unwrap())[23..29], ["0", "0", "4", "", "0", ""], "{text}");
        assert!(!t.contains("best level"), "one load level: no level column: {t}");
    }

    #[test]
    fn a_queue_policy_variant_is_reported_and_recommended_with_its_policy() {
        let space = SearchSpace::new(vec![1], vec![8], vec![0], vec![0])
            .unwrap()
            .with_queue_policy(vec![0, 4], vec![0, 2000])
            .unwrap();
        let q = Variant { max_queue_size: 4, queue_timeout_us: 2000, ..variant(1, 0) };
        let results = vec![measured(variant(1, 0), 1000.0, 4.0, 80.0), measured(q, 1200.0, 3.0, 80.0)];
        let load = settings();
        let ctx = ReportContext {
            model: "m",
            url: "127.0.0.1:1",
            load: &load,
            space: &space,
            search: Strategy::Brute,
            constraints: Constraints::default(),
            objective: Objective::Throughput,
        };
        let outcome = SweepOutcome {
            results,
            reused: 0,
            stop: None,
            search_end: "every variant visited".into(),
            warnings: vec![],
        };
        let r = AnalyzeReport::new(ctx, outcome);
        assert!(r.shows_queue_policy());
        assert_eq!(r.recommended.as_ref().unwrap().key, "i1_b8_p0_d0_q4_t2000");
        let t = table(&r);
        assert!(t.contains("timeout") && t.contains("i1_b8_p0_d0_q4_t2000"), "{t}");
        let text = csv(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[1].starts_with("i1_b8_p0_d0,"), "{}", lines[1]);
        assert_eq!(csv_cells(lines[1])[23..29], ["0", "0", "4", "", "0", ""], "{}", lines[1]);
        assert!(lines[2].starts_with("i1_b8_p0_d0_q4_t2000,1,8,0,0,measured,"), "{}", lines[2]);
        assert_eq!(csv_cells(lines[2])[22..29], ["true", "4", "2000", "4", "", "0", ""], "{}", lines[2]);
        let json: serde_json::Value = serde_json::from_str(&json(&r)).unwrap();
        assert_eq!(json["rows"][1]["variant"]["max_queue_size"], 4);
        assert_eq!(json["rows"][1]["variant"]["queue_timeout_us"], 2000);
        assert_eq!(json["space"]["max_queue_sizes"], serde_json::json!([0, 4]));
        let pbtxt = recommended_pbtxt(&r).unwrap().unwrap();
        assert!(pbtxt.contains("max queue 4, queue timeout 2000 µs (reject)"), "{pbtxt}");
        let back = parse_model_config(&pbtxt).unwrap();
        let policy = nereid_common::config::dynamic_batching(&back).unwrap().default_queue_policy.unwrap();
        assert_eq!((policy.max_queue_size, policy.default_timeout_microseconds), (4, 2000));
        let doc = crate::analyze::html::report(&r);
        assert!(doc.contains("<th>max queue</th>") && doc.contains("<th>queue timeout µs</th>"));
    }
}
