"""The real pretrained text-line orientation classifier in the rapidocr wheel: it tells upright from upside-down printed
lines, inspect finds its convolutions although they are stored in Constant nodes, and a calibrated conversion keeps
its decisions on lines of another source than the calibration lines."""

import json

import numpy as np
import onnx
import pytest

from nmdeploy.cli import main
from nmdeploy.errors import InputError
from nmdeploy.reference import ppocr, textcls
from nmdeploy.runtimes.data import check_batch, graph_inputs
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

pytest.importorskip("sklearn")
pytest.importorskip("PIL")
if not ppocr.is_prepared():
    pytest.skip(f"the PP-OCR networks are not prepared: run `{ppocr.PREPARE}` once", allow_module_level=True)


@pytest.fixture(scope="module")
def evaluation():
    lines, labels = textcls.evaluation_lines(count=64)
    return textcls.line_feeds(lines), labels


def test_classifier_tells_upright_from_upside_down_lines(evaluation):
    feeds, labels = evaluation
    assert 0 < labels.mean() < 1
    scores = textcls.classify_onnx(textcls.model_path(), feeds)
    assert scores.shape == (len(labels), 2)
    np.testing.assert_allclose(scores.sum(axis=1), 1, atol=1e-5)
    assert textcls.accuracy(scores, labels) >= 0.9


def test_lines_are_labelled_reproducible_and_preprocessed_like_rapidocr():
    lines, labels = textcls.calibration_lines(count=8)
    again, labels_again = textcls.calibration_lines(count=8)
    assert all(np.array_equal(a, b) for a, b in zip(lines, again, strict=True))
    np.testing.assert_array_equal(labels, labels_again)
    assert labels.sum() == 4
    inputs = textcls.preprocess([np.full((10, 1000, 3), 255, np.uint8), np.zeros((40, 40, 3), np.uint8)])
    assert inputs.shape == (2, 3, 48, 192)
    assert np.all(inputs[0] == 1)  # a long line fills the width
    assert np.all(inputs[1, :, :, :48] == -1) and np.all(inputs[1, :, :, 48:] == 0)  # a short one is zero-padded
    with pytest.raises(InputError, match="uint8"):
        textcls.preprocess([np.zeros((4, 4), np.uint8)])
    assert textcls.top1_agreement(np.array([[0.9, 0.1], [0.2, 0.8]]), np.array([[0.6, 0.4], [0.7, 0.3]])) == 0.5


def test_a_negative_dimension_is_read_as_dynamic(tmp_path):
    # Paddle exports declare dynamic dimensions as -1, as this model's input [-1, 3, ?, ?] does.
    model = onnx.load(str(textcls.model_path()))
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_value == -1
    (spec,) = graph_inputs(model)
    assert spec.shape == (None, 3, None, None)
    batch = {"x": np.zeros((5, 3, 48, 192), np.float32)}
    assert check_batch(batch, [spec], "batch")["x"] is batch["x"]
    with OnnxRuntimeRunner(textcls.model_path()) as runner:
        assert runner.inputs[0].shape == (None, 3, None, None)


def test_inspect_finds_weights_stored_in_constant_nodes(capsys):
    assert main(["inspect", "--json", str(textcls.model_path())]) == 0
    weights = json.loads(capsys.readouterr().out)["weights"]
    eligible = [w for w in weights if w["eligible"]]
    assert len(eligible) >= 20
    assert all(w["traced"].startswith("constant") for w in eligible)
    assert sum(w["op_types"] == ["Conv"] for w in eligible) == len(eligible) - 1  # and the final MatMul


@pytest.mark.slow
def test_calibrated_conversion_keeps_the_decisions(tmp_path, evaluation, capsys):
    dense = textcls.model_path()
    textcls.write_line_npz(textcls.calibration_lines(count=64)[0], tmp_path / "calib")
    out = tmp_path / "converted.onnx"
    # The last two blocks and the last convolution: the widest layers (up to 200 channels).
    assert (
        main(
            [
                "convert",
                str(dense),
                "-o",
                str(out),
                "--calib",
                str(tmp_path / "calib"),
                "--eligible-only",
                "--include",
                "^conv(1[12]_.*|_last)_weights$",
                "--json",
            ]
        )
        == 0
    )
    rows = [row for row in json.loads(capsys.readouterr().out)["report"] if row["step"] == "convert"]
    converted = [row for row in rows if "skipped" not in row]
    assert len(converted) == 7
    for row in converted:
        assert 0 < row["retained_saliency"] <= 1
        assert all(np.isfinite(row[key]) and row[key] >= 0 for key in ("error_masked", "error_converted"))

    magnitude = tmp_path / "magnitude.onnx"
    assert (
        main(
            [
                "prune",
                str(dense),
                "-o",
                str(magnitude),
                "--eligible-only",
                "--include",
                "^conv(1[12]_.*|_last)_weights$",
            ]
        )
        == 0
    )
    feeds, labels = evaluation
    reference = textcls.classify_onnx(dense, feeds)
    # Measured: 0.98 converted, 0.92 magnitude (converting all 35 eligible weights leaves chance, 0.5).
    agreement = textcls.top1_agreement(reference, textcls.classify_onnx(out, feeds))
    pruned = textcls.top1_agreement(reference, textcls.classify_onnx(magnitude, feeds))
    assert 0.9 <= agreement <= 1.0, agreement
    assert agreement >= pruned - 0.02, (agreement, pruned)
