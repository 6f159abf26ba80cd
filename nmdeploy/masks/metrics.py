"""Metrics that compare masks: how many positions flipped, how much of the score a mask keeps."""

from __future__ import annotations

import torch

from nmdeploy.errors import ShapeError


def _same_shape(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape:
        raise ShapeError(f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")


def sparse_architecture_divergence(before: torch.Tensor, after: torch.Tensor, *, normalize: bool = False) -> float:
    """Number of positions whose keep/prune state differs between two masks (SR-STE's SAD).

    ``normalize=True`` divides by the number of elements, which makes layers of different sizes comparable.
    """
    _same_shape(before, after, "sparse architecture divergence")
    flips = int((before.bool() ^ after.bool()).sum())
    return flips / before.numel() if normalize else float(flips)


def retained_score_fraction(mask: torch.Tensor, scores: torch.Tensor) -> float:
    """Fraction of the total score that ``mask`` keeps (1.0 for an all-zero score, where nothing is lost)."""
    _same_shape(mask, scores, "retained score fraction")
    # torch sums floating-point tensors pairwise, so fp32 accumulation is accurate enough for a fraction.
    total = float(scores.sum())
    kept = float(scores.masked_fill(~mask.bool(), 0).sum())
    return kept / total if total else 1.0
