"""TensorRT eligibility judges the weight as the GEMM reads it: TensorRT folds a Reshape or Cast of a stored tensor
into one 2-D float constant, which it can run sparse, so a dense [1, K, N] weight reshaped to [K, N], or a float64
one cast to float, fails ``--require`` like a plain dense [K, N] weight. Weights read straight from storage keep their
verdicts. ONNX Runtime, reading the operand the MatMul multiplies by, is the oracle for what prune wrote."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main
from nmdeploy.graph.eligibility import tensorrt_verdict
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.masks import Pattern

K, N = 16, 8  # the MatMul reads a [K, N] weight, reduced over K
DENSE_FAILS = "FAILED | 1 TensorRT-eligible weight is not 2:4: W"


def dense(shape, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def model(nodes, initializers, operand_shape=(K, N)) -> onnx.ModelProto:
    """x [2, K] -> MatMul(x, Wr) -> y; ``nodes`` make the operand Wr from the stored W. Wr is an output too, so ONNX
    Runtime shows what the MatMul multiplies by."""
    graph = helper.make_graph(
        [*nodes, helper.make_node("MatMul", ["x", "Wr"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [*operand_shape[:-2], 2, N]),
            helper.make_tensor_value_info("Wr", TensorProto.FLOAT, operand_shape),
        ],
        initializers,
    )
    proto = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(proto, full_check=True)
    return proto


TARGET_SHAPE = numpy_helper.from_array(np.array([K, N], np.int64), "shape")
FOLDED_TO_2D_FLOAT = {
    "[1,K,N] reshaped": model(
        [helper.make_node("Reshape", ["W", "shape"], ["Wr"])],
        [numpy_helper.from_array(dense((1, K, N)), "W"), TARGET_SHAPE],
    ),
    "[K,1,N] reshaped": model(
        [helper.make_node("Reshape", ["W", "shape"], ["Wr"])],
        [numpy_helper.from_array(dense((K, 1, N)), "W"), TARGET_SHAPE],
    ),
    "float64 cast": model(
        [helper.make_node("Cast", ["W"], ["Wr"], to=TensorProto.FLOAT)],
        [numpy_helper.from_array(dense((K, N), np.float64), "W")],
    ),
    "float64 [1,K,N] cast and reshaped": model(
        [
            helper.make_node("Cast", ["W"], ["Wc"], to=TensorProto.FLOAT),
            helper.make_node("Reshape", ["Wc", "shape"], ["Wr"]),
        ],
        [numpy_helper.from_array(dense((1, K, N), np.float64), "W"), TARGET_SHAPE],
    ),
}


def stored(values: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(values, "W")


def last_line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


@pytest.mark.parametrize("case", FOLDED_TO_2D_FLOAT)
def test_a_dense_weight_folded_to_2d_float_fails_require(case, tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(FOLDED_TO_2D_FLOAT[case], path)
    assert main(["inspect", str(path), "--require"]) == 1
    assert last_line(capsys) == DENSE_FAILS


@pytest.mark.parametrize("case", FOLDED_TO_2D_FLOAT)
def test_prune_makes_the_operand_the_gemm_reads_2of4(case, tmp_path, capsys):
    path, pruned = tmp_path / "m.onnx", tmp_path / "pruned.onnx"
    onnx.save(FOLDED_TO_2D_FLOAT[case], path)
    assert main(["prune", str(path), "-o", str(pruned), "--require"]) == 0
    x = np.random.default_rng(1).standard_normal((2, K)).astype(np.float32)
    session = ort.InferenceSession(str(pruned), providers=["CPUExecutionProvider"])
    y, operand = session.run(["y", "Wr"], {"x": x})
    assert operand.shape == (K, N) and operand.dtype == np.float32
    assert (np.count_nonzero(operand.reshape(K // 4, 4, N), axis=1) == 2).all()
    np.testing.assert_allclose(y, x @ operand, rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert main(["inspect", str(pruned), "--require"]) == 0


def test_an_integer_weight_cast_to_float_is_eligible_and_prune_says_why_it_stays_dense(tmp_path, capsys):
    """TensorRT folds the Cast into a float constant; prune does not rank integers read without a DequantizeLinear,
    so both verbs fail ``--require`` with the reason on one line."""
    path = tmp_path / "m.onnx"
    values = (dense((K, N)) * 10).astype(np.int32)
    onnx.save(model([helper.make_node("Cast", ["W"], ["Wr"], to=TensorProto.FLOAT)], [stored(values)]), path)
    assert main(["inspect", str(path), "--require"]) == 1
    assert last_line(capsys) == DENSE_FAILS
    assert main(["prune", str(path), "-o", str(tmp_path / "out.onnx"), "--require"]) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(error) == 1 and "int32 weight that is not read by a DequantizeLinear" in error[0]
    assert not (tmp_path / "out.onnx").exists()


def verdict_reasons(proto: onnx.ModelProto) -> tuple[str, ...]:
    (weight,) = find_prunable_weights(proto).weights
    return tensorrt_verdict(weight, Pattern(2, 4)).reasons


def read_directly(values: np.ndarray) -> onnx.ModelProto:
    """x [2, K] -> MatMul(x, W) with nothing between the stored W and the MatMul; x has W's element type."""
    data_type = helper.np_dtype_to_tensor_dtype(values.dtype)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", data_type, [2, K])],
        [helper.make_tensor_value_info("y", data_type, [*values.shape[:-2], 2, N])],
        [stored(values)],
    )
    proto = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(proto, full_check=True)
    return proto


def test_weights_read_from_storage_keep_their_verdicts():
    """Without ops between storage and the GEMM, the stored tensor is the operand: the verdicts are as before."""
    three_d = verdict_reasons(read_directly(dense((1, K, N))))
    assert "3-D MatMul weight; TensorRT needs a 2-D one" in three_d
    assert "dtype double has no sparse tactics" in verdict_reasons(read_directly(dense((K, N), np.float64)))
    assert not any(reason.startswith("fp32") for reason in verdict_reasons(read_directly(dense((K, N), np.float16))))


def test_the_verdict_follows_the_operand_not_the_storage():
    """A 2-D weight unsqueezed to [1, K, N] is read 3-D; an fp16 weight cast to float is read as fp32."""
    axes = numpy_helper.from_array(np.array([0], np.int64), "axes")
    unsqueeze = [helper.make_node("Unsqueeze", ["W", "axes"], ["Wr"])]
    unsqueezed = verdict_reasons(model(unsqueeze, [stored(dense((K, N))), axes], (1, K, N)))
    assert "3-D MatMul weight; TensorRT needs a 2-D one" in unsqueezed
    cast = [helper.make_node("Cast", ["W"], ["Wr"], to=TensorProto.FLOAT)]
    fp16 = verdict_reasons(model(cast, [stored(dense((K, N), np.float16))]))
    assert any(reason.startswith("fp32 weights") for reason in fp16)
