"""`nmdeploy prune` and `nmdeploy inspect` run on numpy alone (torch only for transposable masks), and what prune
stores is bit for bit what the definition gives: magnitudes in float32, a stable descending sort per group of M,
the pruned entries +0.0 (or the zero point of an integer weight behind DequantizeLinear)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes import prune

ONNX_TYPES = {
    np.float32: TensorProto.FLOAT,
    np.float16: TensorProto.FLOAT16,
    np.float64: TensorProto.DOUBLE,
    ml_dtypes.bfloat16: TensorProto.BFLOAT16,
}


def mixed_model(path: Path) -> dict[str, int]:
    """One GEMM per weight kind: MatMul in four float types, Gemm with transB, Conv, an int8 weight behind a
    per-channel DequantizeLinear. Returns each weight's reduction axis. Ties are common (small integers)."""
    rng = np.random.default_rng(7)
    nodes, inputs, outputs, inits, axes = [], [], [], [], {}
    for dtype, code in ONNX_TYPES.items():
        name = f"W_{np.dtype(dtype).name}"
        inits.append(numpy_helper.from_array((rng.integers(-4, 5, (16, 8)) * 0.25).astype(dtype), name))
        inputs.append(helper.make_tensor_value_info(f"x_{name}", code, [2, 16]))
        outputs.append(helper.make_tensor_value_info(f"y_{name}", code, [2, 8]))
        nodes.append(helper.make_node("MatMul", [f"x_{name}", name], [f"y_{name}"]))
        axes[name] = 0
    inits.append(numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "W_gemm"))
    inputs.append(helper.make_tensor_value_info("x_gemm", TensorProto.FLOAT, [2, 16]))
    outputs.append(helper.make_tensor_value_info("y_gemm", TensorProto.FLOAT, [2, 8]))
    nodes.append(helper.make_node("Gemm", ["x_gemm", "W_gemm"], ["y_gemm"], transB=1))
    axes["W_gemm"] = 1
    inits.append(numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32), "W_conv"))
    inputs.append(helper.make_tensor_value_info("x_conv", TensorProto.FLOAT, [1, 4, 5, 5]))
    outputs.append(helper.make_tensor_value_info("y_conv", TensorProto.FLOAT, [1, 8, 3, 3]))
    nodes.append(helper.make_node("Conv", ["x_conv", "W_conv"], ["y_conv"]))
    axes["W_conv"] = 1
    inits += [
        numpy_helper.from_array(rng.integers(-128, 128, (16, 8), dtype=np.int8), "W_q"),
        numpy_helper.from_array(rng.uniform(0.01, 0.1, 8).astype(np.float32), "scale"),
        numpy_helper.from_array(rng.integers(-3, 4, 8, dtype=np.int8), "zero"),
    ]
    inputs.append(helper.make_tensor_value_info("x_q", TensorProto.FLOAT, [2, 16]))
    outputs.append(helper.make_tensor_value_info("y_q", TensorProto.FLOAT, [2, 8]))
    nodes += [
        helper.make_node("DequantizeLinear", ["W_q", "scale", "zero"], ["W_dq"], axis=1),
        helper.make_node("MatMul", ["x_q", "W_dq"], ["y_q"]),
    ]
    axes["W_q"] = 0
    graph = helper.make_graph(nodes, "mixed", inputs, outputs, inits)
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), path)
    return axes


def test_prune_inspect_and_verify_import_no_torch(tmp_path):
    mixed_model(tmp_path / "m.onnx")
    # A fresh interpreter: this one has torch loaded already.
    script = (
        "import sys\n"
        "from nmdeploy.cli import main\n"
        f"assert main(['prune', {str(tmp_path / 'm.onnx')!r}, '-o', {str(tmp_path / 'p.onnx')!r}]) == 0\n"
        f"assert main(['inspect', {str(tmp_path / 'p.onnx')!r}, '--require']) == 0\n"
        f"assert main(['inspect', {str(tmp_path / 'm.onnx')!r}, '--require']) == 1\n"
        "from nmdeploy.graph.model import OnnxModel\n"
        "from nmdeploy.passes import VerifyPass\n"
        f"assert len(VerifyPass()(OnnxModel.load({str(tmp_path / 'p.onnx')!r})).report) == 7\n"
        "print(sorted(name for name in ('torch', 'onnxruntime') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "[]"
    assert any(line.startswith("PASSED | pruned 7 of 7 weights to 2:4") for line in lines)
    assert any(line.startswith("7 weights found") and "7 2:4-compliant" in line for line in lines)
    assert any(line.startswith("FAILED | 6 TensorRT-eligible weights are not 2:4") for line in lines)


def test_transposable_prune_loads_torch_only_then(tmp_path):
    mixed_model(tmp_path / "m.onnx")
    script = (
        "import sys\n"
        "from nmdeploy.cli import main\n"
        f"code = main(['prune', {str(tmp_path / 'm.onnx')!r}, '-o', {str(tmp_path / 'p.onnx')!r}, "
        "'--transposable', '--include', 'W_float32$'])\n"
        "assert code == 0 and 'torch' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "transposable exact" in result.stdout and "PASSED | pruned 1 of 1 weights" in result.stdout


def _definition(original: np.ndarray, scores: np.ndarray, axis: int, zero: np.ndarray | int) -> np.ndarray:
    """Stable descending sort of each group of 4 along ``axis`` (torch), the first 2 kept, the rest ``zero``."""
    moved = torch.from_numpy(scores).movedim(axis, -1)
    grouped = moved.reshape(*moved.shape[:-1], moved.shape[-1] // 4, 4)
    order = torch.sort(grouped, dim=-1, descending=True, stable=True).indices
    keep = torch.zeros_like(grouped, dtype=torch.bool).scatter_(-1, order[..., :2], True)
    mask = keep.reshape(moved.shape).movedim(-1, axis).numpy()
    return np.where(mask, original, np.asarray(zero).astype(original.dtype))


@pytest.mark.parametrize("workers", [1, 2])
def test_stored_weights_are_bit_for_bit_the_definition(tmp_path, workers):
    axes = mixed_model(tmp_path / "m.onnx")
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "m.onnx").graph.initializer}
    model = OnnxModel.load(tmp_path / "m.onnx")
    result = prune(model, pattern="2:4", workers=workers)
    assert result.modified and all(row.changed and row.method == "1-D" for row in result.report)
    model.save(tmp_path / "p.onnx")
    stored = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / "p.onnx").graph.initializer}
    zero = original["zero"].astype(np.int64)
    for name, axis in axes.items():
        values = original[name]
        if name == "W_q":
            scores = np.abs((values.astype(np.int64) - zero).astype(np.float32) * original["scale"])
            expected = _definition(values, scores, axis, np.broadcast_to(original["zero"], values.shape))
        else:
            scores = np.abs(values.astype(np.float32))
            expected = _definition(values, scores, axis, 0)
        assert stored[name].dtype == values.dtype
        assert stored[name].tobytes() == expected.tobytes(), name
        assert not np.signbit(stored[name][expected == 0].astype(np.float32)).any() or name == "W_q"
    for name in ("scale", "zero"):
        assert stored[name].tobytes() == original[name].tobytes()
