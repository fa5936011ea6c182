"""Ensembles through tritonclient, HTTP and gRPC: the example `scale_ensemble` (versioned_scale
version 1 (x2) then version 2 (x3), and version 2 alone in parallel) against onnxruntime in
Python running the composing models, metadata and config as Triton reports an ensemble, and
EXPLICIT loading that brings the composing model along and `unload_dependents` that takes it.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from nereid_harness import assert_fp32_close, ort_run


def _expected(x):
    doubled = ort_run("versioned_scale", {"INPUT0": x}, version=1)["OUTPUT0"]
    return {
        "SCALED6": ort_run("versioned_scale", {"INPUT0": doubled}, version=2)["OUTPUT0"],
        "SCALED3": ort_run("versioned_scale", {"INPUT0": x}, version=2)["OUTPUT0"],
    }


@pytest.mark.parametrize("mod", [httpclient, grpcclient], ids=["http", "grpc"])
def test_ensemble_outputs_match_onnxruntime(worker, mod):
    url = worker.http_url if mod is httpclient else worker.grpc_url
    c = mod.InferenceServerClient(url)
    try:
        x = np.random.default_rng(7).standard_normal((3, 4)).astype(np.float32)
        inp = mod.InferInput("INPUT0", [3, 4], "FP32")
        inp.set_data_from_numpy(x)
        res = c.infer("scale_ensemble", [inp])
        expected = _expected(x)
        for name, want in expected.items():
            assert_fp32_close(res.as_numpy(name), want)
        # One requested output only.
        res = c.infer("scale_ensemble", [inp], outputs=[mod.InferRequestedOutput("SCALED3")])
        assert res.as_numpy("SCALED6") is None
        assert_fp32_close(res.as_numpy("SCALED3"), expected["SCALED3"])

        md = c.get_model_metadata("scale_ensemble", as_json=True) if mod is grpcclient else c.get_model_metadata("scale_ensemble")
        assert md["platform"] == "ensemble"
        cfg = c.get_model_config("scale_ensemble", as_json=True) if mod is grpcclient else c.get_model_config("scale_ensemble")
        cfg = cfg.get("config", cfg)
        steps = cfg["ensemble_scheduling"]["step"]
        assert [s["model_name"] for s in steps] == ["versioned_scale"] * 3

        # A wrong shape is refused by the ensemble itself, naming it.
        bad = mod.InferInput("INPUT0", [1, 3], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 3), dtype=np.float32))
        with pytest.raises(InferenceServerException, match="scale_ensemble"):
            c.infer("scale_ensemble", [bad])
    finally:
        c.close()


def test_explicit_load_brings_the_composing_model_and_unload_dependents_takes_it(repo_copy, make_worker):
    repo = repo_copy("versioned_scale", "scale_ensemble")
    w = make_worker(repo, "--model-control-mode", "explicit")
    h = httpclient.InferenceServerClient(w.http_url)
    g = grpcclient.InferenceServerClient(w.grpc_url)
    try:
        assert not h.is_model_ready("versioned_scale")
        g.load_model("scale_ensemble")
        assert h.is_model_ready("scale_ensemble") and h.is_model_ready("versioned_scale")
        x = np.ones((1, 4), dtype=np.float32)
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        assert_fp32_close(h.infer("scale_ensemble", [inp]).as_numpy("SCALED6"), x * 6)

        # Plain unload: the composing model stays.
        h.unload_model("scale_ensemble")
        assert not h.is_model_ready("scale_ensemble") and h.is_model_ready("versioned_scale")
        # unload_dependents, over gRPC then HTTP: both go.
        h.load_model("scale_ensemble")
        g.unload_model("scale_ensemble", unload_dependents=True)
        assert not h.is_model_ready("scale_ensemble") and not h.is_model_ready("versioned_scale")
        g.load_model("scale_ensemble")
        h.unload_model("scale_ensemble", unload_dependents=True)
        assert not h.is_model_ready("versioned_scale")
    finally:
        h.close()
        g.close()
