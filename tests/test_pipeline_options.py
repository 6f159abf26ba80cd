"""pipeline MODEL takes convert's fitting flags from the same argument groups: --held-out, --transposable,
--fit-target, --fit, --damping and --calib-batch reach the one controller as convert's do, so the pipeline's
converted-2of4.onnx is the model convert writes with the same flags, and each flag does what it says there (the
held-out rows judge the floor, the masks are transposable, each layer is fitted to the target asked)."""

from __future__ import annotations

import json

import onnx
import pytest
from onnx import numpy_helper
from test_pipeline_user import build_mlp, write_data

from nmdeploy.cli import build_parser, main

HELD_OUT = "HELD_OUT"  # replaced by the held-out file's path
HELD_OUT_ROWS = 24  # unlike the fifth of the 256 calibration rows a seeded split would hold out


@pytest.fixture
def inputs(tmp_path):
    model = build_mlp(tmp_path / "model.onnx")
    calibration, evaluation = write_data(tmp_path / "calib.npz", 256, 1), write_data(tmp_path / "eval.npz", 64, 2)
    return model, calibration, evaluation, write_data(tmp_path / "held.npz", HELD_OUT_ROWS, 3)


def report_rows(document: dict, step: str) -> list[dict]:
    return [row for row in document["report"] if row.get("step") == step]


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    "extra",
    [
        ["--fit-target", "layer", "--damping", "0.3", "--transposable"],
        ["--fit", "parallel", "--method", "refit", "--damping", "0.5", "--calib-batch", "16"],
        ["--held-out", HELD_OUT, "--min-fidelity", "0.85", "--calib-batch", "32"],
        ["--held-out", HELD_OUT, "--recover", "10", "--seed", "2", "--recover-precision", "float32"],
    ],
    ids=["fit-target-transposable", "parallel-refit", "held-out-floor", "held-out-recovery"],
)
def test_the_pipeline_writes_what_convert_writes_with_the_same_flags(tmp_path, capsys, inputs, extra):
    model, calibration, evaluation, held_out = inputs
    flags = ["--calib", str(calibration), *(str(held_out) if flag == HELD_OUT else flag for flag in extra)]
    out = tmp_path / "out"
    assert main(["pipeline", str(model), "--data", str(evaluation), "-o", str(out), "--batch", "1", *flags]) == 0
    capsys.readouterr()
    assert main(["convert", str(model), "-o", str(tmp_path / "convert.onnx"), *flags, "--json"]) == 0
    verb = json.loads(capsys.readouterr().out)
    piped = onnx.load(out / "converted-2of4.onnx")
    assert piped.graph.SerializeToString() == onnx.load(tmp_path / "convert.onnx").graph.SerializeToString()

    step = json.loads((out / "convert.json").read_text())
    (summary,) = report_rows(step, "summary")
    assert summary.get("fit_target") == verb["summary"].get("fit_target")
    if "--calib-batch" in extra and "--min-fidelity" not in extra:  # 256 rows, 16 a run
        assert summary["calibration_batches"] == verb["summary"]["calibration_batches"] == 16
    if "--fit-target" in extra:
        assert summary["fit_target"] == "layer"  # auto would fit this classifier to the dense model's outputs
    if "--transposable" in extra:  # every converted weight is 2:4 along its input and its output channels
        weights = {t.name: numpy_helper.to_array(t) for t in piped.graph.initializer}
        converted = [row["weight"] for row in report_rows(step, "convert") if row.get("method")]
        square = [name for name in converted if weights[name].shape[1] % 4 == 0]
        assert len(square) == 2
        for name in square:
            for grouped in (weights[name].T, weights[name]):
                assert ((grouped.reshape(-1, 4) != 0).sum(axis=1) <= 2).all(), name
    if "--min-fidelity" in extra:  # the floor was judged on the held-out file's rows, as convert judged it
        assert step["budget"]["held_out_rows"] == verb["budget"]["held_out_rows"] == HELD_OUT_ROWS
        assert step["budget"]["layers"] == verb["budget"]["layers"]
    if "--recover" in extra:
        (recovery,) = report_rows(step, "recover")  # judged on the held-out file, as convert's recovery was
        (same,) = report_rows(verb, "recover")
        figures = ("held_out_before", "held_out_after", "held_out_batches", "train_batches", "best_step")
        assert [recovery[key] for key in figures] == [same[key] for key in figures]
    options = step["options"]  # the options the conversion step ran with, as the report states them
    assert options["held_out"] == (str(held_out) if "--held-out" in extra else None)
    assert options["transposable"] == ("--transposable" in extra)
    assert options["damping"] == (float(extra[extra.index("--damping") + 1]) if "--damping" in extra else None)


def test_convert_fitting_flags_the_pipeline_takes_and_those_it_leaves(capsys):
    """Every flag of convert's fitting, fidelity and selection groups is a pipeline flag too, save those named here
    with their reason."""
    left_to_convert = {
        "--pattern",  # the pipeline's files, baselines and engines are 2:4
        "--distributed",  # every torchrun rank would run the whole pipeline, not only its share of the fit
        "--in-place",
        "--require",  # the pipeline's verdict is its regression check
        "--allow-dense",
    }

    def flags(verb: str) -> set[str]:
        parser = build_parser(verb)
        subparsers = next(action for action in parser._actions if action.choices and verb in action.choices)
        return {name for action in subparsers.choices[verb]._actions for name in action.option_strings}

    convert, pipeline = flags("convert"), flags("pipeline")
    assert convert - pipeline == left_to_convert
    assert {"--held-out", "--transposable", "--fit-target", "--fit", "--damping", "--sparse-lm-head"} <= pipeline


def test_the_bundled_models_convert_with_the_method_asked_for_and_judge_it_on_their_baselines(tmp_path, capsys):
    # Like --fit and --damping, --method changes how the bundled models are converted; their baselines judge it.
    out = tmp_path / "out"
    code = main(["pipeline", "--models", "digits", "-o", str(out), "--method", "wanda", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == (0 if report["passed"] else 1)
    conversion = json.loads((out / "digits" / "convert.json").read_text())
    assert conversion["options"]["method"] == "wanda"
    fitted = [row for row in conversion["report"] if row.get("method")]
    assert len(fitted) == report["models"][0]["converted"] >= 3
    assert {row["method"] for row in fitted} == {"wanda"}


def test_the_bundled_models_refuse_the_flags_of_your_own_model(tmp_path, capsys):
    out = tmp_path / "out"
    for flag in (["--held-out", "eval.npz", "--min-fidelity", "0.9"], ["--sparse-lm-head"]):
        assert main(["pipeline", "--models", "digits", "-o", str(out), *flag]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and f"{flag[0]} is for your own model" in error[0]
    assert not out.exists()
