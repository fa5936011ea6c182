"""nereid-perf against a real worker serving a model with a variable (-1) non-batch dim: request
shapes come from `--shape` or from a workload file's per-entry shapes, every shape reaches the
server intact (a wrong byte count would be an error), and a run that does not say the shape is
refused before any load, naming the flag."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from nereid_harness import WORKER_BIN

PERF_BIN = WORKER_BIN.with_name("nereid-perf")
RUN_LIMIT_S = 120
# Two short windows after a short warm-up, a wide stability band: bounded and not about speed.
SHORT = ["-p", "300", "-r", "2", "-s", "1000", "--warmup-ms", "100", "-q"]


@pytest.fixture
def seqsum_repo(tmp_path):
    """A repository with `seqsum`: X FP32 [batch, -1] -> Y = sum over the row, [batch, 1]."""
    repo = tmp_path / "repo"
    (repo / "seqsum" / "1").mkdir(parents=True)
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [1])
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["X", "axes"], ["Y"], keepdims=1)],
        "seqsum",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "len"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 1])],
        initializer=[axes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    (repo / "seqsum" / "1" / "model.onnx").write_bytes(model.SerializeToString())
    (repo / "seqsum" / "config.pbtxt").write_text(
        'name: "seqsum"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        "dynamic_batching { }\n"
    )
    return repo


def perf(*args):
    if not PERF_BIN.exists():
        pytest.fail(f"{PERF_BIN} is not built (cargo build --workspace --all-targets)")
    return subprocess.run([str(PERF_BIN), *args], capture_output=True, text=True, timeout=RUN_LIMIT_S)


def test_variable_dims_take_their_shape_from_flags_or_the_workload(make_worker, seqsum_repo, tmp_path):
    w = make_worker(seqsum_repo)
    url = f"127.0.0.1:{w.grpc_port}"
    metrics = f"127.0.0.1:{w.ports['metrics']}"

    # The model itself answers per shape: a row of ones sums to its length.
    x = np.ones((2, 5), dtype=np.float32)
    body = {"inputs": [{"name": "X", "shape": [2, 5], "datatype": "FP32", "data": x.flatten().tolist()}]}
    status, _, resp = w.post("/v2/models/seqsum/infer", body)
    assert status == 200, resp
    assert json.loads(resp)["outputs"][0]["data"] == [5.0, 5.0]

    # No shape for the variable dim: refused before any load, naming the input and the flag.
    run = perf("-m", "seqsum", "-u", url, "--no-server-stats", *SHORT)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "X" in run.stderr and "--shape" in run.stderr, run.stderr

    # --shape: every request carries 24 values per row; the server counts what it executed.
    out = tmp_path / "flags.json"
    run = perf("-m", "seqsum", "-u", url, "--metrics-url", metrics, "--shape", "X:24", "-b", "2",
               "--concurrency-range", "2", "--json", str(out), *SHORT)
    assert run.returncode == 0, run.stdout + run.stderr
    level = json.loads(out.read_text())["levels"][0]
    assert level["total"]["ok"] > 0 and level["total"]["errors"] == 0, level["total"]
    assert level["server"]["seqsum"]["requests"] > 0, level["server"]

    # A workload mixing two lengths in two classes: both measured, neither failing (a request
    # whose bytes did not match its shape would come back INVALID_ARGUMENT).
    workload = tmp_path / "workload.json"
    workload.write_text(json.dumps({"entries": [
        {"model": "seqsum", "class": "short", "shapes": {"X": [3]}},
        {"model": "seqsum", "class": "long", "batch_size": 4, "shapes": {"X": [300]}, "data": "random"},
    ]}))
    out = tmp_path / "mix.json"
    run = perf("--workload", str(workload), "-u", url, "--metrics-url", metrics, "--concurrency-range", "4",
               "--json", str(out), *SHORT)
    assert run.returncode == 0, run.stdout + run.stderr
    level = json.loads(out.read_text())["levels"][0]
    by_class = {s["name"]: s["summary"] for s in level["series"]}
    assert set(by_class) == {"short", "long"}, by_class
    for name, s in by_class.items():
        assert s["ok"] > 0 and s["errors"] == 0, (name, s)
    long = by_class["long"]
    assert long["infer_per_sec"] == pytest.approx(4 * long["requests_per_sec"], rel=1e-6), long

    # A shape the model cannot take (a fixed dim where the model has none to fix) is refused.
    run = perf("-m", "seqsum", "-u", url, "--shape", "X:2,3", "--no-server-stats", *SHORT)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "X" in run.stderr, run.stderr
