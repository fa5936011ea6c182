"""Concurrent requests: each response carries the rows of its own request (batching must not
mix or reorder rows), and the dynamic batcher really forms batches."""

from __future__ import annotations

import queue

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from nereid_harness import assert_fp32_close, ort_run

N_REQUESTS = 64
ROWS = 4


def _inputs(seed):
    rng = np.random.default_rng(seed)
    # distinct inputs per request so that a mixed-up row is detected
    return [rng.standard_normal((ROWS, 256)).astype(np.float32) + k for k in range(N_REQUESTS)]


def _http_stats(worker, model):
    c = httpclient.InferenceServerClient(worker.http_url)
    try:
        (entry,) = c.get_inference_statistics(model, "1")["model_stats"]
    finally:
        c.close()
    return int(entry["inference_stats"]["success"]["count"]), int(entry["inference_count"]), int(entry["execution_count"]), entry


def test_http_async_burst_rows_not_mixed(worker):
    xs = _inputs(1)
    s0, i0, e0, _ = _http_stats(worker, "mlp_fp32")
    c = httpclient.InferenceServerClient(worker.http_url, concurrency=16, network_timeout=60.0)
    try:
        pending = []
        for x in xs:
            inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            pending.append(c.async_infer("mlp_fp32", [inp], outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]))
        outs = [p.get_result(block=True, timeout=60).as_numpy("OUTPUT0") for p in pending]
    finally:
        c.close()
    for x, out in zip(xs, outs):
        assert out.shape == (ROWS, 10)
        assert_fp32_close(out, ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"])
    s1, i1, e1, _ = _http_stats(worker, "mlp_fp32")
    assert s1 - s0 == N_REQUESTS
    assert i1 - i0 == N_REQUESTS * ROWS
    # every request is in exactly one execution, so executions <= requests < rows
    assert 1 <= e1 - e0 <= N_REQUESTS < i1 - i0


def test_grpc_async_burst_rows_not_mixed(worker):
    """Like the HTTP burst, but with 1 to 7 rows per request, so that batches hold requests of
    different sizes and must be split back at the right offsets."""
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((int(rng.integers(1, 8)), 256)).astype(np.float32) + k for k in range(N_REQUESTS)]
    rows = sum(x.shape[0] for x in xs)
    s0, i0, e0, _ = _http_stats(worker, "mlp_fp32")
    c = grpcclient.InferenceServerClient(worker.grpc_url)
    results: queue.Queue = queue.Queue()
    try:
        for k, x in enumerate(xs):
            inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            c.async_infer("mlp_fp32", [inp], callback=lambda result, error, k=k: results.put((k, result, error)), request_id=str(k), client_timeout=60)
        got = {}
        for _ in range(N_REQUESTS):
            k, result, error = results.get(timeout=60)
            assert error is None, error
            assert result.get_response().id == str(k)
            got[k] = result.as_numpy("OUTPUT0")
    finally:
        c.close()
    assert sorted(got) == list(range(N_REQUESTS))
    for k, x in enumerate(xs):
        assert got[k].shape == (x.shape[0], 10)
        assert_fp32_close(got[k], ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"])
    s1, i1, e1, _ = _http_stats(worker, "mlp_fp32")
    assert s1 - s0 == N_REQUESTS
    assert i1 - i0 == rows
    assert 1 <= e1 - e0 <= N_REQUESTS


def test_full_batch_forms_one_execution(repo_copy, make_worker):
    """Deterministic batching: a queue delay of 10 minutes means nothing runs until
    max_batch_size (64) rows are queued; 16 concurrent requests of 4 rows fill exactly one batch,
    which must run at once as a single execution (a batch that waited for the delay would fail
    the calls' 60 s timeouts)."""
    repo = repo_copy("mlp_fp32")
    cfg = repo / "mlp_fp32" / "config.pbtxt"
    text = cfg.read_text()
    text = text.replace("preferred_batch_size: [ 16, 32 ]", "").replace("max_queue_delay_microseconds: 500", "max_queue_delay_microseconds: 600000000")
    assert "600000000" in text
    cfg.write_text(text)
    w = make_worker(repo)
    n = 16
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((ROWS, 256)).astype(np.float32) for _ in range(n)]
    c = grpcclient.InferenceServerClient(w.grpc_url)
    results: queue.Queue = queue.Queue()
    try:
        for k, x in enumerate(xs):
            inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            c.async_infer("mlp_fp32", [inp], callback=lambda result, error, k=k: results.put((k, result, error)), client_timeout=60)
        got = {}
        for _ in range(n):
            k, result, error = results.get(timeout=60)
            assert error is None, error
            got[k] = result.as_numpy("OUTPUT0")
    finally:
        c.close()
    for k, x in enumerate(xs):
        assert_fp32_close(got[k], ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"])
    s, i, e, entry = _http_stats(w, "mlp_fp32")
    assert (s, i, e) == (n, n * ROWS, 1), entry
    assert {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in entry["batch_stats"]} == {n * ROWS: 1}
