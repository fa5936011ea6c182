"""tritonclient.grpc against a real nereid-worker over the example repository: the unary API,
streaming inference, and HTTP/gRPC statistics agreement.

Numeric outputs are compared with onnxruntime in Python running the same model.onnx.
"""

from __future__ import annotations

import queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg
from tritonclient.utils import InferenceServerException

from nereid_harness import assert_fp32_close, ort_run, wait_until

MODELS = ["identity_fp32", "mlp_fp32", "convnet_fp32", "mixed_types", "string_len", "autocomplete_add", "versioned_scale", "nobatch_add"]


@pytest.fixture(scope="module")
def client(worker):
    c = grpcclient.InferenceServerClient(worker.grpc_url)
    yield c
    c.close()


def _input(name, arr, dtype):
    inp = grpcclient.InferInput(name, list(arr.shape), dtype)
    inp.set_data_from_numpy(arr)
    return inp


def _outputs(names):
    return [grpcclient.InferRequestedOutput(n) for n in names]


# -- health and metadata ------------------------------------------------------------------------


def test_server_live_and_ready(client):
    assert client.is_server_live()
    assert client.is_server_ready()


def test_server_metadata(client):
    md = client.get_server_metadata()
    assert md.name
    assert md.version
    for ext in ("binary_tensor_data", "model_repository", "statistics", "model_configuration"):
        assert ext in md.extensions, md
    # Triton reports the unload parameter it takes as an extension of its own, right after.
    ext = list(md.extensions)
    assert ext.index("model_repository(unload_dependents)") == ext.index("model_repository") + 1, ext
    as_json = client.get_server_metadata(as_json=True)
    assert as_json["name"] == md.name


@pytest.mark.parametrize("model", MODELS)
def test_model_ready(client, model):
    assert client.is_model_ready(model)
    assert client.is_model_ready(model, "1")
    assert not client.is_model_ready(model, "99")


def test_model_ready_versions_and_unknown(client):
    assert client.is_model_ready("versioned_scale", "2")
    assert not client.is_model_ready("no_such_model")


def test_model_metadata(client):
    md = client.get_model_metadata("mixed_types")
    assert md.name == "mixed_types"
    assert "1" in md.versions
    assert md.platform == "onnxruntime_onnx"
    ins = {t.name: (t.datatype, list(t.shape)) for t in md.inputs}
    outs = {t.name: (t.datatype, list(t.shape)) for t in md.outputs}
    assert ins == {"INPUT_FP32": ("FP32", [-1, 4]), "INPUT_INT64": ("INT64", [-1, 4])}
    assert outs == {"OUTPUT_FP16": ("FP16", [-1, 4]), "OUTPUT_BOOL": ("BOOL", [-1, 4])}
    md = client.get_model_metadata("versioned_scale")
    assert sorted(md.versions) == ["1", "2"]


def test_model_metadata_unknown_model(client):
    with pytest.raises(InferenceServerException) as ei:
        client.get_model_metadata("no_such_model")
    assert "no_such_model" in str(ei.value)
    assert ei.value.status() == "StatusCode.NOT_FOUND"


def test_model_config(client):
    cfg = client.get_model_config("convnet_fp32").config
    assert cfg.name == "convnet_fp32"
    assert cfg.max_batch_size == 32
    assert list(cfg.input[0].dims) == [3, 64, 64]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 1000
    js = client.get_model_config("nobatch_add", as_json=True)["config"]
    assert js.get("max_batch_size", 0) == 0
    assert [int(d) for d in js["input"][0]["dims"]] == [2, 3]


def test_autocomplete_config(client):
    cfg = client.get_model_config("autocomplete_add").config
    assert cfg.max_batch_size == 4
    assert sorted(i.name for i in cfg.input) == ["A", "B"]
    assert [o.name for o in cfg.output] == ["SUM"]
    for t in list(cfg.input) + list(cfg.output):
        assert list(t.dims) == [8]
    assert cfg.HasField("dynamic_batching")


# -- inference ----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 4])
def test_infer_identity(client, batch):
    x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
    res = client.infer("identity_fp32", [_input("INPUT0", x, "FP32")], outputs=_outputs(["OUTPUT0"]))
    assert_fp32_close(res.as_numpy("OUTPUT0"), ort_run("identity_fp32", {"INPUT0": x})["OUTPUT0"])
    resp = res.get_response()
    assert resp.model_name == "identity_fp32" and resp.model_version == "1"


@pytest.mark.parametrize("batch", [1, 4])
def test_infer_mlp(client, batch):
    x = np.random.default_rng(10 + batch).standard_normal((batch, 256)).astype(np.float32)
    res = client.infer("mlp_fp32", [_input("INPUT0", x, "FP32")])
    out = res.as_numpy("OUTPUT0")
    assert out.shape == (batch, 10)
    assert_fp32_close(out, ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"])


@pytest.mark.parametrize("batch", [1, 4])
def test_infer_convnet(client, batch):
    x = np.random.default_rng(20 + batch).standard_normal((batch, 3, 64, 64)).astype(np.float32)
    res = client.infer("convnet_fp32", [_input("INPUT0", x, "FP32")], outputs=_outputs(["OUTPUT0"]))
    out = res.as_numpy("OUTPUT0")
    assert out.shape == (batch, 10)
    assert_fp32_close(out, ort_run("convnet_fp32", {"INPUT0": x})["OUTPUT0"])


def _mixed_inputs(batch, seed=30):
    rng = np.random.default_rng(seed + batch)
    f = (rng.standard_normal((batch, 4)) * 10).astype(np.float32)
    i = rng.integers(-10, 10, size=(batch, 4)).astype(np.int64)
    return f, i


@pytest.mark.parametrize("batch", [1, 3])
def test_infer_mixed_types(client, batch):
    f, i = _mixed_inputs(batch)
    res = client.infer("mixed_types", [_input("INPUT_FP32", f, "FP32"), _input("INPUT_INT64", i, "INT64")], outputs=_outputs(["OUTPUT_FP16", "OUTPUT_BOOL"]))
    ref = ort_run("mixed_types", {"INPUT_FP32": f, "INPUT_INT64": i})
    fp16, bools = res.as_numpy("OUTPUT_FP16"), res.as_numpy("OUTPUT_BOOL")
    assert fp16.dtype == np.float16 and bools.dtype == np.bool_
    np.testing.assert_array_equal(fp16, ref["OUTPUT_FP16"])
    np.testing.assert_array_equal(bools, ref["OUTPUT_BOOL"])
    assert {o.name: o.datatype for o in res.get_response().outputs} == {"OUTPUT_FP16": "FP16", "OUTPUT_BOOL": "BOOL"}


@pytest.mark.parametrize("wanted", ["OUTPUT_FP16", "OUTPUT_BOOL"])
def test_infer_requested_output_subset(client, wanted):
    f, i = _mixed_inputs(2)
    res = client.infer("mixed_types", [_input("INPUT_FP32", f, "FP32"), _input("INPUT_INT64", i, "INT64")], outputs=_outputs([wanted]))
    assert [o.name for o in res.get_response().outputs] == [wanted]
    ref = ort_run("mixed_types", {"INPUT_FP32": f, "INPUT_INT64": i})
    np.testing.assert_array_equal(res.as_numpy(wanted), ref[wanted])


def test_infer_string(client):
    texts = np.array([[b"hello"], [b""], ["gr\u00fc\u00dfe".encode()], ["\u65e5\u672c \U0001f600".encode()]], dtype=np.object_)
    res = client.infer("string_len", [_input("TEXT", texts, "BYTES")], outputs=_outputs(["TEXT_OUT"]))
    out = res.as_numpy("TEXT_OUT")
    assert out.shape == (4, 1) and out.dtype == np.object_
    assert list(out.flatten()) == list(texts.flatten())
    ref = ort_run("string_len", {"TEXT": np.array([[t.decode()] for t in texts[:, 0]], dtype=np.object_)})["TEXT_OUT"]
    assert [v.decode() for v in out.flatten()] == [str(v) for v in ref.flatten()]


def test_infer_nobatch(client):
    rng = np.random.default_rng(41)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    y = rng.standard_normal((2, 3)).astype(np.float32)
    res = client.infer("nobatch_add", [_input("X", x, "FP32"), _input("Y", y, "FP32")])
    assert_fp32_close(res.as_numpy("Z"), ort_run("nobatch_add", {"X": x, "Y": y})["Z"])


def test_infer_autocomplete(client):
    rng = np.random.default_rng(51)
    a = rng.standard_normal((4, 8)).astype(np.float32)
    b = rng.standard_normal((4, 8)).astype(np.float32)
    res = client.infer("autocomplete_add", [_input("A", a, "FP32"), _input("B", b, "FP32")])
    assert_fp32_close(res.as_numpy("SUM"), ort_run("autocomplete_add", {"A": a, "B": b})["SUM"])


def test_infer_versions(client):
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    res = client.infer("versioned_scale", [_input("INPUT0", x, "FP32")])
    assert res.get_response().model_version == "2"
    assert_fp32_close(res.as_numpy("OUTPUT0"), ort_run("versioned_scale", {"INPUT0": x}, version=2)["OUTPUT0"])
    assert_fp32_close(res.as_numpy("OUTPUT0"), x * 3)
    res = client.infer("versioned_scale", [_input("INPUT0", x, "FP32")], model_version="1")
    assert res.get_response().model_version == "1"
    assert_fp32_close(res.as_numpy("OUTPUT0"), ort_run("versioned_scale", {"INPUT0": x}, version=1)["OUTPUT0"])
    assert_fp32_close(res.as_numpy("OUTPUT0"), x * 2)


def test_infer_unknown_version(client):
    x = np.ones((1, 4), dtype=np.float32)
    with pytest.raises(InferenceServerException) as ei:
        client.infer("versioned_scale", [_input("INPUT0", x, "FP32")], model_version="7")
    assert "7" in str(ei.value)


# -- streaming ----------------------------------------------------------------------------------


def test_stream_infer(worker):
    c = grpcclient.InferenceServerClient(worker.grpc_url)
    results: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    sent = {}
    try:
        for k in range(8):
            x = np.random.default_rng(100 + k).standard_normal((1 + k % 3, 256)).astype(np.float32)
            sent[f"s{k}"] = ("mlp_fp32", x)
            c.async_stream_infer("mlp_fp32", [_input("INPUT0", x, "FP32")], request_id=f"s{k}")
        for k in range(4):
            x = np.full((2, 4), k + 1, dtype=np.float32)
            sent[f"v{k}"] = ("versioned_scale", x)
            c.async_stream_infer("versioned_scale", [_input("INPUT0", x, "FP32")], request_id=f"v{k}", model_version="1" if k % 2 else "")
        got = {}
        for _ in range(len(sent)):
            result, error = results.get(timeout=30)
            assert error is None, error
            got[result.get_response().id] = result
    finally:
        c.stop_stream()
        c.close()
    assert set(got) == set(sent)
    for rid, (model, x) in sent.items():
        res = got[rid]
        assert res.get_response().model_name == model
        if model == "mlp_fp32":
            assert_fp32_close(res.as_numpy("OUTPUT0"), ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"])
        else:
            k = int(rid[1:])
            version = 1 if k % 2 else 2
            assert res.get_response().model_version == str(version)
            assert_fp32_close(res.as_numpy("OUTPUT0"), ort_run("versioned_scale", {"INPUT0": x}, version=version)["OUTPUT0"])


def test_stream_error_then_success(worker):
    """An error response on the stream does not end it; later requests still succeed."""
    c = grpcclient.InferenceServerClient(worker.grpc_url)
    results: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        bad = np.ones((1, 4), dtype=np.float32)  # wrong shape for identity_fp32
        c.async_stream_infer("identity_fp32", [_input("INPUT0", bad, "FP32")], request_id="bad")
        result, error = results.get(timeout=30)
        assert result is None and error is not None
        assert "INPUT0" in str(error)
        x = np.arange(16, dtype=np.float32).reshape(1, 16)
        c.async_stream_infer("identity_fp32", [_input("INPUT0", x, "FP32")], request_id="good")
        result, error = results.get(timeout=30)
        assert error is None, error
        assert result.get_response().id == "good"
        assert_fp32_close(result.as_numpy("OUTPUT0"), x)
    finally:
        c.stop_stream()
        c.close()


def test_stream_responses_are_marked_final(worker):
    """Triton sets triton_final_response=true on every successful stream response, decoupled model
    or not (clients written for decoupled models wait for it); error responses are unchanged."""
    c = grpcclient.InferenceServerClient(worker.grpc_url)
    results: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        x = np.arange(16, dtype=np.float32).reshape(1, 16)
        for rid in ("a", "b"):
            c.async_stream_infer("identity_fp32", [_input("INPUT0", x, "FP32")], request_id=rid)
            result, error = results.get(timeout=30)
            assert error is None, error
            resp = result.get_response()
            assert resp.id == rid
            assert resp.parameters["triton_final_response"].WhichOneof("parameter_choice") == "bool_param"
            assert resp.parameters["triton_final_response"].bool_param is True
            assert result.get_response(as_json=True)["parameters"]["triton_final_response"] == {"bool_param": True}
        c.async_stream_infer("identity_fp32", [_input("INPUT0", np.ones((1, 4), dtype=np.float32), "FP32")], request_id="bad")
        result, error = results.get(timeout=30)
        assert result is None and "INPUT0" in str(error), (result, error)
    finally:
        c.stop_stream()
        c.close()


# -- what this worker does not support, answered as Triton answers it ----------------------------


@pytest.fixture(scope="module")
def stub(worker):
    ch = grpc.insecure_channel(worker.grpc_url)
    yield pbg.GRPCInferenceServiceStub(ch)
    ch.close()


def _rpc_error(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_trace_setting_is_unavailable(client, stub):
    """Triton built without tracing answers UNAVAILABLE, not UNIMPLEMENTED."""
    for call in (lambda: client.get_trace_settings(), lambda: client.update_trace_settings(settings={"trace_rate": "10"})):
        with pytest.raises(InferenceServerException) as e:
            call()
        assert e.value.status() == "StatusCode.UNAVAILABLE", (e.value.status(), str(e.value))
        assert "the server does not support trace" in str(e.value)
    code, details = _rpc_error(lambda: stub.TraceSetting(pb.TraceSettingRequest(model_name="identity_fp32")))
    assert (code, details) == (grpc.StatusCode.UNAVAILABLE, "the server does not support trace")


def test_repository_name_is_not_supported(stub):
    """A named repository is UNIMPLEMENTED, before the model or the worker's mode is looked at
    (this worker does not allow loads at all: the name is refused first, as in Triton)."""
    refused = (grpc.StatusCode.UNIMPLEMENTED, "'repository_name' specification is not supported")
    assert _rpc_error(lambda: stub.RepositoryIndex(pb.RepositoryIndexRequest(repository_name="models"))) == refused
    assert _rpc_error(lambda: stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(repository_name="models", model_name="no_such_model"))) == refused
    assert _rpc_error(lambda: stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(repository_name="models", model_name="no_such_model"))) == refused
    # Without a name, the index is served.
    assert "identity_fp32" in {m.name for m in stub.RepositoryIndex(pb.RepositoryIndexRequest()).models}


def test_unrecognized_load_parameter_is_invalid(stub):
    req = pb.RepositoryModelLoadRequest(model_name="no_such_model")
    req.parameters["config"].string_param = "{}"
    req.parameters["poll"].bool_param = True
    assert _rpc_error(lambda: stub.RepositoryModelLoad(req)) == (grpc.StatusCode.INVALID_ARGUMENT, "unrecognized load parameter 'poll'.")


# -- statistics ---------------------------------------------------------------------------------


def _grpc_stats(client, model, version):
    st = client.get_inference_statistics(model, version, as_json=True)
    (entry,) = [s for s in st["model_stats"] if s["name"] == model and s["version"] == version]
    return entry


def _n(d, *path):
    for p in path:
        d = d.get(p, {}) if isinstance(d, dict) else {}
    return int(d) if not isinstance(d, dict) else 0  # proto3 JSON leaves out zero values


def test_statistics_increase(client):
    before = _grpc_stats(client, "mlp_fp32", "1")
    x = np.zeros((3, 256), dtype=np.float32)
    for _ in range(2):
        client.infer("mlp_fp32", [_input("INPUT0", x, "FP32")])
    after = _grpc_stats(client, "mlp_fp32", "1")
    assert _n(after, "inference_stats", "success", "count") == _n(before, "inference_stats", "success", "count") + 2
    assert _n(after, "inference_count") == _n(before, "inference_count") + 6
    assert _n(before, "execution_count") < _n(after, "execution_count") <= _n(before, "execution_count") + 2


@pytest.mark.parametrize("model,version", [("identity_fp32", "1"), ("mlp_fp32", "1"), ("versioned_scale", "1"), ("versioned_scale", "2")])
def test_statistics_http_and_grpc_agree(client, worker, model, version):
    # make sure there is something to compare
    x = np.ones((1, 16 if model == "identity_fp32" else 256 if model == "mlp_fp32" else 4), dtype=np.float32)
    client.infer(model, [_input("INPUT0", x, "FP32")], model_version=version)
    h = httpclient.InferenceServerClient(worker.http_url)
    try:
        hs = h.get_inference_statistics(model, version)["model_stats"]
    finally:
        h.close()
    (http_entry,) = hs
    grpc_entry = _grpc_stats(client, model, version)
    assert http_entry["name"] == grpc_entry["name"] == model
    assert http_entry["version"] == grpc_entry["version"] == version
    for key in ("inference_count", "execution_count", "last_inference"):
        assert int(http_entry[key]) == _n(grpc_entry, key), key
    for kind in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        for field in ("count", "ns"):
            assert int(http_entry["inference_stats"][kind][field]) == _n(grpc_entry, "inference_stats", kind, field), (kind, field)
    http_batches = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in http_entry.get("batch_stats", [])}
    grpc_batches = {int(b["batch_size"]): _n(b, "compute_infer", "count") for b in grpc_entry.get("batch_stats", [])}
    assert http_batches == grpc_batches
    assert _n(grpc_entry, "inference_stats", "success", "count") >= 1


# -- compression --------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_infer_compressed(client, algorithm):
    """tritonclient.grpc's compression_algorithm; tritonserver (gRPC C++) accepts gzip and deflate."""
    x = np.random.default_rng(62).standard_normal((4, 16)).astype(np.float32)
    res = client.infer("identity_fp32", [_input("INPUT0", x, "FP32")], compression_algorithm=algorithm)
    assert_fp32_close(res.as_numpy("OUTPUT0"), x)


# -- grpc.health.v1 (Kubernetes gRPC probes, grpc_health_probe) -------------------------------


def _health_check(url, service):
    """grpc.health.v1.Health/Check by hand (HealthCheckRequest{service}; the answer's field 1
    is the status: 1 SERVING, 2 NOT_SERVING)."""
    encoded = service.encode()
    request = (b"\x0a" + bytes([len(encoded)]) + encoded) if encoded else b""
    with grpc.insecure_channel(url) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
        answer = check(request, timeout=10)
    return {b"": 0, b"\x08\x01": 1, b"\x08\x02": 2}[answer]


def test_grpc_health_check_follows_readiness(worker, repo_copy, make_worker):
    assert _health_check(worker.grpc_url, "") == 1
    assert _health_check(worker.grpc_url, "inference.GRPCInferenceService") == 1
    with pytest.raises(grpc.RpcError) as e:
        _health_check(worker.grpc_url, "no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value
    # A model that failed to load keeps the worker not ready (strict readiness): NOT_SERVING.
    repo = repo_copy("identity_fp32")
    cfg = repo / "identity_fp32" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + "bogus_field: 1\n")
    broken = make_worker(repo, wait_ready=False)
    c = grpcclient.InferenceServerClient(broken.grpc_url)
    try:
        def failed():
            return any(m.name == "identity_fp32" and m.state == "UNAVAILABLE" for m in c.get_model_repository_index().models)

        wait_until(failed, 30, interval=0.05, what="the broken model's load to fail")
        assert not c.is_server_ready()
        assert _health_check(broken.grpc_url, "") == 2
    finally:
        c.close()
