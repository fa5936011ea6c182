"""Optional inputs (`optional: true`) through tritonclient: `optional_bias` gives BIAS a
default in the model (an initializer that is also a graph input), so a request may leave it
out; results compared with onnxruntime in Python on the same inputs, over HTTP and gRPC,
with and without BIAS in flight at once."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from nereid_harness import assert_fp32_close, ort_run

CLIENTS = {"http": httpclient, "grpc": grpcclient}


def _client(worker, protocol):
    return httpclient.InferenceServerClient(worker.http_url, concurrency=8) if protocol == "http" else grpcclient.InferenceServerClient(worker.grpc_url)


def _inputs(mod, x, bias=None):
    inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    out = [inp]
    if bias is not None:
        b = mod.InferInput("BIAS", list(bias.shape), "FP32")
        b.set_data_from_numpy(bias)
        out.append(b)
    return out


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_optional_input_may_be_left_out(worker, protocol):
    mod = CLIENTS[protocol]
    c = _client(worker, protocol)
    try:
        cfg = c.get_model_config("optional_bias")
        inputs = cfg["input"] if protocol == "http" else [{"name": i.name, "optional": i.optional} for i in cfg.config.input]
        assert {i["name"]: bool(i.get("optional")) for i in inputs} == {"INPUT0": False, "BIAS": True}

        rng = np.random.default_rng(11)
        x = rng.standard_normal((3, 4)).astype(np.float32)
        bias = rng.standard_normal((3, 4)).astype(np.float32)
        without = c.infer("optional_bias", _inputs(mod, x)).as_numpy("OUTPUT0")
        assert_fp32_close(without, ort_run("optional_bias", {"INPUT0": x})["OUTPUT0"])
        assert_fp32_close(without, x + 0.5)
        with_bias = c.infer("optional_bias", _inputs(mod, x, bias)).as_numpy("OUTPUT0")
        assert_fp32_close(with_bias, ort_run("optional_bias", {"INPUT0": x, "BIAS": bias})["OUTPUT0"])

        # The required input still is.
        b = mod.InferInput("BIAS", [3, 4], "FP32")
        b.set_data_from_numpy(bias)
        with pytest.raises(InferenceServerException) as e:
            c.infer("optional_bias", [b])
        assert "lacks 'INPUT0'" in str(e.value), str(e.value)
    finally:
        c.close()


def test_requests_with_and_without_the_optional_input_in_flight_together(worker):
    c = _client(worker, "http")
    try:
        rng = np.random.default_rng(12)
        cases = []
        for k in range(16):
            x = rng.standard_normal((1 + k % 3, 4)).astype(np.float32)
            bias = rng.standard_normal(x.shape).astype(np.float32) if k % 2 else None
            cases.append((x, bias, c.async_infer("optional_bias", _inputs(httpclient, x, bias))))
        for x, bias, pending in cases:
            got = pending.get_result().as_numpy("OUTPUT0")
            assert_fp32_close(got, x + (bias if bias is not None else 0.5))
    finally:
        c.close()
