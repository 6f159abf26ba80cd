"""1-D N:M selection and the N:M checks on numpy arrays: the one implementation of the ranking and the counting.

``select.py`` and ``check.py`` hand CPU tensors to these functions (numpy shares their memory), and the ONNX
layers call them directly on the arrays they read from a model, so pruning and inspecting a model need no torch.
Nothing here imports torch. Ranking follows one rule everywhere: keep the N highest of each group of M, ties to the
lower index (the order of a stable descending sort), NaN refused.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from nmdeploy.errors import ShapeError
from nmdeploy.masks.groups import check_divisible, nan_scores_error, normalize_axis, row_blocks
from nmdeploy.masks.pattern import Pattern, PatternLike

RANK_BY_COMPARISON_MAX_M = 4
"""Up to this M the N kept are found by pairwise comparison (6 compares for M = 4); above it, by a stable sort."""


@dataclass(frozen=True)
class Compliance:
    """How many groups (or tiles) keep at most N non-zeros out of M."""

    compliant: int
    total: int

    @property
    def fraction(self) -> float:
        """Fraction of compliant groups; 1.0 for an empty tensor, which has nothing to violate."""
        return self.compliant / self.total if self.total else 1.0

    def __bool__(self) -> bool:
        return self.compliant == self.total


def split_axis(array: np.ndarray, m: int, axis: int) -> tuple[np.ndarray, int]:
    """``array`` as ``[..., L/M, M, ...]`` with ``axis`` split in place, and the index of the M dimension (a view
    when the array is C-contiguous). The caller has checked that M divides the axis."""
    shape = array.shape
    return np.ascontiguousarray(array).reshape(*shape[:axis], shape[axis] // m, m, *shape[axis + 1 :]), axis + 1


def as_float_scores(scores: np.ndarray) -> np.ndarray:
    """Scores in float32 (float64 stays float64): ranks are taken in the same precision whatever the weight dtype."""
    return scores if scores.dtype in (np.float32, np.float64) else scores.astype(np.float32)


def _checked_groups(array: np.ndarray, pattern: PatternLike, axis: int) -> tuple[Pattern, int]:
    """The parsed pattern and the non-negative axis, once M is known to divide it (the one error otherwise)."""
    pattern = Pattern.parse(pattern)
    if array.ndim == 0:
        raise ShapeError("cannot group a scalar; N:M patterns need at least one axis")
    axis = normalize_axis(axis, array.ndim)
    check_divisible(array.shape[axis], pattern, axis, "error")
    return pattern, axis


def nm_keep(scores: np.ndarray, pattern: PatternLike = "2:4", axis: int = -1, *, absolute: bool = False) -> np.ndarray:
    """Boolean N:M keep mask of ``scores`` (their magnitudes when ``absolute``) along ``axis``, same shape.

    M must divide the axis (the one error message otherwise); NaN is refused. Works block by block of whole rows,
    so that the copy that makes each group's members contiguous and the compares on them stay in cache.
    """
    pattern, axis = _checked_groups(scores, pattern, axis)
    grouped, dim = split_axis(as_float_scores(scores), pattern.m, axis)
    keep = np.empty(grouped.shape, dtype=bool)
    # Axis 0 never holds the members (dim >= 1), so blocks of rows cut no group.
    for rows in row_blocks(grouped.shape):
        block = grouped[rows]
        # max() propagates NaN: one reduction instead of a full-size boolean array.
        if block.size and np.isnan(block.max()):
            raise nan_scores_error()
        topn_along(block, pattern.n, dim, absolute=absolute, out=keep[rows])
    return keep.reshape(scores.shape)


def topn_along(
    grouped: np.ndarray, n: int, dim: int, *, absolute: bool = False, out: np.ndarray | None = None
) -> np.ndarray:
    """Boolean mask keeping the N highest (by magnitude when ``absolute``) along ``dim``, of size M; ties go to the
    lower index. Written into ``out`` when given. No NaN check: callers refuse NaN first."""
    m = grouped.shape[dim]
    if m <= RANK_BY_COMPARISON_MAX_M:
        # The members made contiguous, each one a [...] array: numpy's compare loops are several times faster on
        # contiguous operands than on stride-M views, which more than pays for this one copy.
        moved = np.moveaxis(grouped, dim, 0)
        members = np.abs(moved, order="C") if absolute else np.ascontiguousarray(moved)
        return np.stack(rank_by_comparison(list(members), n), axis=dim, out=out)
    # Above M = 4 the pairs outnumber a sort's work. A stable ascending sort of the groups reversed puts equal
    # scores last-index first; read backwards it is a stable descending sort: ties to the lower index.
    moved = np.moveaxis(grouped, dim, -1)
    groups = np.abs(moved, order="C") if absolute else np.ascontiguousarray(moved)
    ascending = np.argsort(groups[..., ::-1], axis=-1, kind="stable")
    kept = (m - 1) - ascending[..., ::-1][..., :n]
    keep = np.zeros(groups.shape, dtype=bool)
    np.put_along_axis(keep, kept, True, axis=-1)
    if out is None:
        return np.ascontiguousarray(np.moveaxis(keep, -1, dim))
    out[...] = np.moveaxis(keep, -1, dim)
    return out


def rank_by_comparison(members: list[Any], n: int) -> list[Any]:
    """Keep flags of each of the M members (boolean arrays, numpy or torch): kept when fewer than N rivals beat it.

    A later rival beats a member when strictly higher, an earlier one when at least as high, so ties go to the lower
    index. One compare per pair settles both directions (6 for M = 4), and the count test is a short boolean
    formula, so there is no sort and no integer counter. Only operators are used, so torch tensors on other devices
    are ranked by this same code.
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


def nonzero(array: np.ndarray) -> np.ndarray:
    """Boolean non-zero positions (a bool array is read as a mask; NaN counts as non-zero)."""
    return array if array.dtype == np.bool_ else array != 0


def _fold(array: np.ndarray, axis: int, combine: np.ufunc, dtype: type[np.generic]) -> np.ndarray:
    """``array`` reduced over its short ``axis`` by ``combine``, one whole-array operation per position along it.

    numpy's reductions over a short axis (the M of a group) run an inner loop of M per output element; M slices
    combined elementwise into an accumulator of the narrowest type run several times faster.
    """
    index: list[Any] = [slice(None)] * array.ndim
    index[axis] = 0
    result = array[tuple(index)].astype(dtype)
    for k in range(1, array.shape[axis]):
        index[axis] = k
        combine(result, array[tuple(index)], out=result)
    return result


def _counts(flags: np.ndarray, axis: int, m: int) -> np.ndarray:
    """Non-zeros per group along ``axis`` of a boolean array, counted in the narrowest integer that holds M."""
    counter = np.uint8 if m < 256 else np.int32
    return _fold(flags.view(np.uint8), axis, np.add, counter)


def nm_compliance(array: np.ndarray, pattern: PatternLike = "2:4", axis: int = -1) -> Compliance:
    """Groups of M along ``axis`` with at most N non-zeros; M must divide the axis."""
    pattern, axis = _checked_groups(array, pattern, axis)
    grouped, dim = split_axis(nonzero(array), pattern.m, axis)
    counts = _counts(grouped, dim, pattern.m)
    return Compliance(int(np.count_nonzero(counts <= pattern.n)), counts.size)


def transposable_compliance(
    array: np.ndarray, pattern: PatternLike = "2:4", *, axis: int = -1, out_axis: int = -2
) -> Compliance:
    """M x M tiles over (``out_axis``, ``axis``) whose every row and column has at most N non-zeros; M must divide
    both axes. Other axes are a batch of matrices."""
    pattern = Pattern.parse(pattern)
    if array.ndim < 2:
        raise ShapeError(f"a transposable pattern needs a matrix, got a tensor of rank {array.ndim}")
    axis, out_axis = normalize_axis(axis, array.ndim), normalize_axis(out_axis, array.ndim)
    if axis == out_axis:
        raise ShapeError(f"the reduction axis and the output axis must differ, both are {axis}")
    check_divisible(array.shape[axis], pattern, axis, "error", what="reduction axis")
    check_divisible(array.shape[out_axis], pattern, out_axis, "error", what="output axis")
    m, n = pattern.m, pattern.n
    matrix = np.ascontiguousarray(np.moveaxis(nonzero(array), (out_axis, axis), (-2, -1)))
    rows, cols = matrix.shape[-2:]
    # [..., tile row, output channel in the tile, tile column, reduction element in the tile]
    tiles = matrix.reshape(*matrix.shape[:-2], rows // m, m, cols // m, m)
    rows_ok = _fold(_counts(tiles, -1, m) <= n, -2, np.logical_and, np.bool_)
    cols_ok = _fold(_counts(tiles, -3, m) <= n, -1, np.logical_and, np.bool_)
    ok = rows_ok & cols_ok
    return Compliance(int(np.count_nonzero(ok)), ok.size)
