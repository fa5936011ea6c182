#!/usr/bin/env python3
"""Generate the example ONNX models of the Nereid example model repository.

Usage:
    .venv/bin/python examples/generate_models.py --out examples/models

Writes only ``<out>/<model>/<version>/model.onnx``; the ``config.pbtxt`` files
are hand-written and committed next to the version folders.

The output is deterministic: fixed numpy seeds, constant producer name and
version, no timestamps, so two runs produce byte-identical files.  A file whose
bytes are already correct is not rewritten (its mtime is left alone).

Every model uses ONNX opset 17 and IR version 8 so that ONNX Runtime 1.31 loads
it.  Models with ``max_batch_size > 0`` in their config have a leading dynamic
dimension named ``batch``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
PRODUCER_NAME = "nereid-examples"
PRODUCER_VERSION = "1"
BATCH = "batch"

F32 = TensorProto.FLOAT
F16 = TensorProto.FLOAT16
I64 = TensorProto.INT64
BOOL = TensorProto.BOOL
STRING = TensorProto.STRING


def vi(name: str, elem_type: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem_type, shape)


def init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(array), name=name)


def make_model(name: str, nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes), name, list(inputs), list(outputs), initializer=list(initializers)
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name=PRODUCER_NAME,
        producer_version=PRODUCER_VERSION,
    )
    model.ir_version = IR_VERSION
    model.model_version = 1
    onnx.checker.check_model(model, full_check=True)
    return model


def normal(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# --------------------------------------------------------------------------
# Model builders.  Each returns {version: ModelProto}.
# --------------------------------------------------------------------------


def identity_fp32():
    return {
        1: make_model(
            "identity_fp32",
            [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])],
            [vi("INPUT0", F32, [BATCH, 16])],
            [vi("OUTPUT0", F32, [BATCH, 16])],
        )
    }


def mlp_fp32():
    rng = np.random.default_rng(1001)
    sizes = [256, 1024, 1024, 10]
    nodes, inits = [], []
    cur = "INPUT0"
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        w, b = f"fc{i}.weight", f"fc{i}.bias"
        inits.append(init(w, normal(rng, (n_in, n_out), 0.05)))
        inits.append(init(b, normal(rng, (n_out,), 0.05)))
        last = i == len(sizes) - 2
        gemm_out = "OUTPUT0" if last else f"fc{i}"
        nodes.append(helper.make_node("Gemm", [cur, w, b], [gemm_out], name=f"fc{i}"))
        if not last:
            nodes.append(helper.make_node("Relu", [gemm_out], [f"relu{i}"], name=f"relu{i}"))
            cur = f"relu{i}"
    return {
        1: make_model(
            "mlp_fp32",
            nodes,
            [vi("INPUT0", F32, [BATCH, 256])],
            [vi("OUTPUT0", F32, [BATCH, 10])],
            inits,
        )
    }


def convnet_fp32():
    rng = np.random.default_rng(1002)
    inits = [
        init("conv0.weight", normal(rng, (16, 3, 3, 3), 0.2)),
        init("conv0.bias", normal(rng, (16,), 0.05)),
        init("conv1.weight", normal(rng, (32, 16, 3, 3), 0.1)),
        init("conv1.bias", normal(rng, (32,), 0.05)),
        init("fc.weight", normal(rng, (32, 10), 0.2)),
        init("fc.bias", normal(rng, (10,), 0.05)),
    ]
    conv = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1])
    pool = dict(kernel_shape=[2, 2], strides=[2, 2])
    nodes = [
        helper.make_node("Conv", ["INPUT0", "conv0.weight", "conv0.bias"], ["c0"], name="conv0", **conv),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("MaxPool", ["r0"], ["p0"], name="pool0", **pool),
        helper.make_node("Conv", ["p0", "conv1.weight", "conv1.bias"], ["c1"], name="conv1", **conv),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], name="pool1", **pool),
        helper.make_node("GlobalAveragePool", ["p1"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["OUTPUT0"], name="fc"),
    ]
    return {
        1: make_model(
            "convnet_fp32",
            nodes,
            [vi("INPUT0", F32, [BATCH, 3, 64, 64])],
            [vi("OUTPUT0", F32, [BATCH, 10])],
            inits,
        )
    }


def mixed_types():
    nodes = [
        helper.make_node("Cast", ["INPUT_INT64"], ["int_as_f32"], to=F32),
        helper.make_node("Add", ["INPUT_FP32", "int_as_f32"], ["sum_f32"]),
        helper.make_node("Cast", ["sum_f32"], ["OUTPUT_FP16"], to=F16),
        helper.make_node("Greater", ["INPUT_FP32", "int_as_f32"], ["OUTPUT_BOOL"]),
    ]
    return {
        1: make_model(
            "mixed_types",
            nodes,
            [vi("INPUT_FP32", F32, [BATCH, 4]), vi("INPUT_INT64", I64, [BATCH, 4])],
            [vi("OUTPUT_FP16", F16, [BATCH, 4]), vi("OUTPUT_BOOL", BOOL, [BATCH, 4])],
        )
    }


def string_len():
    # Equal on tensor(string) only exists from opset 19; at opset 17 (required
    # here) neither onnx nor ONNX Runtime 1.31 accept it, so this model is a
    # plain string Identity.
    return {
        1: make_model(
            "string_len",
            [helper.make_node("Identity", ["TEXT"], ["TEXT_OUT"])],
            [vi("TEXT", STRING, [BATCH, 1])],
            [vi("TEXT_OUT", STRING, [BATCH, 1])],
        )
    }


def autocomplete_add():
    return {
        1: make_model(
            "autocomplete_add",
            [helper.make_node("Add", ["A", "B"], ["SUM"])],
            [vi("A", F32, [BATCH, 8]), vi("B", F32, [BATCH, 8])],
            [vi("SUM", F32, [BATCH, 8])],
        )
    }


def versioned_scale():
    out = {}
    for version, factor in ((1, 2.0), (2, 3.0)):
        out[version] = make_model(
            "versioned_scale",
            [helper.make_node("Mul", ["INPUT0", "scale"], ["OUTPUT0"])],
            [vi("INPUT0", F32, [BATCH, 4])],
            [vi("OUTPUT0", F32, [BATCH, 4])],
            [init("scale", np.array(factor, dtype=np.float32))],
        )
    return out


def nobatch_add():
    return {
        1: make_model(
            "nobatch_add",
            [helper.make_node("Add", ["X", "Y"], ["Z"])],
            [vi("X", F32, [2, 3]), vi("Y", F32, [2, 3])],
            [vi("Z", F32, [2, 3])],
        )
    }


def optional_bias():
    # BIAS is a graph input that is also an initializer: ONNX Runtime uses the initializer
    # (0.5 in every column, broadcast over the batch) when a request leaves BIAS out, and the
    # request's tensor when it gives one (config `optional: true`).
    return {
        1: make_model(
            "optional_bias",
            [helper.make_node("Add", ["INPUT0", "BIAS"], ["OUTPUT0"])],
            [vi("INPUT0", F32, [BATCH, 4]), vi("BIAS", F32, [BATCH, 4])],
            [vi("OUTPUT0", F32, [BATCH, 4])],
            [init("BIAS", np.full((1, 4), 0.5, dtype=np.float32))],
        )
    }


MODELS = {
    "identity_fp32": identity_fp32,
    "mlp_fp32": mlp_fp32,
    "convnet_fp32": convnet_fp32,
    "mixed_types": mixed_types,
    "string_len": string_len,
    "autocomplete_add": autocomplete_add,
    "versioned_scale": versioned_scale,
    "nobatch_add": nobatch_add,
    "optional_bias": optional_bias,
}


def write_if_changed(path: str, data: bytes) -> bool:
    """Atomically write ``data`` to ``path`` unless it already holds it."""
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return False
    except FileNotFoundError:
        pass
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".model.onnx.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return True


def generate(out_dir: str, only=None, quiet: bool = False) -> list[str]:
    written = []
    for name, build in MODELS.items():
        if only and name not in only:
            continue
        for version, model in sorted(build().items()):
            path = os.path.join(out_dir, name, str(version), "model.onnx")
            changed = write_if_changed(path, model.SerializeToString())
            written.append(path)
            if not quiet:
                print(f"{'wrote' if changed else 'unchanged'} {path}")
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "models"),
                        help="model repository root (default: examples/models next to this script)")
    parser.add_argument("--model", action="append", choices=sorted(MODELS),
                        help="generate only this model (repeatable)")
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    generate(args.out, only=args.model, quiet=args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
