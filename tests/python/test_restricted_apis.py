"""tritonserver's endpoint restrictions (`--http-restricted-api`, `--grpc-restricted-protocol`)
driven by tritonclient, which sends the headers the way users' code does: a restricted API
answers only requests carrying its group's header and value; the others stay open."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from nereid_harness import EXAMPLE_MODELS, check_example_models

ADMIN_HTTP = {"admin-key": "s3cret"}
ADMIN_GRPC = {"triton-grpc-protocol-admin-key": "s3cret"}
INFER_GRPC = {"triton-grpc-protocol-infer-key": "abc"}


@pytest.fixture(scope="module")
def restricted(start_worker):
    check_example_models()
    return start_worker(
        EXAMPLE_MODELS,
        "--model-control-mode=explicit",
        "--load-model=identity_fp32",
        "--http-restricted-api=model-repository,logging:admin-key=s3cret",
        "--grpc-restricted-protocol=model-repository,logging:admin-key=s3cret",
        "--grpc-restricted-protocol=inference:infer-key=abc",
    )


def _inputs(module):
    data = np.arange(16, dtype=np.float32).reshape(1, 16)
    i = module.InferInput("INPUT0", [1, 16], "FP32")
    i.set_data_from_numpy(data)
    return data, [i]


def test_http_restricted_apis_need_the_header(restricted):
    c = httpclient.InferenceServerClient(restricted.http_url)
    try:
        for call in (lambda h: c.get_model_repository_index(headers=h),
                     lambda h: c.get_log_settings(headers=h),
                     lambda h: c.load_model("mlp_fp32", headers=h)):
            with pytest.raises(InferenceServerException) as e:
                call(None)
            assert "This API is restricted, expecting header 'admin-key'" in str(e.value), str(e.value)
            with pytest.raises(InferenceServerException):
                call({"admin-key": "wrong"})
            call(ADMIN_HTTP)
        assert c.is_model_ready("mlp_fp32"), "loaded with the admin header"
        # Not restricted over HTTP: inference, health, metadata.
        data, inputs = _inputs(httpclient)
        assert np.array_equal(c.infer("identity_fp32", inputs).as_numpy("OUTPUT0"), data)
        assert c.is_server_ready() and c.get_server_metadata()["name"]
    finally:
        c.close()


def test_grpc_restricted_protocols_need_the_prefixed_header(restricted):
    c = grpcclient.InferenceServerClient(restricted.grpc_url)
    try:
        data, inputs = _inputs(grpcclient)
        with pytest.raises(InferenceServerException) as e:
            c.infer("identity_fp32", inputs)
        assert "This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'" in str(e.value)
        assert "UNAVAILABLE" in str(e.value.status()), e.value.status()
        # The HTTP spelling of the header does not open the gRPC protocol.
        with pytest.raises(InferenceServerException):
            c.infer("identity_fp32", inputs, headers={"infer-key": "abc"})
        assert np.array_equal(c.infer("identity_fp32", inputs, headers=INFER_GRPC).as_numpy("OUTPUT0"), data)
        # Each group has its own credential.
        with pytest.raises(InferenceServerException):
            c.get_model_repository_index(headers=INFER_GRPC)
        index = c.get_model_repository_index(headers=ADMIN_GRPC, as_json=True)
        assert any(m["name"] == "identity_fp32" for m in index["models"]), index
        # Not restricted: health, metadata, config, statistics.
        assert c.is_server_ready() and c.get_model_config("identity_fp32").config.name == "identity_fp32"
        c.get_inference_statistics("identity_fp32")
    finally:
        c.close()
