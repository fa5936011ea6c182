//! GPU metrics for `/metrics`, with Triton's names and its `gpu_uuid` label.
//!
//! With the `cuda` feature, [`GpuMonitor::new`] loads NVML (`libnvidia-ml.so.1`) at run time
//! through `nvml-wrapper` (dlopen, no link-time dependency). Without the feature, without
//! NVIDIA's library or driver, or with no device, it returns `None` (logging why, once) and
//! `/metrics` carries no `nv_gpu_` series. Readings are taken at scrape time and cached for
//! [`CACHE_TTL`], so frequent scrapes do not hammer the driver. A query a device does not
//! support (power on some boards, energy before Volta) just leaves that series out.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long one set of readings is reused across scrapes.
pub const CACHE_TTL: Duration = Duration::from_secs(1);

/// One GPU's readings at one instant; `None` where the device does not support the query.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuSample {
    /// NVML's UUID, e.g. `GPU-5fd4bd6c-...`: the `gpu_uuid` label.
    pub uuid: String,
    /// Fraction of the last sample period a kernel was running, 0.0–1.0.
    pub utilization: Option<f64>,
    pub memory_total_bytes: Option<u64>,
    pub memory_used_bytes: Option<u64>,
    pub power_usage_watts: Option<f64>,
    pub power_limit_watts: Option<f64>,
    /// Energy used since the monitor started, in joules (Triton: since the server started).
    pub energy_joules: Option<f64>,
}

type Sampler = Box<dyn Fn() -> Vec<GpuSample> + Send + Sync>;

/// Samples the GPUs at scrape time. Built once at start; see [`GpuMonitor::new`].
pub struct GpuMonitor {
    sampler: Sampler,
    cache: Mutex<Option<(Instant, Vec<GpuSample>)>>,
    ttl: Duration,
}

impl std::fmt::Debug for GpuMonitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuMonitor").finish_non_exhaustive()
    }
}

impl GpuMonitor {
    /// NVML-backed monitor of every visible GPU, or `None` (logged at info level, once) when
    /// built without the `cuda` feature, when NVML cannot be loaded or initialized, or when
    /// it sees no device. Never panics.
    pub fn new() -> Option<GpuMonitor> {
        #[cfg(feature = "cuda")]
        {
            nvml::monitor()
        }
        #[cfg(not(feature = "cuda"))]
        {
            tracing::info!("GPU metrics off: built without the `cuda` feature");
            None
        }
    }

    /// A monitor over any source of readings (tests, other back ends).
    pub fn from_sampler(sampler: impl Fn() -> Vec<GpuSample> + Send + Sync + 'static) -> GpuMonitor {
        GpuMonitor { sampler: Box::new(sampler), cache: Mutex::new(None), ttl: CACHE_TTL }
    }

    /// Reuses one set of readings for `ttl` (`--metrics-interval-ms`) instead of [`CACHE_TTL`].
    pub fn with_interval(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// Current readings, reused if taken less than the interval ago.
    pub fn samples(&self) -> Vec<GpuSample> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, samples)) = cache.as_ref()
            && at.elapsed() < self.ttl
        {
            return samples.clone();
        }
        let samples = (self.sampler)();
        *cache = Some((Instant::now(), samples.clone()));
        samples
    }

    /// Appends the GPU series (Prometheus text format) to `out`.
    pub fn render(&self, out: &mut String) {
        render_samples(out, &self.samples());
    }
}

/// Prometheus text for `samples`: one family per metric that at least one GPU reports, each
/// with `# HELP` and `# TYPE`, one line per GPU labelled `gpu_uuid`. Empty input, empty output.
pub fn render_samples(out: &mut String, samples: &[GpuSample]) {
    type Get = fn(&GpuSample) -> Option<String>;
    let families: [(&str, &str, &str, Get); 6] = [
        ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "gauge", |s| s.utilization.map(|v| v.to_string())),
        ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "gauge", |s| {
            s.memory_total_bytes.map(|v| v.to_string())
        }),
        ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "gauge", |s| {
            s.memory_used_bytes.map(|v| v.to_string())
        }),
        ("nv_gpu_power_usage", "GPU power usage in watts", "gauge", |s| s.power_usage_watts.map(|v| v.to_string())),
        ("nv_gpu_power_limit", "GPU power management limit in watts", "gauge", |s| {
            s.power_limit_watts.map(|v| v.to_string())
        }),
        // Monotonic since start, so a counter, as in Triton.
        ("nv_energy_consumption", "GPU energy consumption in joules since the server started", "counter", |s| {
            s.energy_joules.map(|v| v.to_string())
        }),
    ];
    for (name, help, kind, get) in families {
        let values: Vec<(&str, String)> = samples.iter().filter_map(|s| get(s).map(|v| (s.uuid.as_str(), v))).collect();
        if values.is_empty() {
            continue;
        }
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (uuid, value) in values {
            let _ = writeln!(out, "{name}{{gpu_uuid=\"{}\"}} {value}", crate::metrics::escape(uuid));
        }
    }
}

#[cfg(feature = "cuda")]
mod nvml {
    use nvml_wrapper::Nvml;

    use super::{GpuMonitor, GpuSample};

    struct Gpu {
        index: u32,
        uuid: String,
        /// Energy counter (mJ) at start, so the series counts from the server's start.
        energy_base_mj: Option<u64>,
    }

    pub(super) fn monitor() -> Option<GpuMonitor> {
        let nvml = match Nvml::init() {
            Ok(nvml) => nvml,
            Err(e) => {
                tracing::info!("GPU metrics off: NVML unavailable ({e})");
                return None;
            }
        };
        let count = match nvml.device_count() {
            Ok(n) => n,
            Err(e) => {
                tracing::info!("GPU metrics off: NVML cannot count devices ({e})");
                return None;
            }
        };
        let mut gpus = Vec::new();
        for index in 0..count {
            let device = match nvml.device_by_index(index) {
                Ok(d) => d,
                Err(e) => {
                    tracing::info!("GPU {index} left out of metrics: {e}");
                    continue;
                }
            };
            match device.uuid() {
                Ok(uuid) => gpus.push(Gpu { index, uuid, energy_base_mj: device.total_energy_consumption().ok() }),
                Err(e) => tracing::info!("GPU {index} left out of metrics: no UUID ({e})"),
            }
        }
        if gpus.is_empty() {
            tracing::info!("GPU metrics off: NVML sees no usable GPU ({count} device(s))");
            return None;
        }
        let uuids: Vec<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
        tracing::info!("GPU metrics on for {} GPU(s): {}", gpus.len(), uuids.join(", "));
        Some(GpuMonitor::from_sampler(move || sample(&nvml, &gpus)))
    }

    fn sample(nvml: &Nvml, gpus: &[Gpu]) -> Vec<GpuSample> {
        gpus.iter()
            .filter_map(|g| {
                // A device that fell off the bus drops out of this scrape rather than failing it.
                let d = nvml.device_by_index(g.index).ok()?;
                let memory = d.memory_info().ok();
                let watts = |mw: u32| f64::from(mw) / 1000.0;
                Some(GpuSample {
                    uuid: g.uuid.clone(),
                    utilization: d.utilization_rates().ok().map(|u| f64::from(u.gpu.min(100)) / 100.0),
                    memory_total_bytes: memory.as_ref().map(|m| m.total),
                    memory_used_bytes: memory.as_ref().map(|m| m.used),
                    power_usage_watts: d.power_usage().ok().map(watts),
                    power_limit_watts: d.enforced_power_limit().or_else(|_| d.power_management_limit()).ok().map(watts),
                    energy_joules: g.energy_base_mj.and_then(|base| {
                        d.total_energy_consumption().ok().map(|mj| mj.saturating_sub(base) as f64 / 1000.0)
                    }),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn fake(uuid: &str) -> GpuSample {
        GpuSample {
            uuid: uuid.to_string(),
            utilization: Some(0.37),
            memory_total_bytes: Some(85_899_345_920),
            memory_used_bytes: Some(1_073_741_824),
            power_usage_watts: Some(71.5),
            power_limit_watts: Some(700.0),
            energy_joules: Some(1234.567),
        }
    }

    #[test]
    fn gpu_render_names_labels_and_format() {
        let mut out = String::new();
        render_samples(&mut out, &[fake("GPU-aaaa"), fake("GPU-bbbb")]);
        for line in [
            "# HELP nv_gpu_utilization GPU utilization rate [0.0 - 1.0)",
            "# TYPE nv_gpu_utilization gauge",
            "nv_gpu_utilization{gpu_uuid=\"GPU-aaaa\"} 0.37",
            "nv_gpu_utilization{gpu_uuid=\"GPU-bbbb\"} 0.37",
            "# TYPE nv_gpu_memory_total_bytes gauge",
            "nv_gpu_memory_total_bytes{gpu_uuid=\"GPU-aaaa\"} 85899345920",
            "# TYPE nv_gpu_memory_used_bytes gauge",
            "nv_gpu_memory_used_bytes{gpu_uuid=\"GPU-aaaa\"} 1073741824",
            "# TYPE nv_gpu_power_usage gauge",
            "nv_gpu_power_usage{gpu_uuid=\"GPU-aaaa\"} 71.5",
            "# TYPE nv_gpu_power_limit gauge",
            "nv_gpu_power_limit{gpu_uuid=\"GPU-bbbb\"} 700",
            "# TYPE nv_energy_consumption counter",
            "nv_energy_consumption{gpu_uuid=\"GPU-aaaa\"} 1234.567",
        ] {
            assert!(out.lines().any(|l| l == line), "missing {line:?} in\n{out}");
        }
        // Each family once, HELP before TYPE before samples.
        assert_eq!(out.matches("# TYPE nv_gpu_utilization").count(), 1);
        let help = out.find("# HELP nv_gpu_power_usage").unwrap();
        let kind = out.find("# TYPE nv_gpu_power_usage").unwrap();
        let first = out.find("nv_gpu_power_usage{").unwrap();
        assert!(help < kind && kind < first);
        // Every sample line is `name{gpu_uuid="..."} number`.
        for l in out.lines().filter(|l| !l.starts_with('#')) {
            let (series, value) = l.rsplit_once(' ').unwrap();
            assert!(series.contains("{gpu_uuid=\"GPU-"), "{l}");
            value.parse::<f64>().unwrap_or_else(|_| panic!("bad value in {l}"));
        }
    }

    #[test]
    fn gpu_render_leaves_out_unsupported_and_escapes() {
        let mut out = String::new();
        render_samples(&mut out, &[]);
        assert!(out.is_empty());

        let partial = GpuSample { uuid: "GPU-\"q\"".into(), utilization: Some(1.0), ..Default::default() };
        render_samples(&mut out, &[partial]);
        assert!(out.contains("nv_gpu_utilization{gpu_uuid=\"GPU-\\\"q\\\"\"} 1\n"), "{out}");
        assert!(!out.contains("nv_gpu_power_usage"), "{out}");
        assert!(!out.contains("nv_energy_consumption"), "{out}");
    }

    #[test]
    fn gpu_monitor_caches_readings() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let monitor = GpuMonitor::from_sampler(move || {
            c.fetch_add(1, Ordering::SeqCst);
            vec![fake("GPU-cccc")]
        });
        let mut a = String::new();
        monitor.render(&mut a);
        let mut b = String::new();
        monitor.render(&mut b);
        assert_eq!(a, b);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "second scrape within the TTL reuses the sample");
    }

    #[test]
    fn gpu_monitor_new_never_panics() {
        // No GPU (or no `cuda` feature) here gives None; on a GPU host, real series.
        if let Some(monitor) = GpuMonitor::new() {
            let mut out = String::new();
            monitor.render(&mut out);
            for l in out.lines().filter(|l| !l.starts_with('#')) {
                assert!(l.starts_with("nv_") && l.contains("{gpu_uuid=\""), "{l}");
            }
        }
    }
}
