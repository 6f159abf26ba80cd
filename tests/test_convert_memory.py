"""Conversion within a memory budget: a layer whose statistics do not fit gets block-diagonal ones (stated in the
report with the approximation's cost), one that does not fit even so stays dense with the reason, and the result
is still N:M and better than magnitude pruning."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.calibration.statistics.engine import DEFAULT_RUN_LIMIT
from nmdeploy.cli import main
from nmdeploy.masks import is_nm
from nmdeploy.passes.convert import BASELINE_BYTES

WIDE = 1024  # the first layer's K: 4 MB of float32 statistics


@pytest.fixture
def wide_model(tmp_path):
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "W2"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array((rng.standard_normal((WIDE, 32)) / 32).astype(np.float32), "W1"),
        numpy_helper.from_array((rng.standard_normal((32, 16)) / 6).astype(np.float32), "W2"),
    ]
    graph = helper.make_graph(
        nodes,
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, WIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 16])],
        inits,
    )
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "wide.onnx"
    onnx.save(model, path)
    latent = rng.standard_normal((512, 24))
    inputs = (latent @ rng.standard_normal((24, WIDE)) + 0.3 * rng.standard_normal((512, WIDE))).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=inputs)
    fixed = BASELINE_BYTES + DEFAULT_RUN_LIMIT + 2 * model.ByteSize()
    return path, tmp_path / "calib.npz", inputs, fixed


def _convert(capsys, model, calib, out, *extra) -> dict:
    args = ["convert", str(model), "-o", str(out), "--calib", str(calib), "--cache-limit", "0", "--json", *extra]
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)


def _output_error(inputs, dense_path, converted_path) -> float:
    dense = {t.name: numpy_helper.to_array(t) for t in onnx.load(dense_path).graph.initializer}
    converted = {t.name: numpy_helper.to_array(t) for t in onnx.load(converted_path).graph.initializer}
    return float(np.square(inputs @ dense["W1"] - inputs @ converted["W1"]).sum())


def test_a_small_budget_gives_the_wide_layer_block_diagonal_statistics(wide_model, tmp_path, capsys):
    model, calib, inputs, fixed = wide_model
    # 2 MB left for statistics and fits: W1's full statistics (4 MB) do not fit, blocks of a few hundred columns do.
    small = _convert(capsys, model, calib, tmp_path / "small.onnx", "--max-memory", str((fixed >> 20) + 2))
    rows = {row["weight"]: row for row in small["report"] if row["step"] == "convert"}
    assert rows["W1"]["statistics"].startswith("block-diagonal, blocks of ")
    block = int(rows["W1"]["statistics"].split("blocks of ")[1].split()[0])
    assert 64 <= block < WIDE and block % 4 == 0 and rows["W1"]["statistics_mb"] < 2
    assert rows["W2"]["statistics"] == "full"
    summary = small["summary"]
    assert summary["max_memory_mb"] == pytest.approx((fixed >> 20) + 2)
    (note,) = summary["approximations"]
    assert "block-diagonal statistics for 1 layer" in note and "+37-40 %" in note  # the measured cost is stated

    # The table and the summary say the same in words.
    args = ["convert", str(model), "-o", str(tmp_path / "words.onnx"), "--calib", str(calib), "--cache-limit", "0"]
    assert main([*args, "--max-memory", str((fixed >> 20) + 2)]) == 0
    words = capsys.readouterr().out
    assert "block-diagonal," in words  # the table's note (folded to its column)
    assert "memory budget" in words and "approximation: block-diagonal statistics for 1 layer" in words

    roomy = _convert(capsys, model, calib, tmp_path / "roomy.onnx", "--max-memory", str((fixed >> 20) + 512))
    assert {row["statistics"] for row in roomy["report"] if row["step"] == "convert"} == {"full"}
    assert "approximations" not in roomy["summary"]
    assert main(["prune", str(model), "-o", str(tmp_path / "magnitude.onnx")]) == 0
    capsys.readouterr()

    for path in ("small.onnx", "roomy.onnx"):
        weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(tmp_path / path).graph.initializer}
        import torch

        assert is_nm(torch.from_numpy(weights["W1"]).T, "2:4", axis=1).fraction == 1.0
    full = _output_error(inputs, model, tmp_path / "roomy.onnx")
    blockwise = _output_error(inputs, model, tmp_path / "small.onnx")
    magnitude = _output_error(inputs, model, tmp_path / "magnitude.onnx")
    # The approximation costs output error, and still fits far better than no fit at all.
    assert full < blockwise < magnitude


def test_a_budget_too_small_for_any_statistics_is_one_clear_error(wide_model, tmp_path, capsys):
    model, calib, _, fixed = wide_model
    out = tmp_path / "out.onnx"
    args = ["convert", str(model), "-o", str(out), "--calib", str(calib), "--max-memory", "100"]
    assert main(args) == 2
    error = capsys.readouterr().err
    assert "--max-memory 100 MB" in error and "Traceback" not in error and not out.exists()
    assert main([*args[:-1], "-1"]) == 2
    assert "positive number" in capsys.readouterr().err


def test_a_layer_that_fits_in_no_blocks_stays_dense_with_the_reason(wide_model, tmp_path, capsys):
    model, calib, _, fixed = wide_model
    # 1.2 MB beyond the fixed costs: W2's statistics fit, W1's (2 MB even in blocks of 64 columns) do not.
    report = _convert(capsys, model, calib, tmp_path / "out.onnx", "--max-memory", str((fixed >> 20) + 1.2))
    rows = {row["weight"]: row for row in report["report"] if row["step"] == "convert"}
    assert "--max-memory" in rows["W1"]["skipped"] and not rows["W2"].get("skipped")
    assert "left dense" in " ".join(report["summary"]["approximations"])


def test_a_budget_that_leaves_every_layer_dense_is_refused(wide_model, tmp_path, capsys):
    model, calib, _, fixed = wide_model
    out = tmp_path / "out.onnx"
    memory = ["--cache-limit", "0", "--max-memory", str((fixed >> 20) + 0.3)]
    args = ["convert", str(model), "-o", str(out), "--calib", str(calib), *memory]
    assert main(args) == 2  # nothing converted is nothing done: no PASSED, no file
    error = capsys.readouterr().err
    assert "nothing to convert" in error and "--max-memory" in error and not out.exists()
