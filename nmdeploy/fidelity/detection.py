"""Detection boxes judged as detections: each row's boxes of the candidate matched to the reference's by
intersection over union, the figure the share of boxes matched."""

from __future__ import annotations

import math

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.fidelity.comparison import Figure
from nmdeploy.fidelity.registry import TaskMetric, metric

DEFAULT_BOX_IOU = 0.5
MIN_SCORE = 0.5  # a box whose fifth column (its score) is below this is no detection


def _iou_threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise ValueError("the IoU after '@' must be in (0, 1], e.g. boxes@0.5")
    return value


def detections(boxes: np.ndarray) -> np.ndarray:
    """[n, 4] corners (x1, y1, x2, y2) of one row's detections: boxes of positive area (padding rows are not) whose
    score (a fifth column, where there is one) is at least :data:`MIN_SCORE`."""
    corners = boxes[:, :4].astype(np.float64)
    keep = (corners[:, 2] > corners[:, 0]) & (corners[:, 3] > corners[:, 1])
    if boxes.shape[1] > 4:
        keep &= boxes[:, 4] >= MIN_SCORE
    return corners[keep]


def pairwise_iou(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """[len(first), len(second)] intersection over union of corner boxes."""
    low = np.maximum(first[:, None, :2], second[None, :, :2])
    high = np.minimum(first[:, None, 2:], second[None, :, 2:])
    intersection = np.clip(high - low, 0, None).prod(axis=-1)
    area = lambda boxes: (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])  # noqa: E731
    return intersection / (area(first)[:, None] + area(second)[None, :] - intersection)


def matched(reference: np.ndarray, candidate: np.ndarray, threshold: float) -> int:
    """How many boxes pair up one to one at IoU >= ``threshold``, the best-overlapping pairs first."""
    if not len(reference) or not len(candidate):
        return 0
    overlap = pairwise_iou(reference, candidate)
    rows, columns = set(), set()
    for index in np.argsort(overlap, axis=None, kind="stable")[::-1]:
        row, column = divmod(int(index), overlap.shape[1])
        if overlap[row, column] < threshold:
            break
        if row not in rows and column not in columns:
            rows.add(row)
            columns.add(column)
    return len(rows)


@metric(
    "boxes",
    help="detections [batch, boxes, 4+] (x1, y1, x2, y2[, score >= 0.5, ...]) matched one to one at IoU >= T "
    "(default 0.5): 2 x matched / (reference + candidate boxes)",
    option="T",
    default=DEFAULT_BOX_IOU,
    parse=_iou_threshold,
)
class BoxAgreement(TaskMetric):
    def __init__(self, outputs, option) -> None:
        super().__init__(outputs, option)
        self.counts = {name: [0, 0, 0] for name in self.outputs}  # matched, reference boxes, candidate boxes

    def add(self, reference, candidate, feeds, axes) -> None:
        for name in self.outputs:
            expected, actual = np.asarray(reference[name]), np.asarray(candidate[name])
            if expected.ndim != 3 or expected.shape[-1] < 4 or axes.get(name, 0) != 0:
                raise InputError(
                    f"--metric boxes judges detections shaped [batch, boxes, 4 or more] (x1, y1, x2, y2, ...); output "
                    f"'{name}' has shape {list(expected.shape)}: name the box outputs with --outputs"
                )
            counts = self.counts[name]
            for row_expected, row_actual in zip(expected, actual, strict=True):
                first, second = detections(row_expected), detections(row_actual)
                counts[0] += matched(first, second, self.option)
                counts[1] += len(first)
                counts[2] += len(second)

    def figures(self) -> list[Figure]:
        figures = []
        for name, (pairs, expected, actual) in self.counts.items():
            problem = None if expected + actual else "neither model detected a box in any row"
            value = 2 * pairs / (expected + actual) if expected + actual else 0.0
            details = {"matched": pairs, "reference_boxes": expected, "candidate_boxes": actual}
            figures.append(Figure(name, f"boxes@{self.option:g}", value, None, problem, details))
        return figures
