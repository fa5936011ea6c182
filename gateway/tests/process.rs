//! The `nereid-gateway` binary as operators run it: flag errors name the flag; admission sheds
//! at once with RESOURCE_EXHAUSTED / 429 + Retry-After; deadlines propagate (the worker sees the
//! request cancelled); SIGTERM lets the request in flight finish, then exits 0.
//!
//! A "held" model (identity with a long batching delay) keeps a request in flight for a known
//! time without any sleep in the test: the test waits on the worker's pending-request gauge.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{Proc, fp32_request, identity_repo, start_gateway, start_worker, start_worker_with, wait_until};
use serde_json::json;

/// One request waits in the batcher for up to 3 s (until 4 arrive, which they never do).
const HELD: &str = r#"
name: "held"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
dynamic_batching { max_queue_delay_microseconds: 3000000 }
"#;

/// Same, for 60 s: only a deadline or a cancellation ends its requests within a test.
const STUCK: &str = r#"
name: "stuck"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
dynamic_batching { max_queue_delay_microseconds: 60000000 }
"#;

/// Awaits an answer that must come before `stuck`'s 60 s hold ends (a bound, not a timing
/// assertion: a call that waited for the hold fails here).
async fn before_the_hold<T>(answer: impl std::future::Future<Output = T>) -> T {
    const BOUND: Duration = Duration::from_secs(30);
    tokio::time::timeout(BOUND, answer)
        .await
        .unwrap_or_else(|_| panic!("no answer within {BOUND:?}: it waited for the hold"))
}

const STUCK_PENDING: &str = "nv_inference_pending_request_count{model=\"stuck\",version=\"1\"}";

/// Runs the binary with `args` (and free ports), bounded: one that fails to refuse its flags
/// fails the test instead of serving on.
fn run_cli(args: &[&str]) -> (i32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nereid-gateway"));
    cmd.args(nereid_common::testing::with_free_ports(args));
    nereid_common::testing::run_bounded(cmd, &format!("nereid-gateway {args:?}"), Duration::from_secs(60), || {})
        .code_and_text()
}

#[test]
fn invalid_flags_exit_non_zero_naming_the_flag() {
    for (args, flag) in [
        (vec!["--http-port", "0"], "--worker-grpc"),
        (vec!["--worker-grpc", "nohost"], "--worker-grpc"),
        (vec!["--worker-grpc", "http://h:1"], "--worker-grpc"),
        (vec!["--worker-grpc", "h:1", "--worker-grpc", "h:1"], "--worker-grpc"),
        (vec!["--worker-grpc", "h:1", "--max-concurrent-requests", "0"], "--max-concurrent-requests"),
        (vec!["--worker-grpc", "h:1", "--retry-budget-percent", "101"], "--retry-budget-percent"),
        (vec!["--worker-grpc", "h:1", "--request-timeout-ms", "x"], "--request-timeout-ms"),
        (vec!["--worker-grpc", "h:1", "--request-timeout-ms", "18446744073709551615"], "--request-timeout-ms"),
        (vec!["--worker-grpc", "h:1", "--max-request-bytes", "2147483648"], "--max-request-bytes"),
        (vec!["--worker-grpc", "h:1", "--ejection-base-ms", "5000", "--ejection-max-ms", "10"], "--ejection-max-ms"),
        (vec!["--worker-grpc", "h:1", "--no-such-flag"], "--no-such-flag"),
        (vec!["--etcd-endpoints", "127.0.0.1:2379"], "--etcd-endpoints"),
        (vec!["--etcd-endpoints", "http://h:1", "--worker-grpc", "h:1"], "--worker-grpc"),
        (vec!["--etcd-endpoints", "http://h:1", "--etcd-prefix", "x"], "--etcd-prefix"),
        (vec!["--etcd-endpoints", "http://h:1", "--gateway-id", "a b"], "--gateway-id"),
        (vec!["--etcd-endpoints", "http://h:1", "--election-ttl-secs", "0"], "--election-ttl-secs"),
        (vec!["--worker-grpc", "h:1", "--io-threads", "x"], "--io-threads"),
    ] {
        let (code, output) = run_cli(&args);
        assert_ne!(code, 0, "{args:?} should fail");
        assert!(output.contains(flag), "{args:?}: output does not name {flag}:\n{output}");
    }
    let (code, help) = run_cli(&["--help"]);
    assert_eq!(code, 0);
    for flag in [
        "--worker-grpc",
        "--http-port",
        "--grpc-port",
        "--metrics-port",
        "--address",
        "--port-file",
        "--request-timeout-ms",
        "--max-concurrent-requests",
        "--retry-budget-percent",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
}

async fn held_fleet(gateway_flags: &[&str]) -> (Proc, Proc) {
    let repo = identity_repo(&[("held", HELD), ("stuck", STUCK)]);
    let worker = start_worker(repo.path(), &[]).await;
    let gateway = start_gateway(&[&worker], gateway_flags).await;
    // The worker has loaded the repository: the temporary copy may go.
    drop(repo);
    (worker, gateway)
}

/// One request for `stuck` sent through the gateway, once the worker holds it (60 s, unless
/// the test completes its batch of 4 rows or lets it go): where its answer comes.
async fn held_at_worker(
    worker: &Proc,
    gateway: &Proc,
) -> tokio::task::JoinHandle<Result<tonic::Response<nereid_proto::inference::ModelInferResponse>, tonic::Status>> {
    let mut client = gateway.client().await;
    let held = tokio::spawn(async move { client.model_infer(fp32_request("stuck", "", &[1, 16], |i| i as f32)).await });
    wait_until("the request to be held at the worker", Duration::from_secs(10), || async {
        worker.metric(STUCK_PENDING).await == Some(1.0)
    })
    .await;
    held
}

/// A client that sends its headers and then trickles (here: stops) its body — of an infer
/// request or of the repository index — is answered 504 once the request's deadline passes,
/// instead of holding its buffer for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_http_upload_ends_at_the_deadline() {
    let (_worker, gateway) = held_fleet(&[]).await;
    let answer = headers_only_http(&gateway, "/v2/models/held/infer", "x-nereid-deadline-ms: 300\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 504"), "{answer}");
    assert!(answer.contains("before its body was received"), "{answer}");
    // The repository index's body (a setting) is read within the deadline too.
    let answer = headers_only_http(&gateway, "/v2/repository/index", "x-nereid-deadline-ms: 300\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 504"), "{answer}");
    assert!(answer.contains("before its body was received"), "{answer}");
}

/// A request for a model no worker serves is answered 404 before its body is read (here: never
/// sent, under a deadline of a minute); an index request's body is only a setting, bounded small.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_models_are_refused_before_the_body_and_settings_bodies_are_small() {
    let (_worker, gateway) = held_fleet(&[]).await;
    let answer = headers_only_http(&gateway, "/v2/models/nope/infer", "x-nereid-deadline-ms: 60000\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    let answer =
        headers_only_http(&gateway, "/v2/models/held/versions/9/infer", "x-nereid-deadline-ms: 60000\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    let big = format!(r#"{{"ready": true, "pad": "{}"}}"#, "x".repeat(nereid_worker::http::SMALL_BODY_BYTES));
    let response =
        reqwest::Client::new().post(gateway.http_url("/v2/repository/index")).body(big).send().await.unwrap();
    assert_eq!(response.status(), 400);
    assert!(response.text().await.unwrap().contains("exceeds the limit of 65536 bytes"));
    let response =
        reqwest::Client::new().post(gateway.http_url("/v2/repository/index")).body("{}").send().await.unwrap();
    assert_eq!(response.status(), 200);
}

/// Each JSON tensor fits --max-request-bytes, but the tensors together do not (as a worker
/// reads them, before anything is converted): a 400 naming the limit, nothing forwarded, and
/// the gateway keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_request_whose_tensors_together_outgrow_the_limit_is_refused() {
    let (_worker, gateway) = held_fleet(&["--max-request-bytes", "1048576"]).await;
    // 140,000 zeros per input: 280 KB of JSON each, 560 KB as FP32 each, 1.12 MB together.
    let zeros = vec![0; 140_000];
    let body = json!({"inputs": [
        {"name": "INPUT0", "shape": [8750, 16], "datatype": "FP32", "data": zeros},
        {"name": "INPUT1", "shape": [8750, 16], "datatype": "FP32", "data": zeros},
    ]});
    let r = reqwest::Client::new().post(gateway.http_url("/v2/models/stuck/infer")).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let text = r.text().await.unwrap();
    assert!(text.contains("the request limit of 1048576 bytes"), "{text}");
    // Refused before the stack, yet counted like what the stack refuses.
    let metrics = gateway.metrics_text().await;
    assert!(
        metrics.contains(r#"nereid_gateway_requests_total{code="INVALID_ARGUMENT",model="stuck",version="1"} 1"#),
        "{metrics}"
    );
    // A full batch (max_batch_size 4) runs at once despite the model's long queue delay.
    let out = gateway.client().await.model_infer(fp32_request("stuck", "", &[4, 16], |i| i as f32)).await;
    assert_eq!(out.expect("served").into_inner().raw_output_contents[0].len(), 256);
}

/// A JSON request that fits --max-request-bytes once converted, but not with the version pin
/// forwarding appends to it, is refused by the gateway with a 400 naming the limit — a worker
/// with the same limit would refuse it as too large, which reached the client as a 429 to
/// retry. One with room for the pin is served. The same holds for a gRPC request, forwarded
/// as the client encoded it (INVALID_ARGUMENT naming the limit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_room_for_what_forwarding_appends_is_refused_at_the_gateway() {
    use nereid_proto::inference::ModelInferRequest;
    use nereid_proto::inference::model_infer_request::InferInputTensor;
    use prost::Message;

    const MAX: usize = 1 << 20;
    const ROWS: usize = 16_000; // 1,024,000 bytes of FP32: 16,000 rows of 16 zeros
    let big = HELD
        .replace("\"held\"", "\"big\"")
        .replace("max_batch_size: 4", "max_batch_size: 16000")
        .replace("dynamic_batching { max_queue_delay_microseconds: 3000000 }", "");
    let repo = identity_repo(&[("big", &big)]);
    let limit = ["--max-request-bytes", "1048576"];
    let worker = start_worker_with(repo.path(), &[], &limit).await;
    let gateway = start_gateway(&[&worker], &limit).await;
    // The gRPC message the gateway makes of the JSON request below (and a gRPC client sends),
    // with `id`.
    let big = |id: String| ModelInferRequest {
        model_name: "big".into(),
        id,
        inputs: vec![InferInputTensor {
            name: "INPUT0".into(),
            datatype: "FP32".into(),
            shape: vec![ROWS as i64, 16],
            ..Default::default()
        }],
        raw_input_contents: vec![vec![0u8; ROWS * 64].into()],
        ..Default::default()
    };
    // Its size with an id of `n` bytes.
    let encoded = |n: usize| big("x".repeat(n)).encoded_len();
    // An id costs its length plus its tag and length prefix (a few bytes).
    let id_for = |size: usize| {
        let mut n = size - encoded(0);
        while encoded(n) > size {
            n -= 1;
        }
        assert_eq!(encoded(n), size);
        "x".repeat(n)
    };
    // Written by hand: "datatype" before "data", as tritonclient writes them (json! sorts keys).
    let zeros = vec!["0"; ROWS * 16].join(",");
    let send = |id: String| {
        let body = format!(
            r#"{{"id":"{id}","inputs":[{{"name":"INPUT0","shape":[{ROWS},16],"datatype":"FP32","data":[{zeros}]}}]}}"#
        );
        reqwest::Client::new().post(gateway.http_url("/v2/models/big/infer")).body(body).send()
    };
    // One byte under the limit: the pin (3 bytes) would take it over.
    let r = send(id_for(MAX - 1)).await.unwrap();
    assert_eq!(r.status(), 400);
    let text = r.text().await.unwrap();
    assert!(text.contains("over the limit of 1048576 bytes"), "{text}");
    // With room for what forwarding adds: served.
    let r = send(id_for(MAX - 64)).await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());

    // The same over gRPC, where the client's message is forwarded as it is.
    let grpc = |id: String| {
        let request = big(id);
        async { gateway.client().await.max_encoding_message_size(usize::MAX).model_infer(request).await }
    };
    let status = grpc(id_for(MAX - 1)).await.expect_err("no room for the version pin");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("over the limit of 1048576 bytes"), "{status:?}");
    let served = grpc(id_for(MAX - 64)).await.expect("room for what forwarding adds");
    assert_eq!(served.into_inner().raw_output_contents[0].len(), ROWS * 64);
    // Over the limit itself: refused by the gRPC layer before the message is handed on, and
    // counted in the request metrics like the gateway's own refusals.
    let status = grpc(id_for(MAX + 100)).await.expect_err("over the limit");
    // As a worker answers it (tonic's own OUT_OF_RANGE remapped).
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    let label = nereid_gateway::error::code_label(status.code());
    let series = format!("nereid_gateway_requests_total{{code=\"{label}\",model=\"_unread\",version=\"\"}} 1");
    let text = gateway.metrics_text().await;
    assert!(text.contains(&series), "{status:?}\n{text}");
    // Compressed: bounded once inflated (on the blocking pool, not the event loop), refused
    // as a worker refuses it and counted alike; a compressed request within it is served.
    let gzip = |request| async {
        let client = gateway.client().await.send_compressed(tonic::codec::CompressionEncoding::Gzip);
        client.max_encoding_message_size(usize::MAX).model_infer(request).await
    };
    let mut bomb = big("compressed".into());
    bomb.raw_input_contents[0] = vec![0u8; 2 * MAX].into();
    let status = gzip(bomb).await.expect_err("past the limit once inflated");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("limit of 1048576 bytes"), "{status:?}");
    let series = format!("nereid_gateway_requests_total{{code=\"{label}\",model=\"_unread\",version=\"\"}} 2");
    let text = gateway.metrics_text().await;
    assert!(text.contains(&series), "{status:?}\n{text}");
    let served = gzip(big("compressed".into())).await.expect("a compressed request within the limit");
    assert_eq!(served.into_inner().raw_output_contents[0].len(), ROWS * 64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_sheds_at_once_beyond_the_limit() {
    let (worker, gateway) = held_fleet(&["--max-concurrent-requests", "1"]).await;
    // `stuck` holds its request for 60 s: the only place stays taken until the test lets go.
    let held = held_at_worker(&worker, &gateway).await;

    // gRPC: RESOURCE_EXHAUSTED, at once: not after the held request's 60 s.
    let e = before_the_hold(gateway.client().await.model_infer(fp32_request("held", "", &[1, 16], |_| 0.0)))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    // HTTP: 429 with Retry-After.
    let r = gateway.json_infer("held", None).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    assert!(r.text().await.unwrap().contains("limit of 1 concurrent requests"));

    // Refused before the body is read: a client that sent only its headers is answered at
    // once, not when its (20 s) deadline ends the wait for a body that never comes.
    let answer = headers_only_http(&gateway, "/v2/models/held/infer", "x-nereid-deadline-ms: 20000\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    // Over gRPC too: the answer (trailers-only) comes while the message is still unsent.
    let (status, message) = headers_only_grpc(&gateway, &[]).await;
    assert_eq!(status.as_deref(), Some("8"), "{message:?}"); // RESOURCE_EXHAUSTED
    assert!(message.unwrap_or_default().contains("limit of 1 concurrent requests"));

    let text = gateway.metrics_text().await;
    assert!(
        // Named no version: counted against the one they resolved to.
        text.contains("nereid_gateway_requests_total{code=\"RESOURCE_EXHAUSTED\",model=\"held\",version=\"1\"} 2"),
        "{text}"
    );
    // gRPC names the model in the body, which a refused request never has read.
    assert!(
        text.contains("nereid_gateway_requests_total{code=\"RESOURCE_EXHAUSTED\",model=\"_unread\",version=\"\"} 2"),
        "{text}"
    );

    // The client goes away: the gateway cancels the forwarded call and the place is free again
    // (a request is admitted, and ends at its 100 ms deadline in the batcher, which holds it).
    held.abort();
    wait_until("the place to be given back", Duration::from_secs(10), || async {
        let r = gateway.json_infer("held", Some(100)).await;
        r.status() == 504
    })
    .await;
}

/// A gRPC client that sends its headers and then nothing holds its admission place until its
/// deadline, no longer: DEADLINE_EXCEEDED, and the next request is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_grpc_upload_gives_its_place_back_at_the_deadline() {
    let (_worker, gateway) = held_fleet(&["--max-concurrent-requests", "1"]).await;
    let (status, message) = headers_only_grpc(&gateway, &[("grpc-timeout", "300m")]).await;
    assert_eq!(status.as_deref(), Some("4"), "{message:?}"); // DEADLINE_EXCEEDED
    assert!(message.unwrap_or_default().contains("before its message was received"));
    // A full batch (max_batch_size 4) runs at once despite the model's long queue delay.
    let out = gateway.client().await.model_infer(fp32_request("stuck", "", &[4, 16], |i| i as f32)).await;
    assert_eq!(out.expect("admitted").into_inner().raw_output_contents[0].len(), 256);
}

/// Sends the head of a POST to `path` announcing a 1000-byte body that never comes; returns the
/// gateway's answer (at most 30 s).
async fn headers_only_http(gateway: &Proc, path: &str, extra_headers: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let url = gateway.http_url("/");
    let addr = url.trim_start_matches("http://").trim_end_matches('/').to_string();
    let mut socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: 1000\r\n{extra_headers}\r\n"
    );
    socket.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(30), socket.read(&mut answer))
        .await
        .expect("no answer within 30 s")
        .unwrap();
    String::from_utf8_lossy(&answer[..n]).to_string()
}

/// Opens a `ModelInfer` call on the gateway's gRPC port and sends its headers only; returns
/// the `grpc-status` and `grpc-message` the gateway answers with (at most 30 s).
async fn headers_only_grpc(gateway: &Proc, headers: &[(&str, &str)]) -> (Option<String>, Option<String>) {
    let addr = gateway.grpc_addr();
    let socket = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (client, connection) = h2::client::handshake(socket).await.unwrap();
    tokio::spawn(connection);
    let mut client = client.ready().await.unwrap();
    let mut request = http::Request::post(format!("http://{addr}/inference.GRPCInferenceService/ModelInfer"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(()).unwrap();
    // The stream stays open: no message, no end of stream.
    let (response, _send) = client.send_request(request, false).unwrap();
    let response =
        tokio::time::timeout(Duration::from_secs(30), response).await.expect("no answer within 30 s").unwrap();
    let header = |name: &str| response.headers().get(name).map(|v| v.to_str().unwrap().to_string());
    let message = header("grpc-message").map(|m| m.replace("%20", " "));
    (header("grpc-status"), message)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_propagate_to_the_worker() {
    let (worker, gateway) = held_fleet(&[]).await;
    // grpc-timeout: the gateway answers DEADLINE_EXCEEDED long before the batcher's 60 s, and
    // the worker sees the forwarded call cancelled (its request leaves the queue).
    let mut req = tonic::Request::new(fp32_request("stuck", "", &[1, 16], |_| 0.0));
    req.set_timeout(Duration::from_secs(5));
    let mut client = gateway.client().await;
    let call = tokio::spawn(async move { client.model_infer(req).await });
    // The call reached the worker (and waits in its queue) before its deadline passes.
    wait_until("the request to be queued at the worker", Duration::from_secs(5), || async {
        worker.metric(STUCK_PENDING).await == Some(1.0)
    })
    .await;
    let e = before_the_hold(call).await.unwrap().unwrap_err();
    // The gateway answers DEADLINE_EXCEEDED a few milliseconds before the client's own timer
    // (set from the same grpc-timeout) fires; on a loaded machine that timer can win the race,
    // and tonic reports it as CANCELLED "Timeout expired". Either way the call ended at the
    // deadline, not at the batcher's 60 s, and the worker must see it cancelled (below).
    let client_timer_won = e.code() == tonic::Code::Cancelled && e.message().contains("Timeout expired");
    assert!(e.code() == tonic::Code::DeadlineExceeded || client_timer_won, "{e:?}");
    // (The worker counts such a request as CANCELED — unless its own deadline and the
    // cancellation race, which its statistics can then miss: only the queue is checked.)
    wait_until("the request to leave the worker's queue", Duration::from_secs(20), || async {
        worker.metric(STUCK_PENDING).await == Some(0.0)
    })
    .await;

    // x-nereid-deadline-ms over HTTP: 504.
    let r = before_the_hold(gateway.json_infer("stuck", Some(1000))).await;
    assert_eq!(r.status(), 504);
    wait_until("the second request to leave the worker's queue", Duration::from_secs(20), || async {
        worker.metric(STUCK_PENDING).await == Some(0.0)
    })
    .await;
    let text = gateway.metrics_text().await;
    // Counted as DEADLINE_EXCEEDED — or, when the client's timer won above, possibly that one as
    // CANCELLED (the client went away before the gateway's answer was recorded).
    let count = |code: &str| {
        let series = format!("nereid_gateway_requests_total{{code=\"{code}\",model=\"stuck\",version=\"1\"}} ");
        text.lines().find_map(|l| l.strip_prefix(series.as_str())).map_or(0, |v| v.parse::<u64>().unwrap())
    };
    let (expired, cancelled) = (count("DEADLINE_EXCEEDED"), count("CANCELLED"));
    if client_timer_won {
        assert!(expired >= 1 && expired + cancelled == 2, "{text}");
    } else {
        assert_eq!(expired, 2, "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_request_in_flight_then_exits() {
    let (worker, mut gateway) = held_fleet(&[]).await;
    // Held at the worker until the test completes its batch, below.
    let held = held_at_worker(&worker, &gateway).await;
    gateway.terminate();
    // New connections are refused once intake stops...
    let url = gateway.http_url("/v2/health/live");
    wait_until("the gateway to stop accepting", Duration::from_secs(10), || async {
        reqwest::get(&url).await.is_err()
    })
    .await;
    // Prometheus can still scrape the drain...
    let text = gateway.metrics_text().await;
    assert!(text.contains("nereid_gateway_routing_table_age_seconds"), "metrics during the drain: {text:?}");
    assert!(!held.is_finished(), "the request is still in flight through the drain");
    // ...and the request in flight is answered once the worker runs it (three more rows, sent
    // to the worker directly, fill its batch), and then the gateway exits cleanly.
    let mut direct = worker.client().await;
    let filler = direct.model_infer(fp32_request("stuck", "", &[3, 16], |i| i as f32));
    before_the_hold(filler).await.expect("the rows that complete the batch");
    let out = before_the_hold(held).await.unwrap().expect("the in-flight request must complete").into_inner();
    assert_eq!(out.raw_output_contents[0].len(), 64);
    assert_eq!(gateway.wait_exit(Duration::from_secs(15)), Some(0), "{}", gateway.log());
}

/// The request in flight outlasts --exit-timeout-secs (the worker holds it 60 s): the gateway
/// exits anyway, with a status that says the drain was cut short.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_cut_short_by_the_exit_timeout_exits_non_zero() {
    let (worker, mut gateway) = held_fleet(&["--exit-timeout-secs", "1"]).await;
    let held = held_at_worker(&worker, &gateway).await;
    gateway.terminate();
    assert_eq!(gateway.wait_exit(Duration::from_secs(15)), Some(1), "{}", gateway.log());
    assert!(gateway.log().contains("did not finish within --exit-timeout-secs (1 s)"), "{}", gateway.log());
    held.await.unwrap().expect_err("the gateway left before the worker answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_on_a_thread_pool_as_on_one_event_loop() {
    let worker = common::start_worker(&common::example_models(), &["identity_fp32"]).await;
    for threads in ["0", "3"] {
        let gateway = common::start_gateway(&[&worker], &["--io-threads", threads]).await;
        let mut client = gateway.client().await;
        let resp = client.model_infer(common::fp32_request("identity_fp32", "", &[1, 16], |i| i as f32)).await;
        assert!(resp.is_ok(), "--io-threads {threads}: {resp:?}");
    }
}

/// Established IPv4 TCP connections whose remote end is `port` on this host (/proc/net/tcp).
fn connections_to(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[3] == "01" && f[2].rsplit(':').next() == Some(&format!("{port:04X}"))
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inference_spreads_over_the_upstream_connections() {
    let worker = common::start_worker(&common::example_models(), &["identity_fp32"]).await;
    let port: u16 = worker.grpc_addr().rsplit(':').next().unwrap().parse().unwrap();
    let mut seen = Vec::new();
    for lanes in ["1", "3"] {
        let before = connections_to(port);
        let gateway = common::start_gateway(&[&worker], &["--upstream-connections", lanes]).await;
        let client = gateway.client().await;
        let calls =
            (0..12).map(|n| {
                let mut client = client.clone();
                async move {
                    client.model_infer(common::fp32_request("identity_fp32", "", &[1, 16], |i| (i + n) as f32)).await
                }
            });
        for (n, resp) in futures::future::join_all(calls).await.into_iter().enumerate() {
            let out = resp.unwrap_or_else(|e| panic!("--upstream-connections {lanes}: {e}")).into_inner();
            let values: Vec<f32> =
                out.raw_output_contents[0].chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            assert_eq!(values, (0..16).map(|i| (i + n) as f32).collect::<Vec<_>>(), "call {n} got another's answer");
        }
        seen.push(connections_to(port) - before);
        drop(gateway);
        wait_until("the gateway's connections closed", Duration::from_secs(10), || async {
            connections_to(port) <= before
        })
        .await;
    }
    // The control channel (health polls) adds one either way.
    assert_eq!(seen[1], seen[0] + 2, "connections to the worker with 1 and 3 lanes: {seen:?}");
}

/// A gateway started with a low soft limit on open files (1024 under systemd and many container
/// runtimes) raises it to the hard limit at start: every client and worker connection holds a
/// descriptor.
#[test]
fn the_gateway_raises_its_open_files_limit_to_the_hard_limit() {
    let (_, hard) = nereid_common::limits::open_files_limits_of(std::process::id()).expect("/proc/self/limits");
    if hard <= 256 {
        eprintln!("skipped: the hard open-files limit here is {hard}, no lower soft limit to start from");
        return;
    }
    // `exec`: the shell becomes the gateway, so the child's pid is the gateway's.
    let args: Vec<String> = ["-c", "ulimit -S -n 256 && exec \"$0\" \"$@\"", env!("CARGO_BIN_EXE_nereid-gateway")]
        .into_iter()
        .chain(["--worker-grpc", "127.0.0.1:1"])
        .map(String::from)
        .collect();
    let gateway = Proc::spawn("gateway", std::path::Path::new("/bin/sh"), &args, &[]);
    assert_eq!(
        nereid_common::limits::open_files_limits_of(gateway.child.id()),
        Some((hard, hard)),
        "{}",
        gateway.log()
    );
}
