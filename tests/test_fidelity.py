"""Fidelity measures: the default ``auto`` judges probability maps dominated by near-zero values by their
spread-normalised agreement (per-sample cosine of a text-less detector map measures background noise), keeps the
cosine everywhere else, and ``mask-iou@T`` judges thresholded masks."""

import copy
import importlib.util

import numpy as np
import pytest

from nmdeploy.errors import InputError
from nmdeploy.fidelity import (
    OutputComparison,
    background_share,
    fidelity,
    model_fidelity,
    output_figure,
    resolve_metric,
    select_outputs,
)
from nmdeploy.reference import ppocr


def test_spread_agreement_is_the_cosine_of_centred_outputs_of_equal_norm():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((8, 16))
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    reference = np.concatenate([rows, -rows])  # mean zero, every row of norm 1
    rotation, _ = np.linalg.qr(rng.standard_normal((16, 16)))
    candidate = 0.9 * reference + 0.1 * reference @ rotation
    candidate /= np.linalg.norm(candidate, axis=1, keepdims=True)
    comparison = OutputComparison("embedding")
    comparison.add(reference, candidate)
    assert comparison.spread_agreement == pytest.approx(comparison.mean_cosine, abs=1e-12)
    assert not comparison.probability_map  # signed values, no spatial axes: auto is the cosine
    assert output_figure(comparison, "auto").value == comparison.mean_cosine
    identical = OutputComparison("same")
    identical.add(reference, reference)
    assert identical.spread_agreement == 1.0


def test_a_map_is_recognised_only_when_it_is_a_mostly_empty_probability_map():
    rng = np.random.default_rng(1)
    background = rng.uniform(0, 0.01, (4, 1, 32, 32))
    background[:, :, 8:12, :] = 0.95  # one line of text per image: 12.5 % of the pixels
    cases = {
        "text map": (background, True),
        "logits": (rng.standard_normal((4, 10)), False),
        "class probabilities": (np.full((4, 10), 0.01), False),  # no spatial axes: a classifier
        "a full map": (np.full((4, 1, 8, 8), 0.7), False),
        "signed map": (background - 0.5, False),
    }
    for name, (reference, expected) in cases.items():
        comparison = OutputComparison(name)
        comparison.add(reference, reference)
        assert comparison.probability_map is expected, name
        assert (background_share(reference) is not None) is expected, name  # the same rule on one batch


def test_metric_names():
    assert resolve_metric("auto") == "auto" and resolve_metric("mask-iou@0.3") == "mask-iou@0.3"
    with pytest.raises(InputError, match="must be a number"):
        resolve_metric("mask-iou@high")
    comparison = OutputComparison("y")
    comparison.add(np.zeros((2, 1, 4, 4)), np.zeros((2, 1, 4, 4)))
    with pytest.raises(InputError, match="mask threshold"):
        model_fidelity([comparison], "mask-iou@0.3")


textdet_available = all(importlib.util.find_spec(name) for name in ("sklearn", "PIL")) and ppocr.is_prepared()


@pytest.mark.skipif(
    not textdet_available,
    reason=f"the PP-OCR detector needs scikit-learn, Pillow and its network prepared by `{ppocr.PREPARE}`",
)
def test_auto_judges_the_real_detector_map_by_its_spread_where_cosine_collapses(tmp_path):
    from nmdeploy.graph.model import OnnxModel
    from nmdeploy.passes.prune import PrunePass
    from nmdeploy.reference import textdet
    from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

    # Rendered text, then photo crops the detector finds no text in; one layer pruned to 2:4 by magnitude.
    images = np.concatenate([textdet.evaluation_images(count=2), textdet.calibration_images(count=5)[0::4]])
    feeds = textdet.image_feeds(images, batch=4)
    dense = OnnxModel.load(textdet.model_path())
    pruned = copy.deepcopy(dense)
    PrunePass(include="^auto\\.cast\\.95$")(pruned)
    outputs = []
    for model in (dense, pruned):
        with OnnxRuntimeRunner(model.save(tmp_path / f"{len(outputs)}.onnx")) as runner:
            outputs.append([runner.infer(feed) for feed in feeds])
    reference = np.concatenate([batch[textdet.OUTPUT_NAME] for batch in outputs[0]])
    candidate = np.concatenate([batch[textdet.OUTPUT_NAME] for batch in outputs[1]])
    text = (reference.reshape(len(reference), -1) > textdet.TEXT_THRESHOLD).mean(axis=1)
    assert (text[:2] > 0.05).all() and (text[2:] == 0).all()

    comparison = OutputComparison(textdet.OUTPUT_NAME)
    comparison.add(reference, candidate)
    assert comparison.probability_map and comparison.background_share > 0.8
    rows = [
        (r.ravel(), c.ravel()) for r, c in zip(reference.astype(np.float64), candidate.astype(np.float64), strict=True)
    ]
    cosines = np.array([r @ c / np.linalg.norm(r) / np.linalg.norm(c) for r, c in rows])
    # Measured: 0.93 and 0.95 on the text images, 0.45 and 0.46 on the text-less photos (their maps are ~1e-3
    # everywhere, so a small shift is a new direction); mean 0.70. Spread (per pixel across the four images) 0.92,
    # mask IoU at 0.3: 0.85.
    assert (cosines[:2] > 0.9).all() and (cosines[2:] < 0.6).all()
    assert comparison.mean_cosine < 0.75
    assert comparison.spread_agreement > 0.9
    assert abs(comparison.spread_agreement - cosines[:2].mean()) < 0.03  # the cosine where there is content
    batches = list(zip((o for o in outputs[0]), (o for o in outputs[1]), feeds, strict=True))
    assert fidelity(batches, "auto") == pytest.approx(comparison.spread_agreement)
    assert fidelity(batches, "cosine") == pytest.approx(comparison.mean_cosine)
    assert fidelity(batches, "mask-iou@0.3") == pytest.approx(textdet.mask_iou(reference, candidate, 0.3))
    assert output_figure(comparison, "auto").metric == "spread"
    selection = select_outputs(outputs[0][0], feeds[0])
    assert list(selection.maps) == [textdet.OUTPUT_NAME] and "--metric auto" in selection.describe()


def test_counting_rows_a_block_at_a_time_gives_the_same_figures(monkeypatch):
    from nmdeploy.fidelity import comparison as module

    rng = np.random.default_rng(5)
    reference = rng.normal(0, 1, (3, 9, 40))  # [tokens, batch, classes]: rows along axis 1
    candidate = reference + rng.normal(0, 0.3, reference.shape)
    figures = []
    for block in (1 << 22, 50):  # one block, then blocks of one row (50 values < 3 x 40)
        monkeypatch.setattr(module, "ROW_BLOCK_VALUES", block)
        compared = OutputComparison("y", classifier=True, iou_threshold=0.5, batch_axis=1)
        compared.add(reference, candidate)
        figures.append(compared.as_dict() | {"iou": compared.mask_iou, "chance": compared.top1_figure().chance})
    assert figures[0]["samples"] == 9 and figures[0]["values_per_row"] == 120
    assert figures[0].pop("name") == figures[1].pop("name") == "y"
    assert figures[0] == pytest.approx(figures[1], rel=1e-12)
