"""Folding constant-computed weights keeps every value something else still reads, subgraph reads included, and
works on graphs whose nodes are not stored in topological order."""

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.fold import FoldConstantsPass


def value(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def run(proto, feeds):
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def scaled_weight_model(reversed_order: bool):
    """W * s feeds a MatMul; W * s is also read inside an If branch, so its producer must stay."""
    rng = np.random.default_rng(3)
    branch = helper.make_graph([helper.make_node("Neg", ["Ws"], ["n"])], "then", [], [value("n", [16, 8])])
    nodes = [
        helper.make_node("Mul", ["W", "s"], ["Ws"], name="scale"),
        helper.make_node("Mul", ["Ws", "s"], ["Wss"], name="scale_again"),
        helper.make_node("MatMul", ["x", "Wss"], ["y"], name="mm"),
        helper.make_node("If", ["cond"], ["z"], name="branch", then_branch=branch, else_branch=branch),
    ]
    if reversed_order:
        nodes.reverse()
    graph = helper.make_graph(
        nodes,
        "g",
        [value("x", [2, 16]), value("cond", [], TensorProto.BOOL)],
        [value("y", [2, 8]), value("z", [16, 8])],
        [
            numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "W"),
            numpy_helper.from_array(np.array(0.5, np.float32), "s"),
        ],
    )
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])


def test_fold_keeps_producers_of_values_read_inside_subgraphs_and_handles_unsorted_graphs():
    for reversed_order in (False, True):
        proto = scaled_weight_model(reversed_order)
        feeds = {"x": np.random.default_rng(4).standard_normal((2, 16)).astype(np.float32), "cond": np.array(True)}
        expected = run(proto, feeds) if not reversed_order else run(scaled_weight_model(False), feeds)
        model = OnnxModel(proto, base_dir=".")
        result = FoldConstantsPass()(model)
        assert result.modified and [row["folded"] for row in result.report_json()] == ["Wss"]
        assert sorted(node.name for node in model.proto.graph.node) == ["branch", "mm", "scale"]
        assert sorted(t.name for t in model.proto.graph.initializer) == ["W", "Wss", "s"]
        assert [w.name for w in find_prunable_weights(model.proto).weights] == ["Wss"]
        for got, want in zip(run(onnx.shape_inference.infer_shapes(model.proto), feeds), expected, strict=True):
            np.testing.assert_array_equal(got, want)
