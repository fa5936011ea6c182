//! Two real workers behind a real gateway: results through the gateway equal results straight
//! from a worker (gRPC, HTTP JSON and binary), load spreads over both, a worker killed with
//! SIGKILL under load costs at most the requests in flight on it, a worker that keeps running
//! into the gateway's own timeout is ejected (one that a client's tight deadline times out is
//! not), unknown models are NOT_FOUND, and the gateway's metrics are there.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::{Proc, example_models, fp32_request, inference_count, start_gateway, start_worker, wait_until};
use nereid_proto::inference::*;
use serde_json::{Value, json};

const MODELS: &[&str] = &["identity_fp32", "mlp_fp32", "versioned_scale"];

async fn fleet() -> (Proc, Proc, Proc) {
    let repo = example_models();
    let (a, b) = tokio::join!(start_worker(&repo, MODELS), start_worker(&repo, MODELS));
    let gateway = start_gateway(&[&a, &b], &[]).await;
    (a, b, gateway)
}

fn strip_id(mut r: ModelInferResponse) -> ModelInferResponse {
    r.parameters.clear();
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_through_the_gateway_equal_results_from_a_worker() {
    let (a, _b, gateway) = fleet().await;
    let mut direct = a.client().await;
    let mut through = gateway.client().await;
    let cases = [
        fp32_request("identity_fp32", "", &[2, 16], |i| i as f32 * 0.5 - 3.0),
        fp32_request("mlp_fp32", "", &[3, 256], |i| ((i * 37) % 101) as f32 / 50.0 - 1.0),
        fp32_request("versioned_scale", "1", &[1, 4], |i| i as f32 + 1.0),
        fp32_request("versioned_scale", "2", &[1, 4], |i| i as f32 + 1.0),
        fp32_request("versioned_scale", "", &[1, 4], |i| i as f32 + 1.0),
    ];
    for mut req in cases {
        req.id = format!("{}-{}", req.model_name, req.model_version);
        let want = strip_id(direct.model_infer(req.clone()).await.unwrap().into_inner());
        let got = strip_id(through.model_infer(req.clone()).await.unwrap().into_inner());
        assert_eq!(got, want, "{}", req.id);
    }
    // The version pin is honoured: versions 1 and 2 answer differently.
    let v = |version: &str| fp32_request("versioned_scale", version, &[1, 4], |_| 1.0);
    let one = through.model_infer(v("1")).await.unwrap().into_inner();
    let two = through.model_infer(v("2")).await.unwrap().into_inner();
    assert_eq!((one.model_version.as_str(), two.model_version.as_str()), ("1", "2"));
    assert_ne!(one.raw_output_contents, two.raw_output_contents);

    // HTTP JSON, with and without a version, and the binary tensor extension.
    let http = reqwest::Client::new();
    let body =
        json!({"id": "j", "inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4.5]}]});
    for path in ["/v2/models/versioned_scale/infer", "/v2/models/versioned_scale/versions/1/infer"] {
        let want: Value = http.post(a.http_url(path)).json(&body).send().await.unwrap().json().await.unwrap();
        let got = http.post(gateway.http_url(path)).json(&body).send().await.unwrap();
        assert_eq!(got.status(), 200);
        assert_eq!(got.json::<Value>().await.unwrap(), want, "{path}");
    }
    let header = br#"{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","parameters":{"binary_data_size":64}}],"parameters":{"binary_data_output":true}}"#;
    let mut binary = header.to_vec();
    binary.extend((0..16).flat_map(|i| (i as f32 * 1.25).to_le_bytes()));
    let send = |port_url: String| {
        http.post(port_url)
            .header("Inference-Header-Content-Length", header.len().to_string())
            .header("Content-Type", "application/octet-stream")
            .body(binary.clone())
            .send()
    };
    let want = send(a.http_url("/v2/models/identity_fp32/infer")).await.unwrap();
    let got = send(gateway.http_url("/v2/models/identity_fp32/infer")).await.unwrap();
    assert_eq!(got.status(), 200);
    assert_eq!(
        got.headers().get("inference-header-content-length"),
        want.headers().get("inference-header-content-length")
    );
    assert_eq!(got.bytes().await.unwrap(), want.bytes().await.unwrap());

    // Model metadata, config, readiness and the repository index answer as the worker does.
    for path in ["/v2/models/mlp_fp32", "/v2/models/versioned_scale/versions/2", "/v2/models/mlp_fp32/config"] {
        let want: Value = reqwest::get(a.http_url(path)).await.unwrap().json().await.unwrap();
        let got: Value = reqwest::get(gateway.http_url(path)).await.unwrap().json().await.unwrap();
        assert_eq!(got, want, "{path}");
    }
    assert_eq!(reqwest::get(gateway.http_url("/v2/models/mlp_fp32/ready")).await.unwrap().status(), 200);
    assert_eq!(reqwest::get(gateway.http_url("/v2/models/nope/ready")).await.unwrap().status(), 400);
    // A model name that is not UTF-8: a 400 with a JSON error, from the gateway as from a worker.
    for url in [a.http_url("/v2/models/%C3%28/infer"), gateway.http_url("/v2/models/%C3%28/infer")] {
        let r = http.post(&url).body("{}").send().await.unwrap();
        assert_eq!(r.status(), 400, "{url}");
        let v: Value = r.json().await.unwrap();
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{url}: {v}");
    }
    let index: Value = http
        .post(gateway.http_url("/v2/repository/index"))
        .json(&json!({"ready": true}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let want: Value = http
        .post(a.http_url("/v2/repository/index"))
        .json(&json!({"ready": true}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(index, want);
    let meta = through
        .model_metadata(ModelMetadataRequest { name: "mlp_fp32".into(), version: String::new() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(meta.inputs[0].shape, vec![-1, 256]);
    let config =
        through.model_config(ModelConfigRequest { name: "mlp_fp32".into(), version: String::new() }).await.unwrap();
    assert_eq!(config.into_inner().config.unwrap().max_batch_size, 64);
    let index =
        through.repository_index(RepositoryIndexRequest { repository_name: String::new(), ready: true }).await.unwrap();
    assert_eq!(index.into_inner().models.len(), 4); // identity, mlp, versioned_scale 1 and 2

    // Streaming: each request forwarded on its own, each answered.
    let requests: Vec<ModelInferRequest> = (0..5)
        .map(|k| {
            let mut r = fp32_request("identity_fp32", "", &[1, 16], move |i| (i + k) as f32);
            r.id = format!("s{k}");
            r
        })
        .collect();
    let stream = through.model_stream_infer(futures::stream::iter(requests.clone())).await.unwrap().into_inner();
    let results: Vec<Result<ModelStreamInferResponse, tonic::Status>> = futures::StreamExt::collect(stream).await;
    let mut responses: Vec<ModelStreamInferResponse> = results.into_iter().map(Result::unwrap).collect();
    responses.sort_by(|x, y| x.infer_response.as_ref().unwrap().id.cmp(&y.infer_response.as_ref().unwrap().id));
    assert_eq!(responses.len(), 5);
    for (req, resp) in requests.iter().zip(&responses) {
        assert_eq!(resp.error_message, "");
        assert_eq!(resp.infer_response.as_ref().unwrap().raw_output_contents[0], req.raw_input_contents[0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_models_are_not_found_and_metrics_are_bounded() {
    let (a, b, gateway) = fleet().await;
    let mut through = gateway.client().await;
    let e = through.model_infer(fp32_request("no_such_model", "", &[1, 4], |_| 0.0)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains("no_such_model"), "{}", e.message());
    let e = through.model_infer(fp32_request("versioned_scale", "7", &[1, 4], |_| 0.0)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    let e =
        through.model_metadata(ModelMetadataRequest { name: "nope".into(), version: String::new() }).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);
    // A worker's own error (wrong shape) passes through with its code and message.
    let e = through.model_infer(fp32_request("identity_fp32", "", &[1, 3], |_| 0.0)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    let http = reqwest::Client::new();
    let r = http
        .post(gateway.http_url("/v2/models/no_such_model/infer"))
        .json(&json!({"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "FP32", "data": [1]}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.json::<Value>().await.unwrap()["error"].as_str().unwrap().contains("no_such_model"));
    assert_eq!(reqwest::get(gateway.http_url("/v2/models/nope")).await.unwrap().status(), 404);
    assert_eq!(reqwest::get(gateway.http_url("/v2/nowhere")).await.unwrap().status(), 404);

    through.model_infer(fp32_request("identity_fp32", "", &[1, 16], |_| 0.0)).await.unwrap();
    let text = gateway.metrics_text().await;
    for series in [
        "nereid_gateway_requests_total{code=\"NOT_FOUND\",model=\"_unknown\",version=\"\"} 2",
        // Version 7 does not exist: not a label of its own.
        "nereid_gateway_requests_total{code=\"NOT_FOUND\",model=\"versioned_scale\",version=\"\"} 1",
        // Failed without naming a version: counted against the version it resolved to, as the
        // worker counts it (nv_inference_request_failure{version="1"}), not under an empty one.
        "nereid_gateway_requests_total{code=\"INVALID_ARGUMENT\",model=\"identity_fp32\",version=\"1\"} 1",
        "nereid_gateway_requests_total{code=\"OK\",model=\"identity_fp32\",version=\"1\"} 1",
        // Both identity_fp32 requests (the failed one and the OK one) under version 1.
        "nereid_gateway_request_duration_us_count{model=\"identity_fp32\",version=\"1\"} 2",
        "nereid_gateway_ejections_total 0",
        "nereid_gateway_workers{state=\"ready\"} 2",
        "nereid_gateway_workers{state=\"unreachable\"} 0",
    ] {
        assert!(text.lines().any(|l| l == series), "missing `{series}` in:\n{text}");
    }
    // The worker that ran the INVALID_ARGUMENT request counted it against the same version; no
    // worker labels a failure with an empty version.
    let failed = "nv_inference_request_failure{model=\"identity_fp32\",version=\"1\",reason=\"OTHER\"}";
    assert_eq!(a.metric(failed).await.unwrap() + b.metric(failed).await.unwrap(), 1.0);
    for w in [&a, &b] {
        let text = w.metrics_text().await;
        assert!(!text.contains("version=\"\""), "{text}");
    }
    // The two forwarded requests connected once to each worker they went to, never failing.
    let connects = gateway.metric("nereid_gateway_upstream_connects_total{result=\"ok\"}").await.unwrap();
    assert!((1.0..=2.0).contains(&connects), "{connects}");
    assert!(!text.contains("nereid_gateway_upstream_connects_total{result=\"failed\"}"), "{text}");
    let age = gateway.metric("nereid_gateway_routing_table_age_seconds").await.unwrap();
    // A live age (seconds since the table was last confirmed), not a timestamp or a constant.
    assert!((0.0..60.0).contains(&age), "{age}");
    assert!(!text.contains("no_such_model"), "unknown model names must not become labels");
    assert!(!text.contains("nereid_gateway_retries_total{"), "nothing was retried:\n{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_spreads_over_both_workers() {
    let (a, b, gateway) = fleet().await;
    let mut through = gateway.client().await;
    for i in 0..40 {
        through.model_infer(fp32_request("mlp_fp32", "", &[1, 256], |j| (i + j) as f32 / 256.0)).await.unwrap();
    }
    let (na, nb) = (inference_count(&a, "mlp_fp32").await, inference_count(&b, "mlp_fp32").await);
    assert_eq!(na + nb, 40);
    assert!(na > 0 && nb > 0, "every request went to one worker: {na} / {nb}");
    // Statistics through the gateway are the fleet's: the sum over both workers.
    let stats = through
        .model_statistics(ModelStatisticsRequest { name: "mlp_fp32".into(), version: String::new() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.model_stats.iter().map(|s| s.inference_count).sum::<u64>(), 40);
    let json: Value = reqwest::get(gateway.http_url("/v2/models/mlp_fp32/stats")).await.unwrap().json().await.unwrap();
    assert_eq!(json["model_stats"][0]["inference_count"], 40);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_worker_under_load_costs_only_its_in_flight_requests() {
    const CLIENTS: usize = 4;
    const PER_REQUEST: Duration = Duration::from_secs(10);
    let (mut a, b, gateway) = fleet().await;
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let hung = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let mut client = gateway.client().await;
        let (ok, failed, hung, stop) = (ok.clone(), failed.clone(), hung.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            let mut i = 0usize;
            // Bounded: stops when told, or after 100 000 requests whatever happens.
            while !stop.load(Ordering::Relaxed) && i < 100_000 {
                i += 1;
                let req = fp32_request("identity_fp32", "", &[1, 16], |j| (c * 1000 + i + j) as f32);
                match tokio::time::timeout(PER_REQUEST, client.model_infer(req.clone())).await {
                    Ok(Ok(r)) => {
                        assert_eq!(r.into_inner().raw_output_contents[0], req.raw_input_contents[0]);
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Err(e)) => {
                        eprintln!("request failed: {e:?}");
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => {
                        hung.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    // Load is flowing to both workers.
    wait_until("requests on both workers", Duration::from_secs(30), || async {
        inference_count(&a, "identity_fp32").await > 20 && inference_count(&b, "identity_fp32").await > 20
    })
    .await;
    a.child.kill().unwrap(); // SIGKILL: no drain, connections reset.
    a.child.wait().unwrap();
    let at_kill = ok.load(Ordering::Relaxed);
    wait_until("200 more successes after the kill", Duration::from_secs(60), || async {
        ok.load(Ordering::Relaxed) >= at_kill + 200
    })
    .await;
    wait_until("the dead worker to leave the routing table", Duration::from_secs(30), || async {
        gateway.metric("nereid_gateway_workers{state=\"unreachable\"}").await == Some(1.0)
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        tokio::time::timeout(PER_REQUEST * 2, c).await.expect("a client loop hung").unwrap();
    }
    let (failed, hung) = (failed.load(Ordering::Relaxed), hung.load(Ordering::Relaxed));
    assert_eq!(hung, 0, "requests hung");
    assert!(failed <= CLIENTS as u64, "{failed} failures: more than the {CLIENTS} requests that can be in flight");
    // Requests that found the dead worker's connection refused were retried elsewhere.
    let retries = gateway.metric_sum("nereid_gateway_retries_total").await;
    let labelled = gateway.metric("nereid_gateway_retries_total{model=\"identity_fp32\",version=\"1\"}").await;
    assert_eq!(labelled.unwrap_or(0.0), retries, "retries are labelled with the model and version");
    let ejections = gateway.metric("nereid_gateway_ejections_total").await.unwrap();
    eprintln!("after the kill: {failed} failed, {retries} retried, {ejections} ejections");
    // Everything now goes to the survivor.
    let before = inference_count(&b, "identity_fp32").await;
    let mut client = gateway.client().await;
    for _ in 0..10 {
        client.model_infer(fp32_request("identity_fp32", "", &[1, 16], |_| 1.0)).await.unwrap();
    }
    assert_eq!(inference_count(&b, "identity_fp32").await, before + 10);
}

/// `identity_fp32` on a worker that holds every request in its queue for 10 minutes (a stalled
/// worker, as far as the gateway can tell).
const STALLED_IDENTITY: &str = r#"
name: "identity_fp32"
backend: "onnxruntime"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
dynamic_batching { preferred_batch_size: [ 8 ] max_queue_delay_microseconds: 600000000 }
"#;

/// Ejection after two failures in a row, for a minute (it outlasts each test).
const EJECT_AFTER_TWO_FOR_A_MINUTE: [&str; 6] =
    ["--ejection-consecutive-failures", "2", "--ejection-base-ms", "60000", "--ejection-max-ms", "60000"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_eject_a_worker_only_when_the_gateways_own_limit_set_the_deadline() {
    let repo = common::identity_repo(&[("identity_fp32", STALLED_IDENTITY)]);
    let stalled = start_worker(repo.path(), &[]).await;
    // One worker only: its ejection shows in the counter, and (all holders ejected) requests
    // still go to it, so every phase below reaches it.
    let gateway =
        start_gateway(&[&stalled], &[&["--request-timeout-ms", "800"][..], &EJECT_AFTER_TWO_FOR_A_MINUTE].concat())
            .await;
    let mut client = gateway.client().await;
    let ejected = || gateway.metric("nereid_gateway_workers{state=\"ejected\"}");

    // Clients' own deadlines, tighter than the gateway's limit: a timeout may be theirs, not
    // the worker's fault — no ejection for 6 in a row (it takes 4 × 2, below).
    for _ in 0..3 {
        // Sent as the header, not `grpc-timeout`: tonic's client enforces a `grpc-timeout`
        // itself, and on a slow machine its own timer (CANCELLED) may beat the gateway's answer.
        let mut req = tonic::Request::new(fp32_request("identity_fp32", "", &[1, 16], |_| 1.0));
        req.metadata_mut().insert("x-nereid-deadline-ms", "150".parse().unwrap());
        let e = client.model_infer(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
        let r = gateway.json_infer("identity_fp32", Some(150)).await;
        assert_eq!(r.status(), 504, "{:?}", r.text().await);
    }
    assert_eq!(gateway.metric("nereid_gateway_ejections_total").await, Some(0.0));
    assert_eq!(ejected().await, Some(0.0));

    // No client deadline: the gateway's 800 ms limit applies, and a worker that runs into it
    // twice in a row is failing — ejected.
    for _ in 0..2 {
        let e = client.model_infer(fp32_request("identity_fp32", "", &[1, 16], |_| 1.0)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    }
    wait_until("the stalled worker to be ejected", Duration::from_secs(5), || async {
        gateway.metric("nereid_gateway_ejections_total").await == Some(1.0) && ejected().await == Some(1.0)
    })
    .await;
}

/// A hung worker (a stuck model still answers PINGs and readiness polls) whose every request
/// runs into its client's own deadline is ejected once that happened 4 × the failure threshold
/// in a row with no answer for --ejection-hung-after-ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_every_client_deadline_runs_out_on_is_ejected() {
    let repo = common::identity_repo(&[("identity_fp32", STALLED_IDENTITY)]);
    let stalled = start_worker(repo.path(), &[]).await;
    // A hung-after shorter than the 8 timeouts below take (100 ms each, one after the other).
    let hung = ["--ejection-hung-after-ms", "500"];
    let gateway = start_gateway(&[&stalled], &[&EJECT_AFTER_TWO_FOR_A_MINUTE[..], &hung].concat()).await;
    let mut client = gateway.client().await;
    for i in 0..8 {
        assert_eq!(gateway.metric("nereid_gateway_ejections_total").await, Some(0.0), "after {i}");
        let mut req = tonic::Request::new(fp32_request("identity_fp32", "", &[1, 16], |_| 1.0));
        req.metadata_mut().insert("x-nereid-deadline-ms", "100".parse().unwrap());
        let e = client.model_infer(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    }
    wait_until("the hung worker to be ejected", Duration::from_secs(5), || async {
        gateway.metric("nereid_gateway_ejections_total").await == Some(1.0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_a_full_queue_is_retried_elsewhere_and_a_429_says_when_to_retry() {
    // Worker `full` holds a queue of one; a request sent straight to it fills it (and stays
    // for 20 s). Every later request there is refused at once with RESOURCE_EXHAUSTED — never
    // run, so the gateway retries it on `ok`.
    let config = STALLED_IDENTITY.replace(
        "max_queue_delay_microseconds: 600000000 }",
        "max_queue_delay_microseconds: 600000000 default_queue_policy { max_queue_size: 1 } }",
    );
    let repo = common::identity_repo(&[("identity_fp32", &config)]);
    let full = start_worker(repo.path(), &[]).await;
    let ok = start_worker(&example_models(), &["identity_fp32"]).await;
    let mut direct = full.client().await;
    let filler = tokio::spawn(async move {
        let mut req = tonic::Request::new(fp32_request("identity_fp32", "", &[1, 16], |_| 0.0));
        req.set_timeout(Duration::from_secs(600));
        direct.model_infer(req).await
    });
    wait_until("the stalled worker's queue to fill", Duration::from_secs(10), || async {
        full.metric("nv_inference_pending_request_count{model=\"identity_fp32\",version=\"1\"}").await == Some(1.0)
    })
    .await;

    let gateway = start_gateway(&[&full, &ok], &[]).await;
    let mut client = gateway.client().await;
    // Equal loads: each request picks either worker at random, so some pick `full`.
    for i in 0..20 {
        let r = client.model_infer(fp32_request("identity_fp32", "", &[1, 16], |j| (i + j) as f32)).await;
        assert!(r.is_ok(), "request {i}: {r:?}");
    }
    assert_eq!(inference_count(&ok, "identity_fp32").await, 20, "every request ran on the worker with room");
    let retried = gateway.metric("nereid_gateway_retries_total{model=\"identity_fp32\",version=\"1\"}").await;
    assert!(retried.is_some_and(|n| n >= 1.0), "retries: {retried:?}");

    // With nowhere else to go, the refusal reaches the client: 429 with Retry-After over HTTP.
    let alone = start_gateway(&[&full], &[]).await;
    let r = alone.json_infer("identity_fp32", None).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("1"));
    assert!(r.text().await.unwrap().contains("queue"));
    filler.abort();
}

/// A request the worker's queue policy timed out never ran: it is retried on another worker,
/// unless the wait the client allowed itself (the KServe `timeout` parameter) has passed by
/// then — the client gets the worker's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_timeout_is_retried_elsewhere_unless_the_clients_own_timeout_passed() {
    let config = STALLED_IDENTITY.replace(
        "max_queue_delay_microseconds: 600000000 }",
        "max_queue_delay_microseconds: 600000000 default_queue_policy { timeout_action: REJECT \
         default_timeout_microseconds: 200000 allow_timeout_override: true } }",
    );
    let repo = common::identity_repo(&[("identity_fp32", &config)]);
    let a = start_worker(repo.path(), &[]).await;
    let b = start_worker(repo.path(), &[]).await;
    let gateway = start_gateway(&[&a, &b], &[]).await;
    let mut client = gateway.client().await;
    let retries = || gateway.metric("nereid_gateway_retries_total{model=\"identity_fp32\",version=\"1\"}");
    let timed_out =
        |e: &tonic::Status| e.code() == tonic::Code::Unavailable && e.message() == "Request timeout expired";
    let with_timeout = |us: Option<u64>| {
        let mut request = fp32_request("identity_fp32", "", &[1, 16], |_| 0.0);
        if let Some(us) = us {
            let p = InferParameter { parameter_choice: Some(infer_parameter::ParameterChoice::Uint64Param(us)) };
            request.parameters.insert("timeout".into(), p);
        }
        request
    };

    // The model's default timeout (the worker's limit, 200 ms): tried on both workers.
    let e = client.model_infer(with_timeout(None)).await.unwrap_err();
    assert!(timed_out(&e), "{e:?}");
    assert_eq!(retries().await, Some(1.0));
    // The client's own 100 ms (shorter, and the model allows overriding): spent when the first
    // worker answers — not retried.
    let e = client.model_infer(with_timeout(Some(100_000))).await.unwrap_err();
    assert!(timed_out(&e), "{e:?}");
    assert_eq!(retries().await, Some(1.0), "retried past the client's own timeout");
    // A client timeout of 10 s: the worker's 200 ms fired first, so the client's wait is not
    // spent — retried.
    let e = client.model_infer(with_timeout(Some(10_000_000))).await.unwrap_err();
    assert!(timed_out(&e), "{e:?}");
    assert_eq!(retries().await, Some(2.0));
    // Five refusals in all: two, one, two.
    let series = "nv_inference_request_failure{model=\"identity_fp32\",version=\"1\",reason=\"REJECTED\"}";
    let failed = a.metric(series).await.unwrap_or(0.0) + b.metric(series).await.unwrap_or(0.0);
    assert_eq!(failed, 5.0);
}

/// A request naming no version is pinned to the version the gateway's table resolved. When
/// the worker has replaced that version before the table caught up (a rollout), the request is
/// not failed NOT_FOUND: it goes again unpinned and the worker's latest answers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_replaced_before_the_table_caught_up_is_served_by_the_latest() {
    let worker = start_worker(&example_models(), &["versioned_scale"]).await;
    // The table is read once at start and not again during the test.
    let gateway = start_gateway(&[&worker], &["--discovery-interval-ms", "3600000"]).await;
    let mut client = gateway.client().await;
    let request = || fp32_request("versioned_scale", "", &[1, 4], |_| 1.0);
    let before = client.model_infer(request()).await.unwrap().into_inner();
    assert_eq!(before.model_version, "2");

    // The worker now serves version 1 only; the gateway's table still says 2.
    let config = json!({
        "name": "versioned_scale", "backend": "onnxruntime", "max_batch_size": 16,
        "version_policy": {"specific": {"versions": [1]}},
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]}],
    });
    let load = reqwest::Client::new()
        .post(worker.http_url("/v2/repository/models/versioned_scale/load"))
        .json(&json!({"parameters": {"config": config.to_string()}}))
        .send()
        .await
        .unwrap();
    assert_eq!(load.status(), 200, "{}", load.text().await.unwrap());
    let after = client.model_infer(request()).await.expect("served by the worker's latest version").into_inner();
    assert_eq!(after.model_version, "1");
    // A client that names the gone version still hears that it is gone.
    let named = client.model_infer(fp32_request("versioned_scale", "2", &[1, 4], |_| 1.0)).await.unwrap_err();
    assert_eq!(named.code(), tonic::Code::NotFound, "{named:?}");
    // Metadata, config and readiness asked for no version are asked for the routed version
    // too, and likewise answered by the worker's latest instead of failing.
    use nereid_proto::inference::{ModelConfigRequest, ModelMetadataRequest, ModelReadyRequest};
    let name = || "versioned_scale".to_string();
    let metadata = client.model_metadata(ModelMetadataRequest { name: name(), version: String::new() }).await;
    assert_eq!(metadata.expect("metadata of the latest").into_inner().name, "versioned_scale");
    let config = client.model_config(ModelConfigRequest { name: name(), version: String::new() }).await;
    assert_eq!(config.expect("config of the latest").into_inner().config.unwrap().name, "versioned_scale");
    let ready = client.model_ready(ModelReadyRequest { name: name(), version: String::new() }).await;
    assert!(ready.expect("readiness of the latest").into_inner().ready);
    let http = reqwest::get(gateway.http_url("/v2/models/versioned_scale/ready")).await.unwrap();
    assert_eq!(http.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_draining_on_sigterm_under_load_fails_no_request() {
    const CLIENTS: usize = 4;
    let (mut a, b, gateway) = fleet().await;
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for c in 0..CLIENTS {
        let mut client = gateway.client().await;
        let (ok, failed, stop, errors) = (ok.clone(), failed.clone(), stop.clone(), errors.clone());
        clients.push(tokio::spawn(async move {
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) && i < 100_000 {
                i += 1;
                let req = fp32_request("mlp_fp32", "", &[1, 256], |j| ((c + i + j) % 7) as f32);
                match tokio::time::timeout(Duration::from_secs(10), client.model_infer(req)).await {
                    Ok(Ok(_)) => ok.fetch_add(1, Ordering::Relaxed),
                    Ok(Err(e)) => {
                        errors.lock().unwrap().push(format!("{:?}: {}", e.code(), e.message()));
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                    Err(_) => {
                        errors.lock().unwrap().push("hung".into());
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        }));
    }
    wait_until("requests on both workers", Duration::from_secs(30), || async {
        inference_count(&a, "mlp_fp32").await > 20 && inference_count(&b, "mlp_fp32").await > 20
    })
    .await;
    a.terminate();
    assert_eq!(a.wait_exit(Duration::from_secs(30)), Some(0), "{}", a.log());
    let at_exit = ok.load(Ordering::Relaxed);
    wait_until("100 more successes after the drain", Duration::from_secs(60), || async {
        ok.load(Ordering::Relaxed) >= at_exit + 100
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        tokio::time::timeout(Duration::from_secs(20), c).await.expect("a client loop hung").unwrap();
    }
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "a graceful drain must fail no request: {:?}\nworker log:\n{}\ngateway log:\n{}",
        errors.lock().unwrap(),
        a.log(),
        gateway.log()
    );
}

/// Infer bytes go through undecoded: the gateway checks only the top-level framing (refusing a
/// broken message itself, naming the field), the worker refuses a malformed tensor; either way
/// INVALID_ARGUMENT, and everyone else keeps being served. A failed request on a stream is an
/// error message carrying the request's id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_protobuf_is_refused_and_the_gateway_keeps_serving() {
    use nereid_gateway::wire::BytesCodec;
    use prost::Message;

    let (_a, _b, gateway) = fleet().await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", gateway.grpc_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let send = |body: Vec<u8>| {
        let channel = channel.clone();
        async move {
            let mut grpc = tonic::client::Grpc::new(channel);
            grpc.ready().await.unwrap();
            let path =
                tonic::codegen::http::uri::PathAndQuery::from_static("/inference.GRPCInferenceService/ModelInfer");
            grpc.unary(tonic::Request::new(bytes::Bytes::from(body)), path, BytesCodec::<bytes::Bytes>::default()).await
        }
    };

    let good = fp32_request("identity_fp32", "", &[1, 16], |i| i as f32).encode_to_vec();
    // Cut inside the tensor bytes: the top-level framing is broken, the gateway refuses it.
    let e = send(good[..good.len() - 5].to_vec()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("malformed ModelInferRequest") && e.message().contains("past the end"), "{e:?}");
    // model_name encoded as a number.
    let e = send(vec![0x08, 0x01]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("model_name"), "{e:?}");

    // Sound framing, garbage inside `inputs` (field 5): the worker decodes and refuses it.
    let mut nested = ModelInferRequest { model_name: "identity_fp32".into(), ..Default::default() }.encode_to_vec();
    nested.extend([0x2a, 0x03, 0xff, 0xff, 0xff]);
    let e = send(nested).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    // The good bytes, through the same raw path: answered, bit for bit the input.
    let answer = ModelInferResponse::decode(send(good).await.unwrap().into_inner()).unwrap();
    assert_eq!(answer.model_name, "identity_fp32");
    let want: Vec<u8> = (0..16).flat_map(|i| (i as f32).to_le_bytes()).collect();
    assert_eq!(answer.raw_output_contents[0], want);

    // The other methods: malformed protobuf is INVALID_ARGUMENT (as a worker answers it, not
    // tonic's INTERNAL); a message past the small bound of settings RESOURCE_EXHAUSTED.
    let control = |path: &'static str, body: Vec<u8>| {
        let channel = channel.clone();
        async move {
            let mut grpc = tonic::client::Grpc::new(channel);
            grpc.ready().await.unwrap();
            let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
            grpc.unary(tonic::Request::new(bytes::Bytes::from(body)), path, BytesCodec::<bytes::Bytes>::default()).await
        }
    };
    let e = control("/inference.GRPCInferenceService/ModelMetadata", vec![0x0a, 0x05, b'x']).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let huge_name = ModelConfigRequest { name: "m".repeat(100_000), ..Default::default() }.encode_to_vec();
    let e = control("/inference.GRPCInferenceService/ModelConfig", huge_name).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    // Compressed (a client compressing on the whole channel): accepted, bounded once inflated.
    let mut gzip = grpc_inference_service_client::GrpcInferenceServiceClient::new(channel.clone())
        .send_compressed(tonic::codec::CompressionEncoding::Gzip);
    let name = gzip
        .model_metadata(ModelMetadataRequest { name: "identity_fp32".into(), ..Default::default() })
        .await
        .expect("a compressed control call")
        .into_inner()
        .name;
    assert_eq!(name, "identity_fp32");
    let e = gzip
        .model_config(ModelConfigRequest { name: "m".repeat(100_000), ..Default::default() })
        .await
        .expect_err("past 64 KiB once inflated");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    let metadata = ModelMetadataRequest { name: "identity_fp32".into(), ..Default::default() }.encode_to_vec();
    let answer = control("/inference.GRPCInferenceService/ModelMetadata", metadata).await.unwrap();
    assert_eq!(ModelMetadataResponse::decode(answer.into_inner()).unwrap().name, "identity_fp32");

    // A stream with one good and one unknown-model request: one answer, one error message.
    let mut through = gateway.client().await;
    let mut bad = fp32_request("no_such_model", "", &[1, 16], |_| 0.0);
    bad.id = "bad-1".into();
    let mut ok = fp32_request("identity_fp32", "", &[1, 16], |_| 1.0);
    ok.id = "ok-1".into();
    let stream = through.model_stream_infer(futures::stream::iter(vec![bad, ok])).await.unwrap().into_inner();
    let results: Vec<_> = futures::StreamExt::collect::<Vec<_>>(stream).await;
    let mut replies: Vec<ModelStreamInferResponse> = results.into_iter().map(Result::unwrap).collect();
    replies.sort_by_key(|r| r.infer_response.as_ref().unwrap().id.clone());
    assert!(replies[0].error_message.contains("no_such_model"), "{:?}", replies[0]);
    assert_eq!(replies[0].infer_response.as_ref().unwrap().id, "bad-1");
    assert_eq!(replies[1].error_message, "");
    assert_eq!(replies[1].infer_response.as_ref().unwrap().id, "ok-1");
}

/// A worker that stops answering discovery polls (SIGSTOP: a long pause) is unreachable, but
/// the models it listed stay known: a request for one is UNAVAILABLE — worth retrying — not
/// NOT_FOUND, until it answers again (SIGCONT) and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_misses_polls_leaves_its_models_unavailable_not_unknown() {
    let repo = example_models();
    let worker = start_worker(&repo, &["identity_fp32"]).await;
    let gateway = start_gateway(&[&worker], &["--discovery-interval-ms", "100", "--discovery-timeout-ms", "100"]).await;
    let mut client = gateway.client().await;
    let request = || fp32_request("identity_fp32", "", &[1, 16], |j| j as f32);
    client.model_infer(request()).await.expect("served before the pause");
    worker.signal("STOP");
    wait_until("the paused worker to be unreachable", Duration::from_secs(30), || async {
        gateway.metric("nereid_gateway_workers{state=\"unreachable\"}").await == Some(1.0)
    })
    .await;
    let e = client.model_infer(request()).await.unwrap_err();
    let stats =
        client.model_statistics(ModelStatisticsRequest { name: "identity_fp32".into(), ..Default::default() }).await;
    worker.signal("CONT");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    let e = stats.expect_err("statistics of a model only an unreachable worker lists");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    let e = client.model_infer(fp32_request("nope", "", &[1, 16], |_| 0.0)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "a model nobody listed is still unknown: {e:?}");
    wait_until("the worker to serve again", Duration::from_secs(30), || async {
        client.clone().model_infer(request()).await.is_ok()
    })
    .await;
}
