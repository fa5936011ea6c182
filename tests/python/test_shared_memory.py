"""Triton's system shared-memory extension through tritonclient: regions created with
`tritonclient.utils.shared_memory`, registered over HTTP and gRPC, inputs read from them and
outputs written into them, compared with onnxruntime; status and unregister; the errors a
client can cause; and a worker without `--allow-client-shm` refusing it with the reason. CUDA
shared memory is answered as a CPU-only tritonserver answers it."""

from __future__ import annotations

import json
import os

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pbg
from tritonclient.utils import InferenceServerException

from nereid_harness import EXAMPLE_MODELS, assert_fp32_close, check_example_models, http_request, ort_run

CLIENTS = {"http": httpclient, "grpc": grpcclient}
# What each protocol's client reports as the status of an error.
NOT_FOUND = {"http": "404", "grpc": "StatusCode.NOT_FOUND"}
UNIMPLEMENTED = {"http": "501", "grpc": "StatusCode.UNIMPLEMENTED"}
INVALID = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}


def refusal(call):
    """The InferenceServerException `call` raises."""
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value


@pytest.fixture(scope="module")
def shm_worker(start_worker):
    check_example_models()
    return start_worker(EXAMPLE_MODELS, "--allow-client-shm=true")


def client_for(worker, protocol):
    return httpclient.InferenceServerClient(worker.http_url) if protocol == "http" else grpcclient.InferenceServerClient(worker.grpc_url)


@pytest.fixture
def regions(request):
    """Factory: regions(name, byte_size) -> handle; every region is destroyed after the test."""
    made = []

    def make(name, byte_size):
        # Unique per process and test, so parallel or repeated runs never collide.
        tag = "".join(c if c.isalnum() else "_" for c in request.node.name)[-60:]
        key = f"/nereid_pytest_{os.getpid()}_{len(made)}_{tag}"
        handle = shm.create_shared_memory_region(name, key, byte_size)
        made.append(handle)
        return key, handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_through_shared_memory(shm_worker, regions, protocol):
    mod = CLIENTS[protocol]
    c = client_for(shm_worker, protocol)
    try:
        assert "system_shared_memory" in (c.get_server_metadata()["extensions"] if protocol == "http" else c.get_server_metadata().extensions)
        rng = np.random.default_rng(7)
        x = rng.standard_normal((3, 256)).astype(np.float32)
        in_key, in_handle = regions(f"in_{protocol}", 4096 + x.nbytes)
        out_key, out_handle = regions(f"out_{protocol}", 1024)
        # The input sits at an offset that is not page-aligned.
        shm.set_shared_memory_region(in_handle, [x], offset=100)
        c.register_system_shared_memory(f"in_{protocol}", in_key, 4096 + x.nbytes)
        c.register_system_shared_memory(f"out_{protocol}", out_key, 1024)

        inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_shared_memory(f"in_{protocol}", x.nbytes, offset=100)
        out = mod.InferRequestedOutput("OUTPUT0")
        out.set_shared_memory(f"out_{protocol}", 1024, offset=0)
        result = c.infer("mlp_fp32", [inp], outputs=[out])

        meta = result.get_output("OUTPUT0")
        params = meta["parameters"] if protocol == "http" else {k: v for k, v in meta.parameters.items()}
        if protocol == "http":
            assert params["shared_memory_region"] == "out_http" and params["shared_memory_byte_size"] == 3 * 10 * 4
            assert "data" not in meta
        else:
            assert params["shared_memory_region"].string_param == "out_grpc"
            assert params["shared_memory_byte_size"].int64_param == 3 * 10 * 4
        got = shm.get_contents_as_numpy(out_handle, np.float32, [3, 10])
        assert_fp32_close(got, ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"])

        # Mixed: one input through shared memory, the other in the request; one output each way.
        f = rng.standard_normal((2, 4)).astype(np.float32)
        i = rng.integers(-10, 10, size=(2, 4)).astype(np.int64)
        shm.set_shared_memory_region(in_handle, [i], offset=0)
        a = mod.InferInput("INPUT_FP32", [2, 4], "FP32")
        a.set_data_from_numpy(f)
        b = mod.InferInput("INPUT_INT64", [2, 4], "INT64")
        b.set_shared_memory(f"in_{protocol}", i.nbytes)
        o16 = mod.InferRequestedOutput("OUTPUT_FP16")
        o16.set_shared_memory(f"out_{protocol}", 16, offset=512)
        obool = mod.InferRequestedOutput("OUTPUT_BOOL")
        result = c.infer("mixed_types", [a, b], outputs=[o16, obool])
        ref = ort_run("mixed_types", {"INPUT_FP32": f, "INPUT_INT64": i})
        np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float16, [2, 4], offset=512), ref["OUTPUT_FP16"])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT_BOOL"), ref["OUTPUT_BOOL"])

        # Status lists both regions with what was registered; unregistering one leaves the other.
        status = c.get_system_shared_memory_status()
        if protocol == "http":
            by_name = {r["name"]: r for r in status}
            assert by_name[f"in_{protocol}"]["key"] == in_key and int(by_name[f"in_{protocol}"]["byte_size"]) == 4096 + x.nbytes
        else:
            by_name = dict(status.regions)
            assert by_name[f"in_{protocol}"].key == in_key and by_name[f"in_{protocol}"].byte_size == 4096 + x.nbytes
        assert set(by_name) == {f"in_{protocol}", f"out_{protocol}"}
        c.unregister_system_shared_memory(f"in_{protocol}")
        status = c.get_system_shared_memory_status()
        names = [r["name"] for r in status] if protocol == "http" else list(status.regions)
        assert names == [f"out_{protocol}"]
        c.unregister_system_shared_memory()
        status = c.get_system_shared_memory_status()
        assert (len(status) if protocol == "http" else len(status.regions)) == 0
    finally:
        c.unregister_system_shared_memory()
        c.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_shared_memory_errors_are_clear_and_the_worker_keeps_serving(shm_worker, regions, protocol):
    mod = CLIENTS[protocol]
    c = client_for(shm_worker, protocol)
    name = f"err_{protocol}"
    try:
        key, handle = regions(name, 256)
        x = np.arange(16, dtype=np.float32).reshape(1, 16)
        shm.set_shared_memory_region(handle, [x])

        def refused(call, needle):
            with pytest.raises(InferenceServerException) as e:
                call()
            assert needle in str(e.value), str(e.value)

        refused(lambda: c.register_system_shared_memory(name, "/nereid_no_such_object", 64), "cannot open the shared memory object")
        refused(lambda: c.register_system_shared_memory(name, key, 512), "exceeds the object's size of 256 bytes")
        c.register_system_shared_memory(name, key, 256)
        refused(lambda: c.register_system_shared_memory(name, key, 64), "already registered")
        refused(lambda: c.get_system_shared_memory_status(f"{name}_nope"), f"Unable to find system shared memory region: '{name}_nope'")
        assert refusal(lambda: c.get_system_shared_memory_status(f"{name}_nope")).status() == NOT_FOUND[protocol]

        def infer_with(region, byte_size, offset=0, out=None):
            inp = mod.InferInput("INPUT0", [1, 16], "FP32")
            inp.set_shared_memory(region, byte_size, offset=offset)
            return c.infer("identity_fp32", [inp], outputs=out)

        # Triton's answer: NOT_FOUND (HTTP 404), in its words.
        e = refusal(lambda: infer_with(f"{name}_nope", 64))
        assert f"Unable to find shared memory region: '{name}_nope'" in str(e) and e.status() == NOT_FOUND[protocol], (e.status(), str(e))
        refused(lambda: infer_with(name, 64, offset=224), f"does not fit in region '{name}' of 256 bytes")
        refused(lambda: infer_with(name, 60), "needs 64 bytes")

        def counts():
            stats = c.get_inference_statistics("identity_fp32", **({"as_json": True} if protocol == "grpc" else {}))
            figures = stats["model_stats"][0]["inference_stats"]
            return int(figures["success"].get("count", 0)), int(figures["fail"].get("count", 0))

        def ran():
            stats = c.get_inference_statistics("identity_fp32", **({"as_json": True} if protocol == "grpc" else {}))
            entry = stats["model_stats"][0]
            figures = entry["inference_stats"]
            return (int(entry.get("inference_count", 0)), int(figures["queue"].get("count", 0)),
                    int(figures["compute_infer"].get("count", 0)), int(entry.get("execution_count", 0)))

        small = mod.InferRequestedOutput("OUTPUT0")
        small.set_shared_memory(name, 32, offset=128)
        before, ran_before = counts(), ran()
        refused(lambda: infer_with(name, 64, out=[small]), "output 'OUTPUT0': 64 bytes do not fit")
        # The model ran, but the client got an error: a failure in the statistics, as in Triton,
        # and an execution — but no inference, queue or compute figure (those count successes).
        assert counts() == (before[0], before[1] + 1)
        assert ran() == ran_before[:3] + (ran_before[3] + 1,), (ran_before, ran())

        # After all of that, the same region serves a good request.
        ok = mod.InferRequestedOutput("OUTPUT0")
        ok.set_shared_memory(name, 64, offset=128)
        infer_with(name, 64, out=[ok])
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [1, 16], offset=128), x)
        plain = mod.InferInput("INPUT0", [1, 16], "FP32")
        plain.set_data_from_numpy(x + 1)
        assert_fp32_close(c.infer("identity_fp32", [plain]).as_numpy("OUTPUT0"), x + 1)
    finally:
        c.unregister_system_shared_memory()
        c.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_worker_without_allow_client_shm_refuses_it(worker, regions, protocol):
    mod = CLIENTS[protocol]
    c = client_for(worker, protocol)
    try:
        md = c.get_server_metadata()
        assert "system_shared_memory" not in (md["extensions"] if protocol == "http" else md.extensions)
        key, _ = regions(f"off_{protocol}", 64)
        # Register and unregister: UNIMPLEMENTED (Triton's UNSUPPORTED; HTTP 501), with the reason.
        for call in (
            lambda: c.register_system_shared_memory(f"off_{protocol}", key, 64),
            lambda: c.unregister_system_shared_memory(),
            lambda: c.unregister_system_shared_memory(f"off_{protocol}"),
        ):
            e = refusal(call)
            assert "--allow-client-shm=true" in str(e) and e.status() == UNIMPLEMENTED[protocol], (e.status(), str(e))
        # Status answers as for no regions: there are none.
        status = c.get_system_shared_memory_status()
        assert (len(status) if protocol == "http" else len(status.regions)) == 0
        assert refusal(lambda: c.get_system_shared_memory_status(f"off_{protocol}")).status() == NOT_FOUND[protocol]
        inp = mod.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_shared_memory(f"off_{protocol}", 64)
        e = refusal(lambda: c.infer("identity_fp32", [inp]))
        assert "--allow-client-shm=true" in str(e) and f"Unable to find shared memory region: 'off_{protocol}'" in str(e), str(e)
        assert e.status() == NOT_FOUND[protocol], e.status()
        # CUDA regions, as a CPU-only tritonserver answers: none; register and unregister are
        # refused as the system ones are here.
        status = c.get_cuda_shared_memory_status()
        assert (len(status) if protocol == "http" else len(status.regions)) == 0
        for call in (lambda: c.unregister_cuda_shared_memory(), lambda: c.register_cuda_shared_memory("cuda", b"", 0, 64)):
            e = refusal(call)
            assert "--allow-client-shm=true" in str(e) and e.status() == UNIMPLEMENTED[protocol], (e.status(), str(e))
    finally:
        c.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_cuda_shared_memory_answers_as_a_cpu_only_triton(shm_worker, protocol):
    c = client_for(shm_worker, protocol)
    count = (lambda s: len(s)) if protocol == "http" else (lambda s: len(s.regions))
    try:
        # What tritonclient's shared-memory examples and perf_analyzer do first (and last).
        c.unregister_system_shared_memory()
        c.unregister_cuda_shared_memory()
        c.unregister_cuda_shared_memory("never_registered")
        assert count(c.get_cuda_shared_memory_status()) == 0
        if protocol == "grpc":
            assert c.get_cuda_shared_memory_status(as_json=True) == {}
        e = refusal(lambda: c.get_cuda_shared_memory_status("cuda0"))
        assert e.status() == NOT_FOUND[protocol] and "Unable to find cuda shared memory region: 'cuda0'" in str(e), (e.status(), str(e))
        e = refusal(lambda: c.register_cuda_shared_memory("cuda0", b"AAAA", 0, 64))
        assert e.status() == INVALID[protocol], (e.status(), str(e))
        assert "failed to register CUDA shared memory region: 'cuda0', GPUs not supported" in str(e), str(e)
        assert count(c.get_cuda_shared_memory_status()) == 0
    finally:
        c.close()


def test_grpc_output_cannot_be_both_in_shared_memory_and_a_classification(shm_worker, regions):
    # tritonclient refuses to build such an output, so the request is built by hand.
    key, handle = regions("cls_grpc", 256)
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    shm.set_shared_memory_region(handle, [x])
    c = grpcclient.InferenceServerClient(shm_worker.grpc_url)
    ch = grpc.insecure_channel(shm_worker.grpc_url)
    try:
        c.register_system_shared_memory("cls_grpc", key, 256)
        stub = pbg.GRPCInferenceServiceStub(ch)
        req = pb.ModelInferRequest(model_name="identity_fp32")
        inp = req.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 16])
        inp.parameters["shared_memory_region"].string_param = "cls_grpc"
        inp.parameters["shared_memory_byte_size"].int64_param = 64
        out = req.outputs.add(name="OUTPUT0")
        out.parameters["shared_memory_region"].string_param = "cls_grpc"
        out.parameters["shared_memory_byte_size"].int64_param = 128
        out.parameters["shared_memory_offset"].int64_param = 128
        out.parameters["classification"].int64_param = 2
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "output can't set both 'shared_memory_region' and 'classification'" in e.value.details(), e.value.details()
        # Without the classification, the same request writes the output into the region.
        del out.parameters["classification"]
        stub.ModelInfer(req)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [1, 16], offset=128), x)
    finally:
        c.unregister_system_shared_memory()
        c.close()
        ch.close()


def test_http_output_in_shared_memory_is_neither_a_classification_nor_binary(shm_worker, regions):
    """Triton's HTTP refusals: an output written into a region is not reshaped into classes,
    nor rendered as binary data."""
    key, handle = regions("cls_http", 256)
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    shm.set_shared_memory_region(handle, [x])
    c = httpclient.InferenceServerClient(shm_worker.http_url)
    url = f"http://{shm_worker.http_url}/v2/models/identity_fp32/infer"
    try:
        c.register_system_shared_memory("cls_http", key, 256)

        def body(**extra):
            out = {"shared_memory_region": "cls_http", "shared_memory_byte_size": 128, "shared_memory_offset": 128}
            out.update(extra)
            return json.dumps({
                "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
                            "parameters": {"shared_memory_region": "cls_http", "shared_memory_byte_size": 64}}],
                "outputs": [{"name": "OUTPUT0", "parameters": out}],
            }).encode()

        for extra, word in (({"classification": 2}, "classification"), ({"binary_data": True}, "binary_data")):
            status, _, data = http_request(url, "POST", body(**extra), {"Content-Type": "application/json"})
            assert status == 400, data
            assert f"output can't set both 'shared_memory_region' and '{word}'" in json.loads(data)["error"], data
        status, _, data = http_request(url, "POST", body(binary_data=False), {"Content-Type": "application/json"})
        assert status == 200, data
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [1, 16], offset=128), x)
    finally:
        c.unregister_system_shared_memory()
        c.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_request_copies_no_more_than_the_request_size_limit(repo_copy, make_worker, regions, protocol):
    # Five inputs naming the same 4 KiB region would copy 20 KiB: over a 10 000-byte limit,
    # refused before the third copy (and before the duplicate names are even looked at).
    w = make_worker(repo_copy("identity_fp32"), "--allow-client-shm=true", "--max-request-bytes", "10000")
    mod = CLIENTS[protocol]
    c = client_for(w, protocol)
    try:
        key, handle = regions(f"big_{protocol}", 4096)
        c.register_system_shared_memory(f"big_{protocol}", key, 4096)
        many = []
        for _ in range(5):
            inp = mod.InferInput("INPUT0", [64, 16], "FP32")
            inp.set_shared_memory(f"big_{protocol}", 4096)
            many.append(inp)
        with pytest.raises(InferenceServerException) as e:
            c.infer("identity_fp32", many)
        assert "exceeds the request size limit of 10000 bytes" in str(e.value), str(e.value)
        # One such input is fine.
        x = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
        shm.set_shared_memory_region(handle, [x])
        assert_fp32_close(c.infer("identity_fp32", many[:1]).as_numpy("OUTPUT0"), x)
    finally:
        c.unregister_system_shared_memory()
        c.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_large_shared_memory_inputs(shm_worker, regions, protocol):
    # 32 convnet rows are 1.5 MiB of input: copied off the worker's async threads.
    mod = CLIENTS[protocol]
    c = client_for(shm_worker, protocol)
    name = f"large_{protocol}"
    try:
        x = np.random.default_rng(5).standard_normal((32, 3, 64, 64)).astype(np.float32)
        key, handle = regions(name, x.nbytes)
        shm.set_shared_memory_region(handle, [x])
        c.register_system_shared_memory(name, key, x.nbytes)
        inp = mod.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_shared_memory(name, x.nbytes)
        got = c.infer("convnet_fp32", [inp]).as_numpy("OUTPUT0")
        assert_fp32_close(got, ort_run("convnet_fp32", {"INPUT0": x})["OUTPUT0"])
    finally:
        c.unregister_system_shared_memory()
        c.close()


def test_http_body_limit_does_not_bound_shared_memory_inputs(repo_copy, make_worker, regions):
    # --http-max-input-size bounds what the body carries; a tensor in shared memory is not in
    # the body (the request budget, --max-request-bytes, bounds what the worker copies).
    w = make_worker(repo_copy("identity_fp32"), "--allow-client-shm=true", "--http-max-input-size", "2048")
    c = httpclient.InferenceServerClient(w.http_url)
    try:
        x = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
        key, handle = regions("over_body", x.nbytes)
        shm.set_shared_memory_region(handle, [x])
        c.register_system_shared_memory("over_body", key, x.nbytes)
        inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_shared_memory("over_body", x.nbytes)
        assert_fp32_close(c.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), x)
        # The same tensor in the body is over the body limit.
        plain = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        plain.set_data_from_numpy(x, binary_data=True)
        with pytest.raises(InferenceServerException):
            c.infer("identity_fp32", [plain])
    finally:
        c.unregister_system_shared_memory()
        c.close()
