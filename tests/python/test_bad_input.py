"""Bad input over raw HTTP (http.client / sockets, not tritonclient, which validates client-side)
and raw gRPC (service_pb2 stubs on a plain grpc channel).

Each bad request must get a clear error -- HTTP 400/404 with a JSON body {"error": "..."} that
names the offending field, gRPC INVALID_ARGUMENT / NOT_FOUND with a message naming it -- quickly
(limits are checked before allocating), and afterwards the worker still serves a good request.
"""

from __future__ import annotations

import json
import socket
import struct
import http.client

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg

from nereid_harness import EXAMPLE_MODELS, assert_fp32_close, http_request

MAX_REQUEST_BYTES = 1 << 20  # the bad-input worker's --max-request-bytes


@pytest.fixture(scope="module")
def bw(start_worker):
    """A worker of its own (so that failures do not disturb the shared one's statistics) with a
    small request limit."""
    w = start_worker(EXAMPLE_MODELS, "--max-request-bytes", str(MAX_REQUEST_BYTES))
    yield w
    w.stop()


# -- HTTP helpers -------------------------------------------------------------------------------


def _post(w, path, body: bytes, headers=None, timeout=10.0):
    c = http.client.HTTPConnection("127.0.0.1", w.http_port, timeout=timeout)
    try:
        c.request("POST", path, body=body, headers=headers or {})
        r = c.getresponse()
        data = r.read()
        return r.status, dict(r.getheaders()), data
    finally:
        c.close()


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def _binary(header: dict, *chunks: bytes):
    h = json.dumps(header).encode()
    return h + b"".join(chunks), {"Inference-Header-Content-Length": str(len(h)), "Content-Type": "application/octet-stream"}


def _good_http(w):
    x = np.arange(16, dtype=np.float32)
    status, _, body = _post(w, "/v2/models/identity_fp32/infer", _json({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": x.tolist()}]}))
    assert status == 200, body
    out = json.loads(body)["outputs"][0]
    assert_fp32_close(np.array(out["data"], dtype=np.float32), x)


def _good_grpc(w):
    with grpc.insecure_channel(w.grpc_url) as ch:
        stub = pbg.GRPCInferenceServiceStub(ch)
        x = np.arange(16, dtype=np.float32).reshape(1, 16)
        resp = stub.ModelInfer(_grpc_req(raw=x.tobytes()), timeout=10)
        assert resp.model_name == "identity_fp32"
        assert_fp32_close(np.frombuffer(resp.raw_output_contents[0], dtype=np.float32), x.flatten())


def _assert_http_error(w, status, headers, body, expected_status, needles):
    assert status in (expected_status if isinstance(expected_status, tuple) else (expected_status,)), (status, body)
    assert headers.get("content-type", headers.get("Content-Type", "")).startswith("application/json"), headers
    err = json.loads(body)
    assert isinstance(err, dict) and isinstance(err.get("error"), str) and err["error"], body
    for n in needles:
        assert n in err["error"], f"{n!r} not in error {err['error']!r}"
    assert w.proc.poll() is None, "worker died"
    _good_http(w)
    _good_grpc(w)


def _inp(name="INPUT0", dt="FP32", shape=(1, 16), **kw):
    d = {"name": name, "datatype": dt, "shape": list(shape)}
    d.update(kw)
    return d


ZEROS16 = [0.0] * 16

# (id, path, body, headers, expected status, substrings of the error)
HTTP_CASES = [
    ("malformed_json", "/v2/models/identity_fp32/infer", b'{"inputs": [', None, 400, ["JSON"]),
    ("json_not_object", "/v2/models/identity_fp32/infer", b"[]", None, 400, ["JSON"]),
    ("empty_body", "/v2/models/identity_fp32/infer", b"", None, 400, []),
    ("unknown_model", "/v2/models/no_such_model/infer", _json({"inputs": [_inp(data=ZEROS16)]}), None, 404, ["no_such_model"]),
    ("unknown_version", "/v2/models/identity_fp32/versions/7/infer", _json({"inputs": [_inp(data=ZEROS16)]}), None, 404, ["7"]),
    ("non_numeric_version", "/v2/models/identity_fp32/versions/abc/infer", _json({"inputs": [_inp(data=ZEROS16)]}), None, 400, ["abc"]),
    ("wrong_dtype", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(dt="INT32", data=[0] * 16)]}), None, 400, ["INPUT0", "INT32", "FP32"]),
    ("unknown_dtype", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(dt="FLOAT", data=ZEROS16)]}), None, 400, ["INPUT0", "FLOAT"]),
    ("wrong_shape", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(shape=(1, 8), data=[0.0] * 8)]}), None, 400, ["INPUT0", "shape"]),
    ("wrong_rank", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(shape=(16,), data=ZEROS16)]}), None, 400, ["INPUT0", "shape"]),
    ("negative_dim", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(shape=(-1, 16), data=ZEROS16)]}), None, 400, ["INPUT0"]),
    ("float_dim", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(shape=(1.5, 16), data=ZEROS16)]}), None, 400, ["INPUT0", "shape"]),
    ("missing_shape", "/v2/models/identity_fp32/infer", _json({"inputs": [{"name": "INPUT0", "datatype": "FP32", "data": ZEROS16}]}), None, 400, ["INPUT0", "shape"]),
    ("batch_over_max", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(shape=(65, 16), data=[0.0] * 65 * 16)]}), None, 400, ["INPUT0", "64"]),
    ("nobatch_given_batch_dim", "/v2/models/nobatch_add/infer", _json({"inputs": [_inp("X", shape=(1, 2, 3), data=[0.0] * 6), _inp("Y", shape=(1, 2, 3), data=[0.0] * 6)]}), None, 400, ["shape"]),
    ("json_element_count", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(data=[0.0] * 15)]}), None, 400, ["INPUT0", "16"]),
    ("json_element_type", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(data=["x"] * 16)]}), None, 400, ["INPUT0"]),
    ("json_no_data", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp()]}), None, 400, ["INPUT0"]),
    ("json_int_out_of_range", "/v2/models/mixed_types/infer", _json({"inputs": [_inp("INPUT_FP32", shape=(1, 4), data=[0.0] * 4), _inp("INPUT_INT64", "INT64", (1, 4), data=[1e30, 0, 0, 0])]}), None, 400, ["INPUT_INT64"]),
    ("missing_input", "/v2/models/identity_fp32/infer", _json({"inputs": []}), None, 400, ["INPUT0"]),
    ("missing_one_of_two_inputs", "/v2/models/nobatch_add/infer", _json({"inputs": [_inp("X", shape=(2, 3), data=[0.0] * 6)]}), None, 400, ["Y"]),
    ("extra_input", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(data=ZEROS16), _inp("EXTRA", shape=(1, 1), data=[0.0])]}), None, 400, ["EXTRA"]),
    ("duplicate_input", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(data=ZEROS16), _inp(data=ZEROS16)]}), None, 400, ["INPUT0"]),
    ("unknown_output", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(data=ZEROS16)], "outputs": [{"name": "NOPE"}]}), None, 400, ["NOPE"]),
    ("shape_overflow_json", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(shape=(9223372036854775807, 16), data=[0.0])]}), None, 400, ["INPUT0"]),
    ("shape_huge_json", "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(shape=(1 << 40, 16), data=[0.0])]}), None, 400, ["INPUT0"]),
    ("header_length_over_body", "/v2/models/identity_fp32/infer", b'{"inputs": []}', {"Inference-Header-Content-Length": "1000"}, 400, ["Inference-Header-Content-Length"]),
    ("header_length_not_a_number", "/v2/models/identity_fp32/infer", b'{"inputs": []}', {"Inference-Header-Content-Length": "abc"}, 400, ["Inference-Header-Content-Length"]),
    ("header_length_negative", "/v2/models/identity_fp32/infer", b'{"inputs": []}', {"Inference-Header-Content-Length": "-5"}, 400, ["Inference-Header-Content-Length"]),
    ("header_length_huge", "/v2/models/identity_fp32/infer", b'{"inputs": []}', {"Inference-Header-Content-Length": "18446744073709551615"}, 400, ["Inference-Header-Content-Length"]),
]


def _bin_case(id_, model, inputs, chunks, needles, outputs=None):
    header = {"inputs": inputs}
    if outputs:
        header["outputs"] = outputs
    body, headers = _binary(header, *chunks)
    return (id_, f"/v2/models/{model}/infer", body, headers, 400, needles)


HTTP_CASES += [
    _bin_case("binary_size_not_matching_shape", "identity_fp32", [_inp(parameters={"binary_data_size": 60})], [b"\0" * 60], ["INPUT0", "binary_data_size"]),
    _bin_case("binary_section_shorter_than_claimed", "identity_fp32", [_inp(parameters={"binary_data_size": 64})], [b"\0" * 60], ["INPUT0", "binary_data_size"]),
    _bin_case("binary_section_longer_than_claimed", "identity_fp32", [_inp(parameters={"binary_data_size": 64})], [b"\0" * 70], ["binary"]),
    _bin_case("binary_wrong_dtype", "identity_fp32", [_inp(dt="FP64", parameters={"binary_data_size": 128})], [b"\0" * 128], ["INPUT0", "FP64"]),
    _bin_case("binary_batch_over_max", "identity_fp32", [_inp(shape=(65, 16), parameters={"binary_data_size": 65 * 64})], [b"\0" * 65 * 64], ["INPUT0", "64"]),
    _bin_case("binary_shape_overflow", "identity_fp32", [_inp(shape=(9223372036854775807, 16), parameters={"binary_data_size": 64})], [b"\0" * 64], ["INPUT0"]),
    _bin_case("binary_shape_over_limit", "identity_fp32", [_inp(shape=(1 << 40, 16), parameters={"binary_data_size": 64})], [b"\0" * 64], ["INPUT0"]),
    _bin_case("binary_size_over_limit", "identity_fp32", [_inp(parameters={"binary_data_size": 1 << 40})], [b"\0" * 64], ["INPUT0"]),
    _bin_case("bytes_truncated_element", "string_len", [_inp("TEXT", "BYTES", (1, 1), parameters={"binary_data_size": 6})], [b"\x05\x00\x00\x00ab"], ["TEXT"]),
    _bin_case("bytes_truncated_length_prefix", "string_len", [_inp("TEXT", "BYTES", (1, 1), parameters={"binary_data_size": 2})], [b"\x05\x00"], ["TEXT"]),
    _bin_case("bytes_too_few_elements", "string_len", [_inp("TEXT", "BYTES", (2, 1), parameters={"binary_data_size": 5})], [b"\x01\x00\x00\x00a"], ["TEXT"]),
    _bin_case("bytes_not_utf8", "string_len", [_inp("TEXT", "BYTES", (1, 1), parameters={"binary_data_size": 6})], [b"\x02\x00\x00\x00\xff\xfe"], ["TEXT"]),
    _bin_case("bytes_with_nul", "string_len", [_inp("TEXT", "BYTES", (1, 1), parameters={"binary_data_size": 7})], [b"\x03\x00\x00\x00a\x00b"], ["TEXT"]),
    _bin_case("binary_unknown_output", "identity_fp32", [_inp(parameters={"binary_data_size": 64})], [b"\0" * 64], ["NOPE"], outputs=[{"name": "NOPE", "parameters": {"binary_data": True}}]),
]


@pytest.mark.parametrize("path,body,headers,expected,needles", [c[1:] for c in HTTP_CASES], ids=[c[0] for c in HTTP_CASES])
def test_http_bad_request(bw, path, body, headers, expected, needles):
    status, rheaders, rbody = _post(bw, path, body, headers)
    _assert_http_error(bw, status, rheaders, rbody, expected, needles)


def test_http_bad_requests_counted_as_failures(bw):
    def fails():
        c = http.client.HTTPConnection("127.0.0.1", bw.http_port, timeout=10)
        c.request("GET", "/v2/models/identity_fp32/stats")
        r = c.getresponse()
        st = json.loads(r.read())
        c.close()
        return int(st["model_stats"][0]["inference_stats"]["fail"]["count"])

    def metric_failures():
        total = 0.0
        for line in bw.metrics_text().splitlines():
            if line.startswith("nv_inference_request_failure{") and 'model="identity_fp32"' in line and 'version="1"' in line:
                total += float(line.split()[-1])
        return int(total)

    before = fails()
    status, _, _ = _post(bw, "/v2/models/identity_fp32/infer", _json({"inputs": [_inp(dt="INT32", data=[0] * 16)]}))
    assert status == 400
    assert fails() == before + 1
    # /metrics counts the same failures (summed over its `reason` label)
    assert metric_failures() == fails()


def _raw_http(w, head: bytes, tail: bytes = b"", read_timeout=10.0):
    """Sends a request head (and maybe part of a body) on a plain socket and reads the response
    without sending the rest of the body."""
    s = socket.create_connection(("127.0.0.1", w.http_port), timeout=read_timeout)
    try:
        s.sendall(head + tail)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _content_length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data
    finally:
        s.close()


def _content_length(data: bytes) -> int:
    head = data.split(b"\r\n\r\n", 1)[0].decode(errors="replace").lower()
    for line in head.split("\r\n"):
        if line.startswith("content-length:"):
            return int(line.split(":", 1)[1])
    return 0


def _parse_raw_response(data: bytes):
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, body


@pytest.mark.parametrize("length", [MAX_REQUEST_BYTES + 1, 100_000_000_000, 2**63 - 1])
def test_http_content_length_over_limit_refused_before_reading(bw, length):
    """A body larger than --max-request-bytes is refused from its Content-Length alone: the
    response comes without the body having been sent."""
    head = (
        f"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()
    data = _raw_http(bw, head, b'{"inputs": [')
    status, body = _parse_raw_response(data)
    assert status in (400, 413), data
    assert "error" in json.loads(body)
    _good_http(bw)


def test_http_chunked_body_over_limit(bw):
    """A chunked body (no Content-Length) is cut off once it passes the limit. The body is sent
    from a second thread while this one reads, so the response is seen even if the server closes
    the connection before the client has finished sending."""
    import threading

    s = socket.create_connection(("127.0.0.1", bw.http_port), timeout=10)

    def send():
        try:
            s.sendall(b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
            for _ in range(4 * MAX_REQUEST_BYTES // 0x10000):
                s.sendall(chunk)
            s.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server closed its side once the limit was passed

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            part = s.recv(65536)
            if not part:
                break
            data += part
    finally:
        sender.join(timeout=10)
        s.close()
    status, _ = _parse_raw_response(data)
    assert status in (400, 413), data
    _good_http(bw)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_http_compressed_body_over_limit_after_decompression(bw, encoding):
    """A small compressed body that inflates past --max-request-bytes (a "zip bomb") is refused
    with 400/413 without inflating it all (tritonserver accepts gzip/deflate request bodies, so
    Nereid must too -- and must apply the request limit to the inflated size)."""
    import gzip
    import zlib

    inflated = b'{"inputs": [], "pad": "' + b" " * (8 * MAX_REQUEST_BYTES) + b'"}'
    body = gzip.compress(inflated) if encoding == "gzip" else zlib.compress(inflated)
    assert len(body) < MAX_REQUEST_BYTES // 4
    status, headers, data = _post(bw, "/v2/models/identity_fp32/infer", body, {"Content-Encoding": encoding, "Content-Type": "application/json"})
    # Refused for its inflated size (reading stops one byte past the limit), not for what the
    # JSON would have said once inflated.
    _assert_http_error(bw, status, headers, data, (400, 413), ["exceeds the limit"])


@pytest.mark.parametrize("path", [
    "/v2/repository/models/%FF/load",
    "/v2/repository/models/%FF/unload",
    "/v2/systemsharedmemory/region/%FF/register",
    "/v2/systemsharedmemory/region/%FF/unregister",
    "/v2/models/%FF/infer",
])
def test_http_path_segment_not_utf8_is_a_json_error(bw, path):
    status, _, data = _post(bw, path, b"{}", {"Content-Type": "application/json"})
    assert status == 400, data
    assert "error" in json.loads(data), data


def test_http_wrong_method_and_path(bw):
    c = http.client.HTTPConnection("127.0.0.1", bw.http_port, timeout=10)
    try:
        c.request("GET", "/v2/models/identity_fp32/infer")
        r = c.getresponse()
        assert r.status == 405
        assert "error" in json.loads(r.read())
        c.request("GET", "/v2/no/such/endpoint")
        r = c.getresponse()
        assert r.status == 404
        assert "error" in json.loads(r.read())
        c.request("GET", "/v2/models/no_such_model")
        r = c.getresponse()
        assert r.status == 404
        assert "no_such_model" in json.loads(r.read())["error"]
        c.request("GET", "/v2/models/no_such_model/config")
        r = c.getresponse()
        assert r.status == 404
        assert "no_such_model" in json.loads(r.read())["error"]
    finally:
        c.close()
    _good_http(bw)


# -- gRPC ---------------------------------------------------------------------------------------


def _grpc_req(model="identity_fp32", name="INPUT0", dt="FP32", shape=(1, 16), raw=None, version="", outputs=()):
    r = pb.ModelInferRequest(model_name=model, model_version=version)
    i = r.inputs.add()
    i.name = name
    i.datatype = dt
    i.shape.extend(shape)
    r.raw_input_contents.append(raw if raw is not None else b"\0" * 64)
    for o in outputs:
        r.outputs.add().name = o
    return r


def _with_extra_input():
    r = _grpc_req()
    i = r.inputs.add()
    i.name, i.datatype = "EXTRA", "FP32"
    i.shape.extend([1, 1])
    r.raw_input_contents.append(b"\0" * 4)
    return r


def _with_extra_raw():
    r = _grpc_req()
    r.raw_input_contents.append(b"\0" * 4)
    return r


def _with_both_contents():
    r = _grpc_req()
    r.inputs[0].contents.fp32_contents.extend([0.0] * 16)
    return r


def _typed(count, field="fp32_contents"):
    r = pb.ModelInferRequest(model_name="identity_fp32")
    i = r.inputs.add()
    i.name, i.datatype = "INPUT0", "FP32"
    i.shape.extend([1, 16])
    getattr(i.contents, field).extend([0] * count)
    return r


def _duplicate():
    r = _grpc_req()
    r.inputs.append(r.inputs[0])
    r.raw_input_contents.append(r.raw_input_contents[0])
    return r


INV = grpc.StatusCode.INVALID_ARGUMENT
NF = grpc.StatusCode.NOT_FOUND

GRPC_CASES = [
    ("unknown_model", lambda: _grpc_req(model="no_such_model"), NF, ["no_such_model"]),
    ("unknown_version", lambda: _grpc_req(version="7"), NF, ["7"]),
    ("non_numeric_version", lambda: _grpc_req(version="abc"), INV, ["abc"]),
    ("wrong_dtype", lambda: _grpc_req(dt="INT32"), INV, ["INPUT0", "INT32", "FP32"]),
    ("unknown_dtype", lambda: _grpc_req(dt="FLOAT"), INV, ["INPUT0", "FLOAT"]),
    ("wrong_shape", lambda: _grpc_req(shape=(1, 8), raw=b"\0" * 32), INV, ["INPUT0", "shape"]),
    ("wrong_rank", lambda: _grpc_req(shape=(16,)), INV, ["INPUT0", "shape"]),
    ("negative_dim", lambda: _grpc_req(shape=(-1, 16)), INV, ["INPUT0"]),
    ("batch_over_max", lambda: _grpc_req(shape=(65, 16), raw=b"\0" * 65 * 64), INV, ["INPUT0", "64"]),
    ("raw_size_not_matching_shape", lambda: _grpc_req(raw=b"\0" * 60), INV, ["INPUT0", "raw_input_contents"]),
    ("raw_count_not_matching_inputs", _with_extra_raw, INV, ["raw_input_contents"]),
    ("raw_and_typed_contents", _with_both_contents, INV, ["INPUT0"]),
    ("typed_contents_count", lambda: _typed(15), INV, ["INPUT0", "fp32_contents"]),
    ("typed_contents_wrong_field", lambda: _typed(16, "int_contents"), INV, ["INPUT0"]),
    ("missing_input", lambda: pb.ModelInferRequest(model_name="identity_fp32"), INV, ["INPUT0"]),
    ("extra_input", _with_extra_input, INV, ["EXTRA"]),
    ("duplicate_input", _duplicate, INV, ["INPUT0"]),
    ("shape_overflow", lambda: _grpc_req(shape=(9223372036854775807, 16)), INV, ["INPUT0"]),
    ("shape_over_limit", lambda: _grpc_req(shape=(1 << 40, 16)), INV, ["INPUT0"]),
    ("bytes_shape_over_limit", lambda: _grpc_req("string_len", "TEXT", "BYTES", (1 << 40, 1), raw=b"\x01\x00\x00\x00a"), INV, ["TEXT"]),
    ("bytes_truncated_element", lambda: _grpc_req("string_len", "TEXT", "BYTES", (1, 1), raw=b"\x05\x00\x00\x00ab"), INV, ["TEXT"]),
    ("bytes_truncated_length_prefix", lambda: _grpc_req("string_len", "TEXT", "BYTES", (1, 1), raw=b"\x05\x00"), INV, ["TEXT"]),
    ("bytes_too_few_elements", lambda: _grpc_req("string_len", "TEXT", "BYTES", (2, 1), raw=b"\x01\x00\x00\x00a"), INV, ["TEXT"]),
    ("bytes_not_utf8", lambda: _grpc_req("string_len", "TEXT", "BYTES", (1, 1), raw=b"\x02\x00\x00\x00\xff\xfe"), INV, ["TEXT"]),
    ("unknown_output", lambda: _grpc_req(outputs=["NOPE"]), INV, ["NOPE"]),
]


@pytest.fixture(scope="module")
def stub(bw):
    ch = grpc.insecure_channel(bw.grpc_url, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)])
    yield ch, pbg.GRPCInferenceServiceStub(ch)
    ch.close()


def _assert_grpc_error(w, call, expected, needles):
    with pytest.raises(grpc.RpcError) as ei:
        call()
    err = ei.value
    codes = expected if isinstance(expected, tuple) else (expected,)
    assert err.code() in codes, (err.code(), err.details())
    for n in needles:
        assert n in (err.details() or ""), f"{n!r} not in {err.details()!r}"
    assert w.proc.poll() is None, "worker died"
    _good_grpc(w)
    _good_http(w)


@pytest.mark.parametrize("make,expected,needles", [c[1:] for c in GRPC_CASES], ids=[c[0] for c in GRPC_CASES])
def test_grpc_bad_request(bw, stub, make, expected, needles):
    _, s = stub
    _assert_grpc_error(bw, lambda: s.ModelInfer(make(), timeout=10), expected, needles)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xff\xff\xff\x0f garbage",  # invalid wire type
        b"\x0a\x80\x80\x80\x80\x10",  # field 1 (model_name) with a length running past the end
        b"\x0a\x03ab",  # model_name truncated
    ],
    ids=["bad_wire_type", "length_past_end", "truncated_string"],
)
def test_grpc_malformed_protobuf(bw, stub, garbage):
    """Undecodable bytes sent to ModelInfer: INVALID_ARGUMENT (DESIGN.md: "malformed
    JSON/protobuf ... a clear 400/INVALID_ARGUMENT"), and the worker keeps serving."""
    ch, _ = stub
    raw = ch.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    _assert_grpc_error(bw, lambda: raw(garbage, timeout=10), INV, [])


def test_grpc_stream_malformed_message_is_invalid_argument(bw, stub):
    """Undecodable bytes on ModelStreamInfer end the stream with the code a unary call gets
    (INVALID_ARGUMENT), not INTERNAL."""
    ch, _ = stub
    raw = ch.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    _assert_grpc_error(bw, lambda: list(raw(iter([b"\xff\xff\xff\xff\x0f garbage"]), timeout=10)), INV, [])


def test_grpc_message_over_limit(bw, stub):
    """A message over --max-request-bytes is refused (its length prefix is checked before the
    message is buffered) with RESOURCE_EXHAUSTED -- gRPC's code for an oversized message -- or
    INVALID_ARGUMENT."""
    _, s = stub
    big = _grpc_req(shape=(64, 16), raw=b"\0" * (2 * MAX_REQUEST_BYTES))
    _assert_grpc_error(bw, lambda: s.ModelInfer(big, timeout=10), (grpc.StatusCode.RESOURCE_EXHAUSTED, INV), [str(MAX_REQUEST_BYTES)])


@pytest.mark.parametrize(
    "method,request_",
    [
        ("ModelMetadata", pb.ModelMetadataRequest(name="no_such_model")),
        ("ModelConfig", pb.ModelConfigRequest(name="no_such_model")),
        ("ModelStatistics", pb.ModelStatisticsRequest(name="no_such_model")),
    ],
)
def test_grpc_unknown_model_other_methods(bw, stub, method, request_):
    _, s = stub
    _assert_grpc_error(bw, lambda: getattr(s, method)(request_, timeout=10), NF, ["no_such_model"])


def test_grpc_model_ready_unknown_model_is_false(bw, stub):
    """Like tritonserver (ModelIsReady leaves `ready` false for a model it cannot find and
    succeeds), ModelReady for an unknown model answers OK with ready = false, not an error."""
    _, s = stub
    resp = s.ModelReady(pb.ModelReadyRequest(name="no_such_model"), timeout=10)
    assert resp.ready is False, resp
    _good_grpc(bw)


def test_grpc_stream_with_bad_requests_keeps_going(bw, stub):
    """Bad requests on a stream get error responses on the stream; the stream and the worker
    keep serving."""
    _, s = stub
    good = np.arange(16, dtype=np.float32).reshape(1, 16)
    reqs = [
        _grpc_req(model="no_such_model"),
        _grpc_req(dt="INT32"),
        _grpc_req(raw=b"\0" * 60),
        _grpc_req(shape=(9223372036854775807, 16)),
        _grpc_req(raw=good.tobytes()),
    ]
    for k, r in enumerate(reqs):
        r.id = f"r{k}"
    responses = list(s.ModelStreamInfer(iter(reqs), timeout=30))
    assert len(responses) == len(reqs)
    by_id = {}
    for resp in responses:
        rid = resp.infer_response.id
        by_id[rid] = resp
    errors = [resp.error_message for resp in responses if resp.error_message]
    assert len(errors) == 4, errors
    assert any("no_such_model" in e for e in errors)
    assert sum("INPUT0" in e for e in errors) == 3, errors
    ok = [resp for resp in responses if not resp.error_message]
    assert len(ok) == 1 and ok[0].infer_response.id == "r4"
    assert_fp32_close(np.frombuffer(ok[0].infer_response.raw_output_contents[0], dtype=np.float32), good.flatten())
    _good_grpc(bw)


def test_bytes_output_roundtrip_after_errors(bw, stub):
    """string_len still answers correctly after the BYTES error cases."""
    _, s = stub
    texts = [b"abc", b"", "\u00e9".encode()]
    raw = b"".join(struct.pack("<I", len(t)) + t for t in texts)
    resp = s.ModelInfer(_grpc_req("string_len", "TEXT", "BYTES", (3, 1), raw=raw), timeout=10)
    out = resp.raw_output_contents[0]
    got, off = [], 0
    while off < len(out):
        (n,) = struct.unpack_from("<I", out, off)
        got.append(out[off + 4 : off + 4 + n])
        off += 4 + n
    assert got == texts


def test_a_bad_string_does_not_fail_the_requests_batched_with_it(tmp_path, start_worker):
    """Strings that cannot become an ONNX string tensor (not UTF-8, or holding NUL) are refused
    before they are queued. Found in the batch instead, they failed every request in it."""
    import concurrent.futures

    from nereid_harness import copy_model

    repo = tmp_path / "repo"
    repo.mkdir()
    # One instance and a queue delay far past the calls' timeouts: the five good requests leave
    # together (the preferred size) or not before the calls time out. A bad string that reached
    # the queue would be batched with good ones and fail them, or leave fewer than five behind.
    copy_model(repo, "strings_batched", base="string_len",
               edit=lambda t: t + "dynamic_batching { preferred_batch_size: [ 5 ] max_queue_delay_microseconds: 600000000 }\n"
               "instance_group [ { count: 1 kind: KIND_CPU } ]\n")
    w = start_worker(repo)
    ch = grpc.insecure_channel(w.grpc_url)
    try:
        stub = pbg.GRPCInferenceServiceStub(ch)

        def text(payload: bytes):
            return _grpc_req("strings_batched", "TEXT", "BYTES", (1, 1), raw=struct.pack("<I", len(payload)) + payload)

        bad = {"not_utf8": b"\xff\xfe", "nul": b"a\x00b"}
        good = [f"text {i}".encode() for i in range(5)]
        with concurrent.futures.ThreadPoolExecutor(len(bad) + len(good)) as pool:
            bad_calls = {k: pool.submit(stub.ModelInfer, text(v), timeout=30) for k, v in bad.items()}
            good_calls = [pool.submit(stub.ModelInfer, text(g), timeout=30) for g in good]
            for payload, call in zip(good, good_calls):
                out = call.result().raw_output_contents[0]
                assert out == struct.pack("<I", len(payload)) + payload
            for kind, call in bad_calls.items():
                with pytest.raises(grpc.RpcError) as e:
                    call.result()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kind
                assert "TEXT" in e.value.details() and ("UTF-8" in e.value.details() or "NUL" in e.value.details()), e.value.details()
        status, _, body = http_request(f"{w.base}/v2/models/strings_batched/stats")
        assert status == 200, body
        stats = json.loads(body)["model_stats"][0]
        assert int(stats["execution_count"]) == 1 and int(stats["inference_count"]) == 5, stats
        assert [int(b["batch_size"]) for b in stats["batch_stats"]] == [5], stats
    finally:
        ch.close()
        w.stop()


def test_a_raw_binary_request_is_served_and_a_bad_one_refused(bw):
    """Triton's raw binary request: `Inference-Header-Content-Length: 0` and the body is the
    model's only input, batch 1; the answer is every output, binary, after its JSON header."""
    x = np.arange(16, dtype=np.float32) * 0.5
    headers = {"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"}
    status, got, body = _post(bw, "/v2/models/identity_fp32/infer", x.tobytes(), headers)
    assert status == 200, body
    n = int({k.lower(): v for k, v in got.items()}["inference-header-content-length"])
    header = json.loads(body[:n])
    (out,) = header["outputs"]
    assert (out["name"], out["shape"], out["parameters"]["binary_data_size"]) == ("OUTPUT0", [1, 16], 64)
    np.testing.assert_array_equal(np.frombuffer(body[n:], dtype=np.float32), x)

    # A BYTES input takes the whole body as one element.
    status, got, body = _post(bw, "/v2/models/string_len/infer", b"hello", headers)
    assert status == 200, body

    # A body that is not a whole input, or a model of two inputs: 400, naming why.
    status, _, body = _post(bw, "/v2/models/identity_fp32/infer", x.tobytes()[:60], headers)
    assert status == 400 and "got 60 bytes of data, but shape [1, 16] of FP32 needs 64" in json.loads(body)["error"], body
    status, _, body = _post(bw, "/v2/models/mixed_types/infer", b"\0" * 8, headers)
    assert status == 400 and "exactly one" in json.loads(body)["error"], body
    _good_http(bw)
