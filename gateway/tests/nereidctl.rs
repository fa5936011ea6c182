//! `nereidctl` against a real fleet: a real etcd server, real workers on the example models, a
//! real gateway (placement controller + routing), and the real `nereidctl` binary run as an
//! operator would. Loopback, ephemeral ports, every wait on a condition and bounded.

mod common;

use std::time::{Duration, Instant};

use common::{Etcd, PREFIX, Proc, spawn_fleet_gateway, spawn_fleet_worker, wait_until};
use nereid_common::fleet::etcd_client::GetOptions;
use nereid_common::fleet::records::{self, RouteRecord};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(30);
/// Longest one `nereidctl` run may take (its etcd calls are bounded by 3 s each; a drain waits at
/// most 20 s when no other worker could take its models).
const RUN_TIMEOUT: Duration = Duration::from_secs(60);
const MODEL: &str = "versioned_scale";

/// One finished `nereidctl` run.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }

    #[track_caller]
    fn ok(self) -> Run {
        assert_eq!(self.code, 0, "{self:?}");
        self
    }

    /// Refused: exit 2, with `needle` in the message.
    #[track_caller]
    fn refused(self, needle: &str) -> Run {
        assert_eq!(self.code, 2, "{self:?}");
        assert!(self.stderr.contains(needle), "expected {needle:?} in {self:?}");
        self
    }
}

async fn ctl(endpoint: &str, args: &[&str]) -> Run {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_nereidctl"));
    cmd.arg("--etcd-endpoints").arg(endpoint).args(args).env_remove("NEREID_ETCD_ENDPOINTS").kill_on_drop(true);
    let out = tokio::time::timeout(RUN_TIMEOUT, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("nereidctl {args:?} did not exit within {RUN_TIMEOUT:?}"))
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `models --output json`: (ready, placed) per version of `model`, empty when not declared.
async fn model_counts(endpoint: &str, model: &str) -> Vec<(i64, u64, u64)> {
    let models = ctl(endpoint, &["models", "--output", "json"]).await.ok().json();
    let Some(m) = models.as_array().unwrap().iter().find(|m| m["model"] == model) else { return Vec::new() };
    m["status"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (s["version"].as_i64().unwrap(), s["ready"].as_u64().unwrap(), s["placed"].as_u64().unwrap()))
        .collect()
}

async fn wait_ready(endpoint: &str, what: &str, model: &str, ready: u64) {
    wait_until(what, WAIT, || async {
        let counts = model_counts(endpoint, model).await;
        !counts.is_empty() && counts.iter().all(|(_, r, p)| *r == ready && *p == ready)
    })
    .await;
}

async fn gateway_workers(gateway: &Proc, state: &str) -> f64 {
    gateway.metric(&format!("nereid_gateway_workers{{state=\"{state}\"}}")).await.unwrap_or(0.0)
}

/// Everything under the prefix, as `(key, value)`.
async fn etcd_dump(etcd: &Etcd) -> Vec<(String, String)> {
    let resp = etcd.client().await.get(format!("{PREFIX}/"), Some(GetOptions::new().with_prefix())).await.unwrap();
    resp.kvs().iter().map(|kv| (kv.key_str().unwrap().to_string(), kv.value_str().unwrap().to_string())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_declares_routes_and_drains_through_nereidctl() {
    let etcd = Etcd::start().await;
    let ep = etcd.endpoint();
    let w1 = spawn_fleet_worker(&etcd, "w1", &["--memory-capacity-mb", "1000"]);
    let _w2 = spawn_fleet_worker(&etcd, "w2", &[]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_until("both workers routed", WAIT, || async { gateway_workers(&gateway, "ready").await == 2.0 }).await;

    // Declare: placed on both workers, loaded, and reported READY = replicas.
    let out =
        ctl(&ep, &["model", "declare", MODEL, "--versions", "1,2", "--replicas", "2", "--memory-mb", "100"]).await.ok();
    assert!(out.stdout.contains(&format!("declared model {MODEL}")), "{out:?}");
    assert!(out.stdout.contains(r#""versions":[1,2],"replicas":2,"resources":{"memory_mb":100}"#), "{out:?}");
    wait_ready(&ep, "both versions READY on 2 workers", MODEL, 2).await;
    let table = ctl(&ep, &["models"]).await.ok().stdout;
    assert!(table.lines().any(|l| l.starts_with(MODEL) && l.contains("2/2") && l.contains("100 MiB")), "{table}");

    // `workers` lists both, with address, capacity and each version's status.
    let workers = ctl(&ep, &["workers", "--output", "json"]).await.ok().json();
    let w = &workers[0];
    assert_eq!((w["id"].as_str(), w["state"].as_str()), (Some("w1"), Some("ready")), "{workers}");
    assert_eq!(w["grpc"], w1.grpc_addr());
    assert_eq!(w["capacity"]["memory_mb"], 1000);
    let held: Vec<(String, i64, bool, String)> = w["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let s = |k: &str| m[k].as_str().unwrap_or_default().to_string();
            (s("model"), m["version"].as_i64().unwrap(), m["placed"].as_bool().unwrap(), s("status"))
        })
        .collect();
    assert_eq!(held, [(MODEL.into(), 1, true, "READY".into()), (MODEL.into(), 2, true, "READY".into())]);
    let table = ctl(&ep, &["workers"]).await.ok().stdout;
    assert!(table.contains(&format!("{MODEL}/2 READY")) && table.contains("1000 MiB"), "{table}");
    let placement = ctl(&ep, &["placement", "--output", "json"]).await.ok().json();
    assert_eq!(placement.as_array().unwrap().len(), 2, "{placement}");
    assert_eq!(placement[1]["assignments"][0]["status"], "READY", "{placement}");

    // Routes: an undeclared version (or model) is refused and nothing is written.
    ctl(&ep, &["routes", "set", MODEL, "--weight", "1=90", "--weight", "3=10"])
        .await
        .refused("does not declare version 3 (declared: 1,2)");
    ctl(&ep, &["routes", "set", "mlp_fp32", "--weight", "1=1"]).await.refused("model mlp_fp32 is not declared");
    ctl(&ep, &["routes", "set", MODEL, "--weight", "1=0", "--weight", "2=0"]).await.refused("every weight is 0");
    assert!(etcd_dump(&etcd).await.iter().all(|(k, _)| !k.contains("/routes/")));

    // A valid split round-trips: set, show (JSON and table), the stored record, clear.
    let out =
        ctl(&ep, &["routes", "set", MODEL, "--weight", "1=90", "--weight", "2=10", "--sticky-key", "X-User"]).await;
    out.ok();
    let shown = ctl(&ep, &["routes", "show", MODEL, "--output", "json"]).await.ok().json();
    assert_eq!(shown[0]["weights"], serde_json::json!({"1": 90, "2": 10}), "{shown}");
    assert_eq!(shown[0]["sticky_key"], "x-user");
    let table = ctl(&ep, &["routes", "show"]).await.ok().stdout;
    assert!(table.contains("1=90 (90%), 2=10 (10%)"), "{table}");
    let stored = etcd_dump(&etcd).await.into_iter().find(|(k, _)| k.ends_with(&format!("/routes/{MODEL}"))).unwrap();
    let route: RouteRecord = records::decode(stored.1.as_bytes()).unwrap();
    assert_eq!(route.weights, [(1, 90), (2, 10)].into());
    ctl(&ep, &["routes", "clear", MODEL]).await.ok();
    ctl(&ep, &["routes", "show", MODEL]).await.refused("has no routes");
    ctl(&ep, &["routes", "clear", MODEL]).await.refused("has no routes");

    // Drain: the gateway stops routing to w1 and the controller takes its assignments away.
    ctl(&ep, &["drain", "w9"]).await.refused("worker w9 is not registered");
    ctl(&ep, &["drain", "w1", "--reason", "kernel upgrade"]).await.ok();
    wait_until("the gateway to see w1 not ready", WAIT, || async {
        gateway_workers(&gateway, "not_ready").await == 1.0 && gateway_workers(&gateway, "ready").await == 1.0
    })
    .await;
    wait_ready(&ep, "the drained worker's replicas removed", MODEL, 1).await;
    let workers = ctl(&ep, &["workers", "--output", "json"]).await.ok().json();
    assert_eq!(workers[0]["state"], "drained-by-operator", "{workers}");
    assert_eq!(workers[0]["drain_reason"], "kernel upgrade");
    let placement = ctl(&ep, &["placement", "--output", "json"]).await.ok().json();
    let on_w1 = placement.as_array().unwrap().iter().find(|p| p["worker"] == "w1");
    assert!(on_w1.is_none_or(|p| p["assignments"].as_array().unwrap().iter().all(|a| a["placed"] == false)));

    // Undrain: routed again and placed again.
    ctl(&ep, &["undrain", "w1"]).await.ok();
    wait_until("the gateway to route w1 again", WAIT, || async {
        gateway_workers(&gateway, "ready").await == 2.0 && gateway_workers(&gateway, "not_ready").await == 0.0
    })
    .await;
    wait_ready(&ep, "both versions READY on 2 workers again", MODEL, 2).await;
    ctl(&ep, &["undrain", "w1"]).await.refused("worker w1 is not drained");

    // `get` marks a value no reader accepts; the other views warn and go on without it.
    etcd.client().await.put(format!("{PREFIX}/models/broken"), "{\"schema\":1,\"versions\":[1]}", None).await.unwrap();
    let get = ctl(&ep, &["get"]).await.ok().stdout;
    let line = get.lines().find(|l| l.starts_with(&format!("{PREFIX}/models/broken"))).unwrap();
    assert!(line.contains("<- INVALID:") && line.contains("replicas"), "{get}");
    let dump = ctl(&ep, &["get", "--output", "json"]).await.ok().json();
    let keys: Vec<&str> = dump.as_array().unwrap().iter().map(|k| k["key"].as_str().unwrap()).collect();
    assert!(keys.contains(&"/nereid/v1/workers/w1") && keys.contains(&"/nereid/v1/status/w2/versioned_scale/2"));
    let models = ctl(&ep, &["models", "--output", "json"]).await.ok();
    assert!(models.stderr.contains("warning: rejected model value at /nereid/v1/models/broken"), "{models:?}");
    assert_eq!(models.json().as_array().unwrap().len(), 1);

    // Remove: unloaded everywhere.
    ctl(&ep, &["model", "remove", MODEL]).await.ok();
    ctl(&ep, &["model", "remove", MODEL]).await.refused("is not declared");
    wait_until("the model unloaded everywhere", WAIT, || async {
        ctl(&ep, &["placement", "--output", "json"]).await.ok().json().as_array().unwrap().is_empty()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_input_exits_2_and_writes_nothing() {
    let etcd = Etcd::start().await;
    let ep = etcd.endpoint();
    let declare = |versions: &'static str, replicas: &'static str| {
        ["model", "declare", "m", "--versions", versions, "--replicas", replicas]
    };
    let long_reason = "x".repeat(5000);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (declare("1,x", "1").to_vec(), "--versions"),
        (declare("", "1").to_vec(), "--versions"),
        (declare("0", "1").to_vec(), "version 0 is not a positive integer"),
        (declare("1,1", "1").to_vec(), "listed twice"),
        (declare("1", "0").to_vec(), "--replicas"),
        (declare("1", "many").to_vec(), "--replicas"),
        (vec!["model", "declare", "a/b", "--versions", "1", "--replicas", "1"], "model name 'a/b'"),
        (vec!["model", "declare", "m", "--versions", "1"], "--replicas"),
        (vec!["frobnicate"], "unrecognized subcommand 'frobnicate'"),
        (vec!["routes", "set", "m", "--weight", "1:90"], "--weight"),
        (vec!["routes", "set", "m", "--weight", "1=-1"], "--weight"),
        (vec!["routes", "set", "m"], "--weight"),
        (vec!["routes", "set", "m", "--weight", "1=1", "--sticky-key", "bad header"], "--sticky-key"),
        (vec!["drain", "w1", "--reason", &long_reason], "--reason"),
        (vec!["workers", "--output", "yaml"], "--output"),
        (vec!["workers", "--etcd-prefix", "nereid"], "--etcd-prefix"),
        // Well-formed, but refused by the fleet's (empty) state.
        (vec!["routes", "set", "m", "--weight", "1=1"], "model m is not declared"),
        (vec!["model", "remove", "m"], "model m is not declared"),
        (vec!["drain", "w1"], "worker w1 is not registered"),
        (vec!["undrain", "w1"], "worker w1 is not drained"),
        (vec!["routes", "clear", "m"], "model m has no routes"),
    ];
    for (args, needle) in cases {
        ctl(&ep, &args).await.refused(needle);
    }
    let out = ctl("127.0.0.1:2379", &["workers"]).await.refused("--etcd-endpoints");
    assert!(out.stderr.contains("http://host:port"), "{out:?}");
    assert_eq!(etcd_dump(&etcd).await, Vec::<(String, String)>::new(), "nothing was written");
    assert_eq!(ctl(&ep, &["get", "--output", "json"]).await.ok().json(), serde_json::json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_etcd_exits_1_within_the_timeout() {
    // Nothing listening: refused at once.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let ep = format!("http://127.0.0.1:{port}");
    for args in [&["workers"][..], &["model", "declare", "m", "--versions", "1", "--replicas", "1"], &["get"]] {
        let out = ctl(&ep, args).await;
        assert_eq!(out.code, 1, "{out:?}");
        assert!(out.stderr.contains(&format!("cannot reach etcd at {ep}")), "{out:?}");
    }

    // A listener that never answers (accepted by the kernel, never served): the 3 s bound.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let ep = format!("http://127.0.0.1:{}", silent.local_addr().unwrap().port());
    let out = ctl(&ep, &["drain", "w1", "--force"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("did not answer within 3s"), "{out:?}");

    // A stopped etcd.
    let mut etcd = Etcd::start().await;
    ctl(&etcd.endpoint(), &["models"]).await.ok();
    etcd.stop();
    let out = ctl(&etcd.endpoint(), &["models"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains("cannot reach etcd"), "{out:?}");
}

/// The worker a model version is placed on (the first, by id), per `nereidctl placement`.
async fn holder(endpoint: &str, model: &str) -> Option<String> {
    let placement = ctl(endpoint, &["placement", "--output", "json"]).await.ok().json();
    placement.as_array().unwrap().iter().find_map(|p| {
        let holds = p["assignments"].as_array().unwrap().iter().any(|a| a["model"] == model && a["placed"] == true);
        holds.then(|| p["worker"].as_str().unwrap().to_string())
    })
}

/// A request through the gateway; `Ok` or its error.
async fn through(gateway: &Proc, i: usize) -> Result<(), tonic::Status> {
    let request = common::fp32_request(MODEL, "", &[1, 4], |j| (i + j) as f32);
    gateway.client().await.model_infer(request).await.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_stop_drain_moves_a_single_replica_without_failing_a_request_and_goes_with_the_worker() {
    let etcd = Etcd::start().await;
    let ep = etcd.endpoint();
    let mut workers = vec![("w1", spawn_fleet_worker(&etcd, "w1", &[])), ("w2", spawn_fleet_worker(&etcd, "w2", &[]))];
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_until("both workers routed", WAIT, || async { gateway_workers(&gateway, "ready").await == 2.0 }).await;
    ctl(&ep, &["model", "declare", MODEL, "--versions", "1", "--replicas", "1", "--memory-mb", "10"]).await.ok();
    wait_ready(&ep, "one replica READY", MODEL, 1).await;
    wait_until("the gateway to route the model", WAIT, || async { through(&gateway, 0).await.is_ok() }).await;
    let from = holder(&ep, MODEL).await.expect("placed");

    // Load through the gateway while the holder drains as a pod's preStop hook would.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (stop, addr) = (stop.clone(), gateway.grpc_addr());
        tokio::spawn(async move {
            let mut client =
                nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient::connect(format!(
                    "http://{addr}"
                ))
                .await
                .unwrap();
            let (mut ok, mut failed) = (0u64, Vec::new());
            for i in 0..200_000usize {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let request = common::fp32_request(MODEL, "", &[1, 4], |j| (i + j) as f32);
                match tokio::time::timeout(Duration::from_secs(10), client.model_infer(request)).await {
                    Ok(Ok(_)) => ok += 1,
                    Ok(Err(e)) => failed.push(format!("{:?}: {}", e.code(), e.message())),
                    Err(_) => failed.push("hung".into()),
                }
            }
            (ok, failed)
        })
    };
    let started = Instant::now();
    let out = ctl(&ep, &["drain", &from, "--until-exit", "--reason", "pod terminating", "--wait-secs", "30"]).await;
    let out = out.ok();
    assert!(out.stdout.contains(&format!("all models moved off worker {from}")), "{out:?}");
    let to = holder(&ep, MODEL).await.expect("placed elsewhere");
    assert_ne!(to, from);
    // The drain is bound to the worker's registration.
    let mut client = etcd.client().await;
    let lease_of = |kvs: &[nereid_common::fleet::etcd_client::KeyValue]| kvs.first().map(|kv| kv.lease());
    let worker_lease = lease_of(client.get(format!("{PREFIX}/workers/{from}"), None).await.unwrap().kvs());
    let drain_lease = lease_of(client.get(format!("{PREFIX}/drain/{from}"), None).await.unwrap().kvs());
    assert!(worker_lease.is_some_and(|l| l != 0) && drain_lease == worker_lease, "{worker_lease:?} {drain_lease:?}");
    eprintln!("moved {MODEL} from {from} to {to} in {:?}", started.elapsed());

    // Then SIGTERM, as the kubelet sends after preStop: the worker exits, its drain with it.
    let i = workers.iter().position(|(id, _)| *id == from).unwrap();
    let (_, mut old) = workers.remove(i);
    old.terminate();
    assert_eq!(old.wait_exit(Duration::from_secs(30)), Some(0), "{}", old.log());
    wait_until("the drain key to go with the worker's lease", WAIT, || async {
        let mut c = etcd.client().await;
        c.get(format!("{PREFIX}/drain/{from}"), None).await.unwrap().kvs().is_empty()
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = load.await.unwrap();
    assert!(ok > 0, "no request went through");
    assert!(failed.is_empty(), "{} of {} requests failed during the drain: {:?}", failed.len(), ok, failed);

    // The last worker cannot move its models anywhere: no waiting (a preStop hook would hold
    // SIGTERM for the whole --wait-secs), exit 1, naming them.
    let (last, _) = &workers[0];
    let out = ctl(&ep, &["drain", last, "--until-exit", "--wait-secs", "600"]).await;
    assert_eq!(out.code, 1, "{out:?}");
    assert!(out.stderr.contains(&format!("no other worker can take what worker {last} holds ({MODEL}/1)")), "{out:?}");
    // ... and the model is still served meanwhile (a drained worker is the last resort).
    through(&gateway, 1).await.unwrap();
    // Bound to a registration: --until-exit and --force exclude each other; none is refused.
    ctl(&ep, &["drain", "w9", "--until-exit"]).await.refused("worker w9 is not registered");
    assert_eq!(ctl(&ep, &["drain", last, "--until-exit", "--force"]).await.code, 2);
}

/// The lease `key` (under the prefix) is bound to, if it exists.
async fn lease_of(etcd: &Etcd, key: &str) -> Option<i64> {
    let mut client = etcd.client().await;
    client.get(format!("{PREFIX}/{key}"), None).await.ok()?.kvs().first().map(|kv| kv.lease())
}

/// `--until-exit` binds the drain to the worker's lease. A worker whose etcd session restarts
/// (here: etcd itself restarts) keeps its lease and registers again under it, so the drain
/// stays bound to a lease that lives on, instead of vanishing while the worker is still on its
/// way out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_until_exit_drain_survives_the_workers_session_restart() {
    let mut etcd = Etcd::start().await;
    let ep = etcd.endpoint();
    // A lease that outlives etcd's restart and the worker's reconnect back-off.
    let worker = spawn_fleet_worker(&etcd, "w1", &["--etcd-lease-ttl-secs", "30"]);
    wait_until("w1 registered", WAIT, || async { lease_of(&etcd, "workers/w1").await.is_some() }).await;
    ctl(&ep, &["drain", "w1", "--until-exit"]).await.ok();
    let first = lease_of(&etcd, "workers/w1").await.unwrap();
    assert_eq!(lease_of(&etcd, "drain/w1").await, Some(first));
    let sessions = worker.metric("nereid_worker_etcd_sessions_total").await.unwrap();

    etcd.restart().await;
    wait_until("w1 to register again", WAIT, || async {
        worker.metric("nereid_worker_etcd_sessions_total").await.is_some_and(|n| n > sessions)
            && worker.metric("nereid_worker_etcd_connected").await == Some(1.0)
    })
    .await;
    assert_eq!(lease_of(&etcd, "workers/w1").await, Some(first), "{}", worker.log());
    assert_eq!(lease_of(&etcd, "drain/w1").await, Some(first));

    // A worker's own way out is not undone by a plain undrain (it would take traffic again
    // while its pod waits to be stopped); --force does it.
    ctl(&ep, &["undrain", "w1"]).await.refused("worker w1 is draining until it exits");
    assert_eq!(lease_of(&etcd, "drain/w1").await, Some(first));
    ctl(&ep, &["undrain", "w1", "--force"]).await.ok();
    assert_eq!(lease_of(&etcd, "drain/w1").await, None);
}

/// An operator's drain (until `nereidctl undrain`) is left as it is by a pod's preStop
/// `--until-exit`: bound to the worker's lease it would end with the process, and a pod
/// restarted under the same name would take traffic again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_until_exit_drain_leaves_an_operators_drain_in_place() {
    let etcd = Etcd::start().await;
    let ep = etcd.endpoint();
    let _worker = spawn_fleet_worker(&etcd, "w1", &[]);
    wait_until("w1 registered", WAIT, || async { lease_of(&etcd, "workers/w1").await.is_some() }).await;
    ctl(&ep, &["drain", "w1", "--reason", "bad GPU"]).await.ok();
    assert_eq!(lease_of(&etcd, "drain/w1").await, Some(0));
    let out = ctl(&ep, &["drain", "w1", "--until-exit", "--output", "json"]).await.ok();
    assert_eq!(out.json()["action"], "none", "{out:?}");
    assert!(out.json()["message"].as_str().unwrap().contains("already drained until `nereidctl undrain`"), "{out:?}");
    assert_eq!(lease_of(&etcd, "drain/w1").await, Some(0), "still bound to no lease");
    let shown = ctl(&ep, &["get", "--output", "json"]).await.ok().stdout;
    assert!(shown.contains("bad GPU"), "the operator's reason stays: {shown}");
}
