"""The main job on the digits model: every artefact is written, the 2:4 model keeps the dense model's accuracy and
the shipped baselines hold; a baseline the model cannot meet makes ``nmdeploy pipeline`` exit 1, and updating
baselines rewrites them with the figures measured."""

from __future__ import annotations

import json
import re
import tomllib

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from test_tables import table_cells

from nmdeploy import pipeline
from nmdeploy.cli import main
from nmdeploy.errors import InputError
from nmdeploy.evaluation.regress import load_baselines, measure
from nmdeploy.reference import MODELS_FOLDER

pytest.importorskip("sklearn")

IMPOSSIBLE = """
[[model]]
name = "digits-identical"
reference = "dense.onnx"
candidate = "converted-2of4.onnx"
data = "evaluation"

[model.accuracy.logits]
max_abs_error = { baseline = 0.0, tolerance = 0.0 }
"""


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> pipeline.PipelineReport:
    lines: list[str] = []
    report = pipeline.run_pipeline(tmp_path_factory.mktemp("out"), models=("digits",), progress=lines.append)
    assert any(line.startswith("digits: convert") for line in lines)
    return report


def test_artefacts_and_summary(digits_run):
    folder = digits_run.out_dir / "digits"
    for name in (
        "dense.onnx",
        "converted-2of4.onnx",
        "converted-2of4-fp16.onnx",
        "inspect-dense.json",
        "inspect-converted.json",
        "convert.json",
        "cast.json",
        "compare.json",
        "bench.json",
        "regress.json",
    ):
        assert (folder / name).is_file(), name
    assert len(list((folder / "calibration").glob("batch-*.npz"))) == 8  # 512 images, 64 per batch
    assert sum(len(np.load(f)["image"]) for f in (folder / "evaluation").glob("*.npz")) == 450
    summary = json.loads((digits_run.out_dir / "summary.json").read_text())
    assert summary["passed"] is True
    assert summary["models"][0]["name"] == "digits"
    markdown = (digits_run.out_dir / "summary.md").read_text()
    assert markdown.rstrip().splitlines()[-1].startswith("PASSED | pipeline (digits)")
    header, row = table_cells(markdown)
    cells = dict(zip(header, row, strict=True))
    assert cells["model"] == "digits" and cells["weights 2:4"] == "4/5" and cells["regress"] == "passed"
    value, measure = cells["fidelity"].split()
    assert measure == "cosine"  # 10 logits of varied direction: the per-row cosine fits
    assert float(value) == pytest.approx(summary["models"][0]["comparison"]["mean_cosine"], abs=1e-4)
    assert not list(digits_run.out_dir.rglob(".*.tmp"))  # no temporary file left behind
    inspected = json.loads((folder / "inspect-converted.json").read_text())
    assert inspected["summary"]["compliant"] == 4


def test_converted_model_is_2of4_and_keeps_accuracy(digits_run):
    (model,) = digits_run.models
    # Four of the five weights: the first convolution reduces over a single input channel, which 2:4 cannot divide.
    assert (model.weights, model.converted, model.compliant) == (5, 4, 4)
    # An oracle independent of nmdeploy: every group of 4 input channels of the converted Gemm/Conv weights keeps <= 2.
    proto = onnx.load(str(model.folder / pipeline.CONVERTED))
    weights = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    checked = 0
    for node in proto.graph.node:
        if node.op_type in ("Conv", "Gemm") and weights[node.input[1]].shape[1] % 4 == 0:
            values = weights[node.input[1]]
            groups = np.moveaxis(values, 1, -1).reshape(*np.moveaxis(values, 1, -1).shape[:-1], -1, 4)
            assert (np.count_nonzero(groups, axis=-1) <= 2).all(), node.name
            checked += 1
    assert checked == 4
    task = model.task_accuracy
    assert task["dense"] > 0.95
    assert abs(task["converted"] - task["dense"]) <= 0.01  # within one point of the dense model on 450 test images
    assert abs(task["cast"] - task["converted"]) <= 0.005
    assert model.comparison["mean_cosine"] > 0.99
    assert model.comparison["top1_agreement"] > 0.98
    assert model.cast_comparison["mean_cosine"] > 0.9999
    assert set(model.latency_ratios) == {1, 32} and all(0 < r < 10 for r in model.latency_ratios.values())
    # The default precision is fp16: no quantize step, nothing quantized written.
    assert model.quantization is None and not (model.folder / "converted-2of4-int8.onnx").exists()


def test_shipped_baselines_hold(digits_run):
    (model,) = digits_run.models
    regression = model.regression
    assert not regression.regressed, [c.as_dict() for c in regression.regressed]
    labels = {f"{c.key[0]} {c.label}" for c in regression.checks}
    assert {"accuracy logits.mean_cosine", "accuracy logits.top1_agreement", "latency p50_ratio@batch32"} <= labels
    # The figures judged are the ones the compare and bench steps wrote.
    compare = json.loads((model.folder / "compare.json").read_text())["outputs"][0]
    cosine = next(c for c in regression.checks if c.label == "logits.mean_cosine")
    assert cosine.measured == pytest.approx(compare["mean_cosine"])


def test_engine_step_says_why_it_was_skipped(digits_run):
    (model,) = digits_run.models
    reason = pipeline.engine_skip_reason()
    if reason is None:
        assert model.engine["predicted_eligible"] >= 1
    else:
        assert model.engine == {"skipped": reason}
        assert pipeline.engine_lines(digits_run) == [f"TensorRT engines: skipped ({reason})"]


def test_update_rewrites_baselines_with_measured_figures(digits_run, tmp_path):
    folder = digits_run.out_dir / "digits"
    baselines = tmp_path / "baselines.toml"
    shipped = (MODELS_FOLDER / "digits" / "baselines.toml").read_text()
    baselines.write_text(
        re.sub(r"(?m)^mean_cosine = .*$", "mean_cosine = { baseline = 0.5, tolerance = 0.004 }", shipped)
    )
    (entry,) = load_baselines(baselines, folder)
    figures = measure(entry)

    def cosine_status(report) -> str:
        return next(c.status for c in report.checks if c.label == "logits.mean_cosine")

    measured = {entry.name: figures}
    assert cosine_status(pipeline.regress(baselines, folder, measured, update=False)) == "improved"
    updated = pipeline.regress(baselines, folder, measured, update=True)
    assert updated.updated and not updated.regressed and cosine_status(updated) == "ok"
    written = tomllib.loads(baselines.read_text())["model"][0]["accuracy"]["logits"]["mean_cosine"]
    assert written == {
        "baseline": pytest.approx(figures[("accuracy", "logits", "mean_cosine")], abs=1e-6),
        "tolerance": 0.004,
    }


def test_failing_baseline_makes_the_cli_exit_1(tmp_path, capsys):
    baselines = tmp_path / "models" / "digits" / "baselines.toml"
    baselines.parent.mkdir(parents=True)
    baselines.write_text((MODELS_FOLDER / "digits" / "baselines.toml").read_text() + IMPOSSIBLE)
    code = main(
        ["pipeline", "-o", str(tmp_path / "out"), "--models", "digits", "--baselines", str(tmp_path / "models")]
    )
    out = capsys.readouterr().out
    assert code == 1
    last = out.rstrip().splitlines()[-1]
    assert last.startswith("FAILED | pipeline (digits): 1 of ")
    assert "digits-identical: max_abs_error of output 'logits' " in last and "> baseline 0 + 0" in last
    assert "regressed: digits-identical" in out


def test_bad_requests_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(InputError, match="unknown model"):
        pipeline.run_pipeline(tmp_path, models=("resnet",))
    assert main(["pipeline", "-o", str(tmp_path / "out"), "--models", "digits", "--baselines", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no baselines file" in err[0]
    with pytest.raises(SystemExit) as exit_info:
        main(["pipeline", "--models", "digits,resnet"])
    assert exit_info.value.code == 2


def test_update_baselines_never_rewrites_an_installed_package(tmp_path, monkeypatch, capsys):
    import nmdeploy.cli.pipeline as verb

    bundled = tmp_path / "site-packages" / "nmdeploy" / "models"
    (bundled / "digits").mkdir(parents=True)
    (bundled / "digits" / "baselines.toml").write_text((MODELS_FOLDER / "digits" / "baselines.toml").read_text())
    before = (bundled / "digits" / "baselines.toml").read_bytes()
    monkeypatch.setattr(verb, "MODELS_FOLDER", bundled)
    assert main(["pipeline", "--models", "digits", "--update-baselines", "-o", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "installed package" in error[0]
    assert (bundled / "digits" / "baselines.toml").read_bytes() == before
    assert not (tmp_path / "out").exists()
