"""tritonclient.http against a real nereid-worker over the example repository.

Numeric outputs are compared with onnxruntime in Python running the same model.onnx on the
same inputs.
"""

from __future__ import annotations

import json
import re
import zlib

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from nereid_harness import assert_fp32_close, http_request, ort_run

MODELS = ["identity_fp32", "mlp_fp32", "convnet_fp32", "mixed_types", "string_len", "autocomplete_add", "versioned_scale", "nobatch_add"]


@pytest.fixture(scope="module")
def client(worker):
    c = httpclient.InferenceServerClient(worker.http_url, connection_timeout=30.0, network_timeout=30.0)
    yield c
    c.close()


def _input(name, arr, dtype, binary):
    inp = httpclient.InferInput(name, list(arr.shape), dtype)
    inp.set_data_from_numpy(arr, binary_data=binary)
    return inp


def _outputs(names, binary):
    return [httpclient.InferRequestedOutput(n, binary_data=binary) for n in names]


# -- health and metadata ------------------------------------------------------------------------


def test_server_live_and_ready(client):
    assert client.is_server_live()
    assert client.is_server_ready()


def test_server_metadata(client):
    md = client.get_server_metadata()
    assert md["name"]
    assert md["version"]
    for ext in ("binary_tensor_data", "model_repository", "statistics", "model_configuration"):
        assert ext in md["extensions"], md


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
    assert md["name"] == "mixed_types"
    assert "1" in md["versions"]
    assert md["platform"] == "onnxruntime_onnx"
    ins = {t["name"]: t for t in md["inputs"]}
    outs = {t["name"]: t for t in md["outputs"]}
    assert ins["INPUT_FP32"]["datatype"] == "FP32" and ins["INPUT_FP32"]["shape"] == [-1, 4]
    assert ins["INPUT_INT64"]["datatype"] == "INT64" and ins["INPUT_INT64"]["shape"] == [-1, 4]
    assert outs["OUTPUT_FP16"]["datatype"] == "FP16" and outs["OUTPUT_FP16"]["shape"] == [-1, 4]
    assert outs["OUTPUT_BOOL"]["datatype"] == "BOOL" and outs["OUTPUT_BOOL"]["shape"] == [-1, 4]


def test_model_metadata_nobatch_and_versions(client):
    md = client.get_model_metadata("nobatch_add")
    assert {t["name"]: t["shape"] for t in md["inputs"]} == {"X": [2, 3], "Y": [2, 3]}
    assert md["outputs"][0]["name"] == "Z" and md["outputs"][0]["shape"] == [2, 3]
    md = client.get_model_metadata("versioned_scale")
    assert sorted(md["versions"]) == ["1", "2"]
    md1 = client.get_model_metadata("versioned_scale", "1")
    assert md1["name"] == "versioned_scale"


def test_model_metadata_unknown_model(client):
    with pytest.raises(InferenceServerException) as ei:
        client.get_model_metadata("no_such_model")
    assert "no_such_model" in str(ei.value)


def test_model_config(client):
    cfg = client.get_model_config("mlp_fp32")
    assert cfg["name"] == "mlp_fp32"
    assert cfg["max_batch_size"] == 64
    assert cfg["input"][0]["name"] == "INPUT0"
    assert cfg["input"][0]["data_type"] == "TYPE_FP32"
    assert cfg["input"][0]["dims"] == [256], "Triton answers 64-bit dims as JSON numbers"
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [16, 32]


def test_autocomplete_config(client):
    cfg = client.get_model_config("autocomplete_add")
    assert cfg["name"] == "autocomplete_add"
    assert cfg["max_batch_size"] == 4
    assert sorted(i["name"] for i in cfg["input"]) == ["A", "B"]
    assert [o["name"] for o in cfg["output"]] == ["SUM"]
    for t in cfg["input"] + cfg["output"]:
        assert t["data_type"] == "TYPE_FP32"
        assert t["dims"] == [8]
    assert "dynamic_batching" in cfg


# -- inference ----------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("batch", [1, 4])
def test_infer_identity(client, binary, batch):
    x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
    res = client.infer("identity_fp32", [_input("INPUT0", x, "FP32", binary)], outputs=_outputs(["OUTPUT0"], binary))
    out = res.as_numpy("OUTPUT0")
    assert out.dtype == np.float32 and out.shape == (batch, 16)
    assert_fp32_close(out, ort_run("identity_fp32", {"INPUT0": x})["OUTPUT0"])
    resp = res.get_response()
    assert resp["model_name"] == "identity_fp32"
    assert resp["model_version"] == "1"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("batch", [1, 4])
def test_infer_mlp(client, binary, batch):
    x = np.random.default_rng(10 + batch).standard_normal((batch, 256)).astype(np.float32)
    res = client.infer("mlp_fp32", [_input("INPUT0", x, "FP32", binary)], outputs=_outputs(["OUTPUT0"], binary))
    out = res.as_numpy("OUTPUT0")
    assert out.shape == (batch, 10)
    assert_fp32_close(out, ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"])


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("batch", [1, 4])
def test_infer_convnet(client, binary, batch):
    x = np.random.default_rng(20 + batch).standard_normal((batch, 3, 64, 64)).astype(np.float32)
    res = client.infer("convnet_fp32", [_input("INPUT0", x, "FP32", binary)], outputs=_outputs(["OUTPUT0"], binary))
    out = res.as_numpy("OUTPUT0")
    assert out.shape == (batch, 10)
    assert_fp32_close(out, ort_run("convnet_fp32", {"INPUT0": x})["OUTPUT0"])


def _mixed_inputs(batch):
    rng = np.random.default_rng(30 + batch)
    f = (rng.standard_normal((batch, 4)) * 10).astype(np.float32)
    i = rng.integers(-10, 10, size=(batch, 4)).astype(np.int64)
    return f, i


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("batch", [1, 3])
def test_infer_mixed_types(client, binary, batch):
    f, i = _mixed_inputs(batch)
    res = client.infer(
        "mixed_types",
        [_input("INPUT_FP32", f, "FP32", binary), _input("INPUT_INT64", i, "INT64", binary)],
        outputs=_outputs(["OUTPUT_FP16", "OUTPUT_BOOL"], binary),
    )
    ref = ort_run("mixed_types", {"INPUT_FP32": f, "INPUT_INT64": i})
    fp16 = res.as_numpy("OUTPUT_FP16")
    bools = res.as_numpy("OUTPUT_BOOL")
    assert fp16.dtype == np.float16 and fp16.shape == (batch, 4)
    assert bools.dtype == np.bool_ and bools.shape == (batch, 4)
    np.testing.assert_array_equal(fp16, ref["OUTPUT_FP16"])
    np.testing.assert_array_equal(bools, ref["OUTPUT_BOOL"])
    dts = {o["name"]: o["datatype"] for o in res.get_response()["outputs"]}
    assert dts == {"OUTPUT_FP16": "FP16", "OUTPUT_BOOL": "BOOL"}


@pytest.mark.parametrize("in_binary,out_binary", [(True, False), (False, True)], ids=["binary_in_json_out", "json_in_binary_out"])
def test_infer_mixed_types_cross_encoding(client, in_binary, out_binary):
    f, i = _mixed_inputs(5)
    res = client.infer(
        "mixed_types",
        [_input("INPUT_FP32", f, "FP32", in_binary), _input("INPUT_INT64", i, "INT64", in_binary)],
        outputs=_outputs(["OUTPUT_FP16", "OUTPUT_BOOL"], out_binary),
    )
    ref = ort_run("mixed_types", {"INPUT_FP32": f, "INPUT_INT64": i})
    np.testing.assert_array_equal(res.as_numpy("OUTPUT_FP16"), ref["OUTPUT_FP16"])
    np.testing.assert_array_equal(res.as_numpy("OUTPUT_BOOL"), ref["OUTPUT_BOOL"])


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("wanted", ["OUTPUT_FP16", "OUTPUT_BOOL"])
def test_infer_requested_output_subset(client, binary, wanted):
    f, i = _mixed_inputs(2)
    res = client.infer(
        "mixed_types",
        [_input("INPUT_FP32", f, "FP32", binary), _input("INPUT_INT64", i, "INT64", binary)],
        outputs=_outputs([wanted], binary),
    )
    names = [o["name"] for o in res.get_response()["outputs"]]
    assert names == [wanted]
    ref = ort_run("mixed_types", {"INPUT_FP32": f, "INPUT_INT64": i})
    np.testing.assert_array_equal(res.as_numpy(wanted), ref[wanted])


def test_infer_all_outputs_when_none_requested(client):
    f, i = _mixed_inputs(1)
    res = client.infer("mixed_types", [_input("INPUT_FP32", f, "FP32", True), _input("INPUT_INT64", i, "INT64", True)])
    assert sorted(o["name"] for o in res.get_response()["outputs"]) == ["OUTPUT_BOOL", "OUTPUT_FP16"]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_string(client, binary):
    texts = np.array([[b"hello"], [b""], ["gr\u00fc\u00dfe".encode()], [b"a b c d e f g"]], dtype=np.object_)
    res = client.infer("string_len", [_input("TEXT", texts, "BYTES", binary)], outputs=_outputs(["TEXT_OUT"], binary))
    out = res.as_numpy("TEXT_OUT")
    assert out.shape == (4, 1)
    assert out.dtype == np.object_
    ref = ort_run("string_len", {"TEXT": np.array([[t.decode()] for t in texts[:, 0]], dtype=np.object_)})["TEXT_OUT"]
    got = [v.decode() if isinstance(v, bytes) else v for v in out.flatten()]
    assert got == [str(v) for v in ref.flatten()]
    assert res.get_response()["outputs"][0]["datatype"] == "BYTES"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_nobatch(client, binary):
    rng = np.random.default_rng(40)
    x = rng.standard_normal((2, 3)).astype(np.float32)
    y = rng.standard_normal((2, 3)).astype(np.float32)
    res = client.infer("nobatch_add", [_input("X", x, "FP32", binary), _input("Y", y, "FP32", binary)], outputs=_outputs(["Z"], binary))
    out = res.as_numpy("Z")
    assert out.shape == (2, 3)
    assert_fp32_close(out, ort_run("nobatch_add", {"X": x, "Y": y})["Z"])


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_autocomplete(client, binary):
    rng = np.random.default_rng(50)
    a = rng.standard_normal((3, 8)).astype(np.float32)
    b = rng.standard_normal((3, 8)).astype(np.float32)
    res = client.infer("autocomplete_add", [_input("A", a, "FP32", binary), _input("B", b, "FP32", binary)], outputs=_outputs(["SUM"], binary))
    assert_fp32_close(res.as_numpy("SUM"), ort_run("autocomplete_add", {"A": a, "B": b})["SUM"])


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_versions(client, binary):
    x = np.arange(8, dtype=np.float32).reshape(2, 4) - 3.5
    res = client.infer("versioned_scale", [_input("INPUT0", x, "FP32", binary)], outputs=_outputs(["OUTPUT0"], binary))
    assert res.get_response()["model_version"] == "2"
    assert_fp32_close(res.as_numpy("OUTPUT0"), x * 3)
    assert_fp32_close(res.as_numpy("OUTPUT0"), ort_run("versioned_scale", {"INPUT0": x}, version=2)["OUTPUT0"])
    res = client.infer("versioned_scale", [_input("INPUT0", x, "FP32", binary)], model_version="1", outputs=_outputs(["OUTPUT0"], binary))
    assert res.get_response()["model_version"] == "1"
    assert_fp32_close(res.as_numpy("OUTPUT0"), x * 2)
    assert_fp32_close(res.as_numpy("OUTPUT0"), ort_run("versioned_scale", {"INPUT0": x}, version=1)["OUTPUT0"])


def test_infer_request_id_echoed(client):
    x = np.ones((1, 16), dtype=np.float32)
    res = client.infer("identity_fp32", [_input("INPUT0", x, "FP32", True)], request_id="req-42")
    assert res.get_response()["id"] == "req-42"


def test_infer_unknown_model_raises(client):
    x = np.ones((1, 16), dtype=np.float32)
    with pytest.raises(InferenceServerException) as ei:
        client.infer("no_such_model", [_input("INPUT0", x, "FP32", True)])
    assert "no_such_model" in str(ei.value)


# -- statistics and metrics ---------------------------------------------------------------------


def _stats(client, model, version=""):
    st = client.get_inference_statistics(model, version)
    (entry,) = [s for s in st["model_stats"] if s["name"] == model and (not version or s["version"] == version)]
    return entry


def test_statistics_increase(client):
    before = _stats(client, "identity_fp32", "1")
    x = np.zeros((2, 16), dtype=np.float32)
    n = 3
    for _ in range(n):
        client.infer("identity_fp32", [_input("INPUT0", x, "FP32", True)])
    after = _stats(client, "identity_fp32", "1")
    assert int(after["inference_stats"]["success"]["count"]) == int(before["inference_stats"]["success"]["count"]) + n
    assert int(after["inference_count"]) == int(before["inference_count"]) + 2 * n
    assert int(before["execution_count"]) < int(after["execution_count"]) <= int(before["execution_count"]) + n
    assert int(after["last_inference"]) >= int(before["last_inference"])
    assert int(after["inference_stats"]["success"]["ns"]) > int(before["inference_stats"]["success"]["ns"])


def test_statistics_all_models(client):
    st = client.get_inference_statistics()
    names = {s["name"] for s in st["model_stats"]}
    assert set(MODELS) <= names
    versions = sorted(s["version"] for s in st["model_stats"] if s["name"] == "versioned_scale")
    assert versions == ["1", "2"]


def _metric(text, name, **labels):
    """The value of one sample; labels must match exactly (order-insensitive)."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name + "{"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2)))
        if got == labels:
            return float(m.group(3))
    return None


def test_metrics_match_statistics(client, worker):
    x = np.zeros((1, 16), dtype=np.float32)
    client.infer("identity_fp32", [_input("INPUT0", x, "FP32", True)])
    stats = _stats(client, "identity_fp32", "1")
    text = worker.metrics_text()
    assert 'nv_inference_request_success{model="identity_fp32",version="1"}' in text
    assert _metric(text, "nv_inference_request_success", model="identity_fp32", version="1") == int(stats["inference_stats"]["success"]["count"])
    assert _metric(text, "nv_inference_count", model="identity_fp32", version="1") == int(stats["inference_count"])
    assert _metric(text, "nv_inference_exec_count", model="identity_fp32", version="1") == int(stats["execution_count"])


# -- compression (tritonclient's request_compression_algorithm / response_compression_algorithm) --


# 64×16 FP32: a 4 KiB answer, well over the size below which answers go back uncompressed.
COMPRESSIBLE_SHAPE = (64, 16)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_infer_compressed_response(client, algorithm):
    x = np.random.default_rng(60).standard_normal(COMPRESSIBLE_SHAPE).astype(np.float32)
    res = client.infer("identity_fp32", [_input("INPUT0", x, "FP32", True)], response_compression_algorithm=algorithm)
    assert_fp32_close(res.as_numpy("OUTPUT0"), x)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_infer_compressed_request(client, algorithm):
    """tritonserver's HTTP endpoint accepts `Content-Encoding: gzip|deflate` request bodies,
    which tritonclient sends with request_compression_algorithm."""
    x = np.random.default_rng(61).standard_normal(COMPRESSIBLE_SHAPE).astype(np.float32)
    res = client.infer("identity_fp32", [_input("INPUT0", x, "FP32", True)], request_compression_algorithm=algorithm, response_compression_algorithm=algorithm)
    assert_fp32_close(res.as_numpy("OUTPUT0"), x)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_answer_is_compressed_on_the_wire(worker, algorithm):
    """What tritonclient relies on above, seen on the wire: a large answer comes back with
    `Content-Encoding` and a body that inflates to the JSON answer; a small one goes back plain."""
    x = np.arange(64 * 16, dtype=np.float32).reshape(COMPRESSIBLE_SHAPE)
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": list(x.shape), "data": x.flatten().tolist()}]}).encode()
    status, headers, data = http_request(worker.base + "/v2/models/identity_fp32/infer", "POST", body, {"Accept-Encoding": algorithm})
    assert status == 200, data
    headers = {k.lower(): v for k, v in headers.items()}
    assert headers.get("content-encoding") == algorithm, headers
    answer = json.loads(zlib.decompress(data, wbits=31 if algorithm == "gzip" else 15))
    assert answer["outputs"][0]["data"] == x.flatten().tolist()
    small = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16}]}).encode()
    status, headers, data = http_request(worker.base + "/v2/models/identity_fp32/infer", "POST", small, {"Accept-Encoding": algorithm})
    assert status == 200 and "content-encoding" not in {k.lower() for k in headers}, headers
    assert json.loads(data)["outputs"][0]["data"] == [0.0] * 16


def test_request_level_binary_data_output(worker):
    """The request parameter binary_data_output=true returns every output in binary."""
    x = np.arange(16, dtype=np.float32)
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": x.tolist()}], "parameters": {"binary_data_output": True}}).encode()
    status, headers, data = http_request(worker.base + "/v2/models/identity_fp32/infer", "POST", body)
    assert status == 200, data
    hlen = int({k.lower(): v for k, v in headers.items()}["inference-header-content-length"])
    header = json.loads(data[:hlen])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 64
    assert "data" not in header["outputs"][0]
    np.testing.assert_array_equal(np.frombuffer(data[hlen:], dtype=np.float32), x)


# -- non-finite floats in JSON ------------------------------------------------------------------
# tritonserver parses request JSON with rapidjson's kParseNanAndInfFlag and writes responses with
# kWriteNanAndInfFlag (triton common's TritonJson), so NaN / Infinity / -Infinity round-trip in
# the JSON encoding; Python's json module (used by tritonclient) reads and writes the same tokens.

NON_FINITE = np.array([[np.nan, np.inf, -np.inf, 1.0] + [0.0] * 12], dtype=np.float32)


def test_json_output_non_finite(client):
    res = client.infer("identity_fp32", [_input("INPUT0", NON_FINITE, "FP32", True)], outputs=_outputs(["OUTPUT0"], False))
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), NON_FINITE)  # NaN == NaN for assert_array_equal


def test_json_input_non_finite(client):
    res = client.infer("identity_fp32", [_input("INPUT0", NON_FINITE, "FP32", False)], outputs=_outputs(["OUTPUT0"], True))
    np.testing.assert_array_equal(res.as_numpy("OUTPUT0"), NON_FINITE)


def test_unrecognized_load_parameter_is_invalid(worker):
    """As Triton: a load parameter other than `config` (and `file:...`) is refused, not ignored."""
    body = json.dumps({"parameters": {"config": "{}", "poll": True}}).encode()
    status, _, data = http_request(worker.base + "/v2/repository/models/no_such_model/load", "POST", body)
    assert status == 400, data
    assert json.loads(data)["error"] == "unrecognized load parameter 'poll'.", data
    # Before a file parameter is looked at, as over gRPC (whatever the keys' order).
    body = json.dumps({"parameters": {"file:1/model.onnx": "AAAA", "other": 1}}).encode()
    status, _, data = http_request(worker.base + "/v2/repository/models/no_such_model/load", "POST", body)
    assert status == 400 and json.loads(data)["error"] == "unrecognized load parameter 'other'.", data
