"""The real pretrained PP-OCRv6 text detector in the rapidocr wheel: it runs in ONNX Runtime and finds rendered text,
inspect finds its prunable convolutions, and a calibrated conversion of its largest convolutions keeps its text
masks on images from another source than the calibration images."""

import json

import numpy as np
import pytest

from nmdeploy.cli import main
from nmdeploy.errors import InputError
from nmdeploy.reference import ppocr, textdet

pytest.importorskip("sklearn")
pytest.importorskip("PIL")
if not ppocr.is_prepared():
    pytest.skip(f"the PP-OCR networks are not prepared: run `{ppocr.PREPARE}` once", allow_module_level=True)


def _inspect(path, capsys) -> dict:
    assert main(["inspect", "--json", str(path)]) == 0
    return json.loads(capsys.readouterr().out)


def test_detector_marks_rendered_text_and_not_a_blank_page():
    text = textdet.evaluation_images(count=3)
    blank = np.full((1, *text.shape[1:]), 235, dtype=np.uint8)
    probabilities = textdet.detect_onnx(textdet.model_path(), textdet.image_feeds(np.concatenate([text, blank])))
    assert probabilities.shape == (4, 1, *text.shape[1:3])
    assert probabilities.min() >= 0 and probabilities.max() <= 1
    masks = probabilities[:, 0] > textdet.TEXT_THRESHOLD
    # Every rendered image holds several lines of text; the blank page holds none.
    assert all(masks[index].mean() > 0.03 for index in range(3)), masks.mean(axis=(1, 2))
    assert masks[3].mean() < 0.002
    # Text is found where ink was drawn: rows without any ink carry almost no mask.
    ink = np.abs(text.astype(np.int16) - np.median(text, axis=(1, 2), keepdims=True)).max(axis=3) > 60
    inkless_rows = ~ink.any(axis=2)
    assert masks[:3][inkless_rows].mean() < 0.25 * masks[:3][~inkless_rows].mean()


def test_calibration_and_evaluation_images_differ_and_are_reproducible():
    calibration = textdet.calibration_images(count=4)
    assert calibration.dtype == np.uint8 and calibration.shape == (4, 256, 256, 3)
    np.testing.assert_array_equal(calibration, textdet.calibration_images(count=4))
    np.testing.assert_array_equal(textdet.evaluation_images(count=2), textdet.evaluation_images(count=2))
    inputs = textdet.preprocess(calibration)
    assert inputs.shape == (4, 3, 256, 256) and inputs.dtype == np.float32
    assert inputs.min() >= -1 and inputs.max() <= 1
    with pytest.raises(InputError, match="multiples of 32"):
        textdet.preprocess(np.zeros((1, 100, 64, 3), dtype=np.uint8))


def test_mask_iou():
    a = np.zeros((1, 1, 4, 4))
    b = a.copy()
    assert textdet.mask_iou(a, b) == 1.0  # nothing detected by either
    a[..., :2, :] = 0.9
    b[..., :1, :] = 0.9
    assert textdet.mask_iou(a, b) == pytest.approx(0.5)
    with pytest.raises(InputError, match="shape"):
        textdet.mask_iou(a, b[..., :2])


def test_inspect_finds_the_prunable_convolutions(capsys):
    report = _inspect(textdet.model_path(), capsys)
    eligible = [w for w in report["weights"] if w["eligible"]]
    assert len(eligible) >= 40
    assert all(w["op_types"] == ["Conv"] and w["axis"] == 1 and w["shape"][1] % 4 == 0 for w in eligible)
    # Depthwise convolutions have one input channel per group: reported, with the reason, not offered.
    assert any("depthwise" in row["reason"] for row in report["untraced"])


@pytest.mark.slow
def test_calibrated_conversion_of_the_largest_convolutions_keeps_the_text_masks(tmp_path, capsys):
    dense = textdet.model_path()
    eligible = [w for w in _inspect(dense, capsys)["weights"] if w["eligible"]]
    largest = sorted(eligible, key=lambda w: -int(np.prod(w["shape"])))[:4]
    include = "^(" + "|".join(w["weight"].replace(".", r"\.") for w in largest) + ")$"
    textdet.write_image_npz(textdet.calibration_images(count=8), tmp_path / "calib")

    out = tmp_path / "converted.onnx"
    assert (
        main(
            ["convert", str(dense), "-o", str(out), "--calib", str(tmp_path / "calib"), "--include", include, "--json"]
        )
        == 0
    )
    rows = [row for row in json.loads(capsys.readouterr().out)["report"] if row["step"] == "convert"]
    assert sorted(row["weight"] for row in rows) == sorted(w["weight"] for w in largest)
    for row in rows:
        assert "skipped" not in row and 0 < row["retained_saliency"] <= 1
        assert all(np.isfinite(row[key]) and row[key] >= 0 for key in ("error_masked", "error_converted"))
    converted = {w["weight"]: w for w in _inspect(out, capsys)["weights"]}
    assert all(converted[w["weight"]]["compliant"] == 1.0 for w in largest)

    magnitude = tmp_path / "magnitude.onnx"
    assert main(["prune", str(dense), "-o", str(magnitude), "--include", include]) == 0
    evaluation = textdet.image_feeds(textdet.evaluation_images(count=8))
    reference = textdet.detect_onnx(dense, evaluation)
    fidelity = textdet.mask_iou(reference, textdet.detect_onnx(out, evaluation))
    pruned = textdet.mask_iou(reference, textdet.detect_onnx(magnitude, evaluation))
    assert 0.8 <= fidelity <= 1.0, fidelity
    assert fidelity >= pruned - 0.02, (fidelity, pruned)


@pytest.mark.slow
def test_recovery_runs_on_the_real_detector_and_raises_its_held_out_fidelity(tmp_path, capsys):
    # HardSigmoid, Resize (nearest, asymmetric), ConvTranspose and SAME_UPPER padding all run in the interpreter.
    dense = textdet.model_path()
    textdet.write_image_npz(textdet.calibration_images(count=16, size=64), tmp_path / "calib", batch=4)
    out = tmp_path / "recovered.onnx"
    args = ["convert", str(dense), "-o", str(out), "--calib", str(tmp_path / "calib"), "--method", "magnitude"]
    assert main([*args, "--eligible-only", "--recover", "12", "--json"]) == 0
    (row,) = [row for row in json.loads(capsys.readouterr().out)["report"] if row["step"] == "recover"]
    assert row["masked_tensors"] >= 40 and row["trained_tensors"] > row["masked_tensors"]
    assert row["best_step"] > 0 and row["held_out_after"] > row["held_out_before"]
    assert row["onnxruntime_max_error"] < 1e-3  # the written model, run in ONNX Runtime, is what was trained
    converted = {w["weight"]: w for w in _inspect(out, capsys)["weights"]}
    assert sum(w["compliant"] == 1.0 for w in converted.values()) == row["masked_tensors"]
