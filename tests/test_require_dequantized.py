"""``--require`` judges a quantized weight by what the GEMM reads, not by the stored integers: the zero point of the
DequantizeLinear reading it is applied (through Identity too), a QuantizeLinear -> DequantizeLinear pair passes only
with equal zero points, and where what a stored zero becomes cannot be told the weight is not traced and fails.
ONNX Runtime, multiplying the identity by the weight, is the oracle for what the GEMM reads."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main
from nmdeploy.errors import ComplianceError
from nmdeploy.graph.inspection import inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes import VerifyPass

K, N = 16, 8  # MatMul weight [K, N], reduced over axis 0
UNTRACED = "FAILED | 1 GEMM weight not traced, so not verified 2:4: mm ("


def two_four_integers(zero: int) -> np.ndarray:
    """int8 [K, N] whose groups of 4 along K hold two values equal to ``zero`` and two that are not."""
    values = np.random.default_rng(0).integers(20, 100, (K, N)).astype(np.int8)
    values[0::4] = values[1::4] = zero
    return values


def stored(name, values):
    return numpy_helper.from_array(np.asarray(values), name)


def save(path, nodes, initializers, inputs=()):
    nodes = [*nodes, helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [K, K]), *inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [K, N])],
        initializers,
    )
    onnx.save(helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def weight_is_2of4(path, feeds=None) -> bool:
    """Whether the weight ONNX Runtime multiplies by (x = I) is 2:4 along K. ONNX Runtime's DequantizeLinear turns a
    non-zero zero point into about 1e-7, not 0 (it subtracts zero point times scale), so zero is |w| < 1e-6."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    weight = session.run(None, {"x": np.eye(K, dtype=np.float32), **(feeds or {})})[0]
    return bool(((np.abs(weight) >= 1e-6).reshape(K // 4, 4, N).sum(axis=1) <= 2).all())


def inspect_require(path, capsys) -> tuple[int, str]:
    code = main(["inspect", str(path), "--require"])
    return code, capsys.readouterr().out.strip().splitlines()[-1]


SCALE, FIVE, ZERO = stored("s", np.float32(0.01)), stored("zp", np.int8(5)), stored("z0", np.int8(0))


def dequantize(source, zero="zp", name="dq"):
    return helper.make_node("DequantizeLinear", [source, "s", zero], ["W"], name=name)


# Models whose stored int8 tensor has 2:4 zeros while the weight the MatMul multiplies by is dense.
DENSE_AT_THE_GEMM = {
    "identity before the DequantizeLinear": (
        [helper.make_node("Identity", ["Wq"], ["Wi"]), dequantize("Wi")],
        [stored("Wq", two_four_integers(0)), SCALE, FIVE],
        "FAILED | 1 TensorRT-eligible weight is not 2:4: Wq",
    ),
    "zero point through an Identity": (
        [helper.make_node("Identity", ["zp"], ["zpi"]), dequantize("Wq", "zpi")],
        [stored("Wq", two_four_integers(0)), SCALE, FIVE],
        "FAILED | 1 TensorRT-eligible weight is not 2:4: Wq",
    ),
    "QuantizeLinear zero point 0, DequantizeLinear 5": (
        [helper.make_node("QuantizeLinear", ["Wf", "s", "z0"], ["Wq"], name="q"), dequantize("Wq")],
        [stored("Wf", two_four_integers(0).astype(np.float32) / 100), SCALE, ZERO, FIVE],
        UNTRACED + "QuantizeLinear 'q' turns 0 into a zero point that DequantizeLinear 'dq' does not read as 0 (zero "
        "points differ, or cannot be compared here), so the stored zeros are not zeros at the GEMM)",
    ),
    "non-zero zero point behind a Transpose": (
        [helper.make_node("Transpose", ["Wq"], ["Wt"], perm=[1, 0], name="t"), dequantize("Wt")],
        [stored("Wq", two_four_integers(0).T.copy()), SCALE, FIVE],
        UNTRACED + "Transpose 't' lies between the stored tensor and DequantizeLinear 'dq', whose zero point is not "
        "known to be 0 and is not applied through it here, so what a stored zero dequantizes to is not known)",
    ),
}


@pytest.mark.parametrize("case", DENSE_AT_THE_GEMM)
def test_a_weight_dense_at_the_gemm_fails_require(tmp_path, capsys, case):
    nodes, initializers, reason = DENSE_AT_THE_GEMM[case]
    path = save(tmp_path / "m.onnx", nodes, initializers)
    assert not weight_is_2of4(path)
    assert inspect_require(path, capsys) == (1, reason)
    with pytest.raises(ComplianceError, match="not 2:4|not verified 2:4"):
        VerifyPass(pattern="2:4")(OnnxModel.load(path))


def test_a_zero_point_from_a_graph_input_is_not_traced(tmp_path, capsys):
    zero_input = helper.make_tensor_value_info("zp_in", TensorProto.INT8, [])
    path = save(
        tmp_path / "m.onnx", [dequantize("Wq", "zp_in")], [stored("Wq", two_four_integers(0)), SCALE], [zero_input]
    )
    assert not weight_is_2of4(path, {"zp_in": np.array(5, np.int8)})
    assert inspect_require(path, capsys) == (
        1,
        UNTRACED + "the zero point 'zp_in' of DequantizeLinear 'dq' is not a stored constant, so what a stored zero "
        "becomes at the GEMM is not known here)",
    )


# Models whose weight is 2:4 at the GEMM: each must still pass.
TWO_FOUR_AT_THE_GEMM = {
    "zero point 0 per tensor": ([dequantize("Wq", "z0")], [stored("Wq", two_four_integers(0)), SCALE, ZERO]),
    "zero point 0 per channel": (
        [helper.make_node("DequantizeLinear", ["Wq", "sc", "zc"], ["W"], axis=1)],
        [
            stored("Wq", two_four_integers(0)),
            stored("sc", np.full(N, 0.01, np.float32)),
            stored("zc", np.zeros(N, np.int8)),
        ],
    ),
    "zero point 5 through Identity, stored at the zero point": (
        [
            helper.make_node("Identity", ["Wq"], ["Wi"]),
            helper.make_node("Identity", ["zp"], ["zpi"]),
            dequantize("Wi", "zpi"),
        ],
        [stored("Wq", two_four_integers(5)), SCALE, FIVE],
    ),
    "QuantizeLinear and DequantizeLinear with zero point 0": (
        [helper.make_node("QuantizeLinear", ["Wf", "s", "z0"], ["Wq"]), dequantize("Wq", "z0")],
        [stored("Wf", two_four_integers(0).astype(np.float32) / 100), SCALE, ZERO],
    ),
    "QuantizeLinear and DequantizeLinear sharing zero point 5": (
        [helper.make_node("QuantizeLinear", ["Wf", "s", "zp"], ["Wq"]), dequantize("Wq")],
        [stored("Wf", two_four_integers(0).astype(np.float32) / 100), SCALE, FIVE],
    ),
}


@pytest.mark.parametrize("case", TWO_FOUR_AT_THE_GEMM)
def test_a_weight_2of4_at_the_gemm_passes_require(tmp_path, capsys, case):
    nodes, initializers = TWO_FOUR_AT_THE_GEMM[case]
    path = save(tmp_path / "m.onnx", nodes, initializers)
    assert weight_is_2of4(path)
    code, line = inspect_require(path, capsys)
    assert code == 0, line
    assert [row.compliant for row in inspect_model(OnnxModel.load(path)).rows] == [1.0]


def test_prune_applies_a_zero_point_read_through_identity(tmp_path, capsys):
    """prune and inspect agree on an Identity -> DequantizeLinear weight: pruned to its zero point, 2:4 at the GEMM."""
    nodes = [helper.make_node("Identity", ["Wq"], ["Wi"]), dequantize("Wi")]
    dense = np.random.default_rng(1).integers(-100, 100, (K, N)).astype(np.int8)
    path = save(tmp_path / "m.onnx", nodes, [stored("Wq", dense), SCALE, FIVE])
    assert main(["prune", str(path), "-o", str(tmp_path / "p.onnx"), "--require"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("PASSED | pruned 1 of 1 weights to 2:4")
    assert weight_is_2of4(tmp_path / "p.onnx")
    assert inspect_require(tmp_path / "p.onnx", capsys)[0] == 0


def test_a_missing_model_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.onnx"), "--require"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and error.startswith("nmdeploy inspect: error: ")
