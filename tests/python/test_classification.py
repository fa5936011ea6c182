"""Triton's classification extension through tritonclient (HTTP and gRPC): an output requested
with `class_count=N` comes back as the top N classes of each row, "<score>:<index>[:<label>]",
ranked as onnxruntime's scores for the same input rank them; labels come from the output's
`label_filename` (convnet_fp32 has one, mlp_fp32 none).
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from nereid_harness import EXAMPLE_MODELS, ort_run

LABELS = (EXAMPLE_MODELS / "convnet_fp32" / "labels.txt").read_text().splitlines()
PROTOCOLS = ["http", "grpc"]


def client_for(worker, protocol):
    if protocol == "http":
        return httpclient, httpclient.InferenceServerClient(worker.http_url)
    return grpcclient, grpcclient.InferenceServerClient(worker.grpc_url)


def infer(worker, protocol, model, arrays, outputs, **kwargs):
    lib, client = client_for(worker, protocol)
    inputs = []
    for name, arr in arrays.items():
        inp = lib.InferInput(name, list(arr.shape), "FP32")
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    try:
        return client.infer(model, inputs, outputs=[lib.InferRequestedOutput(n, **kwargs) for n in outputs])
    finally:
        client.close()


def expected_classes(scores: np.ndarray, k: int, labels=None) -> list[list[tuple[int, str | None]]]:
    """Per row: the top-k (index, label) by score, highest first, ties by index."""
    out = []
    for row in scores.reshape(scores.shape[0], -1):
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        out.append([(i, labels[i] if labels and i < len(labels) else None) for i in order])
    return out


def parse(result, name):
    arr = result.as_numpy(name)
    rows = []
    for row in arr:
        parsed = []
        for element in row:
            text = element.decode() if isinstance(element, bytes) else str(element)
            parts = text.split(":")
            parsed.append((float(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else None))
        rows.append(parsed)
    return arr, rows


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_top_classes_with_labels_match_onnxruntime(worker, protocol):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 3, 64, 64)).astype(np.float32)
    scores = ort_run("convnet_fp32", {"INPUT0": x})["OUTPUT0"]
    result = infer(worker, protocol, "convnet_fp32", {"INPUT0": x}, ["OUTPUT0"], class_count=3)
    arr, rows = parse(result, "OUTPUT0")
    assert arr.shape == (3, 3)
    assert arr.dtype == np.object_
    expected = expected_classes(scores, 3, LABELS)
    assert [[(i, label) for _, i, label in row] for row in rows] == expected
    for row, srow in zip(rows, scores):
        for value, index, _ in row:
            assert value == pytest.approx(float(srow[index]), abs=1e-5)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_without_labels_and_more_classes_than_the_output_has(worker, protocol):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 256)).astype(np.float32)
    scores = ort_run("mlp_fp32", {"INPUT0": x})["OUTPUT0"]
    result = infer(worker, protocol, "mlp_fp32", {"INPUT0": x}, ["OUTPUT0"], class_count=50)
    arr, rows = parse(result, "OUTPUT0")
    # mlp_fp32 has 10 classes: all of them, ranked.
    assert arr.shape == (2, 10)
    assert [[(i, label) for _, i, label in row] for row in rows] == expected_classes(scores, 10)


def test_http_json_output_carries_class_strings(worker):
    """Asked as JSON (binary_data false), the classes are BYTES strings in `data`."""
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
    result = infer(worker, "http", "identity_fp32", {"INPUT0": x}, ["OUTPUT0"], class_count=2, binary_data=False)
    response = result.get_response()
    out = response["outputs"][0]
    assert (out["datatype"], out["shape"]) == ("BYTES", [1, 2])
    assert out["data"] == ["1.000000:15", f"{x[0, 14]:.6f}:14"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_classifying_a_non_numeric_output_is_refused_and_the_worker_keeps_serving(worker, protocol):
    lib, client = client_for(worker, protocol)
    try:
        text = lib.InferInput("TEXT", [1, 1], "BYTES")
        text.set_data_from_numpy(np.array([[b"abc"]], dtype=np.object_))
        with pytest.raises(InferenceServerException) as ei:
            client.infer("string_len", [text], outputs=[lib.InferRequestedOutput("TEXT_OUT", class_count=1)])
        assert "output 'TEXT_OUT': classification needs numeric scores, but the output is BYTES" in str(ei.value)
    finally:
        client.close()
    x = np.ones((1, 16), dtype=np.float32)
    result = infer(worker, protocol, "identity_fp32", {"INPUT0": x}, ["OUTPUT0"])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x)


def test_server_metadata_lists_classification(worker):
    client = httpclient.InferenceServerClient(worker.http_url)
    try:
        assert "classification" in client.get_server_metadata()["extensions"]
    finally:
        client.close()


def test_a_missing_label_file_fails_the_load_naming_it(repo_copy, make_worker):
    repo = repo_copy("convnet_fp32")
    (repo / "convnet_fp32" / "labels.txt").unlink()
    w = make_worker(repo, "--model-control-mode=explicit")
    client = httpclient.InferenceServerClient(w.http_url)
    try:
        with pytest.raises(InferenceServerException) as ei:
            client.load_model("convnet_fp32")
        assert "label_filename 'labels.txt'" in str(ei.value)
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["convnet_fp32"]["state"] == "UNAVAILABLE"
        assert "labels.txt" in index["convnet_fp32"]["reason"]
    finally:
        client.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_large_output_is_classified_like_a_small_one(repo_copy, make_worker, protocol):
    """An output over 64 KiB is classified off the I/O thread: the same classes and scores, per
    row — from the model, and again from the response cache."""
    repo = repo_copy("identity_fp32")
    config = repo / "identity_fp32" / "config.pbtxt"
    text = config.read_text().replace("max_batch_size: 64", "max_batch_size: 2048")
    config.write_text(text + "response_cache { enable: true }\n")
    w = make_worker(repo, "--cache-config", "local,size=16777216")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2048, 16)).astype(np.float32)  # 128 KiB of scores
    expected = [[i for i, _ in row] for row in expected_classes(x, 3)]
    for _ in range(2):  # the second answer comes from the cache
        result = infer(w, protocol, "identity_fp32", {"INPUT0": x}, ["OUTPUT0"], class_count=3)
        arr, rows = parse(result, "OUTPUT0")
        assert arr.shape == (2048, 3)
        assert [[i for _, i, _ in row] for row in rows] == expected
        for row, scores in zip(rows, x):
            for value, index, _ in row:
                assert value == pytest.approx(float(scores[index]), abs=1e-5)
    client = httpclient.InferenceServerClient(w.http_url)
    try:
        stats = client.get_inference_statistics("identity_fp32")
    finally:
        client.close()
    assert stats["model_stats"][0]["inference_stats"]["cache_hit"]["count"] == 1
