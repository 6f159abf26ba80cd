"""1-D N:M selection: keep the N highest-scoring elements of every group of M along one axis."""

from __future__ import annotations

import torch

from nmdeploy.masks.groups import check_remainder, normalize_axis, scores_as_float, tail_mask, to_groups
from nmdeploy.masks.pattern import Pattern, PatternLike
from nmdeploy.masks.scoring import Score, magnitude, resolve_scores

_RANK_BY_COMPARISON_MAX_M = 4


def topn_in_groups(grouped_scores: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    """Boolean mask keeping the N highest along ``dim`` (of size M); ties go to the lower index."""
    m = grouped_scores.shape[dim]
    if m <= _RANK_BY_COMPARISON_MAX_M:
        # Rank by counting, for each element, the elements that beat it: a later element beats it when strictly
        # higher, an earlier one when at least as high. One compare per pair settles both directions, so M = 4
        # needs 6 compares instead of a sort (about 3x faster).
        beaten_by = torch.zeros(grouped_scores.shape, dtype=torch.uint8, device=grouped_scores.device)
        for first in range(m):
            for second in range(first + 1, m):
                second_wins = grouped_scores.select(dim, second) > grouped_scores.select(dim, first)
                beaten_by.select(dim, first).add_(second_wins)
                beaten_by.select(dim, second).add_(~second_wins)
        return beaten_by < n
    # A stable descending sort keeps equal scores in index order, which makes tie-breaking deterministic
    # (torch.topk does not promise any order among ties).
    order = torch.sort(grouped_scores, dim=dim, descending=True, stable=True).indices
    keep = torch.zeros_like(grouped_scores, dtype=torch.bool)
    return keep.scatter_(dim, order.narrow(dim, 0, n), True)


def nm_mask(
    tensor: torch.Tensor,
    pattern: PatternLike = "2:4",
    axis: int = -1,
    *,
    score: Score = magnitude,
    remainder: str = "error",
) -> torch.Tensor:
    """N:M mask along ``axis``: True where an element is kept.

    ``score`` ranks the elements (magnitude by default, or any score tensor of the same shape).
    ``remainder`` decides what happens when M does not divide the axis: see :data:`groups.Remainder`.
    """
    pattern = Pattern.parse(pattern)
    check_remainder(remainder)
    scores = scores_as_float(resolve_scores(tensor, score))
    if scores.ndim and scores.shape[normalize_axis(axis, scores.ndim)] % pattern.m == 0:
        # Splitting the axis in place ([..., L/M, M, ...]) is a view, so no copy is made whatever the axis.
        axis = normalize_axis(axis, scores.ndim)
        shape = scores.shape
        split = scores.contiguous().reshape(*shape[:axis], shape[axis] // pattern.m, pattern.m, *shape[axis + 1 :])
        return topn_in_groups(split, pattern.n, dim=axis + 1).reshape(shape)
    grouped, view = to_groups(scores, pattern, axis, remainder, fill=float("-inf"))
    # Contiguous, because callers apply the mask elementwise and strided boolean masks are several times slower.
    keep = view.ungroup(topn_in_groups(grouped, pattern.n)).contiguous()
    if remainder == "dense":
        tail = tail_mask(view, keep.device)
        if tail is not None:
            keep = keep | tail.reshape([-1 if d == view.axis else 1 for d in range(keep.ndim)])
    return keep


def apply_nm(
    tensor: torch.Tensor,
    pattern: PatternLike = "2:4",
    axis: int = -1,
    *,
    score: Score = magnitude,
    remainder: str = "error",
) -> torch.Tensor:
    """``tensor`` with everything outside its N:M mask set to zero (same dtype)."""
    return tensor.masked_fill(~nm_mask(tensor, pattern, axis, score=score, remainder=remainder), 0)
