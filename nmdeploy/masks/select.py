"""1-D N:M selection: keep the N highest-scoring elements of every group of M along one axis."""

from __future__ import annotations

import functools
import operator
from typing import Any

import numpy as np
import torch

from nmdeploy.masks.groups import (
    check_remainder,
    nan_scores_error,
    row_blocks,
    scores_as_float,
    split_groups,
    tail_mask,
    to_groups,
)
from nmdeploy.masks.pattern import Pattern, PatternLike
from nmdeploy.masks.scoring import Score, magnitude, resolve_scores

_RANK_BY_COMPARISON_MAX_M = 4


def topn_in_groups(grouped_scores: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    """Boolean mask keeping the N highest along ``dim`` (of size M); ties go to the lower index."""
    m = grouped_scores.shape[dim]
    if m <= _RANK_BY_COMPARISON_MAX_M:
        array = _cpu_numpy(grouped_scores)
        if array is not None:
            return _topn_of_members(_contiguous_members(array, dim), n, dim)
        return torch.stack(_rank_by_comparison(list(grouped_scores.unbind(dim)), n), dim=dim)
    # A stable descending sort keeps equal scores in index order, which makes tie-breaking deterministic
    # (torch.topk does not promise any order among ties).
    order = torch.sort(grouped_scores, dim=dim, descending=True, stable=True).indices
    keep = torch.zeros_like(grouped_scores, dtype=torch.bool)
    return keep.scatter_(dim, order.narrow(dim, 0, n), True)


def _contiguous_members(array: np.ndarray, dim: int, absolute: bool = False) -> np.ndarray:
    """``array`` (or its magnitude) as ``[M, ...]``, the M members along ``dim`` each contiguous.

    On the CPU numpy's compare loops are several times faster than torch's, and several times faster again on
    contiguous operands than on the stride-M views of the members, which more than pays for this one copy.
    """
    moved = np.moveaxis(array, dim, 0)
    if absolute:
        return np.abs(moved, order="C")
    return np.ascontiguousarray(moved)


def _topn_of_members(members: np.ndarray, n: int, dim: int) -> torch.Tensor:
    """The keep mask of ``[M, ...]`` members, stacked back along ``dim``."""
    return torch.from_numpy(np.stack(_rank_by_comparison(list(members), n), axis=dim))


def _rank_by_comparison(members: list[Any], n: int) -> list[Any]:
    """Keep flags of each of the M members (boolean arrays, numpy or torch): kept when fewer than N rivals beat it.

    A later rival beats a member when strictly higher, an earlier one when at least as high, so ties go to the lower
    index. One compare per pair settles both directions (6 for M = 4), and the count test is a short boolean
    formula, so there is no sort and no integer counter.
    """
    m = len(members)
    beaten_by: list[list[Any]] = [[] for _ in range(m)]
    for first in range(m):
        for second in range(first + 1, m):
            second_wins = members[second] > members[first]
            beaten_by[first].append(second_wins)
            beaten_by[second].append(~second_wins)
    return [_fewer_than(n, flags) for flags in beaten_by]


def _fewer_than(n: int, flags: list[Any]) -> Any:
    """Where fewer than ``n`` of the boolean ``flags`` are set (at most 3 flags, as M <= 4)."""
    if n > len(flags):
        return flags[0] | ~flags[0]
    if n == 1:  # none set
        return ~functools.reduce(operator.or_, flags)
    if n == len(flags):  # not all set
        return ~functools.reduce(operator.and_, flags)
    # n == 2 of 3 flags: kept unless the majority is set.
    first, second, third = flags
    return ~((first & (second | third)) | (second & third))


def _cpu_numpy(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU tensor's memory, or None where numpy cannot share it (other devices, bfloat16)."""
    if tensor.device.type != "cpu" or tensor.dtype in (torch.bfloat16, torch.complex32) or tensor.is_conj():
        return None
    return tensor.detach().numpy()


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
    if score is magnitude and pattern.m <= _RANK_BY_COMPARISON_MAX_M:
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
    array = _cpu_numpy(tensor) if tensor.dtype in (torch.float32, torch.float64) and tensor.ndim else None
    if array is None:
        return None
    split = split_groups(torch.from_numpy(array), pattern.m, axis)
    if split is None:
        return None
    grouped, dim = split
    grouped_array = grouped.numpy()
    keep = np.empty(grouped_array.shape, dtype=bool)
    # Block by block (axis 0 never holds the members: dim >= 1), so that the copy and the compares stay in cache.
    for rows in row_blocks(grouped_array.shape):
        members = _contiguous_members(grouped_array[rows], dim, absolute=True)
        if members.size and np.isnan(members.max()):
            raise nan_scores_error()
        np.stack(_rank_by_comparison(list(members), pattern.n), axis=dim, out=keep[rows])
    return torch.from_numpy(keep).reshape(tensor.shape)


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
