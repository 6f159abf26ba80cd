"""``--metric auto`` on class scores with several positions per row (a CTC reader's [time, batch, classes]): the
row's labels are what is read, and a per-row cosine hides them. A real captcha reader with 2:4 weights kept cosine
0.964 while 44 % of its label sequences changed, and compare said PASSED at 0.95 (the real model's time-major
output is found from the data; here the rows come first)."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main

TIME, FEATURES, CLASSES = 12, 16, 32


def _reader(path, weight: np.ndarray):
    """x [batch, time, features] -> MatMul (a final linear layer: class scores) -> [batch, time, classes]."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"], name="head")],
        "reader",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", TIME, FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", TIME, CLASSES])],
        [numpy_helper.from_array(weight.astype(np.float32), "w")],
    )
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_auto_judges_class_score_sequences_by_their_labels(tmp_path, capsys):
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(FEATURES, CLASSES))
    weight[:, 0] *= 1.5
    weight[:, 1] = weight[:, 0] + 1e-3  # two near-tied classes, often the best
    swapped = weight.copy()
    swapped[:, [0, 1]] = swapped[:, [1, 0]]  # the candidate reads one as the other: logits almost unchanged
    reference, candidate = _reader(tmp_path / "ref.onnx", weight), _reader(tmp_path / "cand.onnx", swapped)
    np.savez(tmp_path / "eval.npz", x=rng.normal(size=(64, TIME, FEATURES)).astype(np.float32))
    argv = ["compare", str(reference), str(candidate), "--data", str(tmp_path / "eval.npz"), "--json"]
    assert main([*argv, "--metric", "cosine"]) == 0
    cosine = json.loads(capsys.readouterr().out)["fidelity"]["value"]
    assert cosine > 0.99
    code = main([*argv, "--min-fidelity", "0.95"])
    document = json.loads(capsys.readouterr().out)
    judged = document["judged"][0]
    assert code == 1 and document["passed"] is False
    assert judged["metric"] == "sequence" and document["outputs"][0]["samples"] == 64  # rows, not time steps
    # the figure is the share of rows whose labels are all unchanged, computed here independently
    logits = np.load(tmp_path / "eval.npz")["x"] @ weight.astype(np.float32)
    labels = logits.argmax(-1)
    unchanged = ~np.isin(labels, [0, 1]).any(axis=1)
    assert abs(judged["value"] - unchanged.mean()) < 1e-9 and judged["value"] < 0.95


def _language_model(path, table: np.ndarray):
    """input_ids [batch, time] -> Gather -> MatMul (a final linear layer) -> logits [batch, time, classes]."""
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "input_ids"], ["hidden"], name="embed"),
            helper.make_node("MatMul", ["hidden", "w"], ["logits"], name="lm_head"),
        ],
        "lm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", TIME])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", TIME, CLASSES])],
        [
            numpy_helper.from_array(table.astype(np.float32), "table"),
            numpy_helper.from_array(np.eye(FEATURES, CLASSES, dtype=np.float32), "w"),
        ],
    )
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_language_model_s_logits_are_not_judged_as_whole_label_sequences(tmp_path, capsys):
    """Logits with one position per input token: a row of next-token guesses is not one answer, so auto does not
    judge whole rows (almost none would agree after any change) but keeps the measure of the values."""
    rng = np.random.default_rng(1)
    table = rng.normal(size=(CLASSES, FEATURES))
    reference = _language_model(tmp_path / "ref.onnx", table)
    candidate = _language_model(tmp_path / "cand.onnx", table + rng.normal(scale=0.05, size=table.shape))
    np.savez(tmp_path / "eval.npz", input_ids=rng.integers(0, CLASSES, size=(64, TIME)))
    argv = ["compare", str(reference), str(candidate), "--data", str(tmp_path / "eval.npz"), "--json"]
    assert main([*argv, "--metric", "auto"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["judged"][0]["metric"] != "sequence" and document["fidelity"]["value"] > 0.95
