//! Output: progress on stderr during the run, a table on stdout, CSV with perf_analyzer's
//! columns (plus goodput and Nereid's own after them), and the full report as JSON.
//!
//! CSV values are microseconds as in perf_analyzer. "Client Send" and "Client Recv" are 0:
//! bodies are encoded before the run and responses are not decoded, so the client spends no
//! measurable time on either; "Network+Server Send/Recv" is the average latency minus the
//! server's queue and compute time, floored at 0, exactly as perf_analyzer computes it.

use std::fmt::Write as _;
use std::io::{IsTerminal, Write};
use std::path::Path;

use crate::driver::{LevelResult, RunReport};
use crate::error::PerfError;
use crate::measure::Summary;
use crate::schedule::LoadLevel;
use crate::server_stats::Breakdown;

/// perf_analyzer's CSV columns after the first (`Concurrency` or `Request Rate`).
pub const PERF_ANALYZER_COLUMNS: [&str; 15] = [
    "Inferences/Second",
    "Client Send",
    "Network+Server Send/Recv",
    "Server Queue",
    "Server Compute Input",
    "Server Compute Infer",
    "Server Compute Output",
    "Client Recv",
    "p50 latency",
    "p90 latency",
    "p95 latency",
    "p99 latency",
    "Avg latency",
    "request/response",
    "response wait",
];

/// Nereid's CSV columns after perf_analyzer's.
pub const EXTRA_COLUMNS: [&str; 11] = [
    "p99.9 latency",
    "Requests/Second",
    "Goodput Inferences/Second",
    "Goodput Requests/Second",
    "Requests",
    "Errors",
    "Sends",
    "Late Sends",
    "Server Avg Batch Size",
    "Stable",
    "SLO Met",
];

/// Progress lines on stderr while a run goes on; rewritten in place on a terminal.
pub struct Progress {
    enabled: bool,
    tty: bool,
}

impl Progress {
    pub fn new(enabled: bool) -> Self {
        Progress { enabled, tty: std::io::stderr().is_terminal() }
    }

    pub fn window(&self, level: &LoadLevel, trial: u32, max_trials: u32, s: &Summary, stable: bool) {
        if !self.enabled {
            return;
        }
        let line = format!(
            "[{level}] window {trial}/{max_trials}: {:.1} infer/s, p99 {}, {} errors{}",
            s.infer_per_sec,
            fmt_ms(s.latency.p99_us),
            s.errors,
            if stable { ", stable" } else { "" }
        );
        let mut err = std::io::stderr().lock();
        let _ = if self.tty { write!(err, "\r\x1b[2K{line}") } else { writeln!(err, "{line}") };
        let _ = err.flush();
    }

    /// A line of its own (on a terminal, below the rewritten window line).
    pub fn note(&self, line: &str) {
        if !self.enabled {
            return;
        }
        let mut err = std::io::stderr().lock();
        let _ = if self.tty { writeln!(err, "\r\x1b[2K{line}") } else { writeln!(err, "{line}") };
    }

    pub fn level_done(&self, result: &LevelResult) {
        if self.enabled && self.tty {
            let _ = writeln!(
                std::io::stderr(),
                "\r\x1b[2K[{}] done: {:.1} infer/s",
                result.level,
                result.total.infer_per_sec
            );
        }
    }
}

fn fmt_ms(us: u64) -> String {
    format!("{:.3} ms", us as f64 / 1000.0)
}

/// The requests-weighted average of every model's breakdown (what one CSV row can hold).
pub fn combined_breakdown(level: &LevelResult) -> Option<Breakdown> {
    let parts: Vec<&Breakdown> = level.server.values().collect();
    let requests: u64 = parts.iter().map(|b| b.requests).sum();
    if requests == 0 {
        return None;
    }
    let avg = |f: fn(&Breakdown) -> f64| parts.iter().map(|b| f(b) * b.requests as f64).sum::<f64>() / requests as f64;
    let batched: Vec<(f64, f64)> =
        parts.iter().filter_map(|b| b.avg_batch_size.map(|s| (s, b.requests as f64))).collect();
    let weight: f64 = batched.iter().map(|(_, w)| w).sum();
    Some(Breakdown {
        requests,
        avg_queue_us: avg(|b| b.avg_queue_us),
        avg_compute_input_us: avg(|b| b.avg_compute_input_us),
        avg_compute_infer_us: avg(|b| b.avg_compute_infer_us),
        avg_compute_output_us: avg(|b| b.avg_compute_output_us),
        avg_batch_size: (weight > 0.0).then(|| batched.iter().map(|(s, w)| s * w).sum::<f64>() / weight),
    })
}

/// The human table, with per-series rows under each level when the workload has several.
pub fn table(report: &RunReport) -> String {
    let mut out = String::new();
    let protocol = match report.protocol {
        crate::client::Protocol::Grpc => "gRPC",
        crate::client::Protocol::Http { binary: true } => "HTTP (binary tensors)",
        crate::client::Protocol::Http { binary: false } => "HTTP (JSON)",
    };
    let models: Vec<&str> = report.models.iter().map(|m| m.name.as_str()).collect();
    let memory = if report.shared_memory { ", tensors through system shared memory" } else { "" };
    let _ = writeln!(out, "nereid-perf: {} over {protocol}{memory} at {}", models.join(", "), report.url);
    let _ = writeln!(out, "load: {}", report.load);
    let _ = writeln!(
        out,
        "{:<34} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>6} {:>9} {:>10} {:>6} {:>7} {:>4}",
        "load",
        "infer/s",
        "req/s",
        "goodput/s",
        "p50 ms",
        "p90 ms",
        "p95 ms",
        "p99 ms",
        "p99.9 ms",
        "avg ms",
        "errors",
        "late",
        "queue µs",
        "compute µs",
        "batch",
        "stable",
        "SLO"
    );
    let ms = |us: u64| format!("{:.3}", us as f64 / 1000.0);
    let row = |out: &mut String,
               label: String,
               s: &Summary,
               server: Option<&Breakdown>,
               stable: &str,
               slo: Option<bool>| {
        let (queue, compute, batch) = match server {
            Some(b) => (
                format!("{:.0}", b.avg_queue_us),
                format!("{:.0}", b.avg_compute_us()),
                b.avg_batch_size.map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into()),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        let late = if s.sends > 0 { s.late_sends.to_string() } else { "-".into() };
        let slo = match slo {
            Some(true) => "met",
            Some(false) => "MISS",
            None => "-",
        };
        let _ = writeln!(
            out,
            "{:<34} {:>10.1} {:>10.1} {:>10.1} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>6} {:>9} {:>10} {:>6} {:>7} {:>4}",
            label,
            s.infer_per_sec,
            s.requests_per_sec,
            s.goodput_infer_per_sec,
            ms(s.latency.p50_us),
            ms(s.latency.p90_us),
            ms(s.latency.p95_us),
            ms(s.latency.p99_us),
            ms(s.latency.p999_us),
            ms(s.latency.avg_us),
            s.errors,
            late,
            queue,
            compute,
            batch,
            stable,
            slo,
        );
    };
    for level in &report.levels {
        let combined = combined_breakdown(level);
        let stable = match (level.complete, level.stable) {
            (false, _) => "partial",
            (true, true) => "yes",
            (true, false) => "NO",
        };
        row(&mut out, level.level.to_string(), &level.total, combined.as_ref(), stable, level.slo_met);
        if level.series.len() > 1 {
            for s in &level.series {
                row(&mut out, format!("  {}", s.name), &s.summary, None, "", s.slo_met);
            }
        }
        for (what, groups) in level.extra_breakdowns() {
            for g in groups {
                row(&mut out, format!("  {what} {}", g.name), &g.summary, None, "", g.slo_met);
            }
        }
        if level.server.len() > 1 {
            for (model, b) in &level.server {
                let _ = writeln!(
                    out,
                    "  server {model}: queue {:.0} µs, compute input {:.0} / infer {:.0} / output {:.0} µs, batch {}",
                    b.avg_queue_us,
                    b.avg_compute_input_us,
                    b.avg_compute_infer_us,
                    b.avg_compute_output_us,
                    b.avg_batch_size.map(|x| format!("{x:.1}")).unwrap_or_else(|| "-".into())
                );
            }
        }
        if let Some(mib) = level.gpu_memory_mib {
            let _ = writeln!(out, "  server GPU memory in use: {mib:.0} MiB (highest over the level's scrapes)");
        }
        if !level.total.errors_by_status.is_empty() {
            let errors: Vec<String> = level.total.errors_by_status.iter().map(|(k, v)| format!("{k} ×{v}")).collect();
            let _ = writeln!(out, "  errors: {}", errors.join(", "));
        }
    }
    for w in &report.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    if let Some(s) = &report.stopped {
        let _ = writeln!(out, "stopped: {s}");
    }
    match &report.binary_search {
        Some(search) => {
            let probes: Vec<String> = search
                .probes
                .iter()
                .map(|p| format!("{} {}", p.level, if p.slo_met { "met" } else { "MISS" }))
                .collect();
            let _ = writeln!(out, "binary search probes, in order: {}", probes.join(", "));
            let _ = writeln!(out, "binary search: {}", search.summary);
        }
        None => {
            if let Some(best) = &report.verdict.best_level_meeting_slo {
                let _ = writeln!(out, "highest load meeting the SLO: {best}");
            }
        }
    }
    for p in &report.verdict.problems {
        let _ = writeln!(out, "PROBLEM: {p}");
    }
    out
}

/// The CSV text: one row per level, perf_analyzer's columns first.
pub fn csv(report: &RunReport) -> String {
    let first = match report.levels.first().map(|l| &l.level) {
        Some(LoadLevel::Concurrency(_)) | None => "Concurrency",
        Some(_) => "Request Rate",
    };
    let mut out = String::new();
    let header: Vec<&str> = std::iter::once(first).chain(PERF_ANALYZER_COLUMNS).chain(EXTRA_COLUMNS).collect();
    let _ = writeln!(out, "{}", header.join(","));
    for level in &report.levels {
        let s = &level.total;
        let l = &s.latency;
        let server = combined_breakdown(level);
        let opt = |v: Option<f64>| v.map(|x| format!("{}", x.round() as u64)).unwrap_or_default();
        let network = server.map(|b| (l.avg_us as f64 - b.avg_queue_us - b.avg_compute_us()).max(0.0));
        let cells: Vec<String> = vec![
            format!("{}", round2(level.level.value())),
            format!("{}", round2(s.infer_per_sec)),
            "0".into(),
            opt(network),
            opt(server.map(|b| b.avg_queue_us)),
            opt(server.map(|b| b.avg_compute_input_us)),
            opt(server.map(|b| b.avg_compute_infer_us)),
            opt(server.map(|b| b.avg_compute_output_us)),
            "0".into(),
            l.p50_us.to_string(),
            l.p90_us.to_string(),
            l.p95_us.to_string(),
            l.p99_us.to_string(),
            l.avg_us.to_string(),
            "0".into(),
            l.avg_us.to_string(),
            l.p999_us.to_string(),
            format!("{}", round2(s.requests_per_sec)),
            format!("{}", round2(s.goodput_infer_per_sec)),
            format!("{}", round2(s.goodput_requests_per_sec)),
            s.requests.to_string(),
            s.errors.to_string(),
            s.sends.to_string(),
            s.late_sends.to_string(),
            server.and_then(|b| b.avg_batch_size).map(|x| format!("{}", round2(x))).unwrap_or_default(),
            level.stable.to_string(),
            level.slo_met.map(|m| m.to_string()).unwrap_or_default(),
        ];
        let _ = writeln!(out, "{}", cells.join(","));
    }
    out
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// The report as pretty JSON.
pub fn json(report: &RunReport) -> String {
    serde_json::to_string_pretty(report).unwrap_or_else(|e| format!("{{\"error\":\"serializing the report: {e}\"}}"))
}

/// Writes `text` to `path` (through a temporary file, so a reader never sees half a report).
pub fn write_file(path: &Path, text: &str) -> Result<(), PerfError> {
    let err = |source| PerfError::Output { path: path.display().to_string(), source };
    let tmp = path.with_extension("tmp~");
    std::fs::write(&tmp, text).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_header_starts_with_perf_analyzer_columns() {
        let header: Vec<&str> = std::iter::once("Concurrency").chain(PERF_ANALYZER_COLUMNS).collect();
        assert_eq!(
            header.join(","),
            "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,\
             Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency,\
             Avg latency,request/response,response wait"
        );
    }
}
