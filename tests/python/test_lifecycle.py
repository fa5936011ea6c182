"""Worker lifecycle: SIGTERM drains in-flight requests before exiting."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import http.client

import grpc
import numpy as np
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg

from nereid_harness import assert_fp32_close, http_request, wait_until

# Held requests wait in the batcher's queue for this long unless something releases them: far
# longer than any test takes, so that nothing completes them but the test's own release.
HOLD_US = 600_000_000


def _pending(w):
    for line in w.metrics_text().splitlines():
        if line.startswith('nv_inference_pending_request_count{model="identity_fp32",version="1"}'):
            return int(float(line.split()[-1]))
    return 0


def _hold_identity(repo):
    """Gives repo's identity_fp32 a long queue delay; returns its max_batch_size."""
    cfg = repo / "identity_fp32" / "config.pbtxt"
    text = cfg.read_text()
    held = text.replace("max_queue_delay_microseconds: 0\n", f"max_queue_delay_microseconds: {HOLD_US}\n")
    assert held != text, "the example identity_fp32 config no longer has the queue delay this test raises"
    cfg.write_text(held)
    return int(re.search(r"^max_batch_size:\s*(\d+)", text, re.M).group(1))


def _read_http_head(sock):
    """Reads one HTTP/1.1 response head (status line and headers) from `sock`; returns it."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"the connection closed before a response head arrived (got {data!r})"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert not rest, f"unexpected bytes after the response head: {rest!r}"
    return head.decode()


def test_sigterm_drains_in_flight_requests(repo_copy, make_worker):
    """Two requests held in the batcher's queue (one HTTP, one gRPC) when SIGTERM arrives: the
    worker reports not ready and keeps them pending while it drains, and answers both once a
    third in-flight request (accepted before SIGTERM, its body sent after it) fills their
    batch; then it exits 0."""
    repo = repo_copy("identity_fp32")
    max_batch = _hold_identity(repo)
    # Far past the few seconds the test takes, so that the drain ends by the release alone.
    w = make_worker(repo, "--exit-timeout-secs", "60")
    x = np.arange(16, dtype=np.float32).reshape(1, 16)

    # two requests that sit in the batcher's queue until their batch is full: one HTTP, one gRPC
    http_result = {}

    def http_infer():
        c = http.client.HTTPConnection("127.0.0.1", w.http_port, timeout=60)
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
    fut = pbg.GRPCInferenceServiceStub(ch).ModelInfer.future(req, timeout=60)

    # The release: the rows that fill the held requests' batch, in a request whose head the
    # worker takes before SIGTERM (it answers `100 Continue` once it reads the body) and whose
    # body the test sends only after checking the drain.
    fill = np.arange((max_batch - 2) * 16, dtype=np.float32).reshape(max_batch - 2, 16)
    fill_body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": list(fill.shape), "data": fill.flatten().tolist()}]}).encode()
    releaser = socket.create_connection(("127.0.0.1", w.http_port), timeout=60)
    try:
        wait_until(lambda: _pending(w) == 2, 10, what="both requests to be queued")
        releaser.sendall(
            b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nExpect: 100-continue\r\n"
            + f"Content-Length: {len(fill_body)}\r\n\r\n".encode()
        )
        head = _read_http_head(releaser)
        assert head.startswith("HTTP/1.1 100"), head
        w.proc.send_signal(signal.SIGTERM)

        # while draining the worker is not ready, and the held requests are still pending
        def not_ready():
            try:
                status, _, _ = http_request(w.base + "/v2/health/ready", timeout=2)
            except OSError:
                return True  # not accepting connections any more
            return status != 200

        wait_until(not_ready, 10, what="the worker to report not ready while draining")
        assert w.proc.poll() is None, f"the worker exited with the requests held:\n{w.log_tail()}"
        # The metrics endpoint outlives intake: it shows the drain.
        assert _pending(w) == 2, w.metrics_text()
        assert not fut.done() and t.is_alive(), (http_result, fut)

        # release: the rows that fill the batch
        releaser.sendall(fill_body)
        resp = http.client.HTTPResponse(releaser)
        resp.begin()
        body = resp.read()
        assert resp.status == 200, body
        out = json.loads(body)["outputs"][0]
        assert_fp32_close(np.array(out["data"], dtype=np.float32), fill.flatten())

        rc = w.proc.wait(timeout=90)
        assert rc == 0, w.log_tail()
        t.join(timeout=30)
        assert http_result.get("status") == 200, http_result
        out = json.loads(http_result["body"])["outputs"][0]
        assert_fp32_close(np.array(out["data"], dtype=np.float32), x.flatten())
        resp = fut.result(timeout=30)
        assert_fp32_close(np.frombuffer(resp.raw_output_contents[0], dtype=np.float32), x.flatten())
    finally:
        releaser.close()
        ch.close()


def test_a_drain_cut_short_by_the_exit_timeout_exits_non_zero(repo_copy, make_worker):
    """--exit-timeout-secs passing with a request still in flight: the worker exits anyway, and
    its exit status says the drain was cut short (tritonserver exits 1), so an orchestrator or
    a supervisor sees that requests were dropped."""
    repo = repo_copy("identity_fp32")
    _hold_identity(repo)
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
