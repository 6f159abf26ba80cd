"""Judged ONNX Runtime sessions compute Q/DQ as written; timed ones run the fused integer kernels. On a CPU without
VNNI, ONNX Runtime's fused u8 x s8 kernel saturates pairwise sums at int16, so a layer whose quantized activations
and weights are both near their ranges' ends comes out wrong by a large share of its outputs, a figure that would
change with the machine."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.evaluation.compare import compare_models
from nmdeploy.runtimes.backends import open_runner

IN, OUT = 64, 16


def saturating_layer(path, seed=0):
    """x -> Q/DQ (uint8, scale 1/255) -> MatMul with an int8 weight of +-127 (DQ, scale 0.01): activations near 255
    times weights at 127 overflow int16 in pairs. Returns (path, the weight as int8)."""
    weight = np.where(np.random.default_rng(seed).random((IN, OUT)) < 0.5, -127, 127).astype(np.int8)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zero"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w_dq"]),
        helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"]),
    ]
    initializers = [
        numpy_helper.from_array(np.array(1 / 255, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(0, np.uint8), "x_zero"),
        numpy_helper.from_array(weight, "w_q"),
        numpy_helper.from_array(np.array(0.01, np.float32), "w_scale"),
    ]
    graph = helper.make_graph(
        nodes,
        "saturating",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", OUT])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.save(model, path)
    return path, weight


def float_twin(path, weight):
    """The same layer with the dequantized weight as a float MatMul and no activation quantization."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "float",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", IN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", OUT])],
        [numpy_helper.from_array(weight.astype(np.float32) * np.float32(0.01), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.save(model, path)
    return path


def high_activations(rows=8, seed=1):
    return (0.8 + 0.2 * np.random.default_rng(seed).random((rows, IN))).astype(np.float32)


def test_a_judged_session_computes_qdq_as_written(tmp_path):
    path, weight = saturating_layer(tmp_path / "q.onnx")
    x = high_activations()
    exact = (np.clip(np.round(x * 255), 0, 255) / 255).astype(np.float32) @ (weight.astype(np.float32) * 0.01)
    with open_runner("ort", path) as runner:
        judged = runner.infer({"x": x})["y"]
    np.testing.assert_allclose(judged, exact, rtol=1e-5, atol=1e-4)


def test_a_timed_session_runs_the_fused_kernels_and_agrees_where_the_cpu_is_exact(tmp_path):
    """The timed runner is ONNX Runtime's fused kernel: where it is exact (VNNI) it equals the judged session; where
    it saturates, the judged session is the one that equals the arithmetic the model states."""
    path, _ = saturating_layer(tmp_path / "q.onnx")
    x = high_activations()
    with open_runner("ort", path) as judged, open_runner("ort", path, interleaved=True) as timed:
        assert judged.fused_qdq is False and timed.fused_qdq is True
        exact, fused = judged.infer({"x": x})["y"], timed.infer({"x": x})["y"]
    assert np.isfinite(fused).all() and fused.shape == exact.shape


def test_compare_judges_a_quantized_model_by_its_arithmetic_not_the_cpus_kernels(tmp_path):
    """The Q/DQ layer against its float twin differs only by rounding x to 8 bits: near 1 on any CPU (the fused
    kernel of an AVX2 CPU without VNNI scores -23 here)."""
    path, weight = saturating_layer(tmp_path / "q.onnx")
    dense = float_twin(tmp_path / "f.onnx", weight)
    x = high_activations(rows=32)
    np.savez(tmp_path / "data.npz", x=x)
    comparison = compare_models(dense, path, tmp_path / "data.npz")
    assert comparison.fidelity > 0.999, comparison.figures
