"""``--require`` under a pattern other than 2:4: no weight is TensorRT-eligible there (its sparse kernels take 2:4
alone), so the check holds to the chosen pattern every weight TensorRT could run sparse as 2:4, and says which."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main
from nmdeploy.errors import ComplianceError
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes import VerifyPass

K = 16


def dense_model(path, *, extra_nodes=(), extra_weights=()):
    """x -> MatMul mm1 (W1) -> MatMul mm2 (W2) -> y, both weights dense [16, 16]."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
        helper.make_node("MatMul", ["h", "W2"], ["y"], name="mm2"),
        *extra_nodes,
    ]
    weights = [numpy_helper.from_array(rng.standard_normal((K, K)).astype(np.float32), name) for name in ("W1", "W2")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, K])]
    outputs += [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None) for node in extra_nodes]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
        outputs,
        [*weights, *extra_weights],
    )
    onnx.save(helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def run(capsys, *argv) -> tuple[int, list[str]]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().out.strip().splitlines()


@pytest.mark.parametrize("pattern", ["4:8", "1:4"])
def test_inspect_require_fails_a_dense_model_under_any_pattern(tmp_path, capsys, pattern):
    model = dense_model(tmp_path / "m.onnx")
    code, lines = run(capsys, "inspect", model, "--pattern", pattern, "--require")
    assert code == 1
    assert lines[-1] == f"FAILED | 2 weights TensorRT could run sparse as 2:4 are not {pattern}: W1, W2"
    assert lines[-2] == (
        f"--require under {pattern} holds 2 weights TensorRT could run sparse as 2:4 to it (TensorRT's sparse kernels "
        "take 2:4 alone): W1, W2"
    )
    with pytest.raises(ComplianceError, match=f"2 weights are not {pattern}"):
        VerifyPass(pattern=pattern, eligible_only=True)(OnnxModel.load(model))


@pytest.mark.parametrize("pattern", ["4:8", "1:4"])
def test_prune_require_fails_on_a_weight_left_dense_under_any_pattern(tmp_path, capsys, pattern):
    model = dense_model(tmp_path / "m.onnx")
    out = tmp_path / "p.onnx"
    code, lines = run(capsys, "prune", model, "-o", out, "--pattern", pattern, "--include", "W1", "--require")
    assert code == 1
    assert lines[-1] == (
        f"FAILED | pruned 1 of 1 weights to {pattern}; 1 weight TensorRT could run sparse as 2:4 left dense: mm2 (not "
        f"selected by --include) (--require) -> {out}"
    )
    # Allowed dense by name, the same result passes, and the line says what --require held to the pattern.
    code, lines = run(
        capsys, "prune", model, "-o", out, "--pattern", pattern, "--include", "W1", "--require", "--allow-dense", "W2"
    )
    assert code == 0
    assert lines[-1].startswith(f"PASSED | pruned 1 of 1 weights to {pattern}; 1 dense on purpose: mm2 (allowed by")
    assert f"--require under {pattern} holds 2 weights TensorRT could run sparse as 2:4 to it" in lines[-1]


def test_prune_every_weight_to_4of8_then_inspect_require_passes(tmp_path, capsys):
    model, out = dense_model(tmp_path / "m.onnx"), tmp_path / "p.onnx"
    code, lines = run(capsys, "prune", model, "-o", out, "--pattern", "4:8", "--require")
    assert code == 0 and lines[-1].startswith("PASSED | pruned 2 of 2 weights to 4:8; --require under 4:8 holds")
    assert run(capsys, "inspect", out, "--pattern", "4:8", "--require")[0] == 0
    VerifyPass(pattern="4:8", eligible_only=True)(OnnxModel.load(out))
    # 4:8 is not 2:4: the same model still fails a 2:4 requirement.
    assert run(capsys, "inspect", out, "--require")[0] == 1


def test_weights_ineligible_for_other_reasons_are_not_required(tmp_path, capsys):
    """A weight TensorRT would not run sparse as 2:4 either (here the first MatMul input) is not held to 4:8, and
    --json marks which weights are."""
    first_input = helper.make_node("MatMul", ["W3", "x_t"], ["z"], name="mm3")
    transposed = helper.make_node("Transpose", ["x"], ["x_t"], perm=[1, 0])
    weight = numpy_helper.from_array(np.ones((K, 1), np.float32), "W3")
    model = dense_model(tmp_path / "m.onnx", extra_nodes=[transposed, first_input], extra_weights=[weight])
    out = tmp_path / "p.onnx"
    assert run(capsys, "prune", model, "-o", out, "--pattern", "4:8", "--include", "W[12]")[0] == 0
    code, lines = run(capsys, "inspect", out, "--pattern", "4:8", "--require", "--json")
    assert code == 0
    required = {row["weight"]: row["required"] for row in json.loads("\n".join(lines))["weights"]}
    assert required == {"W1": True, "W2": True, "W3": False}


def test_an_untraced_weight_fails_require_under_4of8(tmp_path, capsys):
    """A weight computed from constants (weight norm's Mul) is not traced: under 4:8 too, nothing checked it."""
    scaled = helper.make_node("Mul", ["W4", "g"], ["W4g"], name="norm")
    consumer = helper.make_node("MatMul", ["y", "W4g"], ["z"], name="mm4")
    weights = [
        numpy_helper.from_array(np.ones((K, K), np.float32), "W4"),
        numpy_helper.from_array(np.float32(2.0), "g"),
    ]
    model = dense_model(tmp_path / "m.onnx", extra_nodes=[scaled, consumer], extra_weights=weights)
    out = tmp_path / "p.onnx"
    code, lines = run(capsys, "prune", model, "-o", out, "--pattern", "4:8", "--require")
    assert code == 1
    assert "1 GEMM weight not traced, so not verified 4:8: mm4 (computed from constants by Mul 'norm'" in lines[-1]
    assert run(capsys, "inspect", out, "--pattern", "4:8", "--require", "--allow-dense", "mm4")[0] == 0


@pytest.mark.parametrize("verb", ["inspect", "prune"])
@pytest.mark.parametrize("pattern", ["5:4", "4:4"])  # 4:4 keeps every element: a dense weight would pass --require
def test_a_bad_pattern_is_one_line_and_exit_2(tmp_path, capsys, verb, pattern):
    model, out = dense_model(tmp_path / "m.onnx"), tmp_path / "p.onnx"
    with pytest.raises(SystemExit) as exit:
        main([verb, str(model), "--pattern", pattern, "--require", *(["-o", str(out)] if verb == "prune" else [])])
    assert exit.value.code == 2 and not out.exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"nmdeploy {verb}: error: argument --pattern: pattern {pattern}: N must be below M (N:M keeps N of every M "
        "elements); use one such as 2:4"
    )
