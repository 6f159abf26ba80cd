"""Checks: does a tensor already follow an N:M (or transposable N:M) pattern, and how much of it does?"""

from __future__ import annotations

import torch

from nmdeploy.errors import ShapeError
from nmdeploy.masks.arrays import Compliance, nm_compliance, transposable_compliance
from nmdeploy.masks.groups import cpu_array, normalize_axis, split_groups, to_groups
from nmdeploy.masks.pattern import Pattern, PatternLike
from nmdeploy.masks.tiles import to_tiles


def _count_dtype(pattern: Pattern) -> torch.dtype:
    # Counting in the narrowest type that holds M is several times faster than torch's default int64 sum.
    return torch.uint8 if pattern.m < 256 else torch.int32


def _nonzero(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype == torch.bool else tensor != 0


def is_nm(
    tensor: torch.Tensor, pattern: PatternLike = "2:4", axis: int = -1, *, remainder: str = "error"
) -> Compliance:
    """Count the groups of M along ``axis`` with at most N non-zeros (a bool tensor is read as a mask).

    NaN counts as non-zero. With ``remainder="dense"`` the partial tail group is not counted; with ``"pad"`` it is
    checked as if padded with zeros.
    """
    pattern = Pattern.parse(pattern)
    array = cpu_array(tensor)
    if array is not None and array.ndim and not array.shape[normalize_axis(axis, array.ndim)] % pattern.m:
        return nm_compliance(array, pattern, axis)
    nonzero = _nonzero(tensor)
    split = split_groups(nonzero, pattern.m, axis) if nonzero.ndim else None
    if split is not None:  # M divides the axis: count on an in-place split, no copy into [rest, groups, M]
        grouped, m_dim = split
        counts = grouped.sum(dim=m_dim, dtype=_count_dtype(pattern))
        return Compliance(int((counts <= pattern.n).sum()), counts.numel())
    grouped, view = to_groups(nonzero, pattern, axis, remainder, fill=False)
    counts = grouped.sum(dim=-1, dtype=_count_dtype(pattern))
    if remainder == "dense" and view.length % pattern.m:
        counts = counts[..., :-1]
    return Compliance(int((counts <= pattern.n).sum()), counts.numel())


def is_transposable(
    tensor: torch.Tensor,
    pattern: PatternLike = "2:4",
    *,
    axis: int = -1,
    out_axis: int = -2,
    remainder: str = "error",
) -> Compliance:
    """Count the M x M tiles over (``out_axis``, ``axis``) whose every row and column has at most N non-zeros.

    Such a tensor is N:M along its reduction axis and its transpose is N:M along the output axis, so one mask
    serves both the forward GEMM and the input-gradient GEMM. Other axes are treated as a batch of matrices.
    """
    pattern = Pattern.parse(pattern)
    if tensor.ndim < 2:
        raise ShapeError(f"a transposable pattern needs a matrix, got a tensor of rank {tensor.ndim}")
    array = cpu_array(tensor)
    if array is not None and remainder == "error":
        return transposable_compliance(array, pattern, axis=axis, out_axis=out_axis)
    tiles, view = to_tiles(_nonzero(tensor), pattern, axis=axis, out_axis=out_axis, remainder=remainder, fill=False)
    count_dtype = _count_dtype(pattern)
    ok = (tiles.sum(dim=-1, dtype=count_dtype) <= pattern.n).all(dim=-1) & (
        tiles.sum(dim=-2, dtype=count_dtype) <= pattern.n
    ).all(dim=-1)
    if remainder == "dense":
        ok = ok[~view.partial_tiles(ok.device)]
    return Compliance(int(ok.sum()), ok.numel())
