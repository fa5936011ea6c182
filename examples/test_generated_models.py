"""Tests for examples/generate_models.py and the committed example configs.

Run:  .venv/bin/python -m pytest examples/test_generated_models.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATOR = os.path.join(HERE, "generate_models.py")
REPO_MODELS = os.path.join(HERE, "models")

EXPECTED_FILES = sorted(
    [
        "autocomplete_add/1/model.onnx",
        "convnet_fp32/1/model.onnx",
        "identity_fp32/1/model.onnx",
        "mixed_types/1/model.onnx",
        "mlp_fp32/1/model.onnx",
        "nobatch_add/1/model.onnx",
        "optional_bias/1/model.onnx",
        "string_len/1/model.onnx",
        "versioned_scale/1/model.onnx",
        "versioned_scale/2/model.onnx",
    ]
)


def _run_generator(out: str) -> None:
    subprocess.run([sys.executable, GENERATOR, "--out", out, "-q"], check=True)


def _read_tree(root: str) -> dict[str, bytes]:
    files = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                files[os.path.relpath(p, root).replace(os.sep, "/")] = f.read()
    return files


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("models"))
    _run_generator(out)
    return out


def _session(repo: str, model: str, version: int = 1) -> ort.InferenceSession:
    path = os.path.join(repo, model, str(version), "model.onnx")
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"])


# ---------------------------------------------------------------- generator


def test_generator_is_deterministic(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _run_generator(a)
    _run_generator(b)
    ta, tb = _read_tree(a), _read_tree(b)
    assert sorted(ta) == EXPECTED_FILES
    assert ta == tb


def test_generator_is_idempotent(tmp_path):
    out = str(tmp_path / "m")
    _run_generator(out)
    before = _read_tree(out)
    mtimes = {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in before}
    _run_generator(out)
    assert _read_tree(out) == before
    assert {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in before} == mtimes


@pytest.mark.parametrize("rel", EXPECTED_FILES)
def test_model_metadata(repo, rel):
    m = onnx.load(os.path.join(repo, rel))
    onnx.checker.check_model(m, full_check=True)
    assert m.ir_version == 8
    assert [(o.domain, o.version) for o in m.opset_import] == [("", 17)]
    assert m.producer_name == "nereid-examples"


# ------------------------------------------------------------------- models


def test_identity_fp32(repo):
    s = _session(repo, "identity_fp32")
    for batch in (1, 5, 64):
        x = np.random.default_rng(batch).standard_normal((batch, 16)).astype(np.float32)
        (y,) = s.run(["OUTPUT0"], {"INPUT0": x})
        assert y.dtype == np.float32
        np.testing.assert_array_equal(y, x)


def _mlp_reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    w = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    h = x
    for i in range(3):
        h = h @ w[f"fc{i}.weight"] + w[f"fc{i}.bias"]
        if i < 2:
            h = np.maximum(h, 0)
    return h


def test_mlp_fp32(repo):
    path = os.path.join(repo, "mlp_fp32", "1", "model.onnx")
    model = onnx.load(path)
    s = _session(repo, "mlp_fp32")
    x = np.random.default_rng(0).standard_normal((7, 256)).astype(np.float32)
    (y,) = s.run(["OUTPUT0"], {"INPUT0": x})
    assert y.shape == (7, 10) and y.dtype == np.float32
    np.testing.assert_allclose(y, _mlp_reference(model, x.astype(np.float64)), rtol=1e-3, atol=1e-4)
    # rows are independent: batching must not change per-row results
    (y1,) = s.run(["OUTPUT0"], {"INPUT0": x[2:3]})
    np.testing.assert_allclose(y1[0], y[2], rtol=1e-5, atol=1e-6)
    assert np.abs(y).max() > 1e-3  # not degenerate


def _conv2d(x, w, b):
    n, c, hh, ww = x.shape
    k = w.shape[0]
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((n, k, hh, ww), dtype=np.float64)
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,kc->nkhw", xp[:, :, i : i + hh, j : j + ww], w[:, :, i, j])
    return out + b[None, :, None, None]


def _maxpool2(x):
    n, c, h, w = x.shape
    return x.reshape(n, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


def test_convnet_fp32(repo):
    model = onnx.load(os.path.join(repo, "convnet_fp32", "1", "model.onnx"))
    w = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    s = _session(repo, "convnet_fp32")
    x = np.random.default_rng(1).standard_normal((3, 3, 64, 64)).astype(np.float32)
    (y,) = s.run(["OUTPUT0"], {"INPUT0": x})
    assert y.shape == (3, 10) and y.dtype == np.float32
    h = _maxpool2(np.maximum(_conv2d(x.astype(np.float64), w["conv0.weight"], w["conv0.bias"]), 0))
    h = _maxpool2(np.maximum(_conv2d(h, w["conv1.weight"], w["conv1.bias"]), 0))
    ref = h.mean(axis=(2, 3)) @ w["fc.weight"] + w["fc.bias"]
    np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-4)


def test_mixed_types(repo):
    s = _session(repo, "mixed_types")
    xf = np.array([[0.5, -1.0, 2.0, 3.0], [10.0, 0.0, -2.5, 7.0]], dtype=np.float32)
    xi = np.array([[0, 1, 2, -3], [9, 0, -3, 100]], dtype=np.int64)
    out_fp16, out_bool = s.run(["OUTPUT_FP16", "OUTPUT_BOOL"], {"INPUT_FP32": xf, "INPUT_INT64": xi})
    assert out_fp16.dtype == np.float16 and out_fp16.shape == (2, 4)
    assert out_bool.dtype == np.bool_ and out_bool.shape == (2, 4)
    np.testing.assert_array_equal(out_fp16, (xf + xi.astype(np.float32)).astype(np.float16))
    np.testing.assert_array_equal(out_bool, xf > xi.astype(np.float32))


def test_string_len(repo):
    s = _session(repo, "string_len")
    assert [o.name for o in s.get_outputs()] == ["TEXT_OUT"]
    x = np.array([["hello"], [""], ["héllo wörld"]], dtype=object)
    (y,) = s.run(["TEXT_OUT"], {"TEXT": x})
    assert y.shape == (3, 1)
    assert y.tolist() == x.tolist()


def test_autocomplete_add(repo):
    s = _session(repo, "autocomplete_add")
    rng = np.random.default_rng(2)
    a = rng.standard_normal((3, 8)).astype(np.float32)
    b = rng.standard_normal((3, 8)).astype(np.float32)
    (y,) = s.run(["SUM"], {"A": a, "B": b})
    np.testing.assert_array_equal(y, a + b)
    assert not os.path.exists(os.path.join(REPO_MODELS, "autocomplete_add", "config.pbtxt"))


@pytest.mark.parametrize("version,factor", [(1, 2.0), (2, 3.0)])
def test_versioned_scale(repo, version, factor):
    s = _session(repo, "versioned_scale", version)
    x = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    (y,) = s.run(["OUTPUT0"], {"INPUT0": x})
    np.testing.assert_array_equal(y, x * np.float32(factor))


def test_nobatch_add(repo):
    s = _session(repo, "nobatch_add")
    assert [i.shape for i in s.get_inputs()] == [[2, 3], [2, 3]]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = np.full((2, 3), 0.25, dtype=np.float32)
    (z,) = s.run(["Z"], {"X": x, "Y": y})
    np.testing.assert_array_equal(z, x + y)


def test_optional_bias(repo):
    s = _session(repo, "optional_bias")
    # BIAS is an initializer that is also a graph input: not required, but overridable.
    assert [i.name for i in s.get_inputs()] == ["INPUT0"]
    assert [i.name for i in s.get_overridable_initializers()] == ["BIAS"]
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    (y,) = s.run(["OUTPUT0"], {"INPUT0": x})
    np.testing.assert_array_equal(y, x + np.float32(0.5))
    b = np.full((3, 4), 2.0, dtype=np.float32)
    (y,) = s.run(["OUTPUT0"], {"INPUT0": x, "BIAS": b})
    np.testing.assert_array_equal(y, x + b)


# ---------------------------------------------- committed configs vs. models

_ONNX_TO_TRITON = {
    onnx.TensorProto.FLOAT: "TYPE_FP32",
    onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.INT64: "TYPE_INT64",
    onnx.TensorProto.BOOL: "TYPE_BOOL",
    onnx.TensorProto.STRING: "TYPE_STRING",
}

CONFIGURED = sorted({rel.split("/")[0] for rel in EXPECTED_FILES} - {"autocomplete_add"})


@pytest.mark.parametrize("name", CONFIGURED)
def test_config_matches_model(repo, name):
    import tritonclient.grpc.model_config_pb2 as mc
    from google.protobuf import text_format
    with open(os.path.join(REPO_MODELS, name, "config.pbtxt")) as f:
        cfg = text_format.Parse(f.read(), mc.ModelConfig())
    assert cfg.name == name
    assert cfg.backend == "onnxruntime"
    versions = sorted(int(d) for d in os.listdir(os.path.join(repo, name)) if d.isdigit())
    model = onnx.load(os.path.join(repo, name, str(versions[-1]), "model.onnx"))

    def io(values):
        out = {}
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
            out[v.name] = (_ONNX_TO_TRITON[t.elem_type], dims)
        return out

    def cfg_io(values):
        prefix = [-1] if cfg.max_batch_size > 0 else []
        return {
            v.name: (mc.DataType.Name(v.data_type), prefix + list(v.dims)) for v in values
        }

    assert cfg_io(cfg.input) == io(model.graph.input)
    assert cfg_io(cfg.output) == io(model.graph.output)
    if cfg.max_batch_size > 0:
        for v in list(model.graph.input) + list(model.graph.output):
            assert v.type.tensor_type.shape.dim[0].dim_param == "batch"
