"""Activation statistics: H = X^T X of each weight's GEMM input, checked against a direct numpy computation."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.calibration import collect_statistics
from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.model import OnnxModel


@pytest.mark.parametrize("external", [True, False])
def test_second_moments_match_the_activations(tmp_path, external):
    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 32)).astype(np.float32)  # MatMul B [K=16, N=32]
    w2 = rng.standard_normal((8, 32)).astype(np.float32)  # Gemm transB=1 [N=8, K=32]
    w3 = rng.standard_normal((4, 8)).astype(np.float32)  # MatMul A-side: y3 = W3 @ y^T, K = 8
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Gemm", ["r", "W2"], ["y"], transB=1),
        helper.make_node("Transpose", ["y"], ["yt"]),
        helper.make_node("MatMul", ["W3", "yt"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, 16])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2"), numpy_helper.from_array(w3, "W3")],
    )
    # The Gemm needs 2-D input, so the token axis is folded in by a model that feeds [batch*3, 16] rows.
    graph.node.insert(0, helper.make_node("Reshape", ["x", "flat"], ["x2"]))
    graph.node[1].input[0] = "x2"
    graph.initializer.append(numpy_helper.from_array(np.array([-1, 16], np.int64), "flat"))
    proto = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    if external:
        onnx.save(proto, tmp_path / "m.onnx", save_as_external_data=True, location="m.onnx.data", size_threshold=1024)
    else:
        onnx.save(proto, tmp_path / "m.onnx")
    model = OnnxModel.load(tmp_path / "m.onnx")
    weights = find_prunable_weights(model.proto).weights
    batches = [{"x": rng.standard_normal((2, 3, 16)).astype(np.float32)} for _ in range(3)]
    stats, skipped = collect_statistics(model, weights, batches)
    assert skipped == {} and set(stats) == {"W1", "W2", "W3"}

    x = np.concatenate([b["x"].reshape(-1, 16) for b in batches]).astype(np.float64)
    r = np.maximum(x @ w1, 0)
    y = r @ w2.T
    expected = {"W1": x.T @ x, "W2": r.T @ r, "W3": y.T @ y}  # W3 @ y^T reduces over y's last axis (K = 8)
    for name, h in expected.items():
        np.testing.assert_allclose(stats[name].hessian.numpy(), h, rtol=1e-5, atol=1e-4)
        assert stats[name].samples == 18
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["m.onnx", "m.onnx.data"] if external else ["m.onnx"])  # no temporary copy left behind


def test_convolutions_are_reported_not_guessed(tmp_path):
    conv = helper.make_node("Conv", ["x", "C"], ["y"])
    graph = helper.make_graph(
        [conv],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((8, 4, 3, 3), np.float32), "C")],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "c.onnx")
    model = OnnxModel.load(tmp_path / "c.onnx")
    stats, skipped = collect_statistics(model, find_prunable_weights(model.proto).weights, [])
    assert stats == {} and "im2col" in skipped["C"]
