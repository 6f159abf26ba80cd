"""Convert's refusal when every weight stays dense names each reason whole.

A voice-activity detector keeps its convolutions in both branches of an If (one per sample rate) besides
main-graph weights of odd widths; the refusal once clipped its joined reasons at 300 characters and ended
"used inside ...then_branch, whose values the calibration run can", the opposite of what it meant."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main
from nmdeploy.graph.prunable import SUBGRAPH_REASON


def _branch(name: str, seed: int, width: int = 8) -> onnx.GraphProto:
    values = np.random.default_rng(seed).normal(size=(width, width)).astype(np.float32)
    weight = numpy_helper.from_array(values, f"{name}_w")
    node = helper.make_node("MatMul", ["h", f"{name}_w"], [f"{name}_y"], name=f"{name}_mm")
    return helper.make_graph(
        [node], name, [], [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, None)], [weight]
    )


def _model_with_weights_out_of_reach(path, width: int = 8):
    rng = np.random.default_rng(0)
    odd = numpy_helper.from_array(rng.normal(size=(5, width)).astype(np.float32), "odd")  # reduction 5: not 2:4
    nodes = [
        helper.make_node("MatMul", ["x", "odd"], ["h"], name="first"),
        helper.make_node(
            "If",
            ["flag"],
            ["a"],
            then_branch=_branch("rate16k", 1, width),
            else_branch=_branch("rate8k", 2, width),
            name="by_rate",
        ),
        helper.make_node(
            "If",
            ["flag"],
            ["b"],
            then_branch=_branch("large", 3, width),
            else_branch=_branch("small", 4, width),
            name="by_size",
        ),
        helper.make_node("Add", ["a", "b"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        [odd],
    )
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_every_reason_a_weight_stayed_dense_is_said_whole(tmp_path, capsys):
    model = _model_with_weights_out_of_reach(tmp_path / "branches.onnx")
    before = model.read_bytes()
    out = tmp_path / "converted.onnx"
    assert main(["convert", str(model), "--calib", "random", "-o", str(out)]) == 2
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if line.strip()]
    assert len(lines) == 1 and "nothing to convert" in lines[0] and "Traceback" not in error
    for branch in ("by_rate:then_branch", "by_rate:else_branch", "by_size:then_branch", "by_size:else_branch"):
        # each reason is whole: the weight's place, why, and what prune does instead
        assert SUBGRAPH_REASON.format(graph=f"main/{branch}") in error
    assert "1 weight: axis" in error  # the odd main-graph reduction, counted
    assert not out.exists() and model.read_bytes() == before


def test_recover_with_nothing_converted_is_the_same_refusal_not_a_crash(tmp_path, capsys):
    # Once an internal error (exit 3): recovery built an optimizer over no weights at all.
    model = _model_with_weights_out_of_reach(tmp_path / "branches.onnx")
    out = tmp_path / "recovered.onnx"
    assert main(["convert", str(model), "--calib", "random", "--recover", "5", "-o", str(out)]) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and "internal error" not in error
    assert "nothing to convert" in error and "by_rate:then_branch" in error and not out.exists()


def test_the_budget_says_why_no_weight_is_a_candidate(tmp_path, capsys):
    # It once said "no TensorRT-eligible weight large enough to win" for eligible weights inside If branches.
    model = _model_with_weights_out_of_reach(tmp_path / "branches.onnx", width=64)
    out = tmp_path / "budget.onnx"
    assert main(["convert", str(model), "--calib", "random", "--min-fidelity", "0.9", "-o", str(out)]) == 2
    error = capsys.readouterr().err
    assert "nothing to convert" in error and "large enough to win" not in error and "Traceback" not in error
    assert SUBGRAPH_REASON.format(graph="main/by_rate:then_branch") in error and not out.exists()


def test_pipeline_with_nothing_converted_refuses_rather_than_writing_dense_baselines(tmp_path, capsys):
    # It once wrote baselines of the dense model against itself ("CREATED ... 0 weights converted"), exit 0, which
    # every later regress then passed.
    model = _model_with_weights_out_of_reach(tmp_path / "branches.onnx")
    out, data = tmp_path / "pipeline", tmp_path / "data.npz"
    np.savez(data, flag=np.array(True), x=np.random.default_rng(5).normal(size=(16, 5)).astype(np.float32))
    argv = ["pipeline", str(model), "--calib", str(data), "--data", str(data), "-o", str(out)]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "nothing to convert" in error and "Traceback" not in error
    assert not (out / "baselines.toml").exists()


def _lstm_branch(name: str, seed: int) -> onnx.GraphProto:
    """An LSTM over the outer 'x' [time, batch, 16] with 8 hidden units; its last hidden state [batch, 8] out."""
    rng = np.random.default_rng(seed)
    weights = [
        numpy_helper.from_array((rng.normal(size=(1, 32, 16)) / 4).astype(np.float32), f"{name}_W"),
        numpy_helper.from_array((rng.normal(size=(1, 32, 8)) / 4).astype(np.float32), f"{name}_R"),
        numpy_helper.from_array(np.array([0], np.int64), f"{name}_axes"),
    ]
    nodes = [
        helper.make_node("LSTM", ["x", f"{name}_W", f"{name}_R"], ["", f"{name}_h"], hidden_size=8, name=f"{name}"),
        helper.make_node("Squeeze", [f"{name}_h", f"{name}_axes"], [f"{name}_y"]),
    ]
    output = helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, None)
    return helper.make_graph(nodes, name, [], [output], weights)


def _if_with_lstm(path):
    """A detector that picks its LSTM by a scalar flag, as a voice-activity detector picks one per sample rate."""
    node = helper.make_node(
        "If", ["flag"], ["y"], then_branch=_lstm_branch("fast", 1), else_branch=_lstm_branch("slow", 2), name="rate"
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, "batch", 16]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
    )
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_an_lstm_inside_an_if_gets_one_reason_from_inspect_prune_convert_and_the_budget(tmp_path, capsys):
    model = _if_with_lstm(tmp_path / "if_lstm.onnx")
    before = model.read_bytes()
    reasons = {SUBGRAPH_REASON.format(graph=f"main/rate:{branch}_branch") for branch in ("then", "else")}
    data = tmp_path / "calib.npz"
    rng = np.random.default_rng(0)
    np.savez(data, flag=np.array(True), x=rng.normal(size=(6, 32, 16)).astype(np.float32))

    assert main(["inspect", str(model), "--json"]) == 0
    rows = {row["weight"]: row for row in json.loads(capsys.readouterr().out)["weights"]}
    assert {rows[f"{name}_W"]["uncalibrated"] for name in ("fast", "slow")} == reasons
    assert main(["inspect", str(model)]) == 0
    printed = " ".join(capsys.readouterr().out.split())  # lines folded at 120 characters
    assert all(reason in printed for reason in reasons)

    pruned = tmp_path / "pruned.onnx"
    assert main(["prune", str(model), "-o", str(pruned)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert all(reason in printed for reason in reasons) and "pruned 1 weight by magnitude alone (fast)" in printed

    for extra in ([], ["--min-fidelity", "0.9"]):
        out = tmp_path / "converted.onnx"
        assert main(["convert", str(model), "--calib", str(data), "-o", str(out), *extra]) == 2
        error = capsys.readouterr().err
        assert "Traceback" not in error and not out.exists(), extra
        assert all(reason in error for reason in reasons), (extra, error)
    assert model.read_bytes() == before
