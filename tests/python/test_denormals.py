"""Subnormal floats: the worker flushes them to zero on the threads that run models (FTZ/DAZ)
unless told not to, per worker (--denormal-as-zero) or per model (parameter
nereid.denormal_as_zero). `nobatch_add` computes Z = X + Y, so X subnormal and Y = 0 gives
Z = 0 when flushed and Z = X when kept."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from nereid_harness import check_example_models, copy_model, wait_until

SUBNORMAL = np.float32(1e-39)
assert 0 < SUBNORMAL < np.finfo(np.float32).tiny


def _param(value):
    return lambda t: t + f'parameters {{ key: "nereid.denormal_as_zero" value: {{ string_value: "{value}" }} }}\n'


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    check_example_models()
    repo = tmp_path_factory.mktemp("denormals") / "repo"
    repo.mkdir()
    copy_model(repo, "add_default", base="nobatch_add")
    copy_model(repo, "add_keep", base="nobatch_add", edit=_param("false"))
    copy_model(repo, "add_flush", base="nobatch_add", edit=_param("true"))
    copy_model(repo, "add_invalid", base="nobatch_add", edit=_param("sometimes"))
    return repo


def _settled(worker):
    """The repository index by name once no model is loading."""

    def rows():
        idx = {e["name"]: e for e in worker.index()}
        if len(idx) == 4 and all(e.get("state") not in ("", "LOADING") for e in idx.values()):
            return idx
        return None

    return wait_until(rows, 60.0, what="every model settled")


def _add(worker, model):
    """Z for X = SUBNORMAL, Y = 0, asked several times (either of the two instances may
    answer each)."""
    client = grpcclient.InferenceServerClient(worker.grpc_url)
    try:
        x = np.full((2, 3), SUBNORMAL, dtype=np.float32)
        y = np.zeros((2, 3), dtype=np.float32)
        results = []
        for _ in range(8):
            inputs = [grpcclient.InferInput("X", [2, 3], "FP32"), grpcclient.InferInput("Y", [2, 3], "FP32")]
            inputs[0].set_data_from_numpy(x)
            inputs[1].set_data_from_numpy(y)
            results.append(client.infer(model, inputs).as_numpy("Z"))
        return results
    finally:
        client.close()


def _flushed(results):
    return all(np.array_equal(z, np.zeros((2, 3), dtype=np.float32)) for z in results)


def _kept(results):
    return all(np.array_equal(z, np.full((2, 3), SUBNORMAL, dtype=np.float32)) for z in results)


@pytest.mark.parametrize(
    "args,default_flushes",
    [([], True), (["--denormal-as-zero=false"], False)],
    ids=["worker-default", "worker-flag-off"],
)
def test_the_worker_default_and_the_models_that_override_it(start_worker, repo, args, default_flushes):
    w = start_worker(repo, *args, wait_ready=False)
    try:
        _settled(w)
        expected = {"add_default": default_flushes, "add_flush": True, "add_keep": False}
        for model, flushes in expected.items():
            assert (_flushed if flushes else _kept)(_add(w, model)), model
    finally:
        w.stop()


def test_an_invalid_value_fails_the_load_naming_the_parameter(start_worker, repo):
    w = start_worker(repo, wait_ready=False)
    try:
        row = _settled(w)["add_invalid"]
        assert row["state"] == "UNAVAILABLE", row
        assert "nereid.denormal_as_zero" in row["reason"] and "sometimes" in row["reason"], row
        client = grpcclient.InferenceServerClient(w.grpc_url)
        try:
            # A valid request (the same one add_default answers): refused only because the
            # model is not loaded.
            x = np.ones((2, 3), dtype=np.float32)
            inputs = [grpcclient.InferInput("X", [2, 3], "FP32"), grpcclient.InferInput("Y", [2, 3], "FP32")]
            inputs[0].set_data_from_numpy(x)
            inputs[1].set_data_from_numpy(x)
            np.testing.assert_array_equal(client.infer("add_default", inputs).as_numpy("Z"), x + x)
            with pytest.raises(InferenceServerException) as e:
                client.infer("add_invalid", inputs)
            assert e.value.status() == "StatusCode.UNAVAILABLE", (e.value.status(), str(e.value))
            assert "model 'add_invalid' is not ready" in str(e.value), str(e.value)
            assert "nereid.denormal_as_zero" in str(e.value), str(e.value)
        finally:
            client.close()
    finally:
        w.stop()
