"""The built-in output measures: each judges one output from its :class:`OutputComparison`."""

from __future__ import annotations

import math

from nmdeploy.fidelity.comparison import FEW_VALUES, Figure, OutputComparison
from nmdeploy.fidelity.registry import metric

DEFAULT_IOU_THRESHOLD = 0.5


@metric(
    "auto",
    help="what fits each output: next-token perplexity (as --metric perplexity) of a causal language model's "
    "logits; per-row cosine of other wide outputs; spread for outputs of fewer than "
    f"{FEW_VALUES} values per row, rows that all point one way, and probability maps",
)
def auto(comparison: OutputComparison, option: None) -> Figure:
    return comparison.auto_figure()


@metric("cosine", help=f"mean per-row cosine (refused on rows of fewer than {FEW_VALUES} values)")
def cosine(comparison: OutputComparison, option: None) -> Figure:
    return comparison.cosine_figure()


@metric("spread", help="1 - MSE / (2 Var(reference)), the variance across rows: judged across the batch")
def spread(comparison: OutputComparison, option: None) -> Figure:
    return comparison.spread_figure()


@metric("top1", help="top-1 agreement of class-score outputs (Softmax, or a final linear layer)")
def top1(comparison: OutputComparison, option: None) -> Figure:
    return comparison.top1_figure()


def _threshold(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ValueError("the threshold after '@' must be a number, e.g. mask-iou@0.3")
    return value


@metric(
    "mask-iou",
    help="IoU of the outputs thresholded at T (default 0.5)",
    option="T",
    default=DEFAULT_IOU_THRESHOLD,
    parse=_threshold,
)
def mask_iou(comparison: OutputComparison, option: float) -> Figure:
    return comparison.mask_iou_figure()
