"""tritonclient (HTTP and gRPC) through a real nereid-gateway in front of two real nereid-workers:
the same answers as onnxruntime in Python, version pins, streaming, and NOT_FOUND for unknown
models. Reuses the worker harness of tests/python.

Run: .venv/bin/python -m pytest -q gateway/tests/python   (after `cargo build --workspace`)

Environment: NEREID_GATEWAY_BIN (default <repo>/target/debug/nereid-gateway), plus the worker
harness's NEREID_WORKER_BIN and NEREID_ORT_LIB.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests" / "python"))

import tritonclient.grpc as grpcclient  # noqa: E402
import tritonclient.http as httpclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from nereid_harness import (  # noqa: E402
    EXAMPLE_MODELS,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    Worker,
    assert_fp32_close,
    check_example_models,
    http_request,
    ort_run,
    wait_until,
)

GATEWAY_BIN = Path(os.environ.get("NEREID_GATEWAY_BIN", ROOT / "target" / "debug" / "nereid-gateway"))
MODELS = ["identity_fp32", "mlp_fp32", "versioned_scale", "scale_ensemble"]


class Gateway:
    def __init__(self, workers: list[Worker], workdir: Path):
        if not GATEWAY_BIN.exists():
            raise RuntimeError(f"{GATEWAY_BIN} does not exist (cargo build -p nereid-gateway, or set NEREID_GATEWAY_BIN)")
        workdir.mkdir(parents=True, exist_ok=True)
        self.port_file = workdir / "ports.json"
        self.log_path = workdir / "gateway.log"
        cmd = [str(GATEWAY_BIN), "--address", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
               "--metrics-port", "0", "--port-file", str(self.port_file), "--discovery-interval-ms", "100"]
        for w in workers:
            cmd += ["--worker-grpc", w.grpc_url]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})

        def ports():
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}: {self.log_path.read_text()}")
            try:
                return json.loads(self.port_file.read_text())
            except (OSError, json.JSONDecodeError):
                return None

        p = wait_until(ports, START_TIMEOUT_S, what="the gateway's port file")
        self.http_url = f"127.0.0.1:{p['http']}"
        self.grpc_url = f"127.0.0.1:{p['grpc']}"
        self.metrics_url = f"127.0.0.1:{p['metrics']}"
        wait_until(lambda: http_request(f"http://{self.http_url}/v2/health/ready", timeout=2.0)[0] == 200,
                   START_TIMEOUT_S, what="the gateway to be ready")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._log.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    check_example_models()
    load = [a for m in MODELS for a in ("--load-model", m)]
    workers = [Worker(EXAMPLE_MODELS, ["--model-control-mode", "explicit", *load], tmp_path_factory.mktemp("worker"))
               for _ in range(2)]
    gateway = Gateway(workers, tmp_path_factory.mktemp("gateway"))
    yield gateway, workers
    gateway.stop()
    for w in workers:
        w.stop()


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_infer_matches_onnxruntime(fleet, protocol):
    gateway, _ = fleet
    mod = httpclient if protocol == "http" else grpcclient
    client = mod.InferenceServerClient(gateway.http_url if protocol == "http" else gateway.grpc_url)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mlp_fp32")
    for model, shape in [("identity_fp32", (3, 16)), ("mlp_fp32", (2, 256))]:
        x = _x(shape)
        inp = mod.InferInput("INPUT0", list(shape), "FP32")
        if protocol == "http":
            inp.set_data_from_numpy(x, binary_data=True)
        else:
            inp.set_data_from_numpy(x)
        out = client.infer(model, [inp]).as_numpy("OUTPUT0")
        assert_fp32_close(out, ort_run(model, {"INPUT0": x})["OUTPUT0"])
    # Version pins reach the version asked for.
    x = _x((1, 4))
    for version in ("1", "2"):
        inp = mod.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("versioned_scale", [inp], model_version=version)
        assert_fp32_close(result.as_numpy("OUTPUT0"), ort_run("versioned_scale", {"INPUT0": x}, version=int(version))["OUTPUT0"])
    md = client.get_model_metadata("mlp_fp32")
    name = md["name"] if protocol == "http" else md.name
    assert name == "mlp_fp32"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_ensemble_through_the_gateway(fleet, protocol):
    """The gateway routes an ensemble like any model; the worker runs its steps."""
    gateway, _ = fleet
    mod = httpclient if protocol == "http" else grpcclient
    client = mod.InferenceServerClient(gateway.http_url if protocol == "http" else gateway.grpc_url)
    x = _x((2, 4), seed=5)
    inp = mod.InferInput("INPUT0", [2, 4], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("scale_ensemble", [inp])
    doubled = ort_run("versioned_scale", {"INPUT0": x}, version=1)["OUTPUT0"]
    assert_fp32_close(result.as_numpy("SCALED6"), ort_run("versioned_scale", {"INPUT0": doubled}, version=2)["OUTPUT0"])
    assert_fp32_close(result.as_numpy("SCALED3"), ort_run("versioned_scale", {"INPUT0": x}, version=2)["OUTPUT0"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_classification_through_the_gateway(fleet, protocol):
    """An output's class count reaches the worker over both ingresses; the top classes come
    back as the worker ranks them (onnxruntime's order)."""
    gateway, _ = fleet
    mod = httpclient if protocol == "http" else grpcclient
    client = mod.InferenceServerClient(gateway.http_url if protocol == "http" else gateway.grpc_url)
    assert "classification" in (client.get_server_metadata()["extensions"] if protocol == "http"
                                else client.get_server_metadata().extensions)
    x = _x((2, 256), seed=9)
    inp = mod.InferInput("INPUT0", [2, 256], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("mlp_fp32", [inp], outputs=[mod.InferRequestedOutput("OUTPUT0", class_count=3)])
    classes = result.as_numpy("OUTPUT0")
    assert classes.shape == (2, 3)
    scores = ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"]
    for row, srow in zip(classes, scores):
        indices = [int(c.decode().split(":")[1]) for c in row]
        assert indices == sorted(range(10), key=lambda i: (-srow[i], i))[:3]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_http_through_the_gateway(fleet, algorithm):
    """tritonclient compresses the request body and asks for a compressed answer; the gateway
    inflates, forwards, and compresses the answer like a worker does."""
    gateway, _ = fleet
    client = httpclient.InferenceServerClient(gateway.http_url)
    x = _x((8, 256), seed=3)
    inp = httpclient.InferInput("INPUT0", [8, 256], "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    out = client.infer("mlp_fp32", [inp], request_compression_algorithm=algorithm,
                       response_compression_algorithm=algorithm).as_numpy("OUTPUT0")
    assert_fp32_close(out, ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"])
    # JSON request, JSON answer, compressed both ways.
    inp = httpclient.InferInput("INPUT0", [8, 256], "FP32")
    inp.set_data_from_numpy(x, binary_data=False)
    out = client.infer("mlp_fp32", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)],
                       request_compression_algorithm=algorithm, response_compression_algorithm=algorithm)
    assert_fp32_close(out.as_numpy("OUTPUT0"), ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"])
    # On the wire: a 4 KiB answer comes back compressed, as a worker sends it.
    x = np.arange(64 * 16, dtype=np.float32)
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [64, 16], "data": x.tolist()}]}).encode()
    status, headers, data = http_request(f"http://{gateway.http_url}/v2/models/identity_fp32/infer", "POST", body,
                                         {"Accept-Encoding": algorithm})
    assert status == 200, data
    assert {k.lower(): v for k, v in headers.items()}.get("content-encoding") == algorithm, headers
    answer = json.loads(zlib.decompress(data, wbits=31 if algorithm == "gzip" else 15))
    assert answer["outputs"][0]["data"] == x.tolist()


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_grpc_through_the_gateway(fleet, algorithm):
    """tritonclient gRPC with a compressed request message: the gateway's pass-through path
    inflates it (grpc-encoding) and forwards the message bytes to the worker."""
    gateway, _ = fleet
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    x = _x((8, 256), seed=4)
    inp = grpcclient.InferInput("INPUT0", [8, 256], "FP32")
    inp.set_data_from_numpy(x)
    out = client.infer("mlp_fp32", [inp], compression_algorithm=algorithm).as_numpy("OUTPUT0")
    assert_fp32_close(out, ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"])


def test_compressed_body_over_the_limit_once_inflated_is_refused(fleet):
    """The size limit applies to the inflated bytes: a small gzip body that inflates past
    --max-request-bytes (64 MiB) is refused with 400, and the gateway keeps serving."""
    import gzip

    gateway, _ = fleet
    bomb = gzip.compress(b"[" + b" " * (65 << 20) + b"]")
    url = f"http://{gateway.http_url}/v2/models/identity_fp32/infer"
    status, _, body = http_request(url, "POST", bomb, {"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert status == 400, body
    assert b"limit" in body, body
    status, _, body = http_request(url, "POST", b"not gzip", {"Content-Encoding": "gzip"})
    assert status == 400, body
    status, _, body = http_request(url, "POST", b"{}", {"Content-Encoding": "br"})
    assert status == 501, body
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(_x((1, 16)))
    httpclient.InferenceServerClient(gateway.http_url).infer("identity_fp32", [inp])


def test_a_huge_name_in_an_error_comes_back_cut_as_a_400(fleet):
    """A worker's error quotes the client's input name; a name of megabytes must not turn into
    a gRPC trailer no HTTP/2 peer accepts (the gateway would answer 503 and count a failure
    against a healthy worker, or lose the connection other clients' calls share)."""
    gateway, _ = fleet
    name = "\u00e9" * 3_000_000  # 6 MB of UTF-8, 18 MB percent-encoded in a trailer
    body = json.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16}]},
                      ensure_ascii=False).encode()
    url = f"http://{gateway.http_url}/v2/models/identity_fp32/infer"
    status, _, data = http_request(url, "POST", body, {"Content-Type": "application/json"}, timeout=60)
    assert status == 400, data[:300]
    message = json.loads(data)["error"]
    assert len(message) < 8192 and "message cut" in message, message[:300]
    # Over gRPC the message travels percent-encoded in a trailer (an é takes 6 bytes there):
    # grpcio clients refuse trailers past 8 KiB (as RESOURCE_EXHAUSTED), so it is cut to fit.
    inp = grpcclient.InferInput("\u00e9" * 100_000, [1, 16], "FP32")
    inp.set_data_from_numpy(_x((1, 16)))
    with pytest.raises(InferenceServerException) as e:
        grpcclient.InferenceServerClient(gateway.grpc_url).infer("identity_fp32", [inp])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "message cut" in str(e.value), str(e.value)[:300]
    inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(_x((1, 16)))
    httpclient.InferenceServerClient(gateway.http_url).infer("identity_fp32", [inp])


def test_unknown_model_is_not_found(fleet):
    gateway, _ = fleet
    inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(_x((1, 4)))
    with pytest.raises(InferenceServerException) as e:
        httpclient.InferenceServerClient(gateway.http_url).infer("no_such_model", [inp])
    assert "no_such_model" in str(e.value)
    ginp = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    ginp.set_data_from_numpy(_x((1, 4)))
    with pytest.raises(InferenceServerException) as e:
        grpcclient.InferenceServerClient(gateway.grpc_url).infer("no_such_model", [ginp])
    assert e.value.status() == "StatusCode.NOT_FOUND"


def test_streaming_through_the_gateway(fleet):
    gateway, _ = fleet
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    xs = [_x((1, 16), seed=i) for i in range(8)]
    for i, x in enumerate(xs):
        inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(x)
        client.async_stream_infer("identity_fp32", [inp], request_id=str(i))
    got = {}
    for _ in xs:
        result, error = results.get(timeout=30)
        assert error is None, error
        response = result.get_response()
        # Each answer is its request's last, marked so as Triton (and a worker's own stream) marks it.
        assert response.parameters["triton_final_response"].bool_param, response.parameters
        got[response.id] = result.as_numpy("OUTPUT0")
    client.stop_stream()
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(got[str(i)], x)


def test_load_reaches_both_workers(fleet):
    gateway, workers = fleet
    client = grpcclient.InferenceServerClient(gateway.grpc_url)

    def served():
        counts = []
        for w in workers:
            stats = grpcclient.InferenceServerClient(w.grpc_url).get_inference_statistics("identity_fp32", as_json=True)
            counts.append(sum(int(s.get("inference_count", 0)) for s in stats["model_stats"]))
        return counts

    # The fleet is shared with earlier tests: count this test's requests only.
    before = served()
    for i in range(30):
        inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(_x((1, 16), seed=i))
        client.infer("identity_fp32", [inp])
    counts = served()
    added = [after - b for after, b in zip(counts, before)]
    assert sum(added) == 30 and all(a > 0 for a in added), added
    total = client.get_inference_statistics("identity_fp32", as_json=True)
    assert sum(int(s.get("inference_count", 0)) for s in total["model_stats"]) == sum(counts)


def test_shared_memory_is_refused_by_the_gateway(fleet):
    """The gateway registers no regions (its workers may be on other hosts) and refuses
    requests naming one, over both protocols, without passing them to a worker; plain requests
    keep working."""
    gateway, _ = fleet
    h = httpclient.InferenceServerClient(gateway.http_url)
    g = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as e:
            h.register_system_shared_memory("r", "/nereid_gateway_test", 64)
        assert "not supported through the gateway" in str(e.value), str(e.value)
        with pytest.raises(InferenceServerException) as e:
            g.register_system_shared_memory("r", "/nereid_gateway_test", 64)
        assert e.value.status() == "StatusCode.UNIMPLEMENTED", str(e.value)
        for mod, c in ((httpclient, h), (grpcclient, g)):
            inp = mod.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_shared_memory("r", 64)
            with pytest.raises(InferenceServerException) as e:
                c.infer("identity_fp32", [inp])
            # The gateway's own refusal, not a worker's (those would name --allow-client-shm).
            assert "not supported" in str(e.value) and "--allow-client-shm" not in str(e.value), str(e.value)
            out = mod.InferRequestedOutput("OUTPUT0")
            out.set_shared_memory("r", 64)
            plain = mod.InferInput("INPUT0", [1, 16], "FP32")
            plain.set_data_from_numpy(_x((1, 16)))
            with pytest.raises(InferenceServerException) as e:
                c.infer("identity_fp32", [plain], outputs=[out])
            assert "not supported" in str(e.value) and "--allow-client-shm" not in str(e.value), str(e.value)
            assert_fp32_close(c.infer("identity_fp32", [plain]).as_numpy("OUTPUT0"), _x((1, 16)))
    finally:
        h.close()
        g.close()


def test_the_gateways_own_log_settings_are_on_its_operator_port(fleet):
    """Triton's /v2/logging, for the gateway itself, on its metrics port: clients reach the
    ingress, where a tenant must not be able to turn on TRACE."""
    gateway, _ = fleet
    admin = f"http://{gateway.metrics_url}/v2/logging"
    try:
        status, _, body = http_request(admin)
        assert status == 200 and json.loads(body)["log_verbose_level"] == 0, body
        status, _, body = http_request(admin, "POST", json.dumps({"log_verbose_level": 2}).encode())
        assert status == 200 and json.loads(body)["log_verbose_level"] == 2, body
        status, _, body = http_request(admin, "POST", json.dumps({"log_file": "/tmp/gw.log"}).encode())
        assert status == 400 and b"must be empty" in body, body
        # Not on the clients' ingress, over either protocol.
        h = httpclient.InferenceServerClient(gateway.http_url)
        g = grpcclient.InferenceServerClient(gateway.grpc_url)
        try:
            assert "logging" not in h.get_server_metadata()["extensions"]
            with pytest.raises(InferenceServerException):
                h.update_log_settings({"log_verbose_level": 1})
            with pytest.raises(InferenceServerException) as e:
                g.update_log_settings({"log_verbose_level": 1})
            assert e.value.status() == "StatusCode.UNIMPLEMENTED", str(e.value)
        finally:
            h.close()
            g.close()
        status, _, body = http_request(admin)
        assert json.loads(body)["log_verbose_level"] == 2, "the ingress attempts changed nothing"
    finally:
        http_request(admin, "POST", json.dumps({"log_verbose_level": 0}).encode())


def test_trace_and_named_repositories_are_answered_as_a_worker_answers(fleet):
    gateway, workers = fleet
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    for url in (gateway.grpc_url, workers[0].grpc_url):
        with pytest.raises(InferenceServerException) as e:
            grpcclient.InferenceServerClient(url).get_trace_settings()
        assert e.value.status() == "StatusCode.UNAVAILABLE" and "does not support trace" in str(e.value), (url, str(e.value))
        with grpc.insecure_channel(url) as channel:
            with pytest.raises(grpc.RpcError) as e:
                pbg.GRPCInferenceServiceStub(channel).RepositoryIndex(pb.RepositoryIndexRequest(repository_name="models"), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED, (url, e.value)
            assert "'repository_name' specification is not supported" in e.value.details(), (url, e.value.details())


def test_a_stream_refusal_names_the_request_it_answers(fleet):
    """A request the gateway refuses on a stream (shared memory, here) is answered in the
    stream with its id, as a worker answers its own refusals."""
    gateway, _ = fleet
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    bad = pb.ModelInferRequest(model_name="identity_fp32", id="shm-1")
    inp = bad.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    inp.parameters["shared_memory_region"].string_param = "r"
    inp.parameters["shared_memory_byte_size"].int64_param = 64
    good = pb.ModelInferRequest(model_name="identity_fp32", id="plain-2")
    good.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
    good.raw_input_contents.append(_x((1, 16)).tobytes())
    with grpc.insecure_channel(gateway.grpc_url) as channel:
        responses = list(pbg.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([bad, good]), timeout=30))
    assert len(responses) == 2, responses
    assert "not supported" in responses[0].error_message, responses[0]
    assert responses[0].infer_response.id == "shm-1", responses[0]
    assert responses[1].error_message == "" and responses[1].infer_response.id == "plain-2", responses[1]


def test_grpc_health_check_on_the_gateway(fleet):
    """grpc.health.v1 (Kubernetes gRPC probes): SERVING while the gateway is ready."""
    gateway, _ = fleet
    import grpc

    with grpc.insecure_channel(gateway.grpc_url) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
        assert check(b"", timeout=10) == b"\x08\x01"
        with pytest.raises(grpc.RpcError) as e:
            check(b"\x0a\x03xyz", timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value


def test_a_raw_binary_request_through_the_gateway(fleet):
    """Triton's raw binary request (`Inference-Header-Content-Length: 0`, the body is the only
    input's data) through the gateway: shaped by the model's config, answered in binary."""
    gateway, _ = fleet
    x = _x((16,))
    url = f"http://{gateway.http_url}/v2/models/identity_fp32/infer"
    headers = {"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"}
    status, got, body = http_request(url, "POST", x.tobytes(), headers)
    assert status == 200, body
    n = int({k.lower(): v for k, v in dict(got).items()}["inference-header-content-length"])
    (out,) = json.loads(body[:n])["outputs"]
    assert (out["name"], out["shape"]) == ("OUTPUT0", [1, 16]), out
    np.testing.assert_array_equal(np.frombuffer(body[n:], dtype=np.float32), x)
    # Again, shaped by the config the gateway keeps for a moment: the same answer for new data,
    # and a body that fits no shape of the model refused as before.
    status, got, body = http_request(url, "POST", (x + 1).tobytes(), headers)
    assert status == 200, body
    n = int({k.lower(): v for k, v in dict(got).items()}["inference-header-content-length"])
    np.testing.assert_array_equal(np.frombuffer(body[n:], dtype=np.float32), x + 1)
    status, _, body = http_request(url, "POST", x.tobytes()[:-4], headers)
    assert status == 400, body
    status, _, body = http_request(url.replace("identity_fp32", "nope"), "POST", x.tobytes(), headers)
    assert status == 404, body
