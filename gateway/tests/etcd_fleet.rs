//! The fleet through a real etcd: workers register under leases and load what the placement
//! controller (inside the gateway, leader-elected) assigns them; the gateway routes on what
//! etcd says. Real etcd server, real workers on the example models, real gateways; loopback,
//! ephemeral ports, every wait on a condition and bounded.

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    Etcd, PREFIX, Proc, fp32_request, keys_under, put, ready_on, spawn_fleet_gateway, spawn_fleet_worker, wait_until,
};
use nereid_common::fleet::etcd_client::{Client, CompactionOptions, GetOptions, WatchOptions};
use nereid_common::fleet::read::{self, PageLimits};
use nereid_proto::inference::ModelInferRequest;

const WAIT: Duration = Duration::from_secs(30);
const PLACEMENT_READS: &str = "nereid_worker_etcd_placement_reads_total";
const WATCH_RESUMES: &str = "nereid_worker_etcd_watch_resumes_total";
const RESYNCS: &str = "nereid_gateway_etcd_resyncs_total";
const WATCH_CONNECTED: &str = "nereid_gateway_etcd_watch_connected";
/// tonic's default decode limit, which one unpaged read of the prefix used to run into.
const DEFAULT_MESSAGE_LIMIT: usize = 4 << 20;
/// Under etcd's default request limit (1.5 MiB); four of them add up past 4 MiB.
const BIG_VALUE_BYTES: usize = 1_200_000;

async fn infer_ok(gateway: &Proc, request: ModelInferRequest) -> bool {
    let mut client = gateway.client().await;
    client.model_infer(request).await.is_ok()
}

/// Closed-loop gRPC load through the gateway: `concurrency` clients, each request bounded in
/// time (a hang counts as a failure), each client bounded in count.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(gateway: &Proc, concurrency: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..concurrency)
            .map(|i| {
                let (stop, ok, failures) = (stop.clone(), ok.clone(), failures.clone());
                let addr = format!("http://127.0.0.1:{}", gateway.grpc);
                tokio::spawn(async move {
                    let mut client =
                        nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient::connect(
                            addr,
                        )
                        .await
                        .unwrap();
                    for n in 0..20_000 {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let req = fp32_request("identity_fp32", "", &[1, 16], |k| (i * 1000 + n + k) as f32);
                        match tokio::time::timeout(Duration::from_secs(10), client.model_infer(req)).await {
                            Ok(Ok(_)) => {
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(Err(e)) => failures.lock().unwrap().push(format!("{:?}: {}", e.code(), e.message())),
                            Err(_) => failures.lock().unwrap().push("hung for 10 s".into()),
                        }
                    }
                })
            })
            .collect();
        Load { stop, ok, failures, tasks }
    }

    fn ok(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }

    /// Waits until `n` more requests have succeeded.
    async fn progress(&self, n: u64) {
        let target = self.ok() + n;
        wait_until("load to make progress", WAIT, || async { self.ok() >= target }).await;
    }

    async fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.unwrap();
        }
        let failures = self.failures.lock().unwrap().clone();
        (self.ok.load(Ordering::Relaxed), failures)
    }
}

/// Declares identity_fp32 with `replicas` and waits until that many workers hold it READY
/// and the gateway routes it.
async fn declare_identity_and_wait(etcd: &Etcd, gateway: &Proc, replicas: usize) {
    let mut client = etcd.client().await;
    put(&mut client, "models/identity_fp32", &format!(r#"{{"schema":1,"versions":[1],"replicas":{replicas}}}"#)).await;
    wait_until("identity_fp32 READY on every replica", WAIT, || async {
        ready_on(&mut etcd.client().await, "identity_fp32", 1).await.len() == replicas
    })
    .await;
    wait_until("the gateway to route identity_fp32", WAIT, || async {
        infer_ok(gateway, fp32_request("identity_fp32", "", &[1, 16], |i| i as f32)).await
    })
    .await;
}

async fn wait_metric(proc: &Proc, series: &str, what: &str, pred: impl Fn(f64) -> bool) {
    wait_until(what, WAIT, || async { proc.metric(series).await.is_some_and(&pred) }).await;
}

/// Compacts etcd's history up to its current revision (physically: done when this returns), so
/// that no watch can resume from an earlier revision; that revision.
async fn compact_all(client: &mut Client) -> i64 {
    let revision = client.get(PREFIX, None).await.unwrap().header().unwrap().revision();
    client.compact(revision, Some(CompactionOptions::new().with_physical())).await.unwrap();
    revision
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_models_are_placed_within_capacity_and_routed() {
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let _w1 = spawn_fleet_worker(&etcd, "w1", &["--memory-capacity-mb", "1000"]);
    let w2 = spawn_fleet_worker(&etcd, "w2", &["--memory-capacity-mb", "1000", "--label", "zone=b"]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_metric(&gateway, "nereid_gateway_workers{state=\"ready\"}", "both workers registered", |v| v == 2.0).await;
    let record =
        String::from_utf8(client.get(format!("{PREFIX}/workers/w2"), None).await.unwrap().kvs()[0].value().to_vec())
            .unwrap();
    assert!(record.contains(&format!("\"grpc\":\"127.0.0.1:{}\"", w2.grpc)), "{record}");
    assert!(record.contains("\"memory_mb\":1000"), "{record}");

    // identity (300 MiB) fits both workers; mlp (1200 MiB) fits neither; versioned_scale's
    // two versions (100 MiB each) go where its selector allows: w2 only.
    put(
        &mut client,
        "models/identity_fp32",
        r#"{"schema":1,"versions":[1],"replicas":2,"resources":{"memory_mb":300}}"#,
    )
    .await;
    put(&mut client, "models/mlp_fp32", r#"{"schema":1,"versions":[1],"replicas":2,"resources":{"memory_mb":1200}}"#)
        .await;
    put(
        &mut client,
        "models/versioned_scale",
        r#"{"schema":1,"versions":[1,2],"replicas":1,"resources":{"memory_mb":100},"selector":{"zone":"b"}}"#,
    )
    .await;
    wait_until("identity_fp32 READY on both workers", WAIT, || async {
        ready_on(&mut etcd.client().await, "identity_fp32", 1).await == ["w1", "w2"]
    })
    .await;
    wait_until("versioned_scale 1 and 2 READY on w2 (its selector)", WAIT, || async {
        let mut c = etcd.client().await;
        ready_on(&mut c, "versioned_scale", 1).await == ["w2"] && ready_on(&mut c, "versioned_scale", 2).await == ["w2"]
    })
    .await;
    wait_metric(&gateway, "nereid_gateway_placement_unplaced_replicas", "mlp reported unplaced", |v| v == 2.0).await;
    assert!(keys_under(&mut client, "placement/").await.iter().all(|k| !k.contains("mlp_fp32")));
    assert_eq!(gateway.metric("nereid_gateway_placement_leader").await, Some(1.0));

    // Routed through the gateway, with each version's own answer (version 2 scales by 2).
    let mut through = gateway.client().await;
    wait_until("the gateway to route versioned_scale 2", WAIT, || async {
        infer_ok(&gateway, fp32_request("versioned_scale", "2", &[1, 4], |i| i as f32)).await
    })
    .await;
    let one = through.model_infer(fp32_request("versioned_scale", "1", &[1, 4], |i| i as f32 + 1.0)).await.unwrap();
    let two = through.model_infer(fp32_request("versioned_scale", "2", &[1, 4], |i| i as f32 + 1.0)).await.unwrap();
    assert_ne!(one.get_ref().raw_output_contents, two.get_ref().raw_output_contents);
    let identity = through.model_infer(fp32_request("identity_fp32", "", &[2, 16], |i| i as f32)).await.unwrap();
    let expected: Vec<u8> = (0..32).flat_map(|i| (i as f32).to_le_bytes()).collect();
    assert_eq!(identity.get_ref().raw_output_contents[0], expected);
    // Declared but placed nowhere: UNAVAILABLE (it may come), not NOT_FOUND (final for clients).
    let missing = through.model_infer(fp32_request("mlp_fp32", "", &[1, 256], |_| 0.0)).await.unwrap_err();
    assert_eq!(missing.code(), tonic::Code::Unavailable, "{missing:?}");

    // Undeclaring a model unloads it everywhere.
    client.delete(format!("{PREFIX}/models/versioned_scale"), None).await.unwrap();
    wait_until("versioned_scale unloaded", WAIT, || async {
        let mut c = etcd.client().await;
        ready_on(&mut c, "versioned_scale", 1).await.is_empty()
            && ready_on(&mut c, "versioned_scale", 2).await.is_empty()
    })
    .await;
    // Neither declared nor held by any worker any more: unknown.
    wait_until("versioned_scale to be unknown to the gateway", WAIT, || async {
        let r = gateway.client().await.model_infer(fp32_request("versioned_scale", "", &[1, 4], |_| 0.0)).await;
        r.is_err_and(|e| e.code() == tonic::Code::NotFound)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_is_replaced_and_a_lost_lease_re_registers() {
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let mut workers = [
        spawn_fleet_worker(&etcd, "w1", &[]),
        spawn_fleet_worker(&etcd, "w2", &[]),
        spawn_fleet_worker(&etcd, "w3", &[]),
    ];
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    declare_identity_and_wait(&etcd, &gateway, 2).await;

    // SIGKILL one holder under load: only requests in flight on it may fail, none hangs.
    let concurrency = 4;
    let load = Load::start(&gateway, concurrency);
    load.progress(100).await;
    let holders = ready_on(&mut client, "identity_fp32", 1).await;
    let victim = holders[0].clone();
    let index = ["w1", "w2", "w3"].iter().position(|w| *w == victim).unwrap();
    workers[index].child.kill().unwrap();
    workers[index].child.wait().unwrap();
    // The lease expires (TTL 2 s), the controller re-places on the third worker.
    wait_until("the replica re-placed on the spare worker", WAIT, || async {
        let now = ready_on(&mut etcd.client().await, "identity_fp32", 1).await;
        now.len() == 2 && !now.contains(&victim)
    })
    .await;
    wait_metric(&gateway, "nereid_gateway_workers{state=\"ready\"}", "the dead worker out of routing", |v| v == 2.0)
        .await;
    load.progress(100).await;
    let (ok, failures) = load.finish().await;
    assert!(failures.len() <= concurrency, "{} failures (ok {ok}): {failures:?}", failures.len());
    assert!(failures.iter().all(|f| !f.contains("hung")), "{failures:?}");

    // A lost lease (revoked behind the worker's back) is noticed and the worker re-registers.
    let survivor = ["w1", "w2", "w3"].iter().find(|w| **w != victim).unwrap().to_string();
    let key = format!("{PREFIX}/workers/{survivor}");
    let lease = client.get(key.as_str(), None).await.unwrap().kvs()[0].lease();
    client.lease_revoke(lease).await.unwrap();
    wait_until("the worker to re-register under a new lease", WAIT, || async {
        let mut c = etcd.client().await;
        let resp = c.get(key.as_str(), None).await.unwrap();
        resp.kvs().first().is_some_and(|kv| kv.lease() != lease && kv.lease() != 0)
    })
    .await;
    wait_metric(&gateway, "nereid_gateway_workers{state=\"ready\"}", "the worker routed again", |v| v == 2.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_continues_while_etcd_is_down_and_watches_resume() {
    let mut etcd = Etcd::start().await;
    let w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    declare_identity_and_wait(&etcd, &gateway, 1).await;
    wait_metric(&gateway, "nereid_gateway_etcd_watch_connected", "the watch up", |v| v == 1.0).await;
    let resyncs = gateway.metric("nereid_gateway_etcd_resyncs_total").await;
    assert_eq!(w1.metric("nereid_worker_etcd_placement_reads_total").await, Some(1.0));

    let load = Load::start(&gateway, 2);
    load.progress(50).await;
    etcd.stop();
    wait_metric(&gateway, "nereid_gateway_etcd_watch_connected", "the watch to notice etcd is gone", |v| v == 0.0)
        .await;
    load.progress(200).await; // serving on the last good table

    etcd.restart().await;
    wait_metric(&gateway, "nereid_gateway_etcd_watch_connected", "the watch to resume", |v| v == 1.0).await;
    // Resumed from the last revision, not re-read.
    assert_eq!(gateway.metric("nereid_gateway_etcd_resyncs_total").await, resyncs);
    let mut client = etcd.client().await;
    put(&mut client, "models/versioned_scale", r#"{"schema":1,"versions":[2],"replicas":1}"#).await;
    wait_until("a model declared after the outage to be routable", WAIT, || async {
        infer_ok(&gateway, fp32_request("versioned_scale", "2", &[1, 4], |i| i as f32)).await
    })
    .await;
    load.progress(50).await;
    let (ok, failures) = load.finish().await;
    assert!(failures.is_empty(), "ok {ok}, failures: {failures:?}");
    // The worker re-registered and resumed its placement watch (the model placed after the
    // outage reached it through that watch) without reading its placement again.
    wait_metric(&w1, "nereid_worker_etcd_connected", "the worker's session back", |v| v == 1.0).await;
    assert!(w1.metric("nereid_worker_etcd_sessions_total").await.unwrap() >= 2.0);
    assert!(w1.metric("nereid_worker_etcd_watch_resumes_total").await.unwrap() >= 1.0);
    assert_eq!(w1.metric("nereid_worker_etcd_placement_reads_total").await, Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_watch_behind_a_compaction_re_reads_the_placement() {
    let mut etcd = Etcd::start().await;
    let w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    declare_identity_and_wait(&etcd, &gateway, 1).await;
    wait_metric(&w1, "nereid_worker_etcd_connected", "the worker's session up", |v| v == 1.0).await;
    assert_eq!(w1.metric(PLACEMENT_READS).await, Some(1.0));
    let resumes = w1.metric(WATCH_RESUMES).await.unwrap();

    // etcd goes away, and comes back where only this test reaches it: the worker stays cut off
    // (holding its placement and the revision to resume from) while history moves on.
    etcd.stop();
    wait_metric(&w1, "nereid_worker_etcd_connected", "the worker to lose its session", |v| v == 0.0).await;
    let mut isolated = etcd.restart_isolated().await;
    // A model placed on w1 and declared (placed as the controller would: the controller, back,
    // finds it placed and writes nothing), then a change under another worker's prefix, so that
    // w1's change lies strictly before the compaction: the worker can only learn it by reading.
    put(&mut isolated, "placement/w1/versioned_scale/2", r#"{"schema":1,"leader_revision":1}"#).await;
    put(&mut isolated, "models/versioned_scale", r#"{"schema":1,"versions":[2],"replicas":1}"#).await;
    put(&mut isolated, "placement/w2/identity_fp32/1", r#"{"schema":1,"leader_revision":1}"#).await;
    let compacted = compact_all(&mut isolated).await;
    drop(isolated);
    etcd.restart().await;

    // The resumed watch is answered with compact_revision > 0: the worker reads its placement
    // whole, once, and loads what was placed while it was away.
    wait_metric(&w1, PLACEMENT_READS, "the worker to re-read its placement", |v| v == 2.0).await;
    assert!(w1.metric(WATCH_RESUMES).await.unwrap() > resumes, "the watch resumed (from before {compacted}) first");
    wait_until("versioned_scale 2 READY on w1", WAIT, || async {
        ready_on(&mut etcd.client().await, "versioned_scale", 2).await == ["w1"]
    })
    .await;
    assert!(infer_ok(&w1, fp32_request("versioned_scale", "2", &[1, 4], |i| i as f32)).await);
    assert!(infer_ok(&w1, fp32_request("identity_fp32", "", &[1, 16], |i| i as f32)).await);
    wait_until("the gateway to route versioned_scale 2", WAIT, || async {
        infer_ok(&gateway, fp32_request("versioned_scale", "2", &[1, 4], |i| i as f32)).await
    })
    .await;

    // The watch re-established after the read follows later changes: a version declared after
    // the compaction reaches the worker as an event, with no further read.
    put(&mut etcd.client().await, "models/versioned_scale", r#"{"schema":1,"versions":[1,2],"replicas":1}"#).await;
    wait_until("versioned_scale 1 READY on w1", WAIT, || async {
        ready_on(&mut etcd.client().await, "versioned_scale", 1).await == ["w1"]
    })
    .await;
    wait_until("the gateway to route versioned_scale 1", WAIT, || async {
        infer_ok(&gateway, fp32_request("versioned_scale", "1", &[1, 4], |i| i as f32)).await
    })
    .await;
    assert!(infer_ok(&w1, fp32_request("versioned_scale", "1", &[1, 4], |i| i as f32)).await);
    assert_eq!(w1.metric(PLACEMENT_READS).await, Some(2.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_keeps_its_models_when_its_watch_resumes_or_re_reads() {
    let mut etcd = Etcd::start().await;
    let mut w1 = spawn_fleet_worker(&etcd, "w1", &["--drain-delay-ms", "60000"]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    declare_identity_and_wait(&etcd, &gateway, 1).await;
    let identity = || fp32_request("identity_fp32", "", &[1, 16], |i| i as f32);

    // Draining (for up to a minute): the controller takes its placement away; the worker
    // keeps serving what it holds until it exits.
    w1.terminate();
    wait_until("the controller to remove the draining worker's placement", WAIT, || async {
        keys_under(&mut etcd.client().await, "placement/").await.is_empty()
    })
    .await;
    assert!(infer_ok(&w1, identity()).await);

    // A lost session (the watch resumes), then a compaction (the placement is read again, now
    // without identity_fp32): neither may unload what the draining worker serves.
    etcd.stop();
    wait_metric(&w1, "nereid_worker_etcd_connected", "the worker to lose its session", |v| v == 0.0).await;
    let mut isolated = etcd.restart_isolated().await;
    put(&mut isolated, "models/versioned_scale", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    put(&mut isolated, "placement/w2/versioned_scale/1", r#"{"schema":1,"leader_revision":1}"#).await;
    compact_all(&mut isolated).await;
    drop(isolated);
    etcd.restart().await;
    wait_metric(&w1, PLACEMENT_READS, "the worker to re-read its placement", |v| v == 2.0).await;
    wait_metric(&w1, "nereid_worker_etcd_connected", "the worker's session back", |v| v == 1.0).await;
    // A hundred requests after the read (an unload would have happened at once).
    for n in 0..100 {
        assert!(infer_ok(&w1, identity()).await, "request {n} after the re-read failed");
    }
    assert_eq!(w1.child.try_wait().unwrap(), None, "still draining, not exited");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_values_are_rejected_and_the_last_good_state_kept() {
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let _w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    declare_identity_and_wait(&etcd, &gateway, 1).await;

    put(&mut client, "models/identity_fp32", r#"{"schema":1,"versions":[1],"replicas":0}"#).await;
    put(&mut client, "models/identity_fp32", r#"{"schema":2,"versions":[1],"replicas":1}"#).await;
    put(&mut client, "models/broken", "{not json").await;
    put(&mut client, "workers/w1", r#"{"schema":1,"id":"w1","grpc":"nowhere","state":"ready"}"#).await;
    put(&mut client, "routes/identity_fp32", r#"{"schema":1,"weights":{"1":0}}"#).await;
    wait_metric(&gateway, "nereid_gateway_etcd_invalid_values_total{kind=\"model\"}", "model rejections", |v| v >= 3.0)
        .await;
    wait_metric(&gateway, "nereid_gateway_etcd_invalid_values_total{kind=\"worker\"}", "worker rejection", |v| {
        v >= 1.0
    })
    .await;
    wait_metric(&gateway, "nereid_gateway_etcd_invalid_values_total{kind=\"route\"}", "route rejection", |v| v >= 1.0)
        .await;
    // Several re-plans later the model is still placed and routed: the last good values hold.
    let writes = gateway.metric("nereid_gateway_placement_writes_total").await;
    let plans = gateway.metric("nereid_gateway_placement_plans_total").await.unwrap();
    wait_metric(&gateway, "nereid_gateway_placement_plans_total", "two more plans", |v| v >= plans + 2.0).await;
    assert_eq!(gateway.metric("nereid_gateway_placement_writes_total").await, writes);
    assert_eq!(keys_under(&mut client, "placement/").await, vec!["/placement/w1/identity_fp32/1"]);
    assert!(infer_ok(&gateway, fp32_request("identity_fp32", "", &[1, 16], |i| i as f32)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_elect_one_placement_leader_and_fail_over() {
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let _w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let mut gateways = vec![spawn_fleet_gateway(&etcd, "g1", &[]), spawn_fleet_gateway(&etcd, "g2", &[])];
    let leaders = |gws: &[Proc]| {
        let ports: Vec<u16> = gws.iter().map(|g| g.metrics).collect();
        async move {
            let mut n = Vec::new();
            for (i, p) in ports.iter().enumerate() {
                let text = reqwest::get(format!("http://127.0.0.1:{p}/metrics")).await.unwrap().text().await.unwrap();
                if text.lines().any(|l| l == "nereid_gateway_placement_leader 1") {
                    n.push(i);
                }
            }
            n
        }
    };
    wait_until("one leader", WAIT, || async { leaders(&gateways).await.len() == 1 }).await;
    let leader = leaders(&gateways).await[0];
    put(&mut client, "models/identity_fp32", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    wait_until("identity_fp32 placed", WAIT, || async {
        !ready_on(&mut etcd.client().await, "identity_fp32", 1).await.is_empty()
    })
    .await;
    // A bad write to its declaration: rejected, the leader plans on the last good value.
    put(&mut client, "models/identity_fp32", r#"{"schema":2,"versions":[1],"replicas":1}"#).await;

    // SIGKILL the leader: its election lease expires and the other gateway takes over.
    gateways[leader].child.kill().unwrap();
    gateways[leader].child.wait().unwrap();
    let other = gateways.remove(1 - leader);
    wait_metric(&other, "nereid_gateway_placement_leader", "the other gateway to lead", |v| v == 1.0).await;
    put(&mut client, "models/versioned_scale", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    wait_until("the new leader to place a new model", WAIT, || async {
        !ready_on(&mut etcd.client().await, "versioned_scale", 1).await.is_empty()
    })
    .await;
    wait_until("the surviving gateway to route it", WAIT, || async {
        infer_ok(&other, fp32_request("versioned_scale", "1", &[1, 4], |i| i as f32)).await
    })
    .await;
    // The new leader never saw identity_fp32's declaration valid: it keeps the model's
    // placement as it is instead of reading the model as undeclared (its plans ran: it placed
    // versioned_scale).
    let placed = keys_under(&mut client, "placement/").await;
    assert!(placed.contains(&"/placement/w1/identity_fp32/1".to_string()), "{placed:?}");
    assert!(infer_ok(&other, fp32_request("identity_fp32", "", &[1, 16], |i| i as f32)).await);

    // Its election key deleted by hand: the leader steps down at once (and, alone, leads again
    // in a new term), not only when it next writes.
    let election = format!("{PREFIX}/leader/placement");
    client.delete(election, Some(nereid_common::fleet::etcd_client::DeleteOptions::new().with_prefix())).await.unwrap();
    other.wait_log("the leader to step down", "its election key was deleted", WAIT).await;
    wait_metric(&other, "nereid_gateway_placement_leader", "a new term", |v| v == 1.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_worker_under_load_fails_no_request() {
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let mut w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let _w2 = spawn_fleet_worker(&etcd, "w2", &[]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    declare_identity_and_wait(&etcd, &gateway, 2).await;

    let load = Load::start(&gateway, 4);
    load.progress(200).await;
    w1.terminate();
    assert_eq!(w1.wait_exit(WAIT), Some(0), "{}", w1.log());
    load.progress(200).await;
    let (ok, failures) = load.finish().await;
    assert!(failures.is_empty(), "ok {ok}, failures: {failures:?}");
    // Its registration and statuses left with its lease.
    assert!(keys_under(&mut client, "workers/").await == vec!["/workers/w2"]);
    assert!(keys_under(&mut client, "status/w1/").await.is_empty());
}

/// Writes four values of [`BIG_VALUE_BYTES`] under `{PREFIX}/{under}` (4.8 MB in all: past
/// tonic's default 4 MiB decode limit for one response holding them all).
async fn put_big_values(client: &mut Client, under: &str, fill: char) {
    let value = fill.to_string().repeat(BIG_VALUE_BYTES);
    for i in 0..4 {
        client.put(format!("{PREFIX}/{under}/{i}"), value.as_str(), None).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_read_is_paged_complete_and_of_one_revision() {
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let prefix = format!("{PREFIX}/paged/");
    for i in 0..25 {
        put(&mut client, &format!("paged/k{i:02}"), &format!("v{i}")).await;
    }
    put(&mut client, "paged0", "just past the prefix's range").await;
    let small = PageLimits { keys: 4, ..PageLimits::default() };
    let read = read::get_prefix_with(&client, &prefix, small).await.unwrap();
    let keys: Vec<String> = read.kvs.iter().map(|kv| kv.key_str().unwrap().to_string()).collect();
    let expected: Vec<String> = (0..25).map(|i| format!("{prefix}k{i:02}")).collect();
    assert_eq!(keys, expected, "every key, in order, once");
    let now = client.get(PREFIX, None).await.unwrap().header().unwrap().revision();
    assert_eq!(read.mark.revision, now);

    // Pages read while a writer changes the prefix: every read is exactly the prefix as of
    // its own revision (each page pinned to the first page's), never a mix of several.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, mut client) = (stop.clone(), client.clone());
        let prefix = prefix.clone();
        tokio::spawn(async move {
            for n in 0..10_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let i = n % 25;
                client.put(format!("{prefix}k{i:02}"), format!("w{n}"), None).await.unwrap();
                client.put(format!("{prefix}new{n:05}"), "x", None).await.unwrap();
                client.delete(format!("{prefix}new{:05}", n.max(3) - 3), None).await.unwrap();
            }
        })
    };
    let one_key = PageLimits { keys: 1, ..PageLimits::default() };
    for _ in 0..5 {
        let read = read::get_prefix_with(&client, &prefix, one_key).await.unwrap();
        let at = client
            .get(prefix.as_str(), Some(GetOptions::new().with_prefix().with_revision(read.mark.revision)))
            .await
            .unwrap();
        let shown = |kvs: &[nereid_common::fleet::etcd_client::KeyValue]| -> Vec<(Vec<u8>, Vec<u8>, i64)> {
            kvs.iter().map(|kv| (kv.key().to_vec(), kv.value().to_vec(), kv.mod_revision())).collect()
        };
        assert_eq!(shown(&read.kvs), shown(at.kvs()), "the read is the prefix as of revision {}", read.mark.revision);
    }
    stop.store(true, Ordering::Relaxed);
    writer.await.unwrap();

    // Values adding up past the decode limit: one response cannot hold them (what an unpaged
    // read of the prefix ran into), so the pages shrink until each fits.
    put_big_values(&mut client, "big", 'a').await;
    let unpaged = client.get(format!("{PREFIX}/big/"), Some(GetOptions::new().with_prefix())).await.unwrap_err();
    assert!(unpaged.to_string().contains("message length too large"), "{unpaged}");
    let tight = PageLimits { keys: 1000, message_bytes: DEFAULT_MESSAGE_LIMIT };
    let read = read::get_prefix_with(&client, &format!("{PREFIX}/big/"), tight).await.unwrap();
    assert_eq!(read.kvs.len(), 4);
    assert!(read.kvs.iter().all(|kv| kv.value().len() == BIG_VALUE_BYTES));
    let read = read::get_prefix(&client, &format!("{PREFIX}/")).await.unwrap();
    assert!(read.kvs.len() > 4 + 25, "the big values, the paged keys and the one beside them");

    // A watch replaying them (as a watch resuming after an outage does) gets them in one
    // batch: past the default limit (the watch would fail on every resume), within ours.
    let from = read.kvs.iter().filter(|kv| kv.key_str().unwrap().contains("/big/")).map(|kv| kv.mod_revision()).min();
    let options = || WatchOptions::new().with_prefix().with_start_revision(from.unwrap());
    let mut plain = client.watch(format!("{PREFIX}/big/"), Some(options())).await.unwrap();
    let mut batch = String::new();
    for _ in 0..3 {
        // The first answer is the watch's creation; the batch follows.
        match plain.message().await {
            Ok(Some(r)) => assert!(r.events().is_empty(), "the batch was decoded"),
            Ok(None) => break,
            Err(e) => {
                batch = e.to_string();
                break;
            }
        }
    }
    assert!(batch.contains("message length too large"), "{batch}");
    let mut watch = read::watch(&client, format!("{PREFIX}/big/"), options()).await.unwrap();
    let mut events = 0;
    for _ in 0..6 {
        events += watch.message().await.unwrap().unwrap().events().len();
        if events == 4 {
            break;
        }
    }
    assert_eq!(events, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_past_the_grpc_message_limit_stop_neither_the_gateway_nor_nereidctl() {
    let mut etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    // 4.8 MB under the prefix before anyone reads it (not the schema's: ignored by readers).
    put_big_values(&mut client, "junk", 'a').await;
    let w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_metric(&gateway, "nereid_gateway_workers{state=\"ready\"}", "a table read past 4 MiB", |v| v == 1.0).await;
    wait_metric(&gateway, WATCH_CONNECTED, "the watch up", |v| v == 1.0).await;
    let ctl = tokio::process::Command::new(env!("CARGO_BIN_EXE_nereidctl"))
        .args(["--etcd-endpoints", &etcd.endpoint(), "workers", "--output", "json"])
        .env_remove("NEREID_ETCD_ENDPOINTS")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(WAIT, ctl).await.expect("nereidctl did not exit").unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "nereidctl workers: {stdout} {stderr}");
    assert!(stdout.contains("\"w1\""), "{stdout}");

    // While the gateway and worker are cut off, the big values are rewritten and a model placed
    // on w1: the resumed watches receive all of it batched, past 4 MiB.
    etcd.stop();
    wait_metric(&gateway, WATCH_CONNECTED, "the watch to notice etcd is gone", |v| v == 0.0).await;
    let mut isolated = etcd.restart_isolated().await;
    put_big_values(&mut isolated, "junk", 'b').await;
    put(&mut isolated, "models/identity_fp32", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    // Placed as the controller would (the controller, back, finds it placed and writes nothing).
    put(&mut isolated, "placement/w1/identity_fp32/1", r#"{"schema":1,"leader_revision":1}"#).await;
    drop(isolated);
    let resyncs = gateway.metric(RESYNCS).await;
    etcd.restart().await;
    wait_until("identity_fp32 READY on w1", WAIT, || async {
        ready_on(&mut etcd.client().await, "identity_fp32", 1).await == ["w1"]
    })
    .await;
    wait_until("the gateway's resumed watch to route identity_fp32", WAIT, || async {
        infer_ok(&gateway, fp32_request("identity_fp32", "", &[1, 16], |i| i as f32)).await
    })
    .await;
    assert_eq!(gateway.metric(RESYNCS).await, resyncs, "resumed, not re-read");
    assert_eq!(w1.metric(PLACEMENT_READS).await, Some(1.0), "the worker resumed too");
}

/// The data directory of the harness's etcd, as its log states it.
fn data_dir(etcd: &Etcd) -> PathBuf {
    let log = etcd.log();
    let line = log.lines().find_map(|l| l.split_once("data dir = ").map(|(_, d)| d.trim().to_string()));
    PathBuf::from(line.unwrap_or_else(|| panic!("no \"data dir = \" in etcd's log: {log}")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_that_lost_its_data_is_noticed_and_everything_re_read() {
    let mut etcd = Etcd::start().await;
    let w1 = spawn_fleet_worker(&etcd, "w1", &[]);
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    declare_identity_and_wait(&etcd, &gateway, 1).await;
    let mut client = etcd.client().await;
    // Take the revision far past what the wiped etcd reaches before everyone is back, then
    // change w1's placement so that the worker too has seen a revision past all of it.
    for n in 0..100 {
        put(&mut client, "filler", &n.to_string()).await;
    }
    put(&mut client, "models/versioned_scale", r#"{"schema":1,"versions":[1],"replicas":1}"#).await;
    wait_until("versioned_scale 1 routed", WAIT, || async {
        infer_ok(&gateway, fp32_request("versioned_scale", "1", &[1, 4], |i| i as f32)).await
    })
    .await;
    let resyncs = gateway.metric(RESYNCS).await.unwrap();
    assert_eq!(w1.metric(PLACEMENT_READS).await, Some(1.0));

    // etcd comes back empty, at revision 1.
    let data = data_dir(&etcd);
    etcd.stop();
    std::fs::remove_dir_all(&data).unwrap();
    etcd.restart().await;

    // The wiped etcd holds no placement for w1: it keeps serving what it has (a wipe must not
    // take the fleet down) and the gateway routes to it again once it has re-registered.
    wait_until("the worker to re-read its placement", WAIT, || async { w1.metric(PLACEMENT_READS).await == Some(2.0) })
        .await;
    wait_until("identity_fp32 routed after the wipe", WAIT, || async {
        infer_ok(&gateway, fp32_request("identity_fp32", "", &[1, 16], |i| i as f32)).await
    })
    .await;
    assert!(w1.log().contains("holds no placement for this worker"), "{}", w1.log());

    // Still nothing placed since the wipe when the worker's watch falls behind a compaction:
    // the read that follows finds no placement again, and must not unload what it kept.
    etcd.stop();
    wait_metric(&w1, "nereid_worker_etcd_connected", "the worker to lose its session", |v| v == 0.0).await;
    let mut isolated = etcd.restart_isolated().await;
    // Two changes: the revision the worker resumes from (one past the last it read) lies
    // strictly before the compaction.
    put(&mut isolated, "filler", "after the wipe").await;
    put(&mut isolated, "filler", "and again").await;
    compact_all(&mut isolated).await;
    drop(isolated);
    etcd.restart().await;
    wait_metric(&w1, PLACEMENT_READS, "the worker to re-read its placement after the compaction", |v| v >= 3.0).await;
    wait_metric(&w1, "nereid_worker_etcd_connected", "the worker's session back", |v| v == 1.0).await;
    // An unload would come one unload grace (0.5 s here) after the read; an absence cannot be
    // waited on, so the worker is asked for four graces' time.
    let until = std::time::Instant::now() + Duration::from_secs(2);
    let mut n = 0;
    while std::time::Instant::now() < until {
        let req = fp32_request("identity_fp32", "", &[1, 16], |i| i as f32);
        assert!(infer_ok(&w1, req).await, "request {n} after the re-read failed\n{}", w1.log());
        n += 1;
    }
    // Nor was it scheduled for later: the reconciler would have said so as it read the placement.
    assert!(!w1.log().contains("placement removed"), "{}", w1.log());

    // A model declared now is placed at a revision far below the last one seen: the worker only
    // gets it, and the gateway only routes it, if each noticed and read everything again.
    put(&mut etcd.client().await, "models/versioned_scale", r#"{"schema":1,"versions":[2],"replicas":1}"#).await;
    wait_until("versioned_scale 2 routed after the wipe", WAIT, || async {
        infer_ok(&gateway, fp32_request("versioned_scale", "2", &[1, 4], |i| i as f32)).await
    })
    .await;
    assert!(gateway.metric(RESYNCS).await.unwrap() > resyncs);
    // The placement written since replaces the kept one: what the lost data placed is gone,
    // the worker unloads it, the gateway stops routing it.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let req = fp32_request("identity_fp32", "", &[1, 16], |i| i as f32);
        match gateway.client().await.model_infer(req).await {
            Err(e) if e.code() == tonic::Code::NotFound => break,
            other => assert!(
                std::time::Instant::now() < deadline,
                "identity_fp32 still answered {other:?}\nworker log:\n{}\ngateway log:\n{}",
                w1.log(),
                gateway.log()
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One more etcd member started by a test, SIGKILLed on drop.
struct Member {
    name: String,
    client_port: u16,
    peer: String,
    initial_cluster: String,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

/// A free port for an extra member, picked below the kernel's ephemeral range where it can:
/// the port is released before etcd binds it (and a member cannot simply be started again on
/// other ports: its peer URL is registered first, and changing it needs a quorum the cluster
/// may not have yet), so it must not be one that any process's connect or bind(0) — the
/// other tests' loopback traffic — can take meanwhile.
fn free_port() -> u16 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    if ephemeral_start > 12000 {
        // Spread over [10000, start): the process id and a counter keep parallel tests apart.
        let span = ephemeral_start - 10000;
        let seed = std::process::id().wrapping_mul(2654435761);
        for _ in 0..200 {
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let port = 10000 + (seed.wrapping_add(n.wrapping_mul(7919)) % span);
            if std::net::TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
                return port as u16;
            }
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Member {
    /// Adds a member to the cluster `client` reaches (`cluster`: `name=peer` of each member so
    /// far) and starts it, waiting until it is healthy.
    async fn join(client: &mut Client, name: &str, cluster: &mut Vec<String>) -> Member {
        let peer = format!("http://127.0.0.1:{}", free_port());
        // etcd refuses a member while the last one joined is connected for less than 5 s
        // ("unhealthy cluster").
        wait_until("etcd to accept a new member", WAIT, || {
            let (mut client, peer) = (client.clone(), peer.clone());
            async move {
                match client.member_add([peer.as_str()], None).await {
                    Ok(_) => true,
                    Err(e) if e.to_string().contains("unhealthy cluster") => false,
                    Err(e) => panic!("member add: {e}"),
                }
            }
        })
        .await;
        cluster.push(format!("{name}={peer}"));
        let dir = tempfile::tempdir().unwrap();
        let initial_cluster = cluster.join(",");
        let mut member =
            Member { name: name.into(), client_port: free_port(), peer, initial_cluster, dir, child: None };
        member.start().await;
        member
    }

    async fn start(&mut self) {
        let bin = std::env::var_os("NEREID_ETCD_BIN").map(PathBuf::from).unwrap_or_else(|| "etcd".into());
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.path().join("log")).unwrap();
        let child = Command::new(bin)
            .args(["--name", &self.name, "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &self.peer, "--initial-advertise-peer-urls", &self.peer])
            .args(["--initial-cluster", &self.initial_cluster, "--initial-cluster-state", "existing"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!("etcd member {} exited with {status}: {}", self.name, self.log());
            }
            if let Ok(r) = reqwest::get(format!("{client}/health")).await
                && r.text().await.unwrap_or_default().contains("\"health\":\"true\"")
            {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "etcd member {} not healthy: {}", self.name, self.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_on_a_member_without_quorum_reports_its_watch_down() {
    // Three members; the gateway is given only the harness's.
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let members = client.member_list().await.unwrap();
    let first = &members.members()[0];
    let mut cluster = vec![format!("{}={}", first.name(), first.peer_urls()[0])];
    let mut m2 = Member::join(&mut client, "m2", &mut cluster).await;
    let mut m3 = Member::join(&mut client, "m3", &mut cluster).await;
    let gateway = spawn_fleet_gateway(&etcd, "g1", &[]);
    wait_metric(&gateway, WATCH_CONNECTED, "the watch up", |v| v == 1.0).await;
    wait_metric(&gateway, "nereid_gateway_placement_leader", "the gateway leading placement", |v| v == 1.0).await;

    // Its member loses the quorum but keeps answering: the watch must not stay "healthy".
    m2.stop();
    m3.stop();
    wait_metric(&gateway, WATCH_CONNECTED, "the watch reported down", |v| v == 0.0).await;
    wait_metric(&gateway, "nereid_gateway_placement_leader", "the leader stepping down", |v| v == 0.0).await;

    // The quorum back (two of three): the watch resumes.
    m2.start().await;
    wait_metric(&gateway, WATCH_CONNECTED, "the watch to resume", |v| v == 1.0).await;
    // ...and the gateway, alone, campaigns again and leads placement.
    wait_metric(&gateway, "nereid_gateway_placement_leader", "the gateway leading again", |v| v == 1.0).await;
    drop(m3);
}

/// The keep-alive task the worker agent and the placement controller hold their leases with:
/// it keeps the lease alive past its TTL, resolves naming why once the lease is gone, and
/// stops refreshing when dropped (the lease then expires and its keys go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_lease_outlives_its_ttl_its_loss_is_reported_and_dropping_the_task_lets_it_expire() {
    use nereid_common::fleet::{etcd_client::PutOptions, spawn_keepalive};
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;

    let lease = client.lease_grant(2, None).await.unwrap().id();
    let (keeper, responses) = client.lease_keep_alive(lease).await.unwrap();
    let mut task = spawn_keepalive(keeper, responses, Duration::from_millis(200));
    // Kept: alive at every look for well past twice its TTL (the property is one over time).
    let granted = std::time::Instant::now();
    wait_until("the kept lease to outlive twice its TTL", WAIT, || {
        let mut client = client.clone();
        async move {
            let ttl = client.lease_time_to_live(lease, None).await.map(|r| r.ttl()).unwrap_or(-1);
            assert!(ttl > 0, "the kept lease expired after {:?}", granted.elapsed());
            granted.elapsed() > Duration::from_secs(5)
        }
    })
    .await;
    client.lease_revoke(lease).await.unwrap();
    let why = tokio::time::timeout(WAIT, &mut task).await.expect("the task reports the lost lease");
    assert!(why.contains("lease expired") || why.contains("keep-alive"), "{why}");

    let lease = client.lease_grant(2, None).await.unwrap().id();
    client.put("held", "x", Some(PutOptions::new().with_lease(lease))).await.unwrap();
    let (keeper, responses) = client.lease_keep_alive(lease).await.unwrap();
    drop(spawn_keepalive(keeper, responses, Duration::from_millis(200)));
    wait_until("the lease of a dropped task to expire", WAIT, || {
        let mut client = client.clone();
        async move { client.get("held", None).await.unwrap().kvs().is_empty() }
    })
    .await;
}

/// Worker w1 (with `args`) serving identity_fp32, placed by gateway g1 and routed through it.
async fn identity_on_w1(etcd: &Etcd, args: &[&str]) -> (Proc, Proc) {
    let w1 = spawn_fleet_worker(etcd, "w1", args);
    let gateway = spawn_fleet_gateway(etcd, "g1", &[]);
    declare_identity_and_wait(etcd, &gateway, 1).await;
    (w1, gateway)
}

/// The lease `key` is held under, if the key is there.
async fn lease_of(client: &mut Client, key: &str) -> Option<i64> {
    client.get(key, None).await.ok()?.kvs().first().map(|kv| kv.lease())
}

/// An operator's `etcdctl del` of a worker's registration or of one of its statuses, while its
/// lease lives: the worker notices and writes them again, under the same lease, and the gateway
/// routes to it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_writes_its_deleted_keys_again_under_the_same_lease() {
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let (w1, gateway) = identity_on_w1(&etcd, &[]).await;
    let record = format!("{PREFIX}/workers/w1");
    let lease = lease_of(&mut client, &record).await.expect("registered");

    client.delete(record.as_str(), None).await.unwrap();
    wait_until("the record written again under the same lease", WAIT, || async {
        lease_of(&mut etcd.client().await, &record).await == Some(lease)
    })
    .await;
    wait_metric(&gateway, "nereid_gateway_workers{state=\"ready\"}", "the worker routed again", |v| v == 1.0).await;

    let status = format!("{PREFIX}/status/w1/identity_fp32/1");
    client.delete(status.as_str(), None).await.unwrap();
    wait_until("the status written again under the same lease", WAIT, || async {
        lease_of(&mut etcd.client().await, &status).await == Some(lease)
    })
    .await;
    wait_until("identity_fp32 READY on w1 again", WAIT, || async {
        ready_on(&mut etcd.client().await, "identity_fp32", 1).await == ["w1"]
    })
    .await;
    wait_until("the gateway to route identity_fp32 again", WAIT, || async {
        infer_ok(&gateway, fp32_request("identity_fp32", "", &[1, 16], |i| i as f32)).await
    })
    .await;
    assert_eq!(w1.metric("nereid_worker_etcd_leases_granted_total").await, Some(1.0));
}

/// etcd refusing writes (a NOSPACE alarm, armed here by hand as etcd arms it when its quota
/// runs out: puts and lease grants are refused, keep-alives still renew): a status the worker
/// cannot write is retried, the lease is kept, and the registration stays — gateways keep
/// routing to it — where a worker that gave up its lease could not get another and vanished
/// after one TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_keeps_its_lease_and_registration_while_etcd_refuses_writes() {
    use nereid_common::fleet::etcd_client::{AlarmAction, AlarmOptions, AlarmType};
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let (w1, gateway) = identity_on_w1(&etcd, &[]).await;
    let record = format!("{PREFIX}/workers/w1");
    let lease = lease_of(&mut client, &record).await.expect("registered");

    let member = client.status().await.unwrap().header().expect("a header").member_id();
    let alarm = || {
        let mut options = AlarmOptions::new();
        options.with_member(member);
        Some(options)
    };
    client.alarm(AlarmAction::Activate, AlarmType::Nospace, alarm()).await.unwrap();
    let refused = client.put(format!("{PREFIX}/probe"), "x", None).await.unwrap_err();
    assert!(refused.to_string().contains("space"), "{refused}");
    // A status to publish: a model loaded by hand.
    let loaded =
        reqwest::Client::new().post(w1.http_url("/v2/repository/models/versioned_scale/load")).send().await.unwrap();
    assert_eq!(loaded.status(), 200);
    w1.wait_log("a refused status write", "database space exceeded", WAIT).await;

    // Three TTLs of refused writes: at every look the registration is there, under the same
    // lease, and the gateway routes to the worker.
    let since = std::time::Instant::now();
    wait_until("the registration to outlive three TTLs of refused writes", WAIT, || async {
        let mut client = etcd.client().await;
        assert_eq!(lease_of(&mut client, &record).await, Some(lease), "after {:?}\n{}", since.elapsed(), w1.log());
        let routed = infer_ok(&gateway, fp32_request("identity_fp32", "", &[1, 16], |i| i as f32)).await;
        assert!(routed, "not routed after {:?}\n{}", since.elapsed(), gateway.log());
        since.elapsed() > Duration::from_secs(6)
    })
    .await;

    // Writes accepted again: the retried status goes in, under the same lease.
    client.alarm(AlarmAction::Deactivate, AlarmType::Nospace, alarm()).await.unwrap();
    wait_until("the refused status written once etcd accepts writes", WAIT, || async {
        let mut client = etcd.client().await;
        !keys_under(&mut client, "status/w1/versioned_scale/").await.is_empty()
    })
    .await;
    assert_eq!(lease_of(&mut client, &record).await, Some(lease));
    assert_eq!(w1.metric("nereid_worker_etcd_leases_granted_total").await, Some(1.0));
}

/// An etcd restart ends the worker's session (its watches and keep-alive stream break), not
/// its lease: the worker reconnects and registers again under the lease it kept, and routing
/// never stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_keeps_its_lease_across_an_etcd_restart() {
    let mut etcd = Etcd::start().await;
    // A TTL well above how long the restart takes: the lease outlives it in etcd.
    let (w1, gateway) = identity_on_w1(&etcd, &["--etcd-lease-ttl-secs", "10"]).await;
    wait_metric(&w1, "nereid_worker_etcd_connected", "the worker's session up", |v| v == 1.0).await;
    let record = format!("{PREFIX}/workers/w1");
    let lease = lease_of(&mut etcd.client().await, &record).await.expect("registered");
    let sessions = w1.metric("nereid_worker_etcd_sessions_total").await.unwrap();

    let load = Load::start(&gateway, 2);
    load.progress(50).await;
    etcd.restart().await;
    wait_until("a new session of the worker", WAIT, || async {
        w1.metric("nereid_worker_etcd_sessions_total").await.is_some_and(|n| n > sessions)
            && w1.metric("nereid_worker_etcd_connected").await == Some(1.0)
    })
    .await;
    let mut client = etcd.client().await;
    assert_eq!(lease_of(&mut client, &record).await, Some(lease), "{}", w1.log());
    let status = format!("{PREFIX}/status/w1/identity_fp32/1");
    assert_eq!(lease_of(&mut client, &status).await, Some(lease));
    assert_eq!(w1.metric("nereid_worker_etcd_leases_granted_total").await, Some(1.0));
    load.progress(50).await;
    let (ok, failures) = load.finish().await;
    assert!(failures.is_empty(), "ok {ok}, failures: {failures:?}");
}

/// A worker counts the invalid placement values it reads (and, as documented, keeps the
/// assignment its key names).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_counts_invalid_placement_values_and_keeps_the_assignment() {
    let etcd = Etcd::start().await;
    let mut client = etcd.client().await;
    let (w1, _gateway) = identity_on_w1(&etcd, &[]).await;
    let series = "nereid_worker_etcd_invalid_values_total{kind=\"placement\"}";
    assert_eq!(w1.metric(series).await, Some(0.0));

    put(&mut client, "placement/w1/identity_fp32/1", "{not json").await;
    wait_metric(&w1, series, "a value that is not JSON counted", |v| v >= 1.0).await;
    put(&mut client, "placement/w1/identity_fp32/1", r#"{"schema":99,"leader_revision":1}"#).await;
    wait_metric(&w1, series, "a value of an unknown schema counted", |v| v >= 2.0).await;
    assert!(infer_ok(&w1, fp32_request("identity_fp32", "", &[1, 16], |i| i as f32)).await);
    assert_eq!(ready_on(&mut client, "identity_fp32", 1).await, ["w1"]);
}

/// Forwards TCP connections to a port until frozen: then what arrives is held, never forwarded,
/// and every connection stays open — an etcd that stopped answering without closing anything.
struct FreezingProxy {
    port: u16,
    frozen: tokio::sync::watch::Sender<bool>,
    accept: tokio::task::JoinHandle<()>,
}

impl FreezingProxy {
    async fn start(to: u16) -> FreezingProxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (frozen, rx) = tokio::sync::watch::channel(false);
        let accept = tokio::spawn(async move {
            for _ in 0..1000 {
                let Ok((inbound, _)) = listener.accept().await else { return };
                let Ok(outbound) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await else { continue };
                let (from_client, to_client) = inbound.into_split();
                let (from_server, to_server) = outbound.into_split();
                tokio::spawn(Self::pipe(from_client, to_server, rx.clone()));
                tokio::spawn(Self::pipe(from_server, to_client, rx.clone()));
            }
        });
        FreezingProxy { port, frozen, accept }
    }

    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut frozen: tokio::sync::watch::Receiver<bool>,
    ) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if frozen.wait_for(|f| !*f).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn freeze(&self) {
        self.frozen.send_replace(true);
    }
}

impl Drop for FreezingProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Keep-alive answers stop while the stream stays open: both ways of keeping a lease report it
/// lost once its TTL has passed with no answer (clientv3's deadline), rather than believing it
/// alive until a transport notices — this client has no HTTP/2 keep-alives, so only the
/// deadline can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_keep_alives_go_unanswered_is_reported_lost_after_its_ttl() {
    use nereid_common::fleet::{KeptLease, spawn_keepalive};
    let etcd = Etcd::start().await;
    let proxy = FreezingProxy::start(etcd.client_port).await;
    let client = Client::connect([proxy.endpoint()], None).await.unwrap();
    let mut granting = client.clone();
    let lease = granting.lease_grant(2, None).await.unwrap().id();
    let (keeper, responses) = granting.lease_keep_alive(lease).await.unwrap();
    let mut task = spawn_keepalive(keeper, responses, Duration::from_millis(600));
    let kept = KeptLease::grant(&client, Duration::from_secs(2)).await.unwrap();
    // Kept through the proxy, past their TTL, while etcd answers.
    let mut direct = etcd.client().await;
    let since = std::time::Instant::now();
    wait_until("both leases kept past their TTL", WAIT, || async {
        assert_eq!(kept.lost(), None);
        assert!(!task.is_finished(), "the keep-alive task ended after {:?}", since.elapsed());
        since.elapsed() > Duration::from_secs(3)
    })
    .await;
    for id in [lease, kept.id()] {
        assert!(direct.lease_time_to_live(id, None).await.unwrap().ttl() > 0);
    }

    proxy.freeze();
    let why = tokio::time::timeout(WAIT, &mut task).await.expect("the keep-alive task reports the lease lost");
    assert!(why.contains("before its TTL ran out"), "{why}");
    let why = tokio::time::timeout(WAIT, kept.until_lost()).await.expect("the kept lease reported lost");
    assert!(why.contains("before its TTL ran out"), "{why}");
    assert!(kept.lost().is_some());
}
