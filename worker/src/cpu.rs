//! Host CPU metrics for `/metrics`, with Triton's names: `nv_cpu_utilization` (the fraction of
//! the host's CPU time that was busy, 0.0–1.0), `nv_cpu_memory_total_bytes` and
//! `nv_cpu_memory_used_bytes` (total less what the kernel reports available).
//!
//! Read from `/proc/stat` and `/proc/meminfo` at scrape time. The utilization covers the span
//! between the last two readings, taken at least `--metrics-interval-ms` apart (tritonserver
//! updates its CPU metrics on that interval too): scrapes closer together see the same value,
//! and the first covers the time since the worker started. Where `/proc` cannot be read (not
//! Linux), [`CpuMonitor::new`] returns `None` and the series are left out.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Jiffies the CPUs spent busy and in all, summed over every CPU since boot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuTimes {
    pub busy: u64,
    pub total: u64,
}

/// The aggregate `cpu` line of `/proc/stat`: user nice system idle iowait irq softirq steal
/// (guest time is already counted in user and nice). Idle and iowait count as not busy.
pub fn parse_proc_stat(text: &str) -> Option<CpuTimes> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line.split_whitespace().skip(1).take(8).map(|f| f.parse().ok()).collect::<Option<_>>()?;
    if fields.len() < 4 {
        return None;
    }
    let total: u64 = fields.iter().sum();
    let idle = fields[3] + fields.get(4).copied().unwrap_or(0);
    Some(CpuTimes { busy: total - idle, total })
}

/// `(total, used)` bytes of RAM from `/proc/meminfo`: MemTotal, and MemTotal less MemAvailable.
pub fn parse_meminfo(text: &str) -> Option<(u64, u64)> {
    let kib = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map(|v| v.saturating_mul(1024))
    };
    let (total, available) = (kib("MemTotal")?, kib("MemAvailable")?);
    Some((total, total.saturating_sub(available)))
}

/// Busy fraction between two readings; `None` when no time passed.
pub fn utilization(from: CpuTimes, to: CpuTimes) -> Option<f64> {
    let total = to.total.checked_sub(from.total)?;
    let busy = to.busy.checked_sub(from.busy)?;
    (total > 0).then(|| (busy as f64 / total as f64).clamp(0.0, 1.0))
}

struct Readings {
    /// The reading the current utilization starts from, and when it was taken.
    since: (Instant, CpuTimes),
    utilization: Option<f64>,
}

/// Samples the host's CPU and memory at scrape time (see the module docs).
pub struct CpuMonitor {
    interval: Duration,
    readings: Mutex<Readings>,
}

impl std::fmt::Debug for CpuMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuMonitor").field("interval", &self.interval).finish_non_exhaustive()
    }
}

fn read_stat() -> Option<CpuTimes> {
    parse_proc_stat(&std::fs::read_to_string("/proc/stat").ok()?)
}

impl CpuMonitor {
    /// A monitor whose utilization spans at least `interval`; `None` (logged once) where
    /// `/proc/stat` cannot be read.
    pub fn new(interval: Duration) -> Option<CpuMonitor> {
        let Some(now) = read_stat() else {
            tracing::info!("CPU metrics off: /proc/stat cannot be read on this system");
            return None;
        };
        Some(CpuMonitor {
            interval,
            readings: Mutex::new(Readings { since: (Instant::now(), now), utilization: None }),
        })
    }

    /// The utilization over the last span of at least the interval (the first: since start).
    fn utilization(&self) -> Option<f64> {
        let mut r = self.readings.lock().unwrap_or_else(|e| e.into_inner());
        let (at, from) = r.since;
        if (r.utilization.is_none() || at.elapsed() >= self.interval)
            && let Some(now) = read_stat()
            && let Some(u) = utilization(from, now)
        {
            r.utilization = Some(u);
            r.since = (Instant::now(), now);
        }
        r.utilization
    }

    /// Appends the CPU series (Prometheus text format) to `out`; a reading that fails is left
    /// out.
    pub fn render(&self, out: &mut String) {
        let memory = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| parse_meminfo(&t));
        render_readings(out, self.utilization(), memory);
    }
}

/// Prometheus text for one set of readings.
pub fn render_readings(out: &mut String, utilization: Option<f64>, memory: Option<(u64, u64)>) {
    if let Some(u) = utilization {
        let _ = write!(
            out,
            "# HELP nv_cpu_utilization Fraction of the host's CPU time busy over the last interval [0.0 - 1.0]\n\
             # TYPE nv_cpu_utilization gauge\nnv_cpu_utilization {u}\n"
        );
    }
    if let Some((total, used)) = memory {
        let _ = write!(
            out,
            "# HELP nv_cpu_memory_total_bytes The host's total memory (RAM), in bytes\n\
             # TYPE nv_cpu_memory_total_bytes gauge\nnv_cpu_memory_total_bytes {total}\n\
             # HELP nv_cpu_memory_used_bytes The host's memory (RAM) in use (total less available), in bytes\n\
             # TYPE nv_cpu_memory_used_bytes gauge\nnv_cpu_memory_used_bytes {used}\n"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_counts_idle_and_iowait_as_not_busy() {
        let text = "cpu  100 5 50 800 40 3 2 0 7 0\ncpu0 50 2 25 400 20 1 1 0 0 0\nintr 1 2 3\n";
        assert_eq!(parse_proc_stat(text), Some(CpuTimes { busy: 160, total: 1000 }));
        assert_eq!(parse_proc_stat("cpu0 1 2 3 4\n"), None, "only the aggregate line counts");
        assert_eq!(parse_proc_stat("cpu  1 2 x 4\n"), None);
        assert_eq!(parse_proc_stat("cpu  1 2\n"), None);
    }

    #[test]
    fn utilization_is_the_busy_share_between_two_readings() {
        let a = CpuTimes { busy: 100, total: 1000 };
        assert_eq!(utilization(a, CpuTimes { busy: 150, total: 1200 }), Some(0.25));
        assert_eq!(utilization(a, a), None, "no time passed");
        assert_eq!(utilization(a, CpuTimes { busy: 90, total: 900 }), None, "counters went back");
    }

    #[test]
    fn meminfo_gives_total_and_total_less_available() {
        let text = "MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    4096 kB\n";
        assert_eq!(parse_meminfo(text), Some((16384 * 1024, 12288 * 1024)));
        assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None, "no MemAvailable");
    }

    #[test]
    fn readings_render_with_triton_names() {
        let mut out = String::new();
        render_readings(&mut out, Some(0.25), Some((2048, 1024)));
        assert!(out.contains("# TYPE nv_cpu_utilization gauge\nnv_cpu_utilization 0.25\n"), "{out}");
        assert!(out.contains("nv_cpu_memory_total_bytes 2048\n") && out.contains("nv_cpu_memory_used_bytes 1024\n"));
        let mut out = String::new();
        render_readings(&mut out, None, None);
        assert!(out.is_empty());
    }

    #[test]
    fn the_monitor_reads_this_host() {
        let Some(m) = CpuMonitor::new(Duration::ZERO) else { return };
        let mut out = String::new();
        m.render(&mut out);
        let value = |name: &str| -> f64 {
            let line = out.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{out}"));
            line.rsplit(' ').next().unwrap().parse().unwrap()
        };
        assert!(value("nv_cpu_memory_total_bytes") >= value("nv_cpu_memory_used_bytes"));
        assert!(value("nv_cpu_memory_total_bytes") > 0.0);
    }
}
