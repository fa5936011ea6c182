//! Server-side latency breakdown from the server's Prometheus `/metrics`, scraped before and
//! after each window as perf_analyzer reads Triton's statistics.
//!
//! Triton's cumulative counters (`nv_inference_queue_duration_us`,
//! `nv_inference_compute_{input,infer,output}_duration_us`, `nv_inference_request_success`,
//! `nv_inference_exec_count`, `nv_inference_count`) are differenced across a window and divided
//! by the requests served in it: average queue and compute time per request, and the average
//! batch size the scheduler formed. A scrape that fails leaves the breakdown out; it never
//! fails the run. Counters are differenced window by window: a window in which a version's
//! counters were reset (one went down, or its series vanished — a model reload or a server
//! restart) is left out rather than counted wrong. An `https://` metrics URL is scraped over TLS, trusting what the run's
//! `--ssl*` flags trust (else the system's CA bundle).

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;

use crate::client::tls::Connector;
use crate::client::{Tls, TlsSettings};

pub const REQUEST_SUCCESS: &str = "nv_inference_request_success";
pub const INFERENCE_COUNT: &str = "nv_inference_count";
pub const EXEC_COUNT: &str = "nv_inference_exec_count";
pub const QUEUE_DURATION: &str = "nv_inference_queue_duration_us";
pub const COMPUTE_INPUT_DURATION: &str = "nv_inference_compute_input_duration_us";
pub const COMPUTE_INFER_DURATION: &str = "nv_inference_compute_infer_duration_us";
pub const COMPUTE_OUTPUT_DURATION: &str = "nv_inference_compute_output_duration_us";

/// How long one scrape may take.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest `/metrics` body read.
pub const MAX_METRICS_BYTES: usize = 16 << 20;

/// Cumulative counters of one model version.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Counters {
    pub request_success: f64,
    pub inference_count: f64,
    pub exec_count: f64,
    pub queue_us: f64,
    pub compute_input_us: f64,
    pub compute_infer_us: f64,
    pub compute_output_us: f64,
}

impl Counters {
    fn values(&self) -> [f64; 7] {
        [
            self.request_success,
            self.inference_count,
            self.exec_count,
            self.queue_us,
            self.compute_input_us,
            self.compute_infer_us,
            self.compute_output_us,
        ]
    }

    /// `self - before`, or `None` when a counter went down (it was reset in between).
    fn since(&self, before: &Counters) -> Option<Counters> {
        if self.values().iter().zip(before.values()).any(|(a, b)| *a < b) {
            return None;
        }
        Some(Counters {
            request_success: self.request_success - before.request_success,
            inference_count: self.inference_count - before.inference_count,
            exec_count: self.exec_count - before.exec_count,
            queue_us: self.queue_us - before.queue_us,
            compute_input_us: self.compute_input_us - before.compute_input_us,
            compute_infer_us: self.compute_infer_us - before.compute_infer_us,
            compute_output_us: self.compute_output_us - before.compute_output_us,
        })
    }

    fn add(&mut self, other: &Counters) {
        self.request_success += other.request_success;
        self.inference_count += other.inference_count;
        self.exec_count += other.exec_count;
        self.queue_us += other.queue_us;
        self.compute_input_us += other.compute_input_us;
        self.compute_infer_us += other.compute_infer_us;
        self.compute_output_us += other.compute_output_us;
    }
}

/// Used GPU memory per device (`gpu_uuid`), where the server has GPUs.
pub const GPU_MEMORY_USED: &str = "nv_gpu_memory_used_bytes";

/// One scrape: counters per `(model, version)`, and GPU memory per device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    pub models: BTreeMap<(String, String), Counters>,
    /// `nv_gpu_memory_used_bytes` per `gpu_uuid` (empty: no GPU series).
    pub gpu_memory_used_bytes: BTreeMap<String, f64>,
}

impl Snapshot {
    /// Used memory over every GPU the server reports, in MiB (`None`: no GPU series).
    pub fn gpu_memory_used_mib(&self) -> Option<f64> {
        (!self.gpu_memory_used_bytes.is_empty())
            .then(|| self.gpu_memory_used_bytes.values().sum::<f64>() / (1024.0 * 1024.0))
    }

    /// The counters of `model`'s versions (one version, or all of them).
    fn versions<'a>(
        &'a self,
        model: &'a str,
        version: Option<&'a str>,
    ) -> impl Iterator<Item = (&'a str, &'a Counters)> + 'a {
        self.models
            .iter()
            .filter(move |((m, v), _)| m == model && version.is_none_or(|want| want == v))
            .map(|((_, v), c)| (v.as_str(), c))
    }
}

/// What `model` (one version, or all) did between two scrapes, summed over its versions;
/// `None` when a version's counters were reset in between: one went down, or the version was
/// in `before` and is gone from `after` (unloaded, maybe loaded again since). A version absent
/// from `before` counts from 0: its counters were created in between.
fn window_delta(before: &Snapshot, after: &Snapshot, model: &str, version: Option<&str>) -> Option<Counters> {
    let key = |v: &str| (model.to_string(), v.to_string());
    if before.versions(model, version).any(|(v, _)| !after.models.contains_key(&key(v))) {
        return None;
    }
    let mut sum = Counters::default();
    for (v, b) in after.versions(model, version) {
        let a = before.models.get(&key(v)).copied().unwrap_or_default();
        sum.add(&b.since(&a)?);
    }
    Some(sum)
}

/// Parses the Prometheus text exposition format, keeping the counters above. Lines it does not
/// understand are skipped (the format allows many metrics it has no use for).
pub fn parse(text: &str) -> Snapshot {
    let mut snap = Snapshot::default();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, labels, value)) = split_sample(line) else { continue };
        if name == GPU_MEMORY_USED {
            let gpu = parse_labels(labels).remove("gpu_uuid").unwrap_or_default();
            snap.gpu_memory_used_bytes.insert(gpu, value);
            continue;
        }
        let field: fn(&mut Counters) -> &mut f64 = match name {
            REQUEST_SUCCESS => |c| &mut c.request_success,
            INFERENCE_COUNT => |c| &mut c.inference_count,
            EXEC_COUNT => |c| &mut c.exec_count,
            QUEUE_DURATION => |c| &mut c.queue_us,
            COMPUTE_INPUT_DURATION => |c| &mut c.compute_input_us,
            COMPUTE_INFER_DURATION => |c| &mut c.compute_infer_us,
            COMPUTE_OUTPUT_DURATION => |c| &mut c.compute_output_us,
            _ => continue,
        };
        let labels = parse_labels(labels);
        let (Some(model), Some(version)) = (labels.get("model"), labels.get("version")) else { continue };
        let counters = snap.models.entry((model.clone(), version.clone())).or_default();
        *field(counters) += value;
    }
    snap
}

/// `name{labels} value [timestamp]` → (name, labels text, value).
fn split_sample(line: &str) -> Option<(&str, &str, f64)> {
    let (name, labels, rest) = match line.find('{') {
        Some(open) => {
            let close = line.rfind('}')?;
            (&line[..open], &line[open + 1..close], &line[close + 1..])
        }
        None => {
            let sp = line.find(char::is_whitespace)?;
            (&line[..sp], "", &line[sp..])
        }
    };
    let value = rest.split_whitespace().next()?.parse::<f64>().ok()?;
    Some((name.trim(), labels, value))
}

/// `a="x",b="y\"z"` → map; handles escaped quotes and backslashes.
fn parse_labels(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| *c == ',' || c.is_whitespace()) {
            chars.next();
        }
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect::<String>().trim().to_string();
        if key.is_empty() {
            break;
        }
        if chars.next() != Some('"') {
            break;
        }
        let mut value = String::new();
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(other) => value.push(other),
                    None => break,
                },
                '"' => break,
                c => value.push(c),
            }
        }
        out.insert(key, value);
    }
    out
}

/// Server-side averages of one model over one or more windows.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Breakdown {
    /// Requests the server completed successfully in the interval.
    pub requests: u64,
    pub avg_queue_us: f64,
    pub avg_compute_input_us: f64,
    pub avg_compute_infer_us: f64,
    pub avg_compute_output_us: f64,
    /// Rows per model execution; `None` when nothing executed.
    pub avg_batch_size: Option<f64>,
}

impl Breakdown {
    pub fn avg_compute_us(&self) -> f64 {
        self.avg_compute_input_us + self.avg_compute_infer_us + self.avg_compute_output_us
    }
}

impl Breakdown {
    /// Averages of what the counters grew by; `None` when no request succeeded.
    fn of(d: &Counters) -> Option<Breakdown> {
        let requests = d.request_success;
        if requests < 1.0 {
            return None;
        }
        Some(Breakdown {
            requests: requests as u64,
            avg_queue_us: d.queue_us / requests,
            avg_compute_input_us: d.compute_input_us / requests,
            avg_compute_infer_us: d.compute_infer_us / requests,
            avg_compute_output_us: d.compute_output_us / requests,
            avg_batch_size: (d.exec_count >= 1.0).then(|| d.inference_count / d.exec_count),
        })
    }
}

/// The breakdown of `model` (one version, or all) between two scrapes. `None` when it served
/// nothing in between (absent from `after` included; absent from `before` counts from 0), or
/// when its counters were reset in between (see [`breakdown_over`]).
pub fn breakdown(before: &Snapshot, after: &Snapshot, model: &str, version: Option<&str>) -> Option<Breakdown> {
    Breakdown::of(&window_delta(before, after, model, version)?)
}

/// The breakdown of `model` (one version, or all) over consecutive scrapes — the windows
/// between each scrape and the next; a failed scrape (`None`) joins its neighbours' windows —
/// and how many windows were left out because a counter was reset in them (a counter that
/// went down, or a version's series that vanished: a model reload or a server restart).
/// The breakdown sums the other windows; `None` when no request succeeded in them.
pub fn breakdown_over(
    snapshots: &[Option<Snapshot>],
    model: &str,
    version: Option<&str>,
) -> (Option<Breakdown>, usize) {
    let scraped: Vec<&Snapshot> = snapshots.iter().flatten().collect();
    let mut sum = Counters::default();
    let mut resets = 0;
    for pair in scraped.windows(2) {
        match window_delta(pair[0], pair[1], model, version) {
            Some(d) => sum.add(&d),
            None => resets += 1,
        }
    }
    (Breakdown::of(&sum), resets)
}

/// Fetches `/metrics` over HTTP/1.1 (or HTTPS) on a reused connection.
#[derive(Clone)]
pub struct Scraper {
    client: Client<Connector, Empty<Bytes>>,
    uri: http::Uri,
}

/// A scrape failed.
#[derive(Clone, Debug, thiserror::Error)]
#[error("scraping {uri}: {reason}")]
pub struct ScrapeError {
    pub uri: String,
    pub reason: String,
}

impl Scraper {
    /// A scraper of `uri`; an `https://` one uses `tls` (the run's TLS settings) or, without
    /// them, the system's CA bundle.
    pub fn new(uri: http::Uri, tls: Option<&Tls>) -> Result<Self, ScrapeError> {
        let connector = match uri.scheme_str() {
            Some("https") => {
                let tls = match tls {
                    Some(t) => t.clone(),
                    None => Tls::new(&TlsSettings::default())
                        .map_err(|reason| ScrapeError { uri: uri.to_string(), reason })?,
                };
                tls.connector(b"http/1.1")
            }
            _ => Connector::new(None),
        };
        let client = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(1).build(connector);
        Ok(Scraper { client, uri })
    }

    pub fn uri(&self) -> &http::Uri {
        &self.uri
    }

    pub async fn scrape(&self) -> Result<Snapshot, ScrapeError> {
        let err = |reason: String| ScrapeError { uri: self.uri.to_string(), reason };
        let fetch = async {
            let resp = self.client.get(self.uri.clone()).await.map_err(|e| err(format!("{e}")))?;
            if resp.status() != http::StatusCode::OK {
                return Err(err(format!("HTTP {}", resp.status())));
            }
            let body = http_body_util::Limited::new(resp.into_body(), MAX_METRICS_BYTES)
                .collect()
                .await
                .map_err(|e| err(format!("reading the body: {e}")))?
                .to_bytes();
            Ok(parse(&String::from_utf8_lossy(&body)))
        };
        tokio::time::timeout(SCRAPE_TIMEOUT, fetch)
            .await
            .map_err(|_| err(format!("no answer within {SCRAPE_TIMEOUT:?}")))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = r#"# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="mlp",version="1"} 10
nv_inference_request_success{model="mlp",version="2"} 5
nv_inference_request_success{model="other",version="1"} 3
nv_inference_count{model="mlp",version="1"} 40
nv_inference_exec_count{model="mlp",version="1"} 10
nv_inference_queue_duration_us{model="mlp",version="1"} 1000
nv_inference_compute_input_duration_us{model="mlp",version="1"} 100
nv_inference_compute_infer_duration_us{model="mlp",version="1"} 2000
nv_inference_compute_output_duration_us{model="mlp",version="1"} 50
nv_inference_request_failure{model="mlp",version="1",reason="REJECTED"} 7
nereid_inference_batch_size_bucket{model="mlp",version="1",le="+Inf"} 10
"#;

    const AFTER: &str = r#"nv_inference_request_success{model="mlp",version="1"} 110
nv_inference_request_success{model="mlp",version="2"} 5
nv_inference_count{model="mlp",version="1"} 440
nv_inference_exec_count{model="mlp",version="1"} 60
nv_inference_queue_duration_us{model="mlp",version="1"} 6000
nv_inference_compute_input_duration_us{model="mlp",version="1"} 1100
nv_inference_compute_infer_duration_us{model="mlp",version="1"} 32000
nv_inference_compute_output_duration_us{model="mlp",version="1"} 550 1700000000000
"#;

    #[test]
    fn parses_triton_counters_by_model_and_version() {
        let s = parse(BEFORE);
        let c = s.models[&("mlp".to_string(), "1".to_string())];
        assert_eq!(c.request_success, 10.0);
        assert_eq!(c.compute_infer_us, 2000.0);
        assert_eq!(s.models.len(), 3);
        assert_eq!(
            parse(AFTER).models[&("mlp".to_string(), "1".to_string())].compute_output_us,
            550.0,
            "timestamps ignored"
        );
    }

    #[test]
    fn gpu_memory_is_summed_over_devices() {
        assert_eq!(parse(BEFORE).gpu_memory_used_mib(), None, "no GPU series: unknown, not 0");
        let text = "# TYPE nv_gpu_memory_used_bytes gauge\n\
                    nv_gpu_memory_used_bytes{gpu_uuid=\"GPU-aaaa\"} 1048576\n\
                    nv_gpu_memory_used_bytes{gpu_uuid=\"GPU-bbbb\"} 3145728\n\
                    nv_gpu_memory_total_bytes{gpu_uuid=\"GPU-aaaa\"} 81559781376\n";
        let s = parse(&format!("{BEFORE}{text}"));
        assert_eq!(s.gpu_memory_used_mib(), Some(4.0));
        assert_eq!(s.gpu_memory_used_bytes.len(), 2, "total memory is not used memory");
        assert_eq!(s.models, parse(BEFORE).models, "the model counters are unaffected");
    }

    #[test]
    fn breakdown_is_per_request_over_the_interval() {
        let (a, b) = (parse(BEFORE), parse(AFTER));
        let d = breakdown(&a, &b, "mlp", Some("1")).unwrap();
        assert_eq!(d.requests, 100);
        assert_eq!(d.avg_queue_us, 50.0);
        assert_eq!(d.avg_compute_input_us, 10.0);
        assert_eq!(d.avg_compute_infer_us, 300.0);
        assert_eq!(d.avg_compute_output_us, 5.0);
        assert_eq!(d.avg_batch_size, Some(8.0));
        // All versions together: version 2 served nothing in between.
        assert_eq!(breakdown(&a, &b, "mlp", None).unwrap().requests, 100);
        assert_eq!(breakdown(&a, &b, "other", None), None, "absent after");
        assert_eq!(breakdown(&a, &a, "mlp", None), None, "nothing served");
        assert_eq!(breakdown(&b, &a, "mlp", None), None, "counters went backwards");
    }

    /// One scrape of `mlp` version 1 (absent when `None`) and version 2.
    fn scrape(v1: Option<[f64; 4]>, v2: [f64; 4]) -> Option<Snapshot> {
        let lines = |v: &str, [success, count, execs, queue]: [f64; 4]| {
            format!(
                "nv_inference_request_success{{model=\"mlp\",version=\"{v}\"}} {success}\n\
                 nv_inference_count{{model=\"mlp\",version=\"{v}\"}} {count}\n\
                 nv_inference_exec_count{{model=\"mlp\",version=\"{v}\"}} {execs}\n\
                 nv_inference_queue_duration_us{{model=\"mlp\",version=\"{v}\"}} {queue}\n"
            )
        };
        Some(parse(&(v1.map(|c| lines("1", c)).unwrap_or_default() + &lines("2", v2))))
    }

    #[test]
    fn a_window_with_a_counter_reset_is_left_out() {
        let idle = [0.0, 0.0, 0.0, 0.0];
        // Three windows; version 1 is reloaded (its counters start again) during the second.
        let snaps = [
            scrape(Some([100.0, 100.0, 100.0, 1000.0]), idle),
            scrape(Some([200.0, 200.0, 150.0, 2000.0]), idle), // +100 requests, 10 µs queued each
            scrape(Some([50.0, 50.0, 50.0, 5000.0]), idle),    // reset: left out
            scrape(Some([150.0, 150.0, 100.0, 6000.0]), idle), // +100 requests, 10 µs each
        ];
        let (b, resets) = breakdown_over(&snaps, "mlp", Some("1"));
        let b = b.unwrap();
        assert_eq!(resets, 1);
        assert_eq!(b.requests, 200, "both windows without a reset, not 150 - 100");
        assert_eq!(b.avg_queue_us, 10.0);
        assert_eq!(b.avg_batch_size, Some(2.0), "200 rows in 100 executions");
        // All versions: the same (version 2 served nothing), the reset seen through the sum.
        assert_eq!(breakdown_over(&snaps, "mlp", None), (Some(b), 1));

        // Only a time counter went down (requests still grew): a reset all the same.
        let snaps =
            [scrape(Some([100.0, 100.0, 100.0, 9000.0]), idle), scrape(Some([150.0, 150.0, 150.0, 100.0]), idle)];
        assert_eq!(breakdown_over(&snaps, "mlp", Some("1")), (None, 1));

        // Version 1 vanishes (unloaded) and comes back: the window it vanished in is left out,
        // the one it came back in counts from 0; version 2 is counted throughout.
        let snaps = [
            scrape(Some([100.0, 100.0, 100.0, 0.0]), [10.0, 10.0, 10.0, 0.0]),
            scrape(None, [20.0, 20.0, 20.0, 0.0]),
            scrape(Some([30.0, 30.0, 30.0, 0.0]), [40.0, 40.0, 40.0, 0.0]),
        ];
        assert_eq!(breakdown_over(&snaps, "mlp", Some("1")).0.unwrap().requests, 30);
        assert_eq!(breakdown_over(&snaps, "mlp", Some("1")).1, 1);
        let (v2, resets) = breakdown_over(&snaps, "mlp", Some("2"));
        assert_eq!((v2.unwrap().requests, resets), (30, 0));
        let (all, resets) = breakdown_over(&snaps, "mlp", None);
        assert_eq!((all.unwrap().requests, resets), (30 + 20, 1), "the second window: 30 of version 1, 20 of 2");
        // A failed scrape joins its neighbours' windows.
        let joined = [snaps[0].clone(), None, snaps[2].clone()];
        assert_eq!(breakdown_over(&joined, "mlp", Some("2")), (v2, 0));
        assert_eq!(breakdown_over(&joined, "mlp", Some("1")), (None, 1), "100 down to 30: a reset");
        assert_eq!(breakdown_over(&[snaps[0].clone()], "mlp", None), (None, 0), "one scrape: no window");
    }

    #[test]
    fn labels_with_escapes_and_odd_lines() {
        let s = parse("nv_inference_count{version=\"1\", model=\"a\\\"b,c\"} 2\nbroken{ 1\nnv_inference_count 5\n");
        assert_eq!(s.models[&("a\"b,c".to_string(), "1".to_string())].inference_count, 2.0);
        assert_eq!(s.models.len(), 1);
    }
}
