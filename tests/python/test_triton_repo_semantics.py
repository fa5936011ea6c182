"""Model-repository semantics where Nereid follows Triton: strict readiness, canonical version
folders, `specific` policies naming missing versions, instance-group defaults in the served
config, auto-complete's dynamic batching, --strict-model-config, model_warmup checks, warnings
in the repository index, a model name found in two repositories, and metrics that count
successful requests only. Every wait is on a condition, bounded."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from nereid_harness import check_example_models, copy_model, wait_until

LOAD_TIMEOUT_S = 60.0


def _without_instance_group(text):
    return re.sub(r"instance_group \[.*?\]\n", "", text, flags=re.S)


def _settled(worker, names):
    """The index rows of `names` once none is LOADING (or absent)."""

    def rows():
        idx = {e["name"]: e for e in worker.index()}
        if all(n in idx and idx[n].get("state") not in ("", "LOADING") for n in names):
            return idx
        return None

    return wait_until(rows, LOAD_TIMEOUT_S, what=f"{names} settled")


def _warmup(name, value):
    return (
        f'model_warmup [ {{ name: "{name}" batch_size: 1 inputs {{ key: {value} }} }} ]\n'
    )


@pytest.fixture(scope="module")
def semantics_repo(tmp_path_factory):
    check_example_models()
    repo = tmp_path_factory.mktemp("semantics") / "repo"
    repo.mkdir()
    copy_model(repo, "plain")
    # "07" and "+1" are no versions (Triton skips them); "3" is.
    d = copy_model(repo, "odd_versions", edit=lambda t: t + "version_policy: { all: { } }\n")
    (d / "1").rename(d / "07")
    shutil.copytree(d / "07", d / "+1")
    shutil.copytree(d / "07", d / "3")
    copy_model(repo, "specific_missing", edit=lambda t: t + "version_policy: { specific: { versions: [ 1, 5 ] } }\n")
    copy_model(repo, "default_count", edit=lambda t: _without_instance_group(t) + "instance_group [ { kind: KIND_CPU } ]\n")
    copy_model(repo, "no_group", edit=_without_instance_group)
    copy_model(repo, "partial_batching", base="autocomplete_add", config='name: "partial_batching"\nmax_batch_size: 8\n')
    copy_model(repo, "tuning_warning", edit=lambda t: t + "optimization { priority: PRIORITY_MAX graph { level: -1 } }\n")
    copy_model(repo, "graph_level", edit=lambda t: t + 'optimization { graph { level: 1 } }\nparameters { key: "execution_mode" value: { string_value: "1" } }\n')
    for name, value in {
        "warmup_dtype": '"INPUT0" value: { data_type: TYPE_INT32 dims: [ 16 ] zero_data: true }',
        "warmup_dims": '"INPUT0" value: { data_type: TYPE_FP32 dims: [ 15 ] zero_data: true }',
        "warmup_name": '"NOT_AN_INPUT" value: { data_type: TYPE_FP32 dims: [ 16 ] zero_data: true }',
    }.items():
        copy_model(repo, name, edit=lambda t, v=value, n=name: t + _warmup(f"{n}_sample", v))
    return repo


@pytest.fixture(scope="module")
def semantics_worker(start_worker, semantics_repo):
    # Broken models: under strict readiness (the default) the worker never reports ready.
    w = start_worker(semantics_repo, "--log-verbose", "1", wait_ready=False)
    names = [p.name for p in semantics_repo.iterdir()]
    w.settled = _settled(w, names)
    yield w
    w.stop()


def _rows(worker, name):
    return [e for e in worker.index() if e["name"] == name]


def test_strict_readiness_is_the_default(semantics_worker):
    h = httpclient.InferenceServerClient(semantics_worker.http_url)
    g = grpcclient.InferenceServerClient(semantics_worker.grpc_url)
    try:
        assert h.is_server_live()
        assert not h.is_server_ready(), "a model failed to load: not ready under strict readiness"
        assert not g.is_server_ready()
        assert h.is_model_ready("plain")  # the models that loaded still serve
    finally:
        h.close()
        g.close()
    status, _, _ = semantics_worker.get("/v2/health/ready")
    assert status != 200


def test_non_canonical_version_folders_are_skipped(semantics_worker):
    rows = _rows(semantics_worker, "odd_versions")
    assert [r["version"] for r in rows] == ["3"], rows
    assert all(r["state"] == "READY" for r in rows)
    assert "'07'" in rows[0]["reason"] and "'+1'" in rows[0]["reason"], rows


def test_specific_policy_loads_the_versions_that_exist(semantics_worker):
    rows = _rows(semantics_worker, "specific_missing")
    assert [(r["version"], r["state"]) for r in rows] == [("1", "READY")], rows
    assert "version 5" in rows[0]["reason"], rows


@pytest.mark.parametrize("name", ["default_count", "no_group"])
def test_instance_group_defaults_are_resolved_in_the_served_config(semantics_worker, name):
    status, _, body = semantics_worker.get(f"/v2/models/{name}/config")
    assert status == 200, body
    groups = json.loads(body)["instance_group"]
    assert len(groups) == 1, groups
    assert groups[0]["name"] == f"{name}_0"
    assert int(groups[0]["count"]) == 2  # Triton's default count for KIND_CPU
    assert groups[0]["kind"] == "KIND_CPU"
    g = grpcclient.InferenceServerClient(semantics_worker.grpc_url)
    try:
        cfg = g.get_model_config(name, as_json=True)["config"]
        assert int(cfg["instance_group"][0]["count"]) == 2 and cfg["instance_group"][0]["name"] == f"{name}_0"
    finally:
        g.close()


def test_autocomplete_adds_dynamic_batching_to_a_configured_max_batch_size(semantics_worker):
    status, _, body = semantics_worker.get("/v2/models/partial_batching/config")
    assert status == 200, body
    cfg = json.loads(body)
    assert cfg["max_batch_size"] == 8
    assert "dynamic_batching" in cfg, cfg
    assert sorted(i["name"] for i in cfg["input"]) == ["A", "B"]


@pytest.mark.parametrize(
    "name,needles",
    [
        ("warmup_dtype", ["warmup_dtype_sample", "data_type", "TYPE_INT32", "TYPE_FP32"]),
        ("warmup_dims", ["warmup_dims_sample", "dims", "[15]", "[16]"]),
        ("warmup_name", ["warmup_name_sample", "NOT_AN_INPUT", "not a model input"]),
    ],
)
def test_mismatched_warmup_samples_fail_the_load(semantics_worker, name, needles):
    rows = _rows(semantics_worker, name)
    assert rows and all(r["state"] == "UNAVAILABLE" for r in rows), rows
    for n in needles:
        assert n in rows[0]["reason"], (n, rows)


def test_unsupported_field_warnings_are_in_the_index(semantics_worker):
    rows = _rows(semantics_worker, "tuning_warning")
    assert rows and rows[0]["state"] == "READY", rows
    assert "optimization.priority" in rows[0]["reason"], rows
    assert "graph" not in rows[0]["reason"], rows  # applied, not ignored
    g = grpcclient.InferenceServerClient(semantics_worker.grpc_url)
    try:
        models = g.get_model_repository_index(as_json=True).get("models", [])
        row = next(m for m in models if m["name"] == "tuning_warning")
        assert "optimization.priority" in row.get("reason", ""), row
    finally:
        g.close()
    assert _rows(semantics_worker, "plain")[0]["reason"] == ""


def test_graph_level_and_execution_mode_are_applied(semantics_worker):
    rows = _rows(semantics_worker, "graph_level")
    assert rows and rows[0]["state"] == "READY" and rows[0]["reason"] == "", rows
    log = semantics_worker.log_tail(10**7)
    sessions = [line for line in log.splitlines() if "graph_level" in line and "creating an ONNX Runtime session" in line]
    assert sessions, "no session log line for graph_level"
    assert all("Level2" in line and "parallel_execution=true" in line for line in sessions), sessions


def test_explicit_mode_readiness_follows_loads_and_unloads(start_worker, semantics_repo):
    w = start_worker(semantics_repo, "--model-control-mode", "explicit")
    c = httpclient.InferenceServerClient(w.http_url)
    try:
        assert c.is_server_ready(), "nothing loaded yet: ready"
        c.load_model("plain")
        assert c.is_server_ready()
        with pytest.raises(InferenceServerException):
            c.load_model("warmup_dtype")
        assert not c.is_server_ready(), "a model the server tried to load is not READY"
        c.unload_model("warmup_dtype")
        wait_until(lambda: c.is_server_ready(), LOAD_TIMEOUT_S, what="ready after unloading the failed model")
        c.unload_model("plain")
        wait_until(lambda: c.is_server_ready(), LOAD_TIMEOUT_S, what="ready with everything unloaded")
    finally:
        c.close()


def test_strict_readiness_false_and_ambiguous_and_strict_config(start_worker, tmp_path):
    check_example_models()
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    copy_model(first, "twice")
    copy_model(second, "twice")
    copy_model(first, "complete")
    copy_model(first, "partial", base="autocomplete_add", config='name: "partial"\nmax_batch_size: 8\n')
    w = start_worker(
        first, "--model-repository", str(second), "--strict-readiness=false", "--strict-model-config=true"
    )
    c = httpclient.InferenceServerClient(w.http_url)
    try:
        assert c.is_server_ready(), "--strict-readiness=false: ready despite failed models"
        assert c.is_model_ready("complete")
    finally:
        c.close()
    idx = _settled(w, ["twice", "complete", "partial"])
    twice = idx["twice"]
    assert twice["state"] == "UNAVAILABLE", twice
    assert str(first / "twice") in twice["reason"] and str(second / "twice") in twice["reason"], twice
    partial = idx["partial"]
    assert partial["state"] == "UNAVAILABLE", partial
    assert "--strict-model-config" in partial["reason"], partial


def test_metrics_count_successful_requests_only(start_worker, tmp_path):
    check_example_models()
    repo = tmp_path / "repo"
    repo.mkdir()
    copy_model(repo, "m")
    w = start_worker(repo)
    c = httpclient.InferenceServerClient(w.http_url)
    try:
        for rows in (3, 2):
            x = np.ones((rows, 16), dtype=np.float32)
            i = httpclient.InferInput("INPUT0", [rows, 16], "FP32")
            i.set_data_from_numpy(x)
            c.infer("m", [i])
        for _ in range(2):  # fail after resolving the version: wrong shape
            i = httpclient.InferInput("INPUT0", [1, 15], "FP32")
            i.set_data_from_numpy(np.ones((1, 15), dtype=np.float32))
            with pytest.raises(InferenceServerException):
                c.infer("m", [i])
        stats = c.get_inference_statistics("m")["model_stats"][0]
    finally:
        c.close()
    text = w.metrics_text()

    def metric(name, extra=""):
        m = re.search(rf'^{name}{{model="m",version="1"{extra}}} (\d+)$', text, re.M)
        assert m, f"{name} missing:\n{text}"
        return int(m.group(1))

    assert metric("nv_inference_request_success") == 2 == int(stats["inference_stats"]["success"]["count"])
    assert metric("nv_inference_count") == 5 == int(stats["inference_count"])
    failures = sum(metric("nv_inference_request_failure", f',reason="{r}"') for r in ("REJECTED", "CANCELED", "BACKEND", "OTHER"))
    assert failures == 2 == int(stats["inference_stats"]["fail"]["count"])
    assert metric("nv_inference_request_duration_us") == int(stats["inference_stats"]["success"]["ns"]) // 1000
