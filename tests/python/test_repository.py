"""The repository API (EXPLICIT mode) and POLL mode, each on a worker over a temporary copy of
some example models."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from nereid_harness import EXAMPLE_MODELS, assert_fp32_close, ort_run, wait_until

POLL_DEADLINE_S = 30.0


def _index_states(entries):
    """{(name, version or ''): (state, reason)} from an HTTP or gRPC-JSON index."""
    return {(e["name"], e.get("version", "")): (e.get("state", ""), e.get("reason", "")) for e in entries}


def _http_index(c):
    return _index_states(c.get_model_repository_index())


def _grpc_index(c):
    return _index_states(c.get_model_repository_index(as_json=True).get("models", []))


def _infer_identity(c, mod, version=""):
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    inp = mod.InferInput("INPUT0", [1, 16], "FP32")
    inp.set_data_from_numpy(x)
    res = c.infer("identity_fp32", [inp], model_version=version)
    assert_fp32_close(res.as_numpy("OUTPUT0"), x)


def _infer_scale(c, mod, version=""):
    x = np.array([[1, 2, 3, 4]], dtype=np.float32)
    inp = mod.InferInput("INPUT0", [1, 4], "FP32")
    inp.set_data_from_numpy(x)
    return c.infer("versioned_scale", [inp], model_version=version).as_numpy("OUTPUT0") / x


@pytest.fixture
def explicit_worker(repo_copy, make_worker):
    repo = repo_copy("identity_fp32", "versioned_scale", "mlp_fp32")
    return make_worker(repo, "--model-control-mode", "explicit")


@pytest.fixture
def clients(explicit_worker):
    h = httpclient.InferenceServerClient(explicit_worker.http_url)
    g = grpcclient.InferenceServerClient(explicit_worker.grpc_url)
    yield h, g
    h.close()
    g.close()


def test_explicit_index_lists_unloaded_models(clients):
    h, g = clients
    for idx in (_http_index(h), _grpc_index(g)):
        names = {name for name, _ in idx}
        assert names == {"identity_fp32", "versioned_scale", "mlp_fp32"}
        assert all(state != "READY" for state, _ in idx.values()), idx
    assert h.is_server_ready() and g.is_server_ready()
    assert not h.is_model_ready("identity_fp32")
    assert not g.is_model_ready("identity_fp32")


def test_explicit_load_unload_http(clients):
    h, g = clients
    h.load_model("identity_fp32")
    assert h.is_model_ready("identity_fp32") and g.is_model_ready("identity_fp32", "1")
    assert _http_index(h)[("identity_fp32", "1")][0] == "READY"
    _infer_identity(h, httpclient)
    h.unload_model("identity_fp32")
    assert not h.is_model_ready("identity_fp32")
    assert not g.is_model_ready("identity_fp32")
    idx = _http_index(h)
    (entry,) = [v for k, v in idx.items() if k[0] == "identity_fp32"]
    assert entry[0] == "UNAVAILABLE", idx
    with pytest.raises(InferenceServerException):
        _infer_identity(h, httpclient)
    # and it can be loaded again
    h.load_model("identity_fp32")
    _infer_identity(h, httpclient)


def test_explicit_load_unload_grpc(clients):
    h, g = clients
    g.load_model("versioned_scale")
    assert g.is_model_ready("versioned_scale", "1") and g.is_model_ready("versioned_scale", "2")
    idx = _grpc_index(g)
    assert idx[("versioned_scale", "1")][0] == "READY" and idx[("versioned_scale", "2")][0] == "READY"
    np.testing.assert_allclose(_infer_scale(g, grpcclient), 3)
    np.testing.assert_allclose(_infer_scale(g, grpcclient, "1"), 2)
    g.unload_model("versioned_scale")
    assert not g.is_model_ready("versioned_scale")
    assert not h.is_model_ready("versioned_scale", "2")
    with pytest.raises(InferenceServerException):
        _infer_scale(g, grpcclient)


def test_load_with_config_override(clients):
    h, g = clients
    h.load_model("mlp_fp32")
    assert h.get_model_config("mlp_fp32")["max_batch_size"] == 64
    override = {
        "max_batch_size": 8,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [256]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [10]}],
    }
    h.load_model("mlp_fp32", config=json.dumps(override))
    assert h.get_model_config("mlp_fp32")["max_batch_size"] == 8
    assert g.get_model_config("mlp_fp32").config.max_batch_size == 8
    # the new limit is enforced
    x = np.ones((9, 256), dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [9, 256], "FP32")
    inp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as ei:
        h.infer("mlp_fp32", [inp])
    assert "8" in str(ei.value)
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32)
    inp = grpcclient.InferInput("INPUT0", [8, 256], "FP32")
    inp.set_data_from_numpy(x)
    assert_fp32_close(g.infer("mlp_fp32", [inp]).as_numpy("OUTPUT0"), ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"])
    # gRPC load with an override too
    override["max_batch_size"] = 2
    g.load_model("mlp_fp32", config=json.dumps(override))
    assert g.get_model_config("mlp_fp32").config.max_batch_size == 2


def test_load_with_version_policy_override(clients):
    h, g = clients
    h.load_model("versioned_scale", config=json.dumps({"max_batch_size": 16, "version_policy": {"specific": {"versions": [1]}}}))
    assert h.is_model_ready("versioned_scale", "1")
    assert not h.is_model_ready("versioned_scale", "2")
    np.testing.assert_allclose(_infer_scale(g, grpcclient), 2)


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_load_unknown_model(clients, proto):
    c = dict(zip(["http", "grpc"], clients))[proto]
    with pytest.raises(InferenceServerException) as ei:
        c.load_model("no_such_model")
    assert "no_such_model" in str(ei.value)
    assert c.is_server_ready()
    assert "no_such_model" not in {name for name, _ in _http_index(clients[0])}


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_load_with_bad_config_override_keeps_serving(clients, proto):
    h, g = clients
    c = dict(http=h, grpc=g)[proto]
    c.load_model("identity_fp32")
    with pytest.raises(InferenceServerException) as ei:
        c.load_model("identity_fp32", config=json.dumps({"max_batch_sizes": 8}))
    assert "max_batch_sizes" in str(ei.value)
    with pytest.raises(InferenceServerException) as ei:
        c.load_model("identity_fp32", config="{not json")
    assert "config" in str(ei.value)
    # the model that was serving keeps serving
    assert c.is_model_ready("identity_fp32")
    _infer_identity(h, httpclient)
    _infer_identity(g, grpcclient)


_IDENTITY_OVERRIDE = {
    "max_batch_size": 8,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [16]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [16]}],
}


def _warmup(value, **sample):
    return {"model_warmup": [{"name": "w", "batch_size": 1, "inputs": {"INPUT0": value}, **sample}]}


@pytest.mark.parametrize(
    "extra,needle",
    [
        # Files outside the model's directory: a device that never ends, or any host file.
        (_warmup({"data_type": "TYPE_FP32", "dims": [16], "input_data_file": "/dev/zero"}),
         "input_data_file '/dev/zero': must name a file inside the model's directory"),
        (_warmup({"data_type": "TYPE_FP32", "dims": [16], "input_data_file": "../../../../../dev/zero"}),
         "must name a file inside the model's directory"),
        ({"default_model_filename": "../mlp_fp32/1/model.onnx"},
         "default_model_filename '../mlp_fp32/1/model.onnx': must name a file inside"),
        # Work that would run before anything checks it (warm-up sizes: a unit test of
        # check_warmup; this model's dims are fixed).
        (_warmup({"data_type": "TYPE_FP32", "dims": [16], "zero_data": True}, count=100000), "count 100000 is over"),
        ({"instance_group": [{"kind": "KIND_CPU", "count": 100000}]}, "instance_group[0].count must be in 0..=1024"),
        # Counted over all groups before any is built.
        ({"instance_group": [{"kind": "KIND_CPU", "count": 1024}] * 3}, "ask for 3072 instances, more than 1024 instances"),
    ],
    ids=["dev-zero", "dot-dot", "model-file", "warmup-count", "instances", "instance-groups"],
)
def test_load_overrides_cannot_reach_outside_or_exhaust_the_worker(clients, extra, needle):
    """A load request's config override is a client's input: files it names stay inside the
    model's directory and what it makes the worker allocate or run is bounded — each refused
    with a reason naming the field, the model that was serving keeps serving."""
    h, g = clients
    h.load_model("identity_fp32")
    with pytest.raises(InferenceServerException) as ei:
        h.load_model("identity_fp32", config=json.dumps({**_IDENTITY_OVERRIDE, **extra}))
    assert needle in str(ei.value)
    assert h.is_model_ready("identity_fp32")
    _infer_identity(h, httpclient)
    _infer_identity(g, grpcclient)


def test_load_with_files_is_refused_clearly(clients):
    h, _ = clients
    with pytest.raises(InferenceServerException) as ei:
        h.load_model("identity_fp32", config=json.dumps({"max_batch_size": 4}), files={"file:1/model.onnx": b"\x08\x01"})
    assert "file:1/model.onnx" in str(ei.value)
    assert h.is_server_ready()


def test_explicit_load_model_flag(repo_copy, make_worker):
    repo = repo_copy("identity_fp32", "versioned_scale")
    w = make_worker(repo, "--model-control-mode", "explicit", "--load-model", "identity_fp32")
    h = httpclient.InferenceServerClient(w.http_url)
    try:
        assert h.is_model_ready("identity_fp32")
        assert not h.is_model_ready("versioned_scale")
        idx = _http_index(h)
        assert idx[("identity_fp32", "1")][0] == "READY"
        _infer_identity(h, httpclient)
    finally:
        h.close()


def _poll_worker(repo_copy, make_worker, *models):
    repo = repo_copy(*models)
    w = make_worker(repo, "--model-control-mode", "poll", "--repository-poll-secs", "1")
    return repo, w, httpclient.InferenceServerClient(w.http_url)


def _add_model_and_wait(repo, h, name):
    """Copies example model `name` into the repository and waits until polling loaded it:
    proof that at least one full repository scan happened after the call."""
    shutil.copytree(EXAMPLE_MODELS / name, repo / name)
    wait_until(lambda: h.is_model_ready(name), POLL_DEADLINE_S, interval=0.1, what=f"{name} to be loaded by polling")


def test_poll_version_policy_change(repo_copy, make_worker):
    repo, w, h = _poll_worker(repo_copy, make_worker, "versioned_scale")
    try:
        assert h.is_model_ready("versioned_scale", "1") and h.is_model_ready("versioned_scale", "2")
        cfg = repo / "versioned_scale" / "config.pbtxt"
        text = cfg.read_text()
        assert "version_policy: { all: { } }" in text
        cfg.write_text(text.replace("version_policy: { all: { } }", "version_policy: { latest: { num_versions: 1 } }"))

        def v1_gone():
            idx = _http_index(h)
            v1 = idx.get(("versioned_scale", "1"), ("", ""))[0]
            v2 = idx.get(("versioned_scale", "2"), ("", ""))[0]
            return v1 != "READY" and v2 == "READY"

        wait_until(v1_gone, POLL_DEADLINE_S, interval=0.1, what="versioned_scale v1 to be unloaded by polling")
        assert not h.is_model_ready("versioned_scale", "1")
        assert h.is_model_ready("versioned_scale", "2")
        np.testing.assert_allclose(_infer_scale(h, httpclient), 3)
        with pytest.raises(InferenceServerException):
            _infer_scale(h, httpclient, "1")
    finally:
        h.close()


def test_poll_new_model_and_removal(repo_copy, make_worker):
    repo, w, h = _poll_worker(repo_copy, make_worker, "identity_fp32")
    try:
        assert not h.is_model_ready("nobatch_add")
        _add_model_and_wait(repo, h, "nobatch_add")
        x = np.ones((2, 3), dtype=np.float32)
        ins = []
        for name in ("X", "Y"):
            inp = httpclient.InferInput(name, [2, 3], "FP32")
            inp.set_data_from_numpy(x)
            ins.append(inp)
        assert_fp32_close(h.infer("nobatch_add", ins).as_numpy("Z"), x + x)
        shutil.rmtree(repo / "nobatch_add")
        wait_until(lambda: not h.is_model_ready("nobatch_add"), POLL_DEADLINE_S, interval=0.1, what="nobatch_add to be unloaded by polling")
        _infer_identity(h, httpclient)
    finally:
        h.close()


def test_poll_broken_edit_keeps_old_model_serving(repo_copy, make_worker):
    repo, w, h = _poll_worker(repo_copy, make_worker, "identity_fp32")
    try:
        cfg = repo / "identity_fp32" / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace("max_batch_size: 64", "max_batch_size: 64 bogus_field: 1"))
        # the failed reload is reported (naming the field and line) ...
        wait_until(lambda: "bogus_field" in w.log_tail(10**6), POLL_DEADLINE_S, interval=0.1, what="the failed reload to be logged")
        assert "line 3" in [l for l in w.log_tail(10**6).splitlines() if "bogus_field" in l][0]
        # ... while the previous model keeps serving
        assert h.is_model_ready("identity_fp32")
        _infer_identity(h, httpclient)
        assert h.get_model_config("identity_fp32")["max_batch_size"] == 64
        # fixing the file reloads it
        cfg.write_text(cfg.read_text().replace(" bogus_field: 1", "").replace("max_batch_size: 64", "max_batch_size: 32"))
        wait_until(lambda: h.get_model_config("identity_fp32")["max_batch_size"] == 32, POLL_DEADLINE_S, interval=0.1, what="the fixed config to be loaded")
        _infer_identity(h, httpclient)
    finally:
        h.close()


def test_poll_failed_reload_not_retried_until_files_change(repo_copy, make_worker):
    """A reload that failed is not retried on every scan while the files stay the same
    (tritonserver only reloads a model whose files changed). Otherwise a broken model is
    re-parsed and re-loaded (an ONNX Runtime session per instance) every poll period and the log
    fills with the same error."""
    repo, w, h = _poll_worker(repo_copy, make_worker, "identity_fp32")
    try:
        cfg = repo / "identity_fp32" / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace("max_batch_size: 64", "max_batch_size: 64 bogus_field: 1"))
        wait_until(lambda: "bogus_field" in w.log_tail(10**6), POLL_DEADLINE_S, interval=0.1, what="the failed reload to be logged")
        # two more full scans, each proven by a newly added model becoming ready
        _add_model_and_wait(repo, h, "nobatch_add")
        _add_model_and_wait(repo, h, "versioned_scale")
        attempts = [l for l in w.log_tail(10**6).splitlines() if "bogus_field" in l and "reload failed" in l]
        assert len(attempts) == 1, f"the unchanged broken config was reloaded {len(attempts)} times:\n" + "\n".join(attempts)
        assert h.is_model_ready("identity_fp32")
    finally:
        h.close()


def test_poll_removing_a_model_that_failed_to_load_restores_readiness(repo_copy, make_worker, tmp_path):
    """Under strict readiness a model that failed to load keeps the worker not-ready; deleting
    it from the repository (the operator's fix) makes the worker ready again without a restart."""
    repo, w, h = _poll_worker(repo_copy, make_worker, "identity_fp32")
    try:
        assert h.is_server_ready()
        # Prepared outside and renamed in, so that no scan sees it half written.
        staged = tmp_path / "staged"
        shutil.copytree(EXAMPLE_MODELS / "identity_fp32", staged)
        cfg = staged / "config.pbtxt"
        cfg.write_text(cfg.read_text().replace('name: "identity_fp32"', 'name: "broken"') + "bogus_field: 1\n")
        broken = repo / "broken"
        staged.rename(broken)
        wait_until(lambda: not h.is_server_ready(), POLL_DEADLINE_S, interval=0.1, what="the failed load to make the worker not ready")
        rows = {e["name"]: e for e in h.get_model_repository_index()}
        assert rows["broken"]["state"] == "UNAVAILABLE" and "bogus_field" in rows["broken"]["reason"], rows
        shutil.rmtree(broken)
        wait_until(h.is_server_ready, POLL_DEADLINE_S, interval=0.1, what="readiness after the broken model was removed")
        assert not h.is_model_ready("broken")
        _infer_identity(h, httpclient)
    finally:
        h.close()


@pytest.mark.parametrize("mode", ["none", "poll"])
def test_load_unload_refused_outside_explicit_mode(repo_copy, make_worker, mode):
    repo = repo_copy("identity_fp32")
    w = make_worker(repo, "--model-control-mode", mode, "--repository-poll-secs", "1")
    h = httpclient.InferenceServerClient(w.http_url)
    g = grpcclient.InferenceServerClient(w.grpc_url)
    try:
        for c in (h, g):
            for call in (c.unload_model, c.load_model):
                with pytest.raises(InferenceServerException) as e:
                    call("identity_fp32")
                assert "only allowed with --model-control-mode=explicit" in str(e.value), str(e.value)
            assert c.is_model_ready("identity_fp32")
        _infer_identity(h, httpclient)
    finally:
        h.close()
        g.close()


def _pending(w, model="identity_fp32"):
    for line in w.metrics_text().splitlines():
        if line.startswith(f'nv_inference_pending_request_count{{model="{model}",version="1"}}'):
            return int(float(line.split()[-1]))
    return 0


# How long test_unload_and_reload_let_in_flight_requests_finish holds its request (see there).
HOLD_S = 10


def test_unload_and_reload_let_in_flight_requests_finish(repo_copy, make_worker):
    """A request queued when its model is unloaded (or reloaded) still completes, like
    tritonserver.

    The request is held by the batcher's queue delay, and nothing else can release it: once its
    model is unloaded (or replaced) no request reaches the queue it waits in, so no rows can
    fill its batch. The hold is therefore a time, HOLD_S, far longer than the unload (or
    reload) and the checks after it; the request is asserted still pending after them, so that
    the test cannot pass with it answered before the action under test."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    repo = repo_copy("identity_fp32")
    cfg = repo / "identity_fp32" / "config.pbtxt"
    text = cfg.read_text()
    held = text.replace("max_queue_delay_microseconds: 0\n", f"max_queue_delay_microseconds: {HOLD_S * 1_000_000}\n")
    assert held != text, "the example identity_fp32 config no longer has the queue delay this test raises"
    cfg.write_text(held)
    w = make_worker(repo, "--model-control-mode", "explicit", "--load-model", "identity_fp32")
    h = httpclient.InferenceServerClient(w.http_url)
    ch = grpc.insecure_channel(w.grpc_url)
    try:
        stub = pbg.GRPCInferenceServiceStub(ch)
        x = np.arange(16, dtype=np.float32).reshape(1, 16)
        req = pb.ModelInferRequest(model_name="identity_fp32")
        i = req.inputs.add()
        i.name, i.datatype = "INPUT0", "FP32"
        i.shape.extend([1, 16])
        req.raw_input_contents.append(x.tobytes())

        # unload
        fut = stub.ModelInfer.future(req, timeout=HOLD_S + 30)
        wait_until(lambda: _pending(w) == 1, 10, what="the request to be queued")
        h.unload_model("identity_fp32")
        assert not h.is_model_ready("identity_fp32")
        assert not fut.done(), "the held request was answered before the unload was checked"
        resp = fut.result(timeout=HOLD_S + 30)
        assert_fp32_close(np.frombuffer(resp.raw_output_contents[0], dtype=np.float32), x.flatten())

        # reload with a different config (no queue delay)
        h.load_model("identity_fp32")
        fut = stub.ModelInfer.future(req, timeout=HOLD_S + 30)
        wait_until(lambda: _pending(w) == 1, 10, what="the request to be queued")
        h.load_model("identity_fp32", config=json.dumps({"max_batch_size": 8, "dynamic_batching": {}}))
        assert h.get_model_config("identity_fp32")["max_batch_size"] == 8
        # the new version serves at once while the old one still holds its request
        _infer_identity(h, httpclient)
        assert not fut.done(), "the held request was answered before the reload was checked"
        resp = fut.result(timeout=HOLD_S + 30)
        assert_fp32_close(np.frombuffer(resp.raw_output_contents[0], dtype=np.float32), x.flatten())
        _infer_identity(h, httpclient)
    finally:
        ch.close()
        h.close()


def test_load_rejects_path_like_names(repo_copy, make_worker):
    """A model name is looked up among the repository's entries, never followed as a path:
    "../repo/identity_fp32" names this very model by a path (`repo_copy`'s folder is "repo"),
    ".." and "/etc" directories with no model config. Each is refused as no model of that
    name (NOT_FOUND, the message naming it), not loaded or failed on what the path holds."""
    repo = repo_copy("identity_fp32")
    assert repo.name == "repo", "the first name below must point into this repository"
    w = make_worker(repo, "--model-control-mode", "explicit")
    h = httpclient.InferenceServerClient(w.http_url)
    g = grpcclient.InferenceServerClient(w.grpc_url)
    try:
        for name in ("../repo/identity_fp32", "..", "identity_fp32/1", "/etc"):
            with pytest.raises(InferenceServerException) as e:
                g.load_model(name)
            assert e.value.status() == "StatusCode.NOT_FOUND", (name, e.value.status(), str(e.value))
            assert f"failed to load '{name}': no model directory '{name}' in the model repository" in str(e.value), str(e.value)
            assert not g.is_model_ready(name)
        assert all(not name.startswith((".", "/")) for name, _ in _grpc_index(g))
        assert h.is_server_ready()
    finally:
        h.close()
        g.close()
