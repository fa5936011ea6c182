"""A repository with one good model and many broken ones: the worker starts, the good model
serves, and the index reports each broken model UNAVAILABLE with a reason naming the problem
(the field and line for config errors)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from nereid_harness import EXAMPLE_MODELS, ORT_LIB, WORKER_BIN, assert_fp32_close, check_example_models, copy_model


def _variant(repo, name, base, edit=None, model_bytes=None, drop_model=False, drop_versions=False):
    """repo/name: a copy of example model `base` renamed to `name`, then edited."""
    d = copy_model(repo, name, base, edit=edit)
    if model_bytes is not None:
        (d / "1" / "model.onnx").write_bytes(model_bytes)
    if drop_model:
        (d / "1" / "model.onnx").unlink()
    if drop_versions:
        for v in d.iterdir():
            if v.is_dir():
                shutil.rmtree(v)
    return d


def _sub_first(old, new):
    return lambda t: t.replace(old, new, 1)


# name -> (base model, kwargs for _variant, substrings the reason must contain, regex it must match or None)
BROKEN = {
    "syntax_error": ("identity_fp32", dict(edit=lambda t: t + "}}}\n"), ["config.pbtxt", "}"], r"line \d+"),
    "syntax_unclosed_list": ("identity_fp32", dict(edit=_sub_first("dims: [ 16 ]", "dims: [ 16 ")), ["config.pbtxt"], r"line 9\b"),
    "syntax_bad_value": ("identity_fp32", dict(edit=_sub_first("max_batch_size: 64", "max_batch_size: : 64")), ["config.pbtxt"], r"line 3\b"),
    "unknown_field": ("identity_fp32", dict(edit=_sub_first("max_batch_size: 64", "max_batch_size: 64\nmax_batch_sizes: 3")), ["max_batch_sizes"], r"line 4\b"),
    "unknown_nested_field": ("identity_fp32", dict(edit=_sub_first("data_type: TYPE_FP32", "data_type: TYPE_FP32\n    datatype: TYPE_FP32")), ["datatype"], r"line \d+"),
    "unknown_enum_value": ("identity_fp32", dict(edit=_sub_first("KIND_CPU", "KIND_TPU")), ["KIND_TPU"], r"line \d+"),
    "missing_model_file": ("identity_fp32", dict(drop_model=True), ["model.onnx"], None),
    "no_version_folder": ("identity_fp32", dict(drop_versions=True), ["version"], None),
    "not_onnx": ("identity_fp32", dict(model_bytes=bytes(range(256)) * 8), ["model.onnx"], None),
    "input_dtype_mismatch": ("identity_fp32", dict(edit=_sub_first("TYPE_FP32", "TYPE_INT32")), ["INPUT0", "TYPE_INT32", "TYPE_FP32"], None),
    "output_dtype_mismatch": ("mixed_types", dict(edit=_sub_first("TYPE_BOOL", "TYPE_INT32")), ["OUTPUT_BOOL", "TYPE_INT32", "TYPE_BOOL"], None),
    "dims_mismatch": ("identity_fp32", dict(edit=_sub_first("dims: [ 16 ]", "dims: [ 8 ]")), ["INPUT0", "8", "16"], None),
    "unknown_input_name": ("identity_fp32", dict(edit=_sub_first('"INPUT0"', '"WRONG_NAME"')), ["WRONG_NAME"], None),
    "batching_without_batch_dim": ("nobatch_add", dict(edit=_sub_first("max_batch_size: 0", "max_batch_size: 4")), ["X", "max_batch_size"], None),
    "config_name_mismatch": ("identity_fp32", dict(edit=lambda t: t.replace('name: "config_name_mismatch"', 'name: "something_else"')), ["something_else"], None),
    "unsupported_backend": ("identity_fp32", dict(edit=_sub_first('backend: "onnxruntime"', 'backend: "pytorch"')), ["pytorch"], None),
    "unsupported_sequence_batching": ("string_len", dict(edit=lambda t: t + "sequence_batching { }\n"), ["sequence_batching"], None),
    "reshape_element_count": ("identity_fp32", dict(edit=_sub_first("dims: [ 16 ]", "dims: [ 16 ]\n    reshape: { shape: [ 4, 5 ] }")), ["INPUT0", "reshape", "20"], None),
    "reshape_not_the_model": ("identity_fp32", dict(edit=_sub_first("dims: [ 16 ]", "dims: [ 16 ]\n    reshape: { shape: [ 4, 4 ] }")), ["INPUT0", "reshape [4, 4]"], None),
    "reshape_dims_overflow": ("identity_fp32", dict(edit=_sub_first("dims: [ 16 ]", "dims: [ 4294967296, 4294967296 ]\n    reshape: { shape: [ 1 ] }")), ["INPUT0", "more elements than can be counted"], None),
}


@pytest.fixture(scope="module")
def broken_repo(tmp_path_factory):
    check_example_models()
    repo = tmp_path_factory.mktemp("broken") / "repo"
    repo.mkdir()
    shutil.copytree(EXAMPLE_MODELS / "identity_fp32", repo / "identity_fp32")
    # a field that only warns here (response_cache without --cache-config): the model still loads
    _variant(repo, "ignored_tuning_field", "string_len", edit=lambda t: t + "response_cache { enable: true }\n")
    for name, (base, kw, _, _) in BROKEN.items():
        _variant(repo, name, base, **kw)
    return repo


@pytest.fixture(scope="module")
def broken_worker(start_worker, broken_repo):
    # Not strict: with broken models a strictly-ready worker never reports ready
    # (test_triton_repo_semantics.py covers that); here the good models must serve regardless.
    w = start_worker(broken_repo, "--strict-readiness=false")
    yield w
    w.stop()


@pytest.fixture(scope="module")
def index(broken_worker):
    return {(e["name"], e.get("version", "")): e for e in broken_worker.index()}


def test_worker_starts_and_good_model_serves(broken_worker):
    c = httpclient.InferenceServerClient(broken_worker.http_url)
    try:
        assert c.is_server_live() and c.is_server_ready()
        assert c.is_model_ready("identity_fp32")
        x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
        inp = httpclient.InferInput("INPUT0", [2, 16], "FP32")
        inp.set_data_from_numpy(x)
        assert_fp32_close(c.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), x)
    finally:
        c.close()


def test_ignored_tuning_field_still_loads(broken_worker, index):
    assert index[("ignored_tuning_field", "1")]["state"] == "READY"
    assert "response_cache" in broken_worker.log_tail(10**6)  # reported as a warning


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_model_reported(broken_worker, index, name):
    _, _, needles, pattern = BROKEN[name]
    entries = [e for (n, _), e in index.items() if n == name]
    assert entries, f"{name} missing from the index: {sorted(index)}"
    for e in entries:
        assert e["state"] == "UNAVAILABLE", e
        reason = e["reason"]
        assert reason, e
        for n in needles:
            assert n in reason, f"{n!r} not in reason {reason!r}"
        if pattern:
            assert re.search(pattern, reason), f"{pattern!r} does not match reason {reason!r}"
    c = httpclient.InferenceServerClient(broken_worker.http_url)
    try:
        assert not c.is_model_ready(name)
    finally:
        c.close()


def test_broken_model_infer_and_metadata_fail_clearly(broken_worker):
    x = np.zeros((1, 16), dtype=np.float32)
    for path in ("/v2/models/not_onnx", "/v2/models/not_onnx/config"):
        status, _, body = broken_worker.get(path)
        assert status in (400, 404, 503), (path, status, body)
        assert "not_onnx" in json.loads(body)["error"]
    status, _, body = broken_worker.post(
        "/v2/models/input_dtype_mismatch/infer", {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": x.flatten().tolist()}]}
    )
    assert status in (400, 503), (status, body)
    err = json.loads(body)["error"]
    assert "input_dtype_mismatch" in err
    g = grpcclient.InferenceServerClient(broken_worker.grpc_url)
    try:
        inp = grpcclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(x)
        with pytest.raises(InferenceServerException) as ei:
            g.infer("not_onnx", [inp])
        assert ei.value.status() in ("StatusCode.UNAVAILABLE", "StatusCode.NOT_FOUND", "StatusCode.INVALID_ARGUMENT")
        assert "not_onnx" in str(ei.value)
        # and the good one still serves on gRPC
        assert_fp32_close(g.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), x)
    finally:
        g.close()


def test_grpc_index_matches_http(broken_worker, index):
    g = grpcclient.InferenceServerClient(broken_worker.grpc_url)
    try:
        models = g.get_model_repository_index(as_json=True)["models"]
    finally:
        g.close()
    grpc_index = {(m["name"], m.get("version", "")): (m.get("state", ""), m.get("reason", "")) for m in models}
    http_index = {k: (e.get("state", ""), e.get("reason", "")) for k, e in index.items()}
    assert grpc_index == http_index


def test_explicit_load_of_broken_model_then_fix(repo_copy, make_worker):
    repo = repo_copy("identity_fp32")
    _variant(repo, "fixable", "identity_fp32", edit=_sub_first("TYPE_FP32", "TYPE_INT32"))
    w = make_worker(repo, "--model-control-mode", "explicit", "--load-model", "identity_fp32")
    c = httpclient.InferenceServerClient(w.http_url)
    try:
        with pytest.raises(InferenceServerException) as ei:
            c.load_model("fixable")
        assert "INPUT0" in str(ei.value) and "TYPE_INT32" in str(ei.value)
        idx = {(e["name"], e.get("version", "")): e for e in c.get_model_repository_index()}
        (entry,) = [e for (n, _), e in idx.items() if n == "fixable"]
        assert entry["state"] == "UNAVAILABLE" and "TYPE_INT32" in entry["reason"]
        cfg = repo / "fixable" / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace("TYPE_INT32", "TYPE_FP32"))
        c.load_model("fixable")
        assert c.is_model_ready("fixable")
        x = np.ones((1, 16), dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(x)
        assert_fp32_close(c.infer("fixable", [inp]).as_numpy("OUTPUT0"), x)
    finally:
        c.close()


# tritonserver's two spellings: --strict-model-config=true and (newer) --disable-auto-complete-config.
@pytest.mark.parametrize("flag", ["--strict-model-config=true", "--disable-auto-complete-config"])
def test_strict_model_config_refuses_autocomplete(repo_copy, make_worker, flag):
    repo = repo_copy("identity_fp32", "autocomplete_add")
    w = make_worker(repo, flag, "--strict-readiness=false")
    idx = {e["name"]: e for e in w.index()}
    assert idx["identity_fp32"]["state"] == "READY"
    assert idx["autocomplete_add"]["state"] == "UNAVAILABLE"
    assert "config.pbtxt" in idx["autocomplete_add"]["reason"]


def test_exit_on_error(repo_copy, tmp_path):
    repo = repo_copy("identity_fp32")
    _variant(repo, "unknown_field", "identity_fp32", edit=_sub_first("max_batch_size: 64", "max_batch_size: 64\nmax_batch_sizes: 3"))
    proc = subprocess.run(
        [str(WORKER_BIN), "--model-repository", str(repo), "--address", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
         "--exit-on-error=true", "--onnxruntime-lib", str(ORT_LIB)],
        capture_output=True, timeout=60, cwd=tmp_path,
    )
    assert proc.returncode != 0
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    assert "unknown_field" in out and "max_batch_sizes" in out, out[-4000:]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--model-control-mode", "sometimes"], "invalid value 'sometimes' for '--model-control-mode"),
        (["--http-port", "notaport"], "invalid value 'notaport' for '--http-port"),
        (["--no-such-flag"], "unexpected argument '--no-such-flag'"),
    ],
)
def test_invalid_flags_exit_nonzero_naming_the_flag(tmp_path, args, needle):
    # Every port 0 on loopback (but the flag under test: given twice, a flag is refused for
    # that), so that a worker which accepted the flag would bind no fixed port; it would then
    # run, and the bounded wait below fail the test.
    ports = [a for flag in ("--http-port", "--grpc-port", "--metrics-port") if flag not in args for a in (flag, "0")]
    proc = subprocess.run(
        [str(WORKER_BIN), "--model-repository", str(EXAMPLE_MODELS), "--address", "127.0.0.1", *ports,
         "--onnxruntime-lib", str(ORT_LIB), *args],
        capture_output=True, timeout=60, cwd=tmp_path,
    )
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode != 0, out[-4000:]
    assert needle in out, out[-4000:]


def test_missing_repository_exits_nonzero(tmp_path):
    proc = subprocess.run(
        [str(WORKER_BIN), "--model-repository", str(tmp_path / "does_not_exist"), "--address", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
         "--metrics-port", "0", "--onnxruntime-lib", str(ORT_LIB)],
        capture_output=True, timeout=60, cwd=tmp_path,
    )
    assert proc.returncode != 0
    assert "does_not_exist" in (proc.stdout + proc.stderr).decode(errors="replace")
