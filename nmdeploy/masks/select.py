"""1-D N:M selection: keep the N highest-scoring elements of every group of M along one axis."""

from __future__ import annotations

import torch

from nmdeploy.masks.arrays import RANK_BY_COMPARISON_MAX_M, nm_keep, rank_by_comparison, topn_along
from nmdeploy.masks.groups import (
    check_remainder,
    cpu_array,
    normalize_axis,
    scores_as_float,
    split_groups,
    tail_mask,
    to_groups,
)
from nmdeploy.masks.pattern import Pattern, PatternLike
from nmdeploy.masks.scoring import Score, magnitude, resolve_scores


def topn_in_groups(grouped_scores: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    """Boolean mask keeping the N highest along ``dim`` (of size M); ties go to the lower index.

    CPU tensors are ranked by :mod:`nmdeploy.masks.arrays` on their memory (numpy's compare loops are several times
    faster than torch's there); tensors numpy cannot share (other devices, bfloat16) by the same pairwise comparison
    in torch for M <= 4, or a stable descending sort, which orders ties the same way.
    """
    m = grouped_scores.shape[dim]
    array = cpu_array(grouped_scores)
    if array is not None:
        return torch.from_numpy(topn_along(array, n, dim % array.ndim))
    if m <= RANK_BY_COMPARISON_MAX_M:
        return torch.stack(rank_by_comparison(list(grouped_scores.unbind(dim)), n), dim=dim)
    # torch.topk does not promise any order among ties; a stable sort does.
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
    if score is magnitude and pattern.m <= RANK_BY_COMPARISON_MAX_M:
        keep = _magnitude_fast_path(tensor, pattern, axis)
        if keep is not None:
            return keep
    scores = scores_as_float(resolve_scores(tensor, score))
    split = split_groups(scores, pattern.m, axis) if scores.ndim else None
    if split is not None:
        return topn_in_groups(split[0], pattern.n, dim=split[1]).reshape(scores.shape)
    grouped, view = to_groups(scores, pattern, axis, remainder, fill=float("-inf"))
    # Contiguous, because callers apply the mask elementwise and strided boolean masks are several times slower.
    keep = view.ungroup(topn_in_groups(grouped, pattern.n)).contiguous()
    if remainder == "dense":
        tail = tail_mask(view, keep.device)
        if tail is not None:
            keep = keep | tail.reshape([-1 if d == view.axis else 1 for d in range(keep.ndim)])
    return keep


def _magnitude_fast_path(tensor: torch.Tensor, pattern: Pattern, axis: int) -> torch.Tensor | None:
    """:func:`nm_mask` by magnitude of a float32/float64 CPU tensor that M divides, with ``abs`` folded into the
    copy that makes the members contiguous; None where it does not apply."""
    array = cpu_array(tensor) if tensor.dtype in (torch.float32, torch.float64) and tensor.ndim else None
    if array is None or array.shape[normalize_axis(axis, array.ndim)] % pattern.m:
        return None
    return torch.from_numpy(nm_keep(array, pattern, axis, absolute=True))


def as_float(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A boolean mask as 0.0/1.0 in ``dtype``. Converted through its bytes: on the CPU torch converts uint8 several
    times faster than bool."""
    return mask.view(torch.uint8).to(dtype)


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
