"""The pass contract: passes declare whether they work in place and are held to it, ``ensures`` judges the model it
is given (one pass object serves several models), and a failure in a pipeline names the pass and the one before."""

import copy

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_onnx_prune import build_mlp

from nmdeploy import ComplianceError, InputError
from nmdeploy.cli import main
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes import PrunePass, Sequential, VerifyPass
from nmdeploy.passes.base import Pass, PassResult, PostconditionError
from nmdeploy.passes.fold import FoldConstantsPass
from nmdeploy.passes.permute import PermutePass


def mlp_model(tmp_path, name="m.onnx", **options):
    path = tmp_path / name
    onnx.save(build_mlp(**options), path)
    return OnnxModel.load(path)


class ZeroFirstWeight(Pass):
    """Promises that every stored matrix is zero, but zeroes only the first: right for one-weight models only."""

    name = "zero-first"

    def call(self, model):
        first = next(t for t in model.tensors() if len(t.dims) == 2)
        model.write(first, np.zeros_like(model.read(first)))
        return PassResult(model, True)

    def ensures(self, result):
        left = [t.name for t in result.model.tensors() if len(t.dims) == 2 and np.any(result.model.read(t))]
        if left:
            raise AssertionError(f"{left} not zero")


def one_weight_model(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        [numpy_helper.from_array(np.ones((8, 4), np.float32), "W")],
    )
    path = tmp_path / "one.onnx"
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), path)
    return OnnxModel.load(path)


def test_ensures_judges_the_model_it_is_given_so_one_pass_object_serves_several(tmp_path):
    step = ZeroFirstWeight()
    assert step(one_weight_model(tmp_path)).modified  # the promise holds for a model with one matrix
    with pytest.raises(PostconditionError, match=r"zero-first did not ensure what it promises: \['W2'\] not zero"):
        step(mlp_model(tmp_path))
    assert step(one_weight_model(tmp_path)).modified  # nothing of the failed run stuck to the pass


def test_prune_ensures_reads_the_stored_weights(tmp_path, monkeypatch):
    model = mlp_model(tmp_path)
    step = PrunePass(pattern="2:4")
    result = step(model)
    step.ensures(result)  # holds on the model as pruned
    w1 = next(t for t in model.tensors() if t.name == "W1")
    model.write(w1, np.ones_like(model.read(w1)))  # a later edit breaks the pattern: ensures sees it in the model
    with pytest.raises(PostconditionError, match="prune left 'W1' not 2:4"):
        step.ensures(result)


def test_permute_ensures_reads_the_stored_weights(tmp_path):
    model = mlp_model(tmp_path)
    step = PermutePass(pattern="2:4")
    result = step(model)
    (row,) = [row for row in result.report if row.permuted]
    step.ensures(result)
    stored = next(t for t in model.tensors() if t.name == row.weight)
    model.write(stored, np.random.default_rng(5).standard_normal(tuple(stored.dims)).astype(np.float32))
    with pytest.raises(PostconditionError, match=f"permute left '{row.weight}' keeping"):
        step.ensures(result)


def test_a_failing_pass_is_named_with_the_pass_before_it_and_keeps_its_type(tmp_path):
    model = mlp_model(tmp_path)
    with pytest.raises(ComplianceError, match=r"^verify failed after prune: 2 weights are not 1:4"):
        Sequential([PrunePass(pattern="2:4"), VerifyPass(pattern="1:4")])(model)
    with pytest.raises(ComplianceError, match=r"^verify failed as the first pass: 2 weights are not 1:4"):
        Sequential([VerifyPass(pattern="1:4"), PrunePass(pattern="2:4")])(mlp_model(tmp_path, "n.onnx"))
    # A broken promise is a bug, not a bad input: it keeps its message, and one note (the innermost pipeline's)
    # names the pass.
    inner = Sequential([PrunePass(pattern="2:4"), ZeroFirstWeight()])
    with pytest.raises(PostconditionError, match=r"^zero-first did not ensure") as caught:
        Sequential([FoldConstantsPass(), inner])(mlp_model(tmp_path, "o.onnx"))
    assert caught.value.__notes__ == ["zero-first failed after prune"]


class Broken(Pass):
    name = "broken"

    def call(self, model):
        return {}["missing"]  # a bug: keeps its own type and traceback, the pass named in a note


def test_a_bug_in_a_pass_keeps_its_type_with_a_note_naming_the_passes(tmp_path):
    with pytest.raises(KeyError) as caught:
        Sequential([PrunePass(pattern="2:4"), Broken()])(mlp_model(tmp_path))
    assert caught.value.__notes__ == ["broken failed after prune"]


def test_the_command_line_shows_which_step_of_a_recipe_failed(tmp_path, capsys):
    path = tmp_path / "m.onnx"
    onnx.save(build_mlp(), path)
    recipe = tmp_path / "r.toml"
    recipe.write_text('[[passes]]\npass = "prune"\npattern = "2:4"\n[[passes]]\npass = "verify"\npattern = "1:4"\n')
    assert main(["run", str(recipe), str(path), "-o", str(tmp_path / "o.onnx")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "verify failed after prune: 2 weights are not 1:4" in line and not (tmp_path / "o.onnx").exists()


class Copying(Pass):
    """Returns a changed copy; honest when it says so."""

    name = "copying"
    in_place = False

    def call(self, model):
        changed = copy.deepcopy(model)
        w1 = next(t for t in changed.tensors() if t.name == "W1")
        changed.write(w1, np.zeros_like(changed.read(w1)))
        return PassResult(changed, True)


class ClaimsInPlace(Copying):
    name = "claims-in-place"
    in_place = True


def test_in_place_is_declared_and_held_to(tmp_path):
    model = mlp_model(tmp_path)
    before = model.read(next(t for t in model.tensors() if t.name == "W1")).copy()
    result = Sequential([Copying(), PrunePass(pattern="2:4")])(model)
    assert not Sequential([Copying()]).in_place and result.model is not model
    assert np.array_equal(model.read(next(t for t in model.tensors() if t.name == "W1")), before)  # input untouched
    with pytest.raises(PostconditionError, match="claims-in-place works in place but returned another model"):
        ClaimsInPlace()(model)
    with pytest.raises(InputError):  # and a user error inside stays a user error
        Sequential([PrunePass(include="^nothing$")])(model)


def stored(model):
    return {t.name: model.read(t).copy() for t in model.tensors()}


@pytest.mark.parametrize(
    "steps",
    [
        lambda: [PrunePass(pattern="2:4"), Copying()],  # the in-place step first: it would prune the caller's model
        lambda: [Copying(), PrunePass(pattern="2:4")],
        lambda: [PrunePass(pattern="2:4"), Sequential([FoldConstantsPass(), Copying()]), PrunePass(pattern="1:4")],
    ],
)
def test_a_sequential_that_returns_a_copy_never_changes_the_model_it_was_given(tmp_path, steps):
    model = mlp_model(tmp_path)
    before, proto = stored(model), model.proto.SerializeToString()
    pipeline = Sequential(steps())
    result = pipeline(model)
    assert not pipeline.in_place and result.model is not model and result.modified
    assert model.proto.SerializeToString() == proto
    assert all(np.array_equal(values, before[name]) for name, values in stored(model).items())
    changed = stored(result.model)
    assert not np.any(changed["W1"]) and not np.array_equal(changed["W2"], before["W2"])  # both kinds of step ran


def test_a_sequential_of_in_place_steps_changes_the_model_it_was_given(tmp_path):
    model = mlp_model(tmp_path)
    before = stored(model)
    pipeline = Sequential([FoldConstantsPass(), PrunePass(pattern="2:4")])
    assert pipeline.in_place and pipeline(model).model is model
    assert not np.array_equal(stored(model)["W1"], before["W1"])


def _stateless_cases():
    from nmdeploy.conversion.recipes import PASSES
    from nmdeploy.passes.convert import ConvertPass

    cases = {name: (cls, {}) for name, cls in PASSES.items()}
    for name in ("convert", "quantize"):
        cases[name] = (PASSES[name], {"calibration": "random"})
    cases["convert, recovering"] = (PASSES["convert"], {"calibration": "random", "recover": 5})
    cases["convert, within a fidelity floor"] = (PASSES["convert"], {"calibration": "random", "min_fidelity": 0.1})
    cases["the fit alone"] = (ConvertPass, {"calibration": "random"})
    cases["convert, within a precision budget"] = (
        PASSES["convert"],
        {"calibration": "random", "min_fidelity": 0.1, "precision": "int8"},
    )
    return cases


@pytest.mark.parametrize("case", sorted(_stateless_cases()))
def test_a_pass_keeps_nothing_of_its_run(tmp_path, case):
    # Every pass of the recipe table (and the fit and the budgets behind it): after a run, the pass object holds
    # exactly what its constructor set, so a second run (on this model or another) starts from the same pass.
    cls, options = _stateless_cases()[case]
    step = cls(**options)
    made = copy.deepcopy(vars(step))
    model = _wide_mlp(tmp_path)
    if case == "verify":
        PrunePass(pattern="2:4")(model)
    assert step(model).report or case == "fold-constants"  # nothing to fold in this model
    assert sorted(vars(step)) == sorted(made)
    for key, value in made.items():
        assert _same(vars(step)[key], value), key


def _wide_mlp(tmp_path):
    """Two 64 x 64 layers: wide enough for the fidelity budget to consider them (narrower ones never win)."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="first"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "W2"], ["y"], name="second"),
    ]
    weights = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32) / 8, f"W{i}") for i in (1, 2)]
    graph = helper.make_graph(
        nodes,
        "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 64])],
        weights,
    )
    path = tmp_path / "wide.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return OnnxModel.load(path)


def _same(left, right) -> bool:
    if isinstance(left, np.ndarray) or isinstance(right, np.ndarray):
        return np.array_equal(left, right)
    if isinstance(left, list | tuple) and isinstance(right, list | tuple):
        return len(left) == len(right) and all(_same(a, b) for a, b in zip(left, right, strict=True))
    if isinstance(left, dict) and isinstance(right, dict):
        return left.keys() == right.keys() and all(_same(left[k], right[k]) for k in left)
    if type(left) is type(right) and type(left).__eq__ is object.__eq__ and hasattr(left, "__dict__"):
        return _same(vars(left), vars(right))  # a helper object without its own equality (a fitting method)
    return left == right
