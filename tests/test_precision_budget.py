"""The per-layer precision-and-sparsity budget on the digits CNN: each layer's choice among 2:4 + INT8, dense INT8,
2:4 fp16 and dense fp16 follows the floor, the written Q/DQ model is what the report says, and its measured
held-out fidelity keeps the floor."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from test_quantize import mlp

from nmdeploy.conversion.controller import Conversion, convert_model_file
from nmdeploy.conversion.precision_budget import SPEED_UPS
from nmdeploy.errors import InputError
from nmdeploy.graph.inspection import inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.quantize import QuantizePass

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory):
    from nmdeploy.reference import digits

    folder = tmp_path_factory.mktemp("digits")
    splits = digits.digits_splits(0)
    model = digits.DigitsCNN(seed=0)
    digits.train_digits(model, splits, epochs=3, seed=0)
    path = digits.export_digits_onnx(model, folder / "dense.onnx")
    calibration = folder / "calib.npz"
    np.savez(calibration, image=splits.train_x[:256].numpy())
    return path, calibration


def budget(path, calibration, floor, precision="int8"):
    model = OnnxModel.load(path)
    result = Conversion(calibration=calibration, min_fidelity=floor, precision=precision)(model)
    return model, result.report[-1]


def test_speed_table_orders_the_options_for_large_layers_and_gives_small_ones_no_2of4_gain():
    large = {option: gains[1] for option, gains in SPEED_UPS.items()}
    assert large[True, True] > large[False, True] > large[True, False] > large[False, False] == 1.0
    assert SPEED_UPS[True, False][0] == 1.0  # measured: 2:4 fp16 does not pay on small layers


@pytest.mark.slow
def test_digits_choices_follow_the_floor_and_the_model_is_what_the_report_says(digits_model, tmp_path):
    path, calibration = digits_model
    loose_model, loose = budget(path, calibration, 0.9)
    tight_model, tight = budget(path, calibration, 0.99995)
    for model, report, floor in ((loose_model, loose, 0.9), (tight_model, tight, 0.99995)):
        assert report.fidelity >= floor and report.held_out_rows > 0
        stored = {t.name: t.data_type for t in model.proto.graph.initializer}
        compliance = {row.weight: row.compliant for row in inspect_model(model, "2:4").rows}
        for layer in report.layers:
            assert (stored[layer.weight] == TensorProto.INT8) == layer.choice.endswith("INT8"), layer
            assert (compliance[layer.weight] == 1.0) == layer.choice.startswith("2:4"), layer
    first = loose.layers[0]
    assert first.choice == "dense fp16" and "raw data" in first.reason and "not a multiple of 4" in first.reason
    # With room to spare every other layer takes the fastest option; a floor near 1 buys less.
    assert [layer.choice for layer in loose.layers[1:]] == ["2:4 + INT8"] * 4
    assert tight.expected_speed_up < loose.expected_speed_up
    assert any(layer.choice != "2:4 + INT8" for layer in tight.layers[1:])
    for layer in tight.layers[1:]:
        predicted = layer.losses["2:4 fp16"] + layer.losses["dense INT8"]
        assert layer.losses["2:4 + INT8"] == pytest.approx(predicted, abs=2e-6)
    onnx.checker.check_model(tight_model.proto)


def test_bad_inputs_are_refused_before_any_work(tmp_path):
    path, calibration, _ = mlp(tmp_path)
    with pytest.raises(InputError, match="unsupported precision 'int4'"):
        Conversion(calibration=calibration, min_fidelity=0.9, precision="int4")
    with pytest.raises(InputError, match=r"\(0, 1\]"):
        Conversion(calibration=calibration, min_fidelity=1.5, precision="int8")
    with pytest.raises(InputError, match="sets layers"):
        Conversion(calibration=calibration, min_fidelity=0.9, precision="int8", quantize={"layers": ["x"]})
    with pytest.raises(InputError, match="unknown range method 'median'"):
        Conversion(calibration=calibration, min_fidelity=0.9, precision="int8", quantize={"method": "median"})
    with pytest.raises(InputError, match="add min_fidelity"):
        Conversion(calibration=calibration, precision="int8")
    with pytest.raises(InputError, match=r"recover: unknown options \['stepz'\]; valid: steps, lr"):
        Conversion(calibration=calibration, min_fidelity=0.9, precision="int8", recover={"stepz": 5})
    with pytest.raises(InputError, match="the number of steps must be 0 or more"):
        Conversion(calibration=calibration, min_fidelity=0.9, precision="int8", recover={"steps": -1})
    with pytest.raises(InputError, match="read by the precision budget only"):
        Conversion(calibration=calibration, min_fidelity=0.9, quantize={"smooth": False})
    quantized = OnnxModel.load(path)
    QuantizePass(calibration=calibration)(quantized)
    saved = quantized.save(tmp_path / "q.onnx")
    out = tmp_path / "out.onnx"
    with pytest.raises(InputError, match="already holds quantization"):
        convert_model_file(saved, out, calibration=calibration, min_fidelity=0.9, precision="int8")
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros((8, 15), np.float32))
    with pytest.raises(InputError, match="input 'x' has shape"):
        convert_model_file(path, out, calibration=wrong, min_fidelity=0.9, precision="int8")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "calib.npz",
        "model.onnx",
        "q.onnx",
        "wrong.npz",
    ]


def test_greedy_takes_the_most_time_per_fidelity_within_the_allowance():
    from nmdeploy.conversion.precision_budget import _Candidate, _choose, _Unit

    def unit(name, share, sparse, quantized):
        return _Unit([_Candidate(name, name, share, True, None, None, sparse_loss=sparse)], quantized_loss=quantized)

    units = [unit("cheap", 0.5, 0.001, 0.001), unit("costly", 0.5, 0.05, 0.002)]
    chosen, spent = _choose(units, 0.004)
    assert chosen == {0: (True, True), 1: (False, True)} and spent == pytest.approx(0.004)
    chosen, spent = _choose(units, 0.0015)  # room for one INT8 layer alone
    assert chosen == {0: (False, True)} and spent <= 0.0015
    assert _choose(units, 0.0) == ({}, 0.0)
    everything, _ = _choose(units, 1.0)
    assert everything == {0: (True, True), 1: (True, True)}


def test_layers_reading_one_input_are_one_unit_and_2of4_applies_to_those_that_can():
    from nmdeploy.conversion.precision_budget import _Candidate, _Unit

    shared = _Unit(
        [
            _Candidate("q", "q", 0.25, True, None, None, sparse_loss=0.001),
            _Candidate("k", "k", 0.25, True, "not TensorRT-eligible: shape", None),
        ],
        quantized_loss=0.002,
    )
    assert shared.losses == {(False, False): 0.0, (True, False): 0.001, (False, True): 0.002, (True, True): 0.003}
    large = SPEED_UPS[True, True][1], SPEED_UPS[False, True][1]
    assert shared.saved((True, True)) == pytest.approx(0.25 * (1 - 1 / large[0]) + 0.25 * (1 - 1 / large[1]))
    rows = shared.choice_rows((True, True), "int8")
    assert [row.choice for row in rows] == ["2:4 + INT8", "dense INT8"]
    assert all("decided with the 1 other layer(s) reading its input" in row.reason for row in rows)
    assert "2:4: not TensorRT-eligible" in rows[1].reason


def test_convert_precision_writes_the_budgeted_qdq_model_and_needs_a_floor(tmp_path, capsys):
    from nmdeploy.cli import main

    path, calibration, _ = mlp(tmp_path)
    out = tmp_path / "mixed.onnx"
    argv = ["convert", str(path), "-o", str(out), "--calib", str(calibration), "--precision", "int8"]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "add --min-fidelity F" in error[0] and not out.exists()
    assert main([*argv, "--min-fidelity", "0.9", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["budget"]
    assert report["fidelity"] >= 0.9 and report["precision"] == "int8" and report["layers"]
    stored = {t.name: t.data_type for t in OnnxModel.load(out).proto.graph.initializer}
    for layer in report["layers"]:
        assert (stored[layer["weight"]] == TensorProto.INT8) == layer["choice"].endswith("INT8"), layer


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--precision", "int4", "--min-fidelity", "0.9"], "--precision int4: the budget chooses among int8 and fp8"),
        (["--precision", "fp8"], "add --min-fidelity F"),
        (["--precision", "int8", "--min-fidelity", "1.5"], "--min-fidelity 1.5: must be in (0, 1]"),
        (["--precision", "int8", "--min-fidelity", "0.9", "--recover", "-5"], "--recover -5: the number of steps"),
    ],
)
def test_convert_precision_refuses_bad_values_before_the_model_is_read(tmp_path, capsys, monkeypatch, flags, said):
    from nmdeploy.cli import main

    path, calibration, _ = mlp(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def never(*args, **kwargs):
        raise AssertionError("the model was read before the flags were checked")

    monkeypatch.setattr(OnnxModel, "load", never)
    out = tmp_path / "mixed.onnx"
    assert main(["convert", str(path), "-o", str(out), "--calib", str(calibration), *flags]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and said in error[0] and "Traceback" not in error[0]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_convert_precision_honours_require_as_plain_convert_does(tmp_path, capsys):
    from nmdeploy.cli import main

    sparse, calibration, _ = mlp(tmp_path)
    model = onnx.load(sparse)
    rng = np.random.default_rng(5)
    for tensor in model.graph.initializer:  # dense weights: only a 2:4 choice makes them N:M
        values = onnx.numpy_helper.to_array(tensor)
        tensor.CopyFrom(onnx.numpy_helper.from_array(rng.normal(0, 0.3, values.shape).astype(np.float32), tensor.name))
    onnx.save(model, path := tmp_path / "dense.onnx")
    out = tmp_path / "mixed.onnx"
    argv = ["convert", str(path), "-o", str(out), "--calib", str(calibration), "--precision", "int8"]
    argv += ["--min-fidelity", "0.5", "--require"]
    assert main(argv) == 0  # both layers 2:4 + INT8
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("PASSED | held-out")
    out.unlink()
    assert main([*argv, "--exclude", "fc2"]) == 1  # fc2 left dense INT8: the written model fails --require
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("FAILED | ") and "fc2 (the budget chose dense INT8)" in last and "(--require)" in last
    assert out.exists()  # written, to look at, as plain convert does
    out.unlink()
    assert main([*argv, "--exclude", "fc2", "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["passed"] is False and [row["weight"] for row in document["left_dense"]] == ["W2"]
    out.unlink()
    assert main([*argv, "--exclude", "fc2", "--allow-dense", "fc2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True


def test_precision_budget_judges_on_the_held_out_rows_of_its_conversion_options(tmp_path):
    from nmdeploy.conversion.controller import ConversionOptions

    path, calibration, _ = mlp(tmp_path)
    rng = np.random.default_rng(2)
    held_out = ({"x": rng.normal(0, 1, (8, 16)).astype(np.float32)} for _ in range(3))  # one-shot, 24 rows
    options = ConversionOptions(calibration=calibration, min_fidelity=0.5, held_out=held_out, precision="int8")
    assert Conversion(options)(OnnxModel.load(path)).report[-1].held_out_rows == 24


def test_the_shared_back_off_loop_stops_at_the_floor_or_when_nothing_is_left():
    import re

    from nmdeploy.conversion.budgeting import HeldOutEstimate, exact_names, verify_and_back_off

    # Mean and lower bound per number of layers converted; the floor is checked against the bound.
    estimates = {3: (0.8, 0.75), 2: (0.92, 0.88), 1: (0.95, 0.93), 0: (0.99, 0.99)}

    def run(floor, bounded=True):
        chosen = ["a", "b", "c"]

        def back_off(measured):
            if chosen:
                chosen.pop()
            return bool(chosen)

        def measure(size):
            mean, bound = estimates[size]
            return HeldOutEstimate(mean, bound if bounded else None, 24, "" if bounded else "no bound: few rows")

        return verify_and_back_off(lambda: len(chosen), measure, back_off, lambda: {"layers": len(chosen)}, floor)

    built, estimate, attempts = run(0.9)  # two layers hold 0.92 on average, but only 0.88 at the bound
    assert (built, estimate.mean, estimate.bound) == (1, 0.95, 0.93)
    assert attempts == [
        {"layers": 3, "fidelity": 0.8, "bound": 0.75},
        {"layers": 2, "fidelity": 0.92, "bound": 0.88},
        {"layers": 1, "fidelity": 0.95, "bound": 0.93},
    ]
    assert run(0.9, bounded=False)[0] == 2  # without a bound (too few rows) the mean is judged
    built, estimate, attempts = run(0.999)  # nothing left to undo: the last build, below the floor
    assert (built, estimate.mean, len(attempts)) == (1, 0.95, 3)
    assert re.fullmatch(exact_names(["a.b", "c"]), "a.b") and not re.fullmatch(exact_names(["a.b"]), "axb")


def test_every_route_reaches_the_precision_budget_with_its_quantization_options(tmp_path, capsys):
    """The controller's precision budget, its range method and smoothing, from Python, a recipe and ``convert``:
    one model and one report, whichever route asked."""
    from nmdeploy.cli import main
    from nmdeploy.conversion.recipes import load_recipe
    from nmdeploy.passes.quantize import QuantizationSummary

    path, calibration, _ = mlp(tmp_path)
    direct = OnnxModel.load(path)
    rows = Conversion(
        calibration=calibration, min_fidelity=0.5, precision="int8", quantize={"method": "max", "smooth": False}
    )(direct).report
    summaries = [row for row in rows if isinstance(row, QuantizationSummary)]
    assert summaries and {row.method for row in summaries} == {"max"}  # the options reached the quantization
    expected = rows[-1].to_json()
    assert expected["step"] == "precision-budget"
    assert any(layer["choice"].endswith("INT8") for layer in expected["layers"])

    recipe = tmp_path / "budget.toml"
    recipe.write_text(
        '[[passes]]\npass = "convert"\nmin_fidelity = 0.5\nprecision = "int8"\n'
        'quantize = { method = "max", smooth = false }\n'
    )
    from_recipe = OnnxModel.load(path)
    recipe_rows = load_recipe(str(recipe), calibration=str(calibration))(from_recipe).report
    assert recipe_rows[-1].row.to_json() == expected
    assert from_recipe.proto.SerializeToString() == direct.proto.SerializeToString()

    out = tmp_path / "cli.onnx"
    argv = ["convert", str(path), "-o", str(out), "--calib", str(calibration), "--min-fidelity", "0.5"]
    assert main([*argv, "--precision", "int8", "--range-method", "max", "--no-smooth", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budget"] == expected
    assert OnnxModel.load(out).proto.graph.SerializeToString() == direct.proto.graph.SerializeToString()
    # A quantization flag without --precision would do nothing: refused, nothing written.
    out.unlink()
    assert main([*argv, "--range-method", "max"]) == 2
    assert "--range-method: quantization flags" in capsys.readouterr().err and not out.exists()


RECOVERY = {"steps": 60, "lr": 1e-3, "batch_size": 16, "eval_every": 20, "patience": 3, "seed": 3}


def held_out_figure(dense, candidate, batches) -> float:
    from nmdeploy.fidelity import fidelity
    from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

    with OnnxRuntimeRunner(dense) as reference, OnnxRuntimeRunner(candidate) as runner:
        return fidelity([(reference.infer(batch), runner.infer(batch), batch) for batch in batches])


@pytest.mark.usefixtures("one_torch_thread")
def test_precision_budget_recovers_its_2of4_layers_before_quantizing_on_the_one_seeded_split(tmp_path):
    """fit -> recover (masks fixed) -> quantize inside the budget: the same layers chosen as without recovery (the
    choice comes first), a higher measured fidelity, and recovery and the budget judged on the one split that
    recovery's seed makes."""
    from test_recovery import save_mlp

    from nmdeploy.calibration.data import CalibrationData
    from nmdeploy.conversion.recovery import RecoveryOptions
    from nmdeploy.masks import is_nm

    path, calibration = save_mlp(tmp_path, np.random.default_rng(0))
    recover = RecoveryOptions(**RECOVERY, precision="float32")
    results = {}
    for label, recovery in (("one-shot", None), ("recovered", recover)):
        model = OnnxModel.load(path)
        options = {"min_fidelity": 0.9, "precision": "int8", "method": "magnitude", "recover": recovery}
        results[label] = model, Conversion(calibration=calibration, **options)(model)
    (plain, one_shot), (model, recovered) = results["one-shot"], results["recovered"]
    before, after = one_shot.report[-1], recovered.report[-1]
    assert before.recovery is None and "recovery" not in before.to_json()
    choices = [layer.choice for layer in after.layers]
    assert choices == [layer.choice for layer in before.layers] and "2:4 + INT8" in choices and "dense INT8" in choices
    row = after.recovery
    assert row.held_out_after > row.held_out_before and row.best_step > 0
    assert after.fidelity > before.fidelity >= 0.9
    assert after.to_json()["recovery"]["held_out_after"] == row.held_out_after

    # One split: recovery's seeded held-out rows are the rows the budget measured the written model on.
    data = CalibrationData(calibration, plain.proto)
    split, other = data.split(recover.split), data.split(RecoveryOptions(**{**RECOVERY, "seed": 0}).split)
    assert after.held_out_rows == split.held_out_rows
    written = model.save(tmp_path / "mixed.onnx")
    assert held_out_figure(path, written, split.held_out) == pytest.approx(after.fidelity, abs=1e-6)
    assert held_out_figure(path, written, other.held_out) != pytest.approx(after.fidelity, abs=1e-4)
    # Recovery's figure is the float mix before quantization, on the same rows (torch interpreter against ORT).
    unquantized = recovered.unquantized.save(tmp_path / "float-mix.onnx")
    assert held_out_figure(path, unquantized, split.held_out) == pytest.approx(row.held_out_after, abs=1e-5)

    # Masks fixed: each 2:4 layer of the recovered mix is zero exactly where the one-shot fit pruned it, and its
    # kept weights moved; the layers chosen dense keep their dense weights.
    fitted = {t.name: onnx.numpy_helper.to_array(t) for t in one_shot.unquantized.proto.graph.initializer}
    trained = {t.name: onnx.numpy_helper.to_array(t) for t in recovered.unquantized.proto.graph.initializer}
    dense = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    for layer in after.layers:
        name = layer.weight
        if layer.choice.startswith("2:4"):
            assert np.array_equal(trained[name] == 0, fitted[name] == 0) and (trained[name] == 0).mean() >= 0.5
            assert not np.array_equal(trained[name], fitted[name])
            assert is_nm(torch.from_numpy(trained[name].copy()), "2:4", axis=1 if name == "W2" else 0)
        else:
            assert np.array_equal(trained[name], dense[name])


@pytest.mark.usefixtures("one_torch_thread")
def test_convert_precision_with_recover_reports_recovery_in_text_and_json(tmp_path, capsys):
    from test_recovery import save_mlp

    from nmdeploy.cli import main

    path, calibration = save_mlp(tmp_path, np.random.default_rng(0))
    out = tmp_path / "mixed.onnx"
    argv = ["convert", str(path), "-o", str(out), "--calib", str(calibration), "--method", "magnitude"]
    argv += ["--precision", "int8", "--min-fidelity", "0.9", "--recover", "40", "--recover-precision", "float32"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    (line,) = [line for line in lines if line.startswith("recovery of the 2:4 layers, before quantization:")]
    before, after = (float(v) for v in line.split("cosine ")[1].split(" (")[0].split(" -> "))
    assert after > before and "float32 training" in line
    assert lines[-1].startswith("PASSED | held-out cosine")
    out.unlink()
    assert main([*argv, "--json"]) == 0
    budget = json.loads(capsys.readouterr().out)["budget"]
    assert budget["recovery"]["step"] == "recover" and budget["recovery"]["steps_run"] > 0
    assert budget["recovery"]["held_out_before"] == pytest.approx(before, abs=1e-4)
    assert budget["recovery"]["held_out_after"] == pytest.approx(after, abs=1e-4)
    assert budget["fidelity"] >= 0.9


@pytest.mark.usefixtures("one_torch_thread")
def test_every_route_reaches_the_precision_budget_with_recovery(tmp_path, capsys):
    """Python (RecoveryOptions), a recipe (``recover`` as a table) and ``convert --recover --seed``: one model."""
    from test_recovery import save_mlp

    from nmdeploy.cli import main
    from nmdeploy.conversion.recipes import load_recipe
    from nmdeploy.conversion.recovery import RecoveryOptions

    path, calibration = save_mlp(tmp_path, np.random.default_rng(0))
    options = {"steps": 40, "seed": 3, "precision": "float32"}
    direct = OnnxModel.load(path)
    result = Conversion(
        calibration=calibration, min_fidelity=0.9, precision="int8", method="magnitude",
        recover=RecoveryOptions(**options),
    )(direct)  # fmt: skip
    expected = result.report[-1].to_json()
    assert expected["recovery"]["steps_run"] > 0

    recipe = tmp_path / "budget.toml"
    recipe.write_text(
        '[[passes]]\npass = "convert"\nmethod = "magnitude"\nmin_fidelity = 0.9\nprecision = "int8"\n'
        'recover = { steps = 40, seed = 3, precision = "float32" }\n'
    )
    from_recipe = OnnxModel.load(path)
    rows = load_recipe(str(recipe), calibration=str(calibration))(from_recipe).report
    assert from_recipe.proto.SerializeToString() == direct.proto.SerializeToString()
    assert rows[-1].row.layers == result.report[-1].layers

    out = tmp_path / "cli.onnx"
    argv = ["convert", str(path), "-o", str(out), "--calib", str(calibration), "--method", "magnitude"]
    argv += ["--precision", "int8", "--min-fidelity", "0.9", "--recover", "40", "--seed", "3"]
    assert main([*argv, "--recover-precision", "float32", "--json"]) == 0
    budget = json.loads(capsys.readouterr().out)["budget"]
    assert budget["layers"] == expected["layers"] and budget["fidelity"] == expected["fidelity"]
    assert OnnxModel.load(out).proto.graph.SerializeToString() == direct.proto.graph.SerializeToString()
    out.unlink()
    assert main([*argv, "--seed", "4", "--recover-precision", "float32"]) == 0  # another split: another model
    assert OnnxModel.load(out).proto.graph.SerializeToString() != direct.proto.graph.SerializeToString()
