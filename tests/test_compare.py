"""compare: per-output errors, cosine and top-1 agreement, data loading and its errors, and the metric hook."""

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy import InputError
from nmdeploy.cli import main
from nmdeploy.evaluation.compare import compare_models


def linear_model(path, weight):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["logits"])],
        "lin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 3])],
        [numpy_helper.from_array(weight.astype(np.float32), "W")],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture
def pair(tmp_path):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((4, 3))
    changed = weight.copy()
    changed[:, 2] *= -1  # flips the sign of the third logit
    data = rng.standard_normal((10, 4)).astype(np.float32)
    np.savez(tmp_path / "data.npz", x=data)
    return (
        linear_model(tmp_path / "ref.onnx", weight),
        linear_model(tmp_path / "cand.onnx", changed),
        data,
        weight.astype(np.float32),
        changed.astype(np.float32),
    )


def test_identical_models_agree_exactly(pair):
    ref, _, _, _, _ = pair
    result = compare_models(ref, ref, ref.parent / "data.npz")
    (output,) = result.outputs
    assert (output.max_abs_error, output.max_rel_error, output.mean_cosine, output.top1_agreement) == (0, 0, 1, 1)
    assert output.samples == 10 and result.batches == 1


def test_figures_match_an_independent_computation(pair, tmp_path):
    ref, cand, data, weight, changed = pair
    np.savez(tmp_path / "more.npz", x=data[:3])  # a folder of two batches
    folder = tmp_path / "batches"
    folder.mkdir()
    (tmp_path / "data.npz").rename(folder / "a.npz")
    (tmp_path / "more.npz").rename(folder / "b.npz")
    result = compare_models(ref, cand, folder)
    (output,) = result.outputs
    inputs = np.concatenate([data, data[:3]])
    expected, actual = inputs @ weight, inputs @ changed
    cosine = (expected * actual).sum(1) / np.linalg.norm(expected, axis=1) / np.linalg.norm(actual, axis=1)
    assert output.samples == 13 and result.batches == 2
    assert output.max_abs_error == pytest.approx(np.abs(expected - actual).max(), rel=1e-5)
    assert output.mean_cosine == pytest.approx(cosine.mean(), rel=1e-5)
    assert output.top1_agreement == pytest.approx((expected.argmax(1) == actual.argmax(1)).mean())


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "nmdeploy", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.mark.parametrize(
    "arrays,message",
    [
        ({"y": np.zeros((2, 4), np.float32)}, "no array for input 'x'; the model expects x: float32[?, 4]"),
        ({"x": np.zeros((2, 4), np.float64)}, "input 'x' is float64, the model expects x: float32[?, 4]"),
        ({"x": np.zeros((2, 5), np.float32)}, "input 'x' has shape [2, 5], the model expects x: float32[?, 4]"),
    ],
)
def test_mismatched_data_names_the_input_and_expected_shape(pair, tmp_path, arrays, message):
    ref, cand, _, _, _ = pair
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(InputError, match="bad.npz: "):
        compare_models(ref, cand, tmp_path / "bad.npz")
    result = run_cli("compare", str(ref), str(cand), "--data", str(tmp_path / "bad.npz"))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_metric_hook_and_json(pair, tmp_path):
    ref, cand, _, _, _ = pair
    (tmp_path / "my_metric.py").write_text(
        "def mean_gap(reference, candidate, feeds):\n"
        "    return float(abs(reference['logits'] - candidate['logits']).mean())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = run_cli(
        "compare",
        str(ref),
        str(cand),
        "--data",
        str(tmp_path / "data.npz"),
        "--metric",
        "my_metric:mean_gap",
        "--json",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["metric"] > 0 and report["outputs"][0]["name"] == "logits"
    missing = run_cli("compare", str(ref), str(cand), "--data", "random", "--metric", "my_metric:nope", env=env)
    assert missing.returncode == 2 and "has no function 'nope'" in missing.stderr


def test_a_metric_module_that_fails_to_import_is_one_line(pair, tmp_path, monkeypatch, capsys):
    """The metric's module is the user's code: an error raised while importing it is their input, not a crash."""
    ref, cand, _, _, _ = pair
    (tmp_path / "broken_metric.py").write_text("raise RuntimeError('missing config file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["compare", str(ref), str(cand), "--data", "random", "--metric", "broken_metric:gap"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "cannot import 'broken_metric' (missing config file)" in err
