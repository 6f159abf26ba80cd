"""Recovery after conversion and the fidelity budget, on small MLPs whose behaviour ONNX Runtime checks.

Recovery must keep every mask bit (a pruned entry stays +0.0, bit for bit), raise held-out fidelity, be
reproducible with a seed and refuse models the interpreter cannot run; the budget must report only fidelities it
measured, keep the floor, and explain every layer.
"""

import dataclasses
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from runner_doubles import RecordingRunner
from token_model import token_tables_model

from nmdeploy.calibration.data import CalibrationData, SplitSettings
from nmdeploy.cli import main
from nmdeploy.conversion.controller import Conversion, ConversionOptions
from nmdeploy.conversion.recovery import (
    ChannelSpread,
    Recovery,
    RecoveryOptions,
    RecoveryReport,
    language_model_logits,
    warmup_cosine,
)
from nmdeploy.errors import InputError
from nmdeploy.fidelity import fidelity
from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.trainable import embedding_inputs, trainable_tensors
from nmdeploy.masks import is_nm
from nmdeploy.masks.augmentation import FIT_COPIES, rank_prior, token_pool
from nmdeploy.masks.distillation import next_token_divergence
from nmdeploy.passes.convert import ConvertPass
from nmdeploy.runtimes.interpreter import GraphProgram
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner
from nmdeploy.runtimes.torch import native_bfloat16, training_precision

WIDTH = 64


def inputs(rng, rows):
    latent = rng.standard_normal((rows, 8))
    x = latent @ rng.standard_normal((8, WIDTH)) + 0.2 * rng.standard_normal((rows, WIDTH))
    x[:, ::3] *= 3
    return x.astype(np.float32)


def save_mlp(folder, rng, extra_nodes=(), extra_inits=()):
    """x -> MatMul+bias -> Relu -> LayerNorm -> Gemm(+bias) -> Relu -> MatMul (a small 16-output head) -> y."""
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h1"], name="fc1"),
        helper.make_node("Add", ["b1", "h1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("LayerNormalization", ["r1", "gamma", "beta"], ["n1"], axis=-1),
        helper.make_node("Gemm", ["n1", "W2", "b2"], ["h2"], transB=1, name="fc2"),
        helper.make_node("Relu", ["h2"], ["r2"]),
        helper.make_node("MatMul", ["r2", "W3"], ["y0"], name="head"),
        *extra_nodes,
    ]
    inits = [
        numpy_helper.from_array((rng.standard_normal((WIDTH, 128)) / 8).astype(np.float32), "W1"),
        numpy_helper.from_array((rng.standard_normal(128) / 4).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 128).astype(np.float32), "gamma"),
        numpy_helper.from_array((rng.standard_normal(128) / 4).astype(np.float32), "beta"),
        numpy_helper.from_array((rng.standard_normal((128, 128)) / 11).astype(np.float32), "W2"),
        numpy_helper.from_array((rng.standard_normal(128) / 4).astype(np.float32), "b2"),
        numpy_helper.from_array((rng.standard_normal((128, 16)) / 11).astype(np.float32), "W3"),
        *extra_inits,
    ]
    output = extra_nodes[-1].output[0] if extra_nodes else "y0"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, WIDTH])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [None, 16])],
        inits,
    )
    path = folder / "mlp.onnx"
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]), path)
    calibration = folder / "calib"
    calibration.mkdir()
    for k in range(4):
        np.savez(calibration / f"batch-{k}.npz", x=inputs(rng, 48))
    return path, calibration


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny graphs train fastest on one thread; two spin against each other on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def mlp(tmp_path):
    return save_mlp(tmp_path, np.random.default_rng(0))


OPTIONS = RecoveryOptions(steps=60, lr=1e-3, batch_size=16, eval_every=20, patience=3)


def weights_of(model):
    return {t.name: numpy_helper.to_array(t).copy() for t in model.proto.graph.initializer}


@pytest.mark.parametrize(
    "blocks, precision",
    [(True, "float32"), (False, "float32"), (True, "bfloat16")],
    ids=["outputs-and-blocks", "outputs-only", "bfloat16-training"],
)
def test_recovery_keeps_every_mask_bit_and_raises_held_out_fidelity(mlp, blocks, precision):
    path, calibration = mlp
    model = OnnxModel.load(path)
    convert = ConvertPass(calibration=calibration, method="magnitude")
    options = dataclasses.replace(OPTIONS, blocks=blocks, precision=precision)
    split = CalibrationData(calibration, model.proto).split(options.split)
    recovery = Recovery.prepare(model, find_prunable_weights(model.proto).weights, split, options)
    convert(model)
    converted = weights_of(model)
    row = recovery.run(model, ["W1", "W2", "W3"])
    recovered = weights_of(model)

    assert set(trainable_tensors(model.proto, ["W1", "W2", "W3"])) == {"W1", "W2", "W3", "b1", "b2", "gamma", "beta"}
    for name, axis in (("W1", 0), ("W2", 1), ("W3", 0)):  # W2 feeds Gemm(transB=1): [out, in]
        pruned = converted[name] == 0
        assert pruned.mean() >= 0.5
        # Bit for bit: +0.0 stays +0.0 (no -0.0, no tiny values) wherever the mask pruned.
        assert (recovered[name][pruned].view(np.int32) == 0).all()
        assert is_nm(torch.from_numpy(recovered[name]), "2:4", axis=axis)
        assert not np.array_equal(recovered[name], converted[name])  # the kept weights did move
    assert not np.array_equal(recovered["gamma"], converted["gamma"])
    assert row.best_step > 0 and row.held_out_after > row.held_out_before
    assert row.block_targets == (1 if blocks else 0)  # the LayerNorm output
    assert row.precision == precision
    assert row.onnxruntime_max_error < 1e-4  # bfloat16 trains, but the weights written are float32

    # The reported held-out figures are what the saved models give in ONNX Runtime on the held-out split.
    split = CalibrationData(calibration, model.proto).split(OPTIONS.split)
    saved = model.save(path.parent / "recovered.onnx")
    with OnnxRuntimeRunner(path) as dense, OnnxRuntimeRunner(saved) as candidate:
        batches = [(dense.infer(b), candidate.infer(b), b) for b in split.held_out]
    assert fidelity(batches) == pytest.approx(row.held_out_after, abs=1e-5)


def recovery_row(result) -> RecoveryReport:
    (row,) = [row for row in result.report if isinstance(row, RecoveryReport)]
    return row


def test_recovered_model_matches_the_interpreter_in_onnxruntime(mlp, tmp_path):
    path, calibration = mlp
    model = OnnxModel.load(path)
    row = recovery_row(Conversion(calibration=calibration, recover=OPTIONS)(model))
    assert row.best_step > 0 and row.held_out_after > row.held_out_before  # trained weights, not the fitted ones
    saved = model.save(tmp_path / "out.onnx")
    feeds = {"x": inputs(np.random.default_rng(5), 32)}
    with OnnxRuntimeRunner(saved) as runner:
        expected = runner.infer(feeds)["y0"]
    values = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in model.proto.graph.initializer}
    actual = GraphProgram(model.proto).run({**values, "x": torch.from_numpy(feeds["x"])})["y0"]
    np.testing.assert_allclose(actual.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_recovery_runs_the_model_only_through_the_backend_registry(mlp, monkeypatch):
    """Every run recovery makes (the dense labels, the training passes, the held-out checks, the check of what it
    wrote) goes through graph runners the torch backend opens from the registry, with the training precision and
    the block outputs the loss matches."""
    from nmdeploy.runtimes.backends import BACKENDS

    torch_backend, opened, runs = BACKENDS["torch"], [], []
    open_graph = torch_backend.open_graph

    def recording(graph, fixed=None, **options):
        kind = (options.get("precision", "float32"), tuple(options.get("outputs", ())))
        opened.append({**options, "kind": kind})
        return RecordingRunner(open_graph(graph, fixed, **options), kind, runs)

    monkeypatch.setattr(torch_backend, "open_graph", recording)
    path, calibration = mlp
    model = OnnxModel.load(path)
    options = dataclasses.replace(OPTIONS, precision="bfloat16")
    split = CalibrationData(calibration, model.proto).split(options.split)
    recovery = Recovery.prepare(model, find_prunable_weights(model.proto).weights, split, options)
    ConvertPass(calibration=calibration, method="magnitude")(model)
    row = recovery.run(model, ["W1", "W2", "W3"])

    assert row.best_step > 0 and row.held_out_after > row.held_out_before
    assert all(each["differentiable"] and each["device"] == "cpu" for each in opened)
    training, labelling, checking = ("bfloat16", ("n1",)), ("float32", ("n1",)), ("float32", ())
    assert sorted(each["kind"] for each in opened) == sorted([training, labelling, checking])
    assert runs.count(training) == row.steps_run
    assert runs.count(labelling) == row.train_batches
    held_out_checks = 2 + -(-row.steps_run // options.eval_every)  # the dense labels, the start, every check
    assert runs.count(checking) == held_out_checks * row.held_out_batches + 1  # and the written model's check
    assert len(runs) == row.steps_run + row.train_batches + held_out_checks * row.held_out_batches + 1


def test_recovery_is_deterministic_with_a_seed(mlp, tmp_path):
    path, calibration = mlp
    outputs = []
    for run in range(2):
        model = OnnxModel.load(path)
        row = recovery_row(Conversion(calibration=calibration, recover=OPTIONS)(model))
        assert row.best_step > 0 and row.held_out_after > row.held_out_before  # training ran: the same result twice
        outputs.append(model.save(tmp_path / f"run{run}.onnx").read_bytes())
    assert outputs[0] == outputs[1]
    model = OnnxModel.load(path)
    Conversion(calibration=calibration, recover=RecoveryOptions(**{**vars(OPTIONS), "seed": 1}))(model)
    assert model.save(tmp_path / "other.onnx").read_bytes() != outputs[0]


def cli(capsys, *args):
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_recover_refuses_an_op_the_interpreter_cannot_run(tmp_path, capsys):
    rng = np.random.default_rng(1)
    arctangent = helper.make_node("Atan", ["y0"], ["y"], name="rescale")  # ONNX Runtime runs it, the interpreter not
    path, calibration = save_mlp(tmp_path, rng, [arctangent], [])
    before = path.read_bytes()
    out = tmp_path / "out.onnx"
    code, stdout, stderr = cli(capsys, "convert", path, "-o", out, "--calib", calibration, "--recover", "20")
    assert code == 2 and not out.exists() and path.read_bytes() == before
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "'rescale' (Atan)" in lines[0] and "without --recover" in lines[0]
    code, stdout, _ = cli(capsys, "convert", path, "-o", out, "--calib", calibration)
    assert code == 0 and out.exists()


def metric_returning_none(reference, candidate, feeds):
    return None


def test_bad_fidelity_options_are_one_line_and_write_nothing(mlp, tmp_path, capsys):
    path, calibration = mlp
    out = tmp_path / "out.onnx"
    base = ["convert", path, "-o", out, "--calib", calibration]
    for extra, expected in (
        (["--min-fidelity", "0"], "(0, 1]"),
        (["--min-fidelity", "1.5"], "(0, 1]"),
        (["--min-fidelity", "-0.2"], "(0, 1]"),
        (["--recover", "-3"], "0 or more"),
        (["--recover", "5", "--recover-batch", "0"], "1 row or more"),
        (["--recover-batch", "4"], "add --recover"),
        (["--recover-precision", "float32"], "add --recover"),
        (["--recover", "5", "--recover-precision", "float8"], "choose one of auto"),
        (["--recover", "5", "--recover-precision", "float16"], "float16 is for CUDA devices"),
        (["--metric", "nosuchmodule:f", "--recover", "5"], "cannot import"),
        (["--metric", f"{__name__}:metric_returning_none", "--recover", "5"], "a number"),
        (["--metric", f"{__name__}:metric_returning_none", "--min-fidelity", "0.9"], "a number"),
    ):
        code, _, stderr = cli(capsys, *base, *extra)
        assert code == 2, extra
        assert len(stderr.strip().splitlines()) == 1 and expected in stderr, (extra, stderr)
        assert not out.exists()


def test_budget_keeps_the_floor_reports_only_measured_fidelity_and_explains_every_layer(mlp, tmp_path, capsys):
    path, calibration = mlp
    whole = OnnxModel.load(path)
    ConvertPass(calibration=calibration, method="magnitude", include="^W[12]$")(whole)
    split = CalibrationData(calibration, whole.proto).split(SplitSettings())

    def held_out_fidelity(candidate_path):
        with OnnxRuntimeRunner(path) as dense, OnnxRuntimeRunner(candidate_path) as candidate:
            return fidelity([(dense.infer(b), candidate.infer(b), b) for b in split.held_out])

    alone = {}
    for name in ("W1", "W2"):
        single = OnnxModel.load(path)
        ConvertPass(calibration=calibration, method="magnitude", include=f"^{name}$")(single)
        alone[name] = held_out_fidelity(single.save(tmp_path / f"{name}.onnx"))
    both = held_out_fidelity(whole.save(tmp_path / "whole.onnx"))
    floor = round((max(alone.values()) + both) / 2, 4)  # the better layer alone fits, both do not
    out = tmp_path / "budget.onnx"
    code, stdout, _ = cli(
        capsys,
        "convert",
        path,
        "-o",
        out,
        "--calib",
        calibration,
        "--method",
        "magnitude",
        "--min-fidelity",
        floor,
        "--json",
    )
    assert code == 0
    budget = json.loads(stdout)["budget"]
    layers = {row["weight"]: row for row in budget["layers"]}
    assert layers["W3"]["reason"].startswith("too small to win") and not layers["W3"]["converted"]
    tolerant = max(alone, key=alone.get)
    assert layers[tolerant]["reason"] == "converted" and layers[tolerant]["converted"]
    assert layers[{"W1": "W2", "W2": "W1"}[tolerant]]["reason"] == "budget"
    assert layers[tolerant]["sensitivity"] == pytest.approx(1 - alone[tolerant], abs=1e-6)
    assert all(layers[n]["sensitivity"] is not None for n in ("W1", "W2"))
    # The reported fidelity is the one the written model gives on the held-out split, and it keeps the floor.
    assert budget["fidelity"] == pytest.approx(held_out_fidelity(out), abs=1e-6)
    assert budget["fidelity"] >= floor
    assert budget["attempts"][-1]["fidelity"] == budget["fidelity"]
    converted = OnnxModel.load(out)
    for name, axis in (("W1", 0), ("W2", 1)):
        values = numpy_helper.to_array(next(t for t in converted.proto.graph.initializer if t.name == name)).copy()
        assert bool(is_nm(torch.from_numpy(values), "2:4", axis=axis)) == layers[name]["converted"]


def test_budget_with_nothing_affordable_is_an_error(mlp):
    path, calibration = mlp
    with pytest.raises(InputError, match="no layer can be converted"):
        Conversion(calibration=calibration, min_fidelity=1.0, method="magnitude")(OnnxModel.load(path))


def test_pipeline_checks_its_fidelity_options_before_any_work(tmp_path, capsys):
    out = tmp_path / "pipeline-out"
    for extra in (["--min-fidelity", "0"], ["--min-fidelity", "2"], ["--recover", "-1"]):
        code, _, stderr = cli(capsys, "pipeline", "-o", out, "--models", "digits", *extra)
        assert code == 2 and len(stderr.strip().splitlines()) == 1, (extra, stderr)
        assert not out.exists()


def test_recover_from_the_command_line_reports_held_out_fidelity(mlp, tmp_path, capsys):
    path, calibration = mlp
    out = tmp_path / "out.onnx"
    code, stdout, _ = cli(
        capsys, "convert", path, "-o", out, "--calib", calibration, "--recover", "40", "--seed", "3",
        "--recover-precision", "float32", "--recover-batch", "12",
    )  # fmt: skip
    assert code == 0 and out.exists()
    (line,) = [line for line in stdout.splitlines() if line.startswith("recovery: held-out cosine")]
    assert "float32 training" in line and "steps of 12 rows" in line
    before, after = (float(v) for v in line.split("cosine ")[1].split(" (")[0].split(" -> "))
    assert after > before  # recovery keeps the start unless training improved it, so only > shows it trained
    assert "MB of the fit; recovery trains the whole model in memory)" in stdout
    assert stdout.splitlines()[-1].startswith("PASSED | converted 3 weights")


def as_constant_nodes(path, names):
    """The model with the named initializers moved into Constant nodes, as Paddle and TF exports store weights."""
    proto = onnx.load(path)
    moved = [t for t in proto.graph.initializer if t.name in names]
    constants = [helper.make_node("Constant", [], [t.name], value=t, name=f"const_{t.name}") for t in moved]
    kept = [t for t in proto.graph.initializer if t.name not in names]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    nodes = list(proto.graph.node)
    del proto.graph.node[:]
    proto.graph.node.extend(constants + nodes)
    onnx.save(proto, path)
    return path


def constants_of(model):
    return {
        n.output[0]: numpy_helper.to_array(n.attribute[0].t).copy()
        for n in model.proto.graph.node
        if n.op_type == "Constant"
    }


def test_weights_in_constant_nodes_are_trained_and_written_back_in_place(mlp, tmp_path):
    path, calibration = mlp
    stored = {"W1", "b1", "W2", "gamma"}
    as_constant_nodes(path, stored)
    model = OnnxModel.load(path)
    assert {w.name for w in find_prunable_weights(model.proto).weights if w.kind == "constant"} == {"W1", "W2"}
    assert set(trainable_tensors(model.proto, ["W1", "W2", "W3"])) == {"W1", "W2", "W3", "b1", "b2", "gamma", "beta"}
    split = CalibrationData(calibration, model.proto).split(OPTIONS.split)
    recovery = Recovery.prepare(model, find_prunable_weights(model.proto).weights, split, OPTIONS)
    ConvertPass(calibration=calibration, method="magnitude")(model)
    converted = constants_of(model)
    row = recovery.run(model, ["W1", "W2", "W3"])
    recovered = constants_of(model)

    assert set(recovered) == stored and not stored & {t.name for t in model.proto.graph.initializer}
    for name in stored:
        assert not np.array_equal(recovered[name], converted[name]), name  # trained, in the Constant node itself
    for name, axis in (("W1", 0), ("W2", 1)):
        pruned = converted[name] == 0
        assert pruned.mean() >= 0.5 and (recovered[name][pruned].view(np.int32) == 0).all()
        assert is_nm(torch.from_numpy(recovered[name]), "2:4", axis=axis)
    assert row.best_step > 0 and row.held_out_after > row.held_out_before
    assert row.trained_tensors == 7 and row.masked_tensors == 3
    # What ONNX Runtime computes from the written Constant nodes is what recovery measured.
    split = CalibrationData(calibration, model.proto).split(OPTIONS.split)
    saved = model.save(tmp_path / "recovered.onnx")
    with OnnxRuntimeRunner(path) as dense, OnnxRuntimeRunner(saved) as candidate:
        batches = [(dense.infer(b), candidate.infer(b), b) for b in split.held_out]
    assert fidelity(batches) == pytest.approx(row.held_out_after, abs=1e-5)


def test_budget_with_a_fitted_method_converts_every_layer_it_reports(mlp):
    # The budget fits copies of the model; each copy's conversion must really change the layers it names.
    path, calibration = mlp
    model = OnnxModel.load(path)
    *report, result = Conversion(calibration=calibration, min_fidelity=0.5)(model).report
    converted = {row.weight for row in result.layers if row.converted}
    assert converted and all(row.sensitivity and row.sensitivity > 0 for row in result.layers if row.converted)
    assert not any(row.step == "convert" and row.skipped for row in report)
    stored = {w.name: w for w in find_prunable_weights(model.proto).weights}
    for name in converted:
        values = torch.from_numpy(np.asarray(model.read(stored[name].tensor)).copy())
        assert is_nm(values, "2:4", axis=stored[name].axis)
    assert result.fidelity < 1.0


VOCABULARY, UNTRAINED = 200, 40  # ids below UNTRAINED keep a small initial norm, as BERT's [unused] rows do


def save_token_model(folder, rng):
    """ids -> Cast -> Gather(table) -> MatMul -> LayerNorm -> MatMul -> ReduceMean over tokens -> y: a tiny encoder."""
    table = rng.standard_normal((VOCABULARY, 32)).astype(np.float32)
    table[:UNTRAINED] *= 0.05
    nodes = [
        helper.make_node("Cast", ["ids"], ["ids32"], to=TensorProto.INT32),
        helper.make_node("Gather", ["table", "ids32"], ["e"]),
        helper.make_node("MatMul", ["e", "W1"], ["h"], name="fc1"),
        helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["n"], axis=-1),
        helper.make_node("MatMul", ["n", "W2"], ["t"], name="fc2"),
        helper.make_node("ReduceMean", ["t", "axes"], ["y"], keepdims=0),
    ]
    inits = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array((rng.standard_normal((32, 64)) / 6).astype(np.float32), "W1"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 64).astype(np.float32), "gamma"),
        numpy_helper.from_array((rng.standard_normal(64) / 4).astype(np.float32), "beta"),
        numpy_helper.from_array((rng.standard_normal((64, 16)) / 8).astype(np.float32), "W2"),
        numpy_helper.from_array(np.array([1], np.int64), "axes"),
    ]
    graph = helper.make_graph(
        nodes,
        "tokens",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [None, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 16])],
        inits,
    )
    path = folder / "tokens.onnx"
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]), path)
    calibration = folder / "calib"
    calibration.mkdir()
    for k in range(4):  # "text" uses only a narrow band of the trained ids
        np.savez(calibration / f"batch-{k}.npz", ids=rng.integers(UNTRAINED, UNTRAINED + 60, (32, 12)))
    return path, calibration


def test_token_inputs_are_augmented_with_ids_of_trained_rows_only(tmp_path):
    path, calibration = save_token_model(tmp_path, np.random.default_rng(3))
    model = OnnxModel.load(path)
    assert embedding_inputs(model.proto) == {"ids": "table"}  # found through the Cast
    table = numpy_helper.to_array(model.proto.graph.initializer[0])
    pool = token_pool(table, np.arange(UNTRAINED, UNTRAINED + 60))
    assert pool.min() >= UNTRAINED and len(pool) > VOCABULARY - UNTRAINED - 10  # every untrained row left out
    assert token_pool(table, np.array([-1, VOCABULARY])) is None  # no calibration id is a row: no augmentation
    options = RecoveryOptions(steps=40, lr=1e-3, batch_size=16, eval_every=10, patience=3, augment=0.5)
    weights = find_prunable_weights(model.proto).weights
    recovery = Recovery.prepare(model, weights, CalibrationData(calibration, model.proto).split(options.split), options)
    batch, targets = recovery._training_pair(0, torch.Generator().manual_seed(0))
    original = recovery.split.train[0]["ids"]
    replaced = batch["ids"].numpy() != original
    assert 0.3 < replaced.mean() < 0.7
    assert np.isin(batch["ids"].numpy()[replaced], pool.numpy()).all()
    assert targets["y"].shape == (16, 16)  # the dense model labels the augmented batch
    # Replacements favour the low ids (tokenizers number common tokens first) as rank_prior says.
    generator = torch.Generator().manual_seed(1)
    augmented = recovery.augmentation.augmented
    drawn = torch.cat([augmented({"ids": torch.from_numpy(original)}, generator)["ids"] for _ in range(40)])
    ranks = torch.searchsorted(pool, drawn[drawn != torch.from_numpy(original).repeat(40, 1)]).double()
    prior = rank_prior(len(pool))
    expected = float((prior * torch.arange(len(pool))).sum())
    assert expected < 0.7 * (len(pool) - 1) / 2  # well below a uniform draw's mean rank
    assert abs(float(ranks.mean()) - expected) < 0.05 * len(pool)
    assert prior[0] / prior[-1] == pytest.approx((len(pool) - 1 + 10) / 10) and float(prior.sum()) == pytest.approx(1)
    empty = torch.zeros((4, 0), dtype=torch.int64)
    assert augmented({"ids": empty}, generator)["ids"].shape == (4, 0)
    fitted = recovery.fitting_batches()
    train = recovery.split.train_batches()
    assert len(fitted) == (1 + FIT_COPIES) * len(train)
    for original, copy in zip(train * FIT_COPIES, fitted[len(train) :], strict=True):
        changed = copy["ids"] != original["ids"]
        assert 0.3 < changed.mean() < 0.7 and np.isin(copy["ids"][changed], pool.numpy()).all()
    assert all(np.array_equal(a["ids"], b["ids"]) for a, b in zip(train, fitted, strict=False))

    ConvertPass(calibration=calibration, method="magnitude")(model)
    before = {name: array for name, array in weights_of(model).items() if name in ("W1", "W2")}
    report = recovery.run(model, ["W1", "W2"])
    after = weights_of(model)
    for name, pruned in before.items():
        assert np.array_equal(after[name] == 0, pruned == 0)  # every mask bit kept
        assert is_nm(torch.from_numpy(after[name]), "2:4", axis=0)
    assert report.held_out_after > report.held_out_before and report.best_step > 0


def test_models_without_token_inputs_fit_on_the_training_split_as_it_is(mlp):
    path, calibration = mlp
    model = OnnxModel.load(path)
    split = CalibrationData(calibration, model.proto).split(OPTIONS.split)
    recovery = Recovery.prepare(model, find_prunable_weights(model.proto).weights, split, OPTIONS)
    fitted, train = recovery.fitting_batches(), recovery.split.train_batches()
    assert len(fitted) == len(train) and all(np.array_equal(a["x"], b["x"]) for a, b in zip(fitted, train, strict=True))


def test_block_errors_weigh_every_channel_by_its_own_spread():
    rng = np.random.default_rng(0)
    tensor = torch.from_numpy(rng.standard_normal((4, 10, 6)).astype(np.float32))
    tensor[..., 0] *= 100  # a massive channel, as transformers carry
    tensor[..., 5] = 0.25  # a constant one
    accumulated = ChannelSpread(axis=-1)
    accumulated.add(tensor[:2])  # batch by batch, as recovery labels them
    accumulated.add(tensor[2:])
    spread = accumulated.value()
    assert spread.shape == (1, 1, 6)
    expected = tensor.reshape(-1, 6).double().std(dim=0, correction=0)
    assert torch.allclose(spread[0, 0, :5].double(), expected[:5], rtol=1e-5)
    assert float(spread[0, 0, 5]) == pytest.approx(0.01 * float(expected.mean()), rel=1e-4)  # floored
    across = ChannelSpread(axis=1)
    across.add(tensor.permute(0, 2, 1))
    assert across.value().shape == (1, 6, 1)


def test_only_a_language_models_logits_are_trained_by_next_token_divergence(tmp_path):
    path = tmp_path / "tables.onnx"
    onnx.save(token_tables_model(positions=256), path)  # a position table as wide as the vocabulary
    model = OnnxModel.load(path)
    ids = np.zeros((2, 5), np.int64)
    feeds = {"input_ids": ids, "position_ids": ids, "token_type_ids": ids}
    outputs = {
        "logits": np.zeros((2, 5, 256), np.float32),
        "hidden": np.zeros((2, 5, 64), np.float32),  # follows the tokens, as wide as the model
        "present.0.key": np.zeros((2, 2, 5, 256), np.float32),  # [batch, heads, ...]: not one row per token
        "pooled": np.zeros((2, 256), np.float32),
        "classes": np.zeros((2, 2), np.float32),  # as wide as the segment table
    }
    assert language_model_logits(model, outputs, feeds) == ("logits",)
    assert language_model_logits(model, outputs, {"position_ids": ids}) == ()  # the token input not fed
    onnx.save(token_tables_model(vocabulary=1000), path)  # the token table's rows name the vocabulary
    assert language_model_logits(OnnxModel.load(path), outputs, feeds) == ()


@pytest.mark.parametrize("slice_values", [1 << 24, 7 * 3])  # one slice; slices of 3 positions (the last short)
def test_next_token_divergence_is_the_kl_of_the_distributions_over_kept_positions(monkeypatch, slice_values):
    import nmdeploy.masks.distillation as distillation

    monkeypatch.setattr(distillation, "SLICE_VALUES", slice_values)
    rng = np.random.default_rng(0)
    dense, student = (torch.from_numpy(rng.standard_normal((2, 4, 7)).astype(np.float32)) for _ in range(2))

    def plain(student, mask=None):  # the formula, differentiated by autograd
        p, log_q = dense.double().softmax(-1), student.double().log_softmax(-1)
        per_position = (p * (p.log() - log_q)).sum(-1)
        return per_position.mean() if mask is None else per_position[mask.bool()].mean()

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    for kept in (None, mask):
        ours, reference = student.clone().requires_grad_(True), student.double().requires_grad_(True)
        value = next_token_divergence(ours, dense, kept)
        expected = plain(reference, kept)
        assert float(value.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
        value.backward()
        expected.backward()
        torch.testing.assert_close(ours.grad.double(), reference.grad, rtol=1e-4, atol=1e-6)
        if kept is not None:
            assert float(ours.grad[1, 2:].abs().max()) == 0.0  # masked positions get no gradient
    assert float(next_token_divergence(dense + 3.0, dense)) == pytest.approx(0.0, abs=1e-6)  # a shift is no change
    low = student.bfloat16().requires_grad_(True)
    value = next_token_divergence(low, dense)
    value.backward()
    assert low.grad.dtype == torch.bfloat16 and float(value.detach()) == pytest.approx(float(plain(student)), rel=1e-2)


def test_learning_rate_warms_up_then_decays_to_zero():
    factors = [warmup_cosine(step, 100) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:-1], factors[10:], strict=True)) and factors[-1] < 0.01


def test_training_precision_auto_follows_the_cpu_and_unknown_ones_are_refused(monkeypatch):
    assert training_precision("auto") == ("bfloat16" if native_bfloat16() else "float32")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert training_precision("auto") == "float32"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert training_precision("auto") == "bfloat16"
    assert training_precision("float32") == "float32"
    with pytest.raises(InputError, match="float8"):
        RecoveryOptions(precision="float8")
    with pytest.raises(InputError, match="float16 is for CUDA devices"):
        training_precision("float16", "cpu")


def test_budget_judges_on_held_out_data_of_its_own_and_fits_on_every_calibration_row(mlp, tmp_path):
    path, calibration = mlp
    held_out = tmp_path / "held-out"
    held_out.mkdir()
    rng = np.random.default_rng(7)
    np.savez(held_out / "other.npz", x=(1.5 * inputs(rng, 40)).astype(np.float32))  # another spread than the fit's
    data = CalibrationData(calibration, OnnxModel.load(path).proto, held_out=held_out)
    split = data.split(SplitSettings())
    assert sum(len(b["x"]) for b in split.train) == 4 * 48  # no calibration row held back
    assert sum(len(b["x"]) for b in split.held_out) == 40
    model = OnnxModel.load(path)
    result = Conversion(calibration=data, method="magnitude", min_fidelity=0.5)(model)
    budget = next(row for row in result.report if type(row).__name__ == "BudgetReport")
    out = model.save(tmp_path / "budget.onnx")
    with OnnxRuntimeRunner(path) as dense, OnnxRuntimeRunner(out) as candidate:
        measured = fidelity([(dense.infer(b), candidate.infer(b), b) for b in split.held_out])
    assert budget.fidelity == pytest.approx(measured, abs=1e-6)
    on_calibration = CalibrationData(calibration, OnnxModel.load(path).proto).split(SplitSettings())
    with OnnxRuntimeRunner(path) as dense, OnnxRuntimeRunner(out) as candidate:
        own_share = fidelity([(dense.infer(b), candidate.infer(b), b) for b in on_calibration.held_out])
    assert abs(own_share - measured) > 1e-4  # the judgement really read the other rows


@pytest.mark.parametrize(
    "held_out, extra, reason",
    [
        ("calib", {"min_fidelity": 0.9}, "shares files with the calibration data"),
        ("random", {"min_fidelity": 0.9}, "judges fidelity on noise"),
        ("other", {}, "read by --min-fidelity and --recover only"),
    ],
)
def test_held_out_data_that_cannot_judge_is_refused(mlp, tmp_path, held_out, extra, reason):
    path, calibration = mlp
    other = tmp_path / "other"
    other.mkdir()
    np.savez(other / "x.npz", x=inputs(np.random.default_rng(1), 16))
    source = {"calib": calibration, "random": "random", "other": other}[held_out]
    with pytest.raises(InputError, match=reason):
        Conversion(calibration=calibration, method="magnitude", held_out=source, **extra)(OnnxModel.load(path))


def test_held_out_from_the_command_line_is_what_the_budget_reports_and_a_shared_file_is_refused(mlp, tmp_path, capsys):
    path, calibration = mlp
    held_out = tmp_path / "held-out"
    held_out.mkdir()
    np.savez(held_out / "rows.npz", x=inputs(np.random.default_rng(3), 24))
    out = tmp_path / "out.onnx"
    common = ["convert", path, "-o", out, "--calib", calibration, "--method", "magnitude", "--min-fidelity", "0.5"]
    code, stdout, _ = cli(capsys, *common, "--held-out", held_out, "--json")
    assert code == 0
    assert json.loads(stdout)["budget"]["held_out_rows"] == 24
    out.unlink()
    before = {p.name: p.read_bytes() for p in calibration.iterdir()}
    code, stdout, stderr = cli(capsys, *common, "--held-out", calibration)
    assert code == 2 and "shares files with the calibration data" in stderr and len(stderr.strip().splitlines()) == 1
    assert not out.exists() and {p.name: p.read_bytes() for p in calibration.iterdir()} == before


def test_held_out_rows_from_a_generator_are_read_from_the_shared_data(mlp, tmp_path):
    path, calibration = mlp
    rng = np.random.default_rng(9)

    def rows():
        for _ in range(3):
            yield {"x": inputs(rng, 8)}

    held_out = rows()
    data = CalibrationData(calibration, OnnxModel.load(path).proto, held_out=held_out)
    # Given beside the data too (as the data's own source): the options read the data's rows, compare nothing.
    options = ConversionOptions(calibration=data, method="magnitude", min_fidelity=0.5, held_out=held_out)
    assert options.held_out is data.held_out_source and len(options.held_out) == 3
    assert dataclasses.replace(options, held_out=None).held_out is data.held_out_source  # inner conversions too
    budget = Conversion(options)(OnnxModel.load(path)).report[-1]
    assert type(budget).__name__ == "BudgetReport" and budget.held_out_rows == 24
    plain = CalibrationData(calibration, OnnxModel.load(path).proto)
    with pytest.raises(InputError, match="goes to the CalibrationData"):
        ConversionOptions(calibration=plain, min_fidelity=0.5, held_out=rows())


def test_held_out_without_a_reader_is_refused_before_the_model_is_read(mlp, tmp_path, capsys, monkeypatch):
    path, calibration = mlp

    def never(*args, **kwargs):
        raise AssertionError("the model was read before the flags were checked")

    monkeypatch.setattr(OnnxModel, "load", never)
    out = tmp_path / "out.onnx"
    assert (
        main(["convert", str(path), "-o", str(out), "--calib", str(calibration), "--held-out", str(calibration)]) == 2
    )
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "read by --min-fidelity and --recover only" in error[0] and not out.exists()


def test_a_split_is_a_value_the_data_does_not_keep(mlp):
    # Splitting reads the data and hands back a frozen value: the data gives what it gave before, a second split
    # with other settings is no conflict, and the same settings give the same rows again.
    path, calibration = mlp
    data = CalibrationData(calibration, OnnxModel.load(path).proto)
    every_row = np.concatenate([batch["x"] for batch in data.batches()])
    first = data.split(SplitSettings())
    other = data.split(SplitSettings(rows=4, held_out=0.5, seed=3))
    again = data.split(SplitSettings())
    assert np.array_equal(np.concatenate([batch["x"] for batch in data.batches()]), every_row)
    for split in (first, again, other):
        parts = np.concatenate([batch["x"] for batch in (*split.train, *split.held_out)])
        assert sorted(map(tuple, parts.tolist())) == sorted(map(tuple, every_row.tolist()))  # every row, once
    assert all(np.array_equal(a["x"], b["x"]) for a, b in zip(first.held_out, again.held_out, strict=True))
    assert len(other.held_out) == len(other.train) and len(other.held_out[0]["x"]) == 4
    assert not any(np.array_equal(a["x"], b["x"]) for a in first.train_batches() for b in first.held_out)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.train = ()  # type: ignore[misc]
