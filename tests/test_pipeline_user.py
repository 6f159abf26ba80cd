"""pipeline on a user's own model (a seeded MLP built here, not from models/): inputs checked first, every step run,
a baselines file written that `regress` then passes twice in a row; a tampered candidate fails it."""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main

FEATURES, HIDDEN, CLASSES = 64, 256, 10


def build_mlp(path: Path, seed: int = 0) -> Path:
    """64 -> 256 -> 256 -> 10 with ReLUs, He-initialised weights: big enough that 2:4 matters, fast to run."""
    rng = np.random.default_rng(seed)
    sizes = [FEATURES, HIDDEN, HIDDEN, CLASSES]
    nodes, initializers, current = [], [], "x"
    for index, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        weight = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2 / fan_in)).astype(np.float32)
        bias = (rng.standard_normal(fan_out) * 0.1).astype(np.float32)
        initializers += [numpy_helper.from_array(weight, f"w{index}"), numpy_helper.from_array(bias, f"b{index}")]
        last = index == len(sizes) - 2
        nodes.append(helper.make_node("MatMul", [current, f"w{index}"], [f"mm{index}"], name=f"fc{index}"))
        nodes.append(helper.make_node("Add", [f"mm{index}", f"b{index}"], ["logits" if last else f"pre{index}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"pre{index}"], [f"h{index}"]))
            current = f"h{index}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def write_data(path: Path, rows: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    np.savez(path, x=rng.standard_normal((rows, FEATURES)).astype(np.float32))
    return path


@pytest.fixture(scope="module")
def user_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user")
    model = build_mlp(folder / "my-model.onnx")
    calib = write_data(folder / "calib.npz", 256, seed=1)
    evaluation = write_data(folder / "eval.npz", 64, seed=2)
    out = folder / "out"
    code = main(["pipeline", str(model), "--calib", str(calib), "--data", str(evaluation), "-o", str(out)])
    return folder, out, code


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_pipeline_writes_baselines_that_regress_passes_twice(user_run, capsys):
    folder, out, code = user_run
    assert code == 0
    for name in ("converted-2of4.onnx", "converted-2of4-fp16.onnx", "compare.json", "bench.json", "summary.md"):
        assert (out / name).is_file(), name
    assert not (out / "dense.onnx").exists()  # the user's model is referenced where it lies, not copied
    document = tomllib.loads((out / "baselines.toml").read_text())
    (entry,) = document["model"]
    assert (entry["reference"], entry["candidate"], entry["data"]) == (
        "../my-model.onnx",
        "converted-2of4.onnx",
        "../eval.npz",
    )
    cosine = entry["accuracy"]["logits"]["mean_cosine"]
    assert 0.5 < cosine["baseline"] < 0.999 and cosine["tolerance"] >= 0.005  # 2:4 of random weights costs fidelity
    assert entry["latency"]["batch"] == [1, 64] and entry["latency"]["runs"] >= 3  # 64: the evaluation batch
    assert set(entry["latency"]["p50_ratio"]) == {"1", "64"}
    assert all(row["tolerance"] >= 0.4 * row["baseline"] * 0.99 for row in entry["latency"]["p50_ratio"].values())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["models"][0]["regression"]["created"]
    # Nothing was judged on the first run: the verdict says the baselines were created, not PASSED.
    assert last_line((out / "summary.md").read_text()).startswith("CREATED | pipeline (my-model)")
    converted = {t.name: numpy_helper.to_array(t) for t in onnx.load(out / "converted-2of4.onnx").graph.initializer}
    for index in range(3):
        weight = converted[f"w{index}"].T  # reduction axis last
        assert ((weight.reshape(-1, 4) != 0).sum(axis=1) <= 2).all()
    capsys.readouterr()
    for _ in range(2):  # the bar users check: the unchanged model passes its own new baselines, again and again
        assert main(["regress", str(out / "baselines.toml")]) == 0
        assert last_line(capsys.readouterr().out).startswith("PASSED | 5 checks within tolerance")


def test_a_second_pipeline_run_judges_against_the_file_it_wrote(user_run, capsys):
    folder, out, _ = user_run
    before = (out / "baselines.toml").read_text()
    model, calib, evaluation = (folder / name for name in ("my-model.onnx", "calib.npz", "eval.npz"))
    assert main(["pipeline", str(model), "--calib", str(calib), "--data", str(evaluation), "-o", str(out)]) == 0
    output = capsys.readouterr().out
    assert last_line(output).startswith("PASSED | pipeline (my-model)") and "created" not in output
    assert (out / "baselines.toml").read_text() == before


def test_tampered_candidate_fails_regress_with_the_figure_named(user_run, tmp_path, capsys):
    folder, out, _ = user_run
    copy = tmp_path / "user"
    shutil.copytree(folder, copy)
    candidate = onnx.load(copy / "out" / "converted-2of4.onnx")
    (tensor,) = [t for t in candidate.graph.initializer if t.name == "w1"]
    weight = numpy_helper.to_array(tensor)
    noise = np.random.default_rng(3).uniform(0, 2, weight.shape).astype(np.float32)  # each weight scaled 0..2x
    tensor.CopyFrom(numpy_helper.from_array(weight * noise, "w1"))
    onnx.save(candidate, copy / "out" / "converted-2of4.onnx")
    assert main(["regress", str(copy / "out" / "baselines.toml")]) == 1
    line = last_line(capsys.readouterr().out)
    assert line.startswith("FAILED | ") and "my-model-2of4: mean_cosine of output 'logits' " in line


def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys, caplog):
    model = build_mlp(tmp_path / "m.onnx")
    calib = write_data(tmp_path / "calib.npz", 32, seed=1)
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, image=np.zeros((4, 64), np.float32))
    (tmp_path / "not-a-model.onnx").write_text("hello")
    other = tmp_path / "other.toml"  # judges another pair only: a run against it would judge nothing of its own
    other.write_text(
        '[[model]]\nname = "other"\nreference = "a.onnx"\ncandidate = "b.onnx"\ndata = "calib.npz"\n'
        "[model.accuracy.y]\nmean_cosine = { baseline = 0.9, tolerance = 0.01 }\n"
    )
    out = tmp_path / "out"
    cases = [
        (["not-a-model.onnx", "--calib", "calib.npz", "--data", "calib.npz"], "not-a-model.onnx"),
        (["m.onnx", "--calib", "missing.npz", "--data", "calib.npz"], "missing.npz"),
        (["m.onnx", "--calib", "calib.npz", "--data", "wrong.npz"], "x"),
        (["m.onnx", "--calib", "calib.npz"], "--data"),
        (["m.onnx", "--calib", "calib.npz", "--data", "calib.npz", "--metric", "no_such_module:f"], "no_such_module"),
        (["m.onnx", "--calib", "calib.npz", "--data", "calib.npz", "--models", "digits"], "--models"),
        (["--calib", "calib.npz"], "your own model"),
        (["m.onnx", "--calib", "calib.npz", "--data", "calib.npz", "--baselines", str(other)], "no [[model]] entry"),
        (["m.onnx", "--calib", "calib.npz", "--data", "calib.npz", "--outputs", "nope"], "has no output 'nope'"),
    ]
    for arguments, named in cases:
        arguments = [str(tmp_path / a) if a.endswith(".onnx") or a.endswith(".npz") else a for a in arguments]
        assert main(["pipeline", *arguments, "-o", str(out)]) == 2, arguments
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("nmdeploy pipeline: error:") and named in line, (arguments, line)
        assert not out.exists()
    (tmp_path / "a-file").write_text("")
    assert main(["pipeline", str(model), "--calib", str(calib), "--data", str(calib), "-o", str(tmp_path / "a-file")])
    assert "overstates" in caplog.text  # fidelity on the calibration data is warned about, before the error


def test_metric_batch_exclude_and_a_baselines_file_elsewhere(user_run, tmp_path, monkeypatch, capsys):
    folder, _, _ = user_run
    (tmp_path / "my_metric.py").write_text(
        "def top1(reference, candidate, feeds):\n"
        "    return float((reference['logits'].argmax(-1) == candidate['logits'].argmax(-1)).mean())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model, calib, evaluation = (folder / name for name in ("my-model.onnx", "calib.npz", "eval.npz"))
    baselines, out = tmp_path / "baselines.toml", tmp_path / "out"
    arguments = ["pipeline", str(model), "--calib", str(calib), "--data", str(evaluation), "-o", str(out)]
    arguments += ["--metric", "my_metric:top1", "--batch", "2", "--exclude", "fc2", "--baselines", str(baselines)]
    assert main(arguments) == 0
    (entry,) = tomllib.loads(baselines.read_text())["model"]
    assert (baselines.parent / entry["reference"]).resolve() == model.resolve()
    assert entry["candidate"] == "out/converted-2of4.onnx" and entry["latency"]["batch"] == [2]
    assert entry["metric"] == "my_metric:top1"
    metric, top1 = entry["accuracy"]["metric"]["value"], entry["accuracy"]["logits"]["top1_agreement"]
    assert metric["baseline"] == pytest.approx(top1["baseline"])  # one evaluation batch: the same figure
    converted = {t.name: numpy_helper.to_array(t) for t in onnx.load(out / "converted-2of4.onnx").graph.initializer}
    assert ((converted["w2"].T.reshape(-1, 4) != 0).sum(axis=1) > 2).any()  # fc2 excluded: left dense
    assert ((converted["w1"].T.reshape(-1, 4) != 0).sum(axis=1) <= 2).all()
    capsys.readouterr()
    assert main(["regress", str(baselines)]) == 0
    assert "accuracy metric.value" in capsys.readouterr().out


def test_update_baselines_rewrites_numbers_and_keeps_tolerances_and_comments(user_run, tmp_path, capsys):
    folder, _, _ = user_run
    copy = tmp_path / "user"
    shutil.copytree(folder, copy)
    path = copy / "out" / "baselines.toml"
    path.write_text(re.sub(r"mean_cosine = \{baseline = [0-9.e-]+", "mean_cosine = {baseline = 0.1", path.read_text()))
    before = tomllib.loads(path.read_text())["model"][0]
    model, calib, evaluation = (copy / name for name in ("my-model.onnx", "calib.npz", "eval.npz"))
    arguments = ["pipeline", str(model), "--calib", str(calib), "--data", str(evaluation), "-o", str(copy / "out")]
    assert main([*arguments, "--update-baselines"]) == 0
    assert "| updated |" in capsys.readouterr().out
    after = tomllib.loads(path.read_text())["model"][0]
    cosine = after["accuracy"]["logits"]["mean_cosine"]
    assert cosine["baseline"] > 0.5 and cosine["tolerance"] == before["accuracy"]["logits"]["mean_cosine"]["tolerance"]
    assert "# Tolerances are absolute" in path.read_text()


def test_the_pipeline_convert_step_takes_every_fitting_option_convert_takes(tmp_path):
    """The pipeline's step and ``convert`` reach the one controller with the same fitting options: the same model."""
    from nmdeploy.cli import main as cli
    from nmdeploy.pipeline.models import PreparedModel
    from nmdeploy.pipeline.steps import ConvertSettings, convert

    dense = build_mlp(tmp_path / "dense.onnx")
    calibration = write_data(tmp_path / "calib.npz", 64, 1)
    prepared = PreparedModel("m", tmp_path, dense, calibration, calibration, None, {}, True)
    fitting = {"sequential": False, "damping": 0.5}
    settings = ConvertSettings(method="refit", fitting=fitting)
    convert(prepared, tmp_path / "step.onnx", tmp_path / "step.json", settings=settings)
    flags = ["--method", "refit", "--fit", "parallel", "--damping", "0.5"]
    assert cli(["convert", str(dense), "-o", str(tmp_path / "cli.onnx"), "--calib", str(calibration), *flags]) == 0
    step, verb = onnx.load(tmp_path / "step.onnx"), onnx.load(tmp_path / "cli.onnx")
    assert step.graph.SerializeToString() == verb.graph.SerializeToString()
    convert(prepared, tmp_path / "default.onnx", tmp_path / "default.json", settings=ConvertSettings(method="refit"))
    assert onnx.load(tmp_path / "default.onnx").graph.SerializeToString() != step.graph.SerializeToString()
