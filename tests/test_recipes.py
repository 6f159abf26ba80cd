"""Recipes and the run verb: bundled recipes work, and mistakes in a recipe are errors that list the valid names."""

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from test_onnx_prune import build_mlp

from nmdeploy import ComplianceError, Error
from nmdeploy.cli import main
from nmdeploy.conversion.recipes import PASSES, load_recipe
from nmdeploy.graph.model import OnnxModel
from nmdeploy.masks import is_nm, is_transposable
from nmdeploy.passes import PrunePass, Sequential, VerifyPass


@pytest.fixture
def mlp(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(build_mlp(), path)
    return path


def weights(path):
    return {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in onnx.load(path).graph.initializer}


@pytest.mark.parametrize("recipe", ["tensorrt-2of4", "transposable-2of4"])
def test_bundled_recipes_prune_and_verify(mlp, tmp_path, recipe):
    result = subprocess.run(
        [sys.executable, "-m", "nmdeploy", "run", recipe, str(mlp), "-o", str(tmp_path / "o.onnx")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("PASSED")
    pruned = weights(tmp_path / "o.onnx")
    assert is_nm(pruned["W1"], "2:4", axis=0) and is_nm(pruned["W2"], "2:4", axis=1)
    if recipe.startswith("transposable"):
        assert is_transposable(pruned["W1"], "2:4", axis=0, out_axis=1)


def test_verify_fails_on_a_dense_model_and_changes_nothing(mlp):
    model = OnnxModel.load(mlp)
    with pytest.raises(ComplianceError, match="2 weights are not 2:4"):
        VerifyPass(pattern="2:4")(model)
    result = Sequential([PrunePass(pattern="2:4"), VerifyPass(pattern="2:4")])(model)
    assert result.modified and [row["pass"] for row in result.report_json()] == ["prune", "prune", "verify", "verify"]
    assert not VerifyPass(pattern="2:4")(model).modified


def test_run_of_a_recipe_whose_verify_fails_is_no_pass_and_writes_nothing(mlp, tmp_path, capsys):
    recipe = tmp_path / "verify-only.toml"
    recipe.write_text('[[passes]]\npass = "verify"\npattern = "2:4"\n')
    before = mlp.read_bytes()
    assert main(["run", str(recipe), str(mlp), "-o", str(tmp_path / "out.onnx")]) == 2
    captured = capsys.readouterr()
    assert "PASSED" not in captured.out and len(captured.err.strip().splitlines()) == 1
    assert "not 2:4" in captured.err
    assert not (tmp_path / "out.onnx").exists() and mlp.read_bytes() == before


TYPO_IN_VERIFY = 'pass = "prune"\ninclude = "W1"\n[[passes]]\npass = "verify"\ninclude = "W_"\n'
EVERYTHING_EXCLUDED = 'pass = "verify"\nexclude = "."\n'


@pytest.mark.parametrize(
    "steps,failure",
    [
        # A typo in the verify step's include: W2 is left dense and nothing would have checked it.
        (TYPO_IN_VERIFY, "verify failed after prune: nothing to verify: the verify step's include 'W_' leaves"),
        (
            EVERYTHING_EXCLUDED,
            "verify failed as the first pass: nothing to verify: the verify step's exclude '.' leaves",
        ),
    ],
)
def test_a_verify_step_that_selects_no_weight_is_a_bad_recipe_not_a_pass(mlp, tmp_path, capsys, steps, failure):
    recipe, out = tmp_path / "r.toml", tmp_path / "out.onnx"
    recipe.write_text("[[passes]]\n" + steps)
    assert main(["run", str(recipe), str(mlp), "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert "PASSED" not in captured.out and not out.exists()
    assert captured.err.strip().splitlines() == [
        f"nmdeploy run: error: {failure} none of the model's 2 weights (W1, W2); change its include/exclude"
    ]
    # The same step selecting its weights passes, and its line says how many it checked.
    recipe.write_text('[[passes]]\npass = "prune"\n[[passes]]\npass = "verify"\ninclude = "W"\n')
    assert main(["run", str(recipe), str(mlp), "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"PASSED | {recipe}: 2 passes, 2 weights verified, modified -> {out}"
    )


def test_verify_selects_weights_by_their_consumer_nodes_as_prune_does(mlp, tmp_path, capsys):
    """``include = "mm"`` names the MatMul node of W1: prune prunes W1 by it, and verify must check the same W1
    rather than find nothing (or, with exclude, check what prune left)."""
    recipe, out = tmp_path / "r.toml", tmp_path / "out.onnx"
    recipe.write_text('[[passes]]\npass = "prune"\ninclude = "mm"\n[[passes]]\npass = "verify"\ninclude = "mm"\n')
    assert main(["run", str(recipe), str(mlp), "-o", str(out), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert [row["weight"] for row in document["report"] if row["pass"] == "verify"] == ["W1"]
    recipe.write_text('[[passes]]\npass = "prune"\ninclude = "mm"\n[[passes]]\npass = "verify"\nexclude = "mm"\n')
    assert main(["run", str(recipe), str(mlp), "-o", str(out)]) == 2  # W2, behind node fc, was left dense
    assert "1 weights are not 2:4 along their reduction axis: W2" in capsys.readouterr().err


def test_verify_eligible_only_with_no_eligible_weight_is_nothing_to_verify(tmp_path):
    # A reduction axis of 6 is no multiple of 4: TensorRT cannot run it sparse, so eligible_only leaves nothing.
    path = tmp_path / "small.onnx"
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        "small",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 6])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(np.ones((6, 8), np.float32), "W")],
    )
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)]), path)
    with pytest.raises(
        Error, match=r"^nothing to verify: eligible_only .* none of the 1 selected of the model's 1 weight \(W\)"
    ):
        VerifyPass(eligible_only=True)(OnnxModel.load(path))


def test_passes_report_honestly_when_nothing_changes(mlp):
    model = OnnxModel.load(mlp)
    assert PrunePass(pattern="2:4")(model).modified
    assert not PrunePass(pattern="2:4")(model).modified  # already 2:4: the second run changes nothing


@pytest.mark.parametrize(
    "text,message",
    [
        ('[[passes]]\npass = "shrink"\n', "known passes: " + ", ".join(sorted(PASSES))),
        ('[[passes]]\npass = "prune"\npatern = "2:4"\n', "unknown options ['patern']"),
        ('description = "empty"\n', "non-empty [[passes]]"),
        ("[[passes]\n", "not valid TOML"),
        ('[[passes]]\npass = "prune"\npattern = "5:4"\n', "N must be below M"),
        ('[[passes]]\npass = "verify"\npattern = "4:4"\n', "pattern 4:4: N must be below M"),
    ],
)
def test_recipe_mistakes_are_clear_errors(tmp_path, text, message):
    path = tmp_path / "r.toml"
    path.write_text(text)
    with pytest.raises(Error, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_recipe(str(path))


def test_unknown_recipe_name_lists_the_bundled_ones():
    with pytest.raises(Error, match="tensorrt-2of4"):
        load_recipe("no-such-recipe")


def test_prune_python_api_mirrors_the_cli(mlp):
    model = OnnxModel.load(mlp)
    result = PrunePass(pattern="4:8", include="W1")(model)
    assert [row["weight"] for row in result.report_json()] == ["W1"]
    assert is_nm(torch.from_numpy(model.read(model.proto.graph.initializer[0]).copy()), "4:8", axis=0)
    assert np.count_nonzero(model.read(model.proto.graph.initializer[1])) == 8 * 32  # W2 untouched


def test_fold_constants_makes_computed_weights_prunable(tmp_path):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(5)
    nodes = [
        helper.make_node("Mul", ["W", "s"], ["Ws"], name="scale"),
        helper.make_node("Reshape", ["Ws", "shape"], ["Wr"], name="reshape"),
        helper.make_node("MatMul", ["x", "Wr"], ["y"], name="mm"),
        helper.make_node("Add", ["s", "s"], ["s2"], name="unrelated"),
    ]  # shares an input; must stay
    inits = [
        numpy_helper.from_array(rng.standard_normal(128).astype(np.float32), "W"),
        numpy_helper.from_array(np.array(0.5, np.float32), "s"),
        numpy_helper.from_array(np.array([16, 8], np.int64), "shape"),
        numpy_helper.from_array(np.zeros(3, np.float32), "unused_originally"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8]),
            helper.make_tensor_value_info("s2", TensorProto.FLOAT, []),
        ],
        inits,
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nmdeploy",
            "run",
            "tensorrt-2of4",
            str(tmp_path / "m.onnx"),
            "-o",
            str(tmp_path / "o.onnx"),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = onnx.load(tmp_path / "o.onnx")
    assert [n.name for n in out.graph.node] == ["mm", "unrelated"]
    assert sorted(t.name for t in out.graph.initializer) == ["Wr", "s", "unused_originally"]
    folded = weights(tmp_path / "o.onnx")["Wr"]
    dense = torch.from_numpy((numpy_helper.to_array(inits[0]) * 0.5).reshape(16, 8))
    assert is_nm(folded, "2:4", axis=0) and torch.equal(folded[folded != 0], dense[folded != 0])
    x = np.ones((2, 16), np.float32)
    y, s2 = ort.InferenceSession(str(tmp_path / "o.onnx")).run(None, {"x": x})
    assert np.allclose(y, x @ folded.numpy()) and s2 == 1.0
