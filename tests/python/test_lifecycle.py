"""Worker lifecycle: SIGTERM drains in-flight requests before exiting."""

from __future__ import annotations

import json
import signal
import threading
import http.client

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg

from nereid_harness import assert_fp32_close, http_request, wait_until

QUEUE_DELAY_S = 3


def _pending(w):
    for line in w.metrics_text().splitlines():
        if line.startswith('nv_inference_pending_request_count{model="identity_fp32",version="1"}'):
            return int(float(line.split()[-1]))
    return 0


def test_sigterm_drains_in_flight_requests(repo_copy, make_worker):
    repo = repo_copy("identity_fp32")
    cfg = repo / "identity_fp32" / "config.pbtxt"
    text = cfg.read_text()
    held = text.replace("max_queue_delay_microseconds: 0\n", f"max_queue_delay_microseconds: {QUEUE_DELAY_S * 1_000_000}\n")
    assert held != text, "the example identity_fp32 config no longer has the queue delay this test raises"
    cfg.write_text(held)
    w = make_worker(repo, "--exit-timeout-secs", "20")
    x = np.arange(16, dtype=np.float32).reshape(1, 16)

    # two requests that sit in the batcher's queue for QUEUE_DELAY_S: one HTTP, one gRPC
    http_result = {}

    def http_infer():
        c = http.client.HTTPConnection("127.0.0.1", w.http_port, timeout=30)
        try:
            body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": x.flatten().tolist()}]})
            c.request("POST", "/v2/models/identity_fp32/infer", body=body)
            r = c.getresponse()
            http_result["status"], http_result["body"] = r.status, r.read()
        except Exception as exc:  # noqa: BLE001
            http_result["exc"] = exc
        finally:
            c.close()

    t = threading.Thread(target=http_infer, daemon=True)
    t.start()
    ch = grpc.insecure_channel(w.grpc_url)
    req = pb.ModelInferRequest(model_name="identity_fp32")
    i = req.inputs.add()
    i.name, i.datatype = "INPUT0", "FP32"
    i.shape.extend([1, 16])
    req.raw_input_contents.append(x.tobytes())
    fut = pbg.GRPCInferenceServiceStub(ch).ModelInfer.future(req, timeout=30)
    try:
        wait_until(lambda: _pending(w) == 2, 10, what="both requests to be queued")
        w.proc.send_signal(signal.SIGTERM)

        # while draining the worker is not ready
        def not_ready():
            try:
                status, _, _ = http_request(w.base + "/v2/health/ready", timeout=2)
            except OSError:
                return True  # not accepting connections any more
            return status != 200

        if w.proc.poll() is None:
            wait_until(not_ready, 10, what="the worker to report not ready while draining")

        rc = w.proc.wait(timeout=30)
        assert rc == 0, w.log_tail()
        t.join(timeout=30)
        assert http_result.get("status") == 200, http_result
        out = json.loads(http_result["body"])["outputs"][0]
        assert_fp32_close(np.array(out["data"], dtype=np.float32), x.flatten())
        resp = fut.result(timeout=30)
        assert_fp32_close(np.frombuffer(resp.raw_output_contents[0], dtype=np.float32), x.flatten())
    finally:
        ch.close()


def test_a_drain_cut_short_by_the_exit_timeout_exits_non_zero(repo_copy, make_worker):
    """--exit-timeout-secs passing with a request still in flight: the worker exits anyway, and
    its exit status says the drain was cut short (tritonserver exits 1), so an orchestrator or
    a supervisor sees that requests were dropped."""
    repo = repo_copy("identity_fp32")
    cfg = repo / "identity_fp32" / "config.pbtxt"
    text = cfg.read_text()
    held = text.replace("max_queue_delay_microseconds: 0\n", "max_queue_delay_microseconds: 60000000\n")
    assert held != text, "the example identity_fp32 config no longer has the queue delay this test raises"
    cfg.write_text(held)
    w = make_worker(repo, "--exit-timeout-secs", "1")
    ch = grpc.insecure_channel(w.grpc_url)
    req = pb.ModelInferRequest(model_name="identity_fp32")
    i = req.inputs.add()
    i.name, i.datatype = "INPUT0", "FP32"
    i.shape.extend([1, 16])
    req.raw_input_contents.append(np.zeros(16, dtype=np.float32).tobytes())
    fut = pbg.GRPCInferenceServiceStub(ch).ModelInfer.future(req, timeout=60)
    try:
        wait_until(lambda: _pending(w) == 1, 10, what="the request to be queued")
        w.proc.send_signal(signal.SIGTERM)
        rc = w.proc.wait(timeout=30)
        assert rc == 1, w.log_tail()
        assert "did not finish within --exit-timeout-secs (1 s)" in w.log_tail(), w.log_tail()
        assert fut.exception(timeout=30) is not None, "the held request cannot have been answered"
    finally:
        ch.close()
