"""The response cache through tritonclient: a worker started with `--cache-config
local,size=...` answers a repeated request to a model with `response_cache { enable: true }`
from the cache, and both statistics APIs report the hit and the misses."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from nereid_harness import assert_fp32_close


@pytest.fixture(params=[["--cache-config", "local,size=1048576"], ["--response-cache-byte-size=1048576"]],
                ids=["cache-config", "response-cache-byte-size"])
def cached_worker(request, repo_copy, make_worker):
    # Both spellings size the cache: tritonserver's current flag and its older one.
    repo = repo_copy("identity_fp32")
    config = repo / "identity_fp32" / "config.pbtxt"
    config.write_text(config.read_text() + "\nresponse_cache { enable: true }\n")
    return make_worker(repo, *request.param)


def test_a_repeated_request_is_answered_from_the_cache(cached_worker):
    h = httpclient.InferenceServerClient(cached_worker.http_url)
    g = grpcclient.InferenceServerClient(cached_worker.grpc_url)
    try:
        x = np.arange(32, dtype=np.float32).reshape(2, 16)
        for mod, c in ((httpclient, h), (grpcclient, g), (httpclient, h)):
            inp = mod.InferInput("INPUT0", [2, 16], "FP32")
            inp.set_data_from_numpy(x)
            assert_fp32_close(c.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), x)
        other = httpclient.InferInput("INPUT0", [2, 16], "FP32")
        other.set_data_from_numpy(x + 1)
        assert_fp32_close(h.infer("identity_fp32", [other]).as_numpy("OUTPUT0"), x + 1)

        http_stats = h.get_inference_statistics("identity_fp32")["model_stats"][0]
        grpc_stats = g.get_inference_statistics("identity_fp32", as_json=True)["model_stats"][0]
        for s in (http_stats, grpc_stats):
            inf = s["inference_stats"]
            assert int(inf["cache_hit"]["count"]) == 2, s
            assert int(inf["cache_miss"]["count"]) == 2, s
            assert int(s["execution_count"]) == 2, s
            assert int(inf["success"]["count"]) == 4, s
            # As Triton's: queue figures include cache hits, compute figures do not.
            assert int(inf["queue"]["count"]) == 4, s
            assert int(inf["compute_infer"]["count"]) == 2, s
    finally:
        h.close()
        g.close()


def test_response_cache_on_a_worker_without_a_cache_loads_with_a_warning(repo_copy, make_worker):
    repo = repo_copy("identity_fp32")
    config = repo / "identity_fp32" / "config.pbtxt"
    config.write_text(config.read_text() + "\nresponse_cache { enable: true }\n")
    w = make_worker(repo)  # no --cache-config
    h = httpclient.InferenceServerClient(w.http_url)
    try:
        (entry,) = [e for e in h.get_model_repository_index() if e["name"] == "identity_fp32"]
        assert entry["state"] == "READY", entry
        # Load warnings go to the worker's log (written before the model reported READY).
        log = w.log_path.read_text(errors="replace")
        assert "response_cache.enable is set but the worker has no response cache (--cache-config" in log, log[-2000:]
        x = np.ones((1, 16), dtype=np.float32)
        for _ in range(2):
            inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_data_from_numpy(x)
            assert_fp32_close(h.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), x)
        stats = h.get_inference_statistics("identity_fp32")["model_stats"][0]
        assert int(stats["execution_count"]) == 2, stats
        assert int(stats["inference_stats"]["cache_hit"]["count"]) == 0, stats
    finally:
        h.close()
