"""convert and prune say which TensorRT-eligible weights they left dense and why, fail on them with --require, and
name layers by their node in tables that fit 120 columns."""

from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main
from nmdeploy.graph.inspection import inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.prunable import SHARED_REASON

LONG = "/encoder/layer.0/attention/self/" + "/".join(f"block{i}" for i in range(14)) + "/query/key/MatMul"


def two_layer_model(path, *, shared: bool = True):
    """x -> MatMul (a 150-character node name, weight W1) -> h; with ``shared``, W2 feeds two MatMuls of h (one
    weight, two consumers: TensorRT-eligible, but convert fits one consumer per weight)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name=LONG)]
    inits = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "W1")]
    output = "h"
    if shared:
        nodes += [
            helper.make_node("MatMul", ["h", "W2"], ["a"], name="/shared/a"),
            helper.make_node("MatMul", ["h", "W2"], ["b"], name="/shared/b"),
            helper.make_node("Add", ["a", "b"], ["y"], name="/add"),
        ]
        inits.append(numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "W2"))
        output = "y"
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 64])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
        inits,
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


SHARED = SHARED_REASON.format(count=2, nodes="'/shared/a', '/shared/b'")


def test_convert_names_eligible_weights_left_dense_and_require_fails_on_them(tmp_path, capsys):
    model = two_layer_model(tmp_path / "m.onnx")
    convert = ["convert", str(model), "--calib", "random"]

    assert main([*convert, "-o", str(tmp_path / "a.onnx")]) == 0
    out = capsys.readouterr().out
    assert last_line(out) == (
        f"PASSED | converted 1 weights to 2:4; 1 TensorRT-eligible weight left dense: /shared/a (+1) ({SHARED}) -> "
        f"{tmp_path / 'a.onnx'}"
    )
    table = out[: out.index("conversion ")]
    assert max(len(line) for line in table.splitlines()) <= 120 < len(LONG)
    nodes = "".join(line.split("|")[1].strip() for line in table.splitlines()[3:] if line.startswith("|"))
    assert nodes == "/shared/a (+1)" + LONG  # layers by node name (skipped first), the long one folded, not cut
    assert "W1" not in table and "W2" not in table

    # --require: the result is written, then judged; an eligible weight left dense fails it.
    assert main([*convert, "-o", str(tmp_path / "b.onnx"), "--require"]) == 1
    line = last_line(capsys.readouterr().out)
    assert line.startswith("FAILED | converted 1 weights to 2:4; 1 TensorRT-eligible weight left dense: /shared/a")
    assert line.endswith(f"(--require) -> {tmp_path / 'b.onnx'}")
    written = {row.weight: row.compliant for row in inspect_model(OnnxModel.load(tmp_path / "b.onnx")).rows}
    assert written == {"W1": 1.0, "W2": 0.0}

    # Allowed by node name: dense on purpose, and PASSED.
    assert main([*convert, "-o", str(tmp_path / "c.onnx"), "--require", "--allow-dense", "^/shared/"]) == 0
    assert last_line(capsys.readouterr().out).startswith(
        "PASSED | converted 1 weights to 2:4; 1 dense on purpose: /shared/a (+1) (allowed by --allow-dense '^/shared/')"
    )

    # --json keeps the weight names, adds the node, and says what was left dense.
    assert main([*convert, "-o", str(tmp_path / "d.onnx"), "--require", "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    rows = {row["weight"]: row for row in document["report"] if row["step"] == "convert"}
    assert rows["W1"]["node"] == LONG and rows["W2"]["node"] == "/shared/a (+1)"
    assert document["left_dense"] == [{"weight": "W2", "node": "/shared/a (+1)", "reason": SHARED, "allowed": False}]
    assert document["passed"] is False
    assert 0 < document["summary"]["seconds"] <= document["summary"]["total_seconds"]


def test_convert_passes_require_when_nothing_eligible_is_left_and_names_filters(tmp_path, capsys):
    model = two_layer_model(tmp_path / "m.onnx", shared=False)
    assert main(["convert", str(model), "--calib", "random", "-o", str(tmp_path / "a.onnx"), "--require"]) == 0
    out = capsys.readouterr().out
    assert last_line(out) == f"PASSED | converted 1 weights to 2:4 -> {tmp_path / 'a.onnx'}"
    # What the summary line times, of the verb's whole wall time.
    timed = re.match(r"conversion ([0-9.]+) s of ([0-9.]+) s total wall time, peak RSS", out.splitlines()[-2])
    assert timed and 0 <= float(timed[1]) <= float(timed[2])

    shared = two_layer_model(tmp_path / "s.onnx")
    args = ["convert", str(shared), "--calib", "random", "-o", str(tmp_path / "b.onnx"), "--include", "^/encoder"]
    assert main([*args, "--require"]) == 1
    assert "/shared/a (+1) (not selected by --include)" in last_line(capsys.readouterr().out)


def test_prune_names_layers_by_node_and_require_fails_on_excluded_eligible_weights(tmp_path, capsys):
    model = two_layer_model(tmp_path / "m.onnx")
    assert main(["prune", str(model), "-o", str(tmp_path / "a.onnx"), "--require"]) == 0
    out = capsys.readouterr().out
    assert last_line(out) == f"PASSED | pruned 2 of 2 weights to 2:4 -> {tmp_path / 'a.onnx'}"
    assert max(len(line) for line in out.splitlines()) <= 120 and "/shared/a (+1)" in out

    excluded = ["prune", str(model), "--exclude", "^/shared/", "--require"]
    assert main([*excluded, "-o", str(tmp_path / "b.onnx")]) == 1
    assert last_line(capsys.readouterr().out) == (
        "FAILED | pruned 1 of 1 weights to 2:4; 1 TensorRT-eligible weight left dense: /shared/a (+1) (not selected "
        f"by --exclude) (--require) -> {tmp_path / 'b.onnx'}"
    )
    assert (tmp_path / "b.onnx").exists()
    assert main([*excluded, "-o", str(tmp_path / "c.onnx"), "--allow-dense", "W2", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["passed"] and document["left_dense"][0]["allowed"]
    assert {row["weight"]: row["node"] for row in document["weights"]} == {"W1": LONG}


@pytest.mark.parametrize("verb", ["prune", "convert"])
def test_a_bad_allow_dense_expression_is_an_input_error_before_anything_is_written(tmp_path, capsys, verb):
    model = two_layer_model(tmp_path / "m.onnx")
    before = model.read_bytes()
    extra = ["--calib", "random"] if verb == "convert" else []
    assert main([verb, str(model), "-o", str(tmp_path / "o.onnx"), *extra, "--allow-dense", "("]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-dense '(' is not a valid regular expression" in err
    assert not (tmp_path / "o.onnx").exists() and model.read_bytes() == before


def test_a_weight_read_by_several_gemms_gets_one_reason_from_inspect_prune_convert_and_the_budget(tmp_path, capsys):
    model = two_layer_model(tmp_path / "m.onnx")
    assert main(["inspect", str(model), "--json"]) == 0
    rows = {row["weight"]: row for row in json.loads(capsys.readouterr().out)["weights"]}
    assert rows["W2"]["uncalibrated"] == SHARED and rows["W1"]["uncalibrated"] is None
    assert main(["inspect", str(model)]) == 0
    out = capsys.readouterr().out
    assert f"convert leaves 1 weight dense (/shared/a (+1)): {SHARED}" in " ".join(out.split())
    assert max(len(line) for line in out.splitlines()) <= 120

    assert main(["prune", str(model), "-o", str(tmp_path / "p.onnx")]) == 0
    assert f"pruned 1 weight by magnitude alone (/shared/a (+1)): {SHARED}" in " ".join(capsys.readouterr().out.split())

    calib = tmp_path / "calib.npz"
    np.savez(calib, x=np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32))
    assert main(["convert", str(model), "--calib", str(calib), "-o", str(tmp_path / "c.onnx"), "--json"]) == 0
    rows = {row["weight"]: row for row in json.loads(capsys.readouterr().out)["report"] if row["step"] == "convert"}
    assert rows["W2"]["skipped"] == SHARED
    budget = ["convert", str(model), "--calib", str(calib), "--min-fidelity", "0.5", "--json"]
    assert main([*budget, "-o", str(tmp_path / "b.onnx")]) == 0
    layers = {row["weight"]: row for row in json.loads(capsys.readouterr().out)["budget"]["layers"]}
    assert layers["W2"]["reason"] == f"not convertible: {SHARED}" and not layers["W2"]["converted"]


def computed_weight_model(path, second: list, inits: dict, *, first: bool = True):
    """x -> MatMul W1 (stored, 16 x 16) -> h -> MatMul with the operand ``second`` nodes compute from constants
    (``inits``), left out with ``first=False``: a weight the tracer cannot follow, which TensorRT folds dense."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"])] if first else []
    arrays = {"W1": rng.standard_normal((16, 16))} if first else {}
    nodes += [*second, helper.make_node("MatMul", ["h" if first else "x", second[-1].output[0]], ["y"])]
    stored = [numpy_helper.from_array(np.asarray(v, dtype=np.float32), n) for n, v in (arrays | inits).items()]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        stored,
    )
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def test_require_fails_on_a_gemm_weight_the_tracer_cannot_follow(tmp_path, capsys):
    rng = np.random.default_rng(1)
    # weight norm: W2 = v * g, a constant TensorRT folds into one dense 2-D weight that no tracer sees.
    norm = computed_weight_model(
        tmp_path / "wn.onnx",
        [helper.make_node("Mul", ["v", "g"], ["W2"])],
        {"v": rng.standard_normal((16, 8)), "g": rng.uniform(0.5, 1.5, (1, 8))},
    )
    pruned = tmp_path / "pruned.onnx"
    assert main(["prune", str(norm), "-o", str(pruned), "--require"]) == 1
    why = (
        "computed from constants by Mul 'W2'; fold constants first (the fold-constants pass, or polygraphy surgeon "
        "sanitize --fold-constants)"
    )
    assert last_line(capsys.readouterr().out) == (
        f"FAILED | pruned 1 of 1 weights to 2:4; 1 GEMM weight not traced, so not verified 2:4: MatMul(W2) ({why}) "
        f"(--require) -> {pruned}"
    )
    assert main(["inspect", str(pruned), "--require"]) == 1
    assert (
        last_line(capsys.readouterr().out)
        == f"FAILED | 1 GEMM weight not traced, so not verified 2:4: MatMul(W2) ({why})"
    )
    assert main(["prune", str(norm), "-o", str(pruned), "--json"]) == 0  # without --require: said, not judged
    document = json.loads(capsys.readouterr().out)
    assert document["left_dense"] == [{"weight": "W2", "node": "MatMul(W2)", "reason": why, "allowed": False}]

    # Allowed the way --require allows any weight: by its name or its node's, with --allow-dense.
    assert main(["inspect", str(pruned), "--require", "--allow-dense", "^W2$"]) == 0
    assert main(["prune", str(norm), "-o", str(pruned), "--require", "--allow-dense", r"MatMul\(W2\)"]) == 0
    assert last_line(capsys.readouterr().out).startswith("PASSED | pruned 1 of 1 weights to 2:4 -> ")

    # A Reshape that moves the reduction axis, and a model whose only weight is untraced: inspect fails both.
    reshaped = computed_weight_model(
        tmp_path / "reshaped.onnx",
        [helper.make_node("Reshape", ["w", "shape"], ["W2"])],
        {"w": rng.standard_normal((8, 16))},
        first=False,
    )
    model = onnx.load(reshaped)
    model.graph.initializer.append(numpy_helper.from_array(np.array([16, 8], np.int64), "shape"))
    onnx.save(model, reshaped)
    assert main(["inspect", str(reshaped), "--require"]) == 1
    line = last_line(capsys.readouterr().out)
    assert line.startswith("FAILED | 1 GEMM weight not traced, so not verified 2:4: MatMul(W2) (Reshape 'W2' splits")
    assert line.endswith("fold constants first, then prune the folded weight)")


def test_require_passes_untraced_operands_tensorrt_would_not_run_sparse(tmp_path, capsys):
    rng = np.random.default_rng(2)
    cases = {
        # a reduction of 6 rows: not a multiple of 4, so not TensorRT-eligible even traced
        "odd.onnx": ([helper.make_node("Mul", ["v", "g"], ["W2"])], {"v": rng.standard_normal((6, 8)), "g": [2.0]}),
        # a vector operand: no N:M structure
        "vector.onnx": ([helper.make_node("Mul", ["v", "g"], ["W2"])], {"v": rng.standard_normal(16), "g": [2.0]}),
    }
    for name, (nodes, inits) in cases.items():
        path = computed_weight_model(tmp_path / name, nodes, inits, first=False)
        if name == "odd.onnx":  # x [b, 6] for the 6-row weight
            model = onnx.load(path)
            model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 6
            onnx.save(model, path)
        assert main(["inspect", str(path), "--require"]) == 0, name
        assert "constant operands not traced" in capsys.readouterr().out
    # A constant first operand of a MatMul: TensorRT needs the weight second, so it is not one it runs sparse.
    graph = helper.make_graph(
        [helper.make_node("Mul", ["a", "g"], ["A"]), helper.make_node("MatMul", ["A", "x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, "b"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "a"),
            numpy_helper.from_array(np.float32(2.0), "g"),
        ],
    )
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "a.onnx")
    assert main(["inspect", str(tmp_path / "a.onnx"), "--require"]) == 0


def test_a_recipes_verify_step_fails_on_a_gemm_weight_the_tracer_cannot_follow(tmp_path):
    from nmdeploy.errors import ComplianceError, InputError
    from nmdeploy.passes.verify import VerifyPass

    rng = np.random.default_rng(2)
    norm = computed_weight_model(
        tmp_path / "wn.onnx",
        [helper.make_node("Mul", ["v", "g"], ["W2"])],
        {"v": rng.standard_normal((16, 8)), "g": rng.uniform(0.5, 1.5, (1, 8))},
        first=False,
    )
    with pytest.raises(ComplianceError, match=r"1 GEMM weight not traced, so not verified 2:4: MatMul\(W2\)"):
        VerifyPass()(OnnxModel.load(norm))
    # Left out of the check by name, as any weight; then the step checks nothing, which is no pass either.
    with pytest.raises(InputError, match=r"exclude '\^W2\$' leaves none of the model's 1 weight \(W2\)"):
        VerifyPass(exclude="^W2$")(OnnxModel.load(norm))
