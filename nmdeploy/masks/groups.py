"""Views of a tensor as groups of M consecutive elements along one axis, and back.

Every 1-D N:M operation (selection, checking, MVUE sampling) works on a ``[..., groups, M]`` view made here,
so axis handling and the policy for lengths that M does not divide live in one place. The axis, remainder and
block helpers serve numpy arrays too (``nmdeploy.masks.arrays``), so torch is imported only by the functions that
take tensors: pruning and inspecting an ONNX model never load it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from nmdeploy.errors import InputError, ShapeError
from nmdeploy.masks.pattern import Pattern

if TYPE_CHECKING:
    import numpy as np
    import torch

Remainder = Literal["error", "dense", "pad"]
"""What to do when M does not divide the grouped axis.

``"error"`` refuses; ``"dense"`` leaves the trailing partial group untouched (all kept, not checked);
``"pad"`` treats it as a group padded with zeros, so it keeps at most N of its elements.
"""

REMAINDER_POLICIES: tuple[str, ...] = ("error", "dense", "pad")


def normalize_axis(axis: int, ndim: int) -> int:
    """Return ``axis`` as a non-negative index, or raise a ShapeError naming the rank."""
    if not -ndim <= axis < ndim:
        raise ShapeError(f"axis {axis} is out of range for a tensor of rank {ndim}")
    return axis % ndim


def check_remainder(remainder: str) -> None:
    if remainder not in REMAINDER_POLICIES:
        raise ShapeError(f"unknown remainder policy {remainder!r}; choose one of {', '.join(REMAINDER_POLICIES)}")


def check_divisible(length: int, pattern: Pattern, axis: int, remainder: str, what: str = "axis") -> None:
    """Raise the one error message for an axis that M does not divide under the "error" policy."""
    check_remainder(remainder)
    if length % pattern.m and remainder == "error":
        raise ShapeError(
            f"pattern {pattern} needs the length of {what} {axis} to be a multiple of {pattern.m}, got {length}; "
            f"pass remainder='dense' or remainder='pad' to allow it"
        )


def nan_scores_error() -> InputError:
    return InputError("scores contain NaN; fix or drop the NaN weights before computing an N:M mask")


def cpu_array(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU tensor's memory, or None where numpy cannot share it (other devices, bfloat16).

    Selection and checking hand such views to :mod:`nmdeploy.masks.arrays`: on the CPU numpy's compare and count
    loops are several times faster than torch's.
    """
    import torch

    if tensor.device.type != "cpu" or tensor.dtype in (torch.bfloat16, torch.complex32) or tensor.is_conj():
        return None
    return tensor.detach().numpy()


def scores_as_float(scores: torch.Tensor) -> torch.Tensor:
    """Scores in fp32 (fp64 stays fp64), refusing NaN: a NaN score cannot be ranked."""
    import torch

    if not torch.is_floating_point(scores) or scores.dtype != torch.float64:
        scores = scores.to(torch.float32)
    # max() propagates NaN: one reduction instead of a full-size boolean tensor and a second pass over it.
    if scores.numel() and bool(torch.isnan(scores.max())):
        raise nan_scores_error()
    return scores


CACHE_BLOCK_ELEMENTS = 1 << 18
"""Elementwise pipelines of many short passes (mask selection, MVUE) run on blocks of about this many elements
(1 MiB of float32) on the CPU, so that the intermediates stay in cache between passes."""


def row_blocks(shape: Sequence[int]) -> list[slice]:
    """Slices of axis 0 of a tensor of ``shape`` that cut it into blocks of whole rows of about
    :data:`CACHE_BLOCK_ELEMENTS` elements (at least one row each)."""
    if not shape:
        return [slice(None)]
    rows = max(1, CACHE_BLOCK_ELEMENTS // max(1, math.prod(shape[1:])))
    return [slice(start, start + rows) for start in range(0, max(shape[0], 1), rows)]


def split_groups(tensor: torch.Tensor, m: int, axis: int) -> tuple[torch.Tensor, int] | None:
    """``tensor`` as ``[..., L/M, M, ...]`` with ``axis`` split in place, and the index of the M dimension; None
    when M does not divide the axis.

    Splitting in place is a view of contiguous memory whatever the axis, so nothing is copied, and reducing over
    the M dimension of it runs many times faster than over a trailing dimension of size M.
    """
    if tensor.ndim == 0:
        raise ShapeError("cannot group a scalar; N:M patterns need at least one axis")
    axis = normalize_axis(axis, tensor.ndim)
    shape = tensor.shape
    if shape[axis] % m:
        return None
    return tensor.contiguous().reshape(*shape[:axis], shape[axis] // m, m, *shape[axis + 1 :]), axis + 1


@dataclass(frozen=True)
class GroupedView:
    """How a tensor was turned into ``[rest, groups, M]`` so the result can be turned back."""

    shape: torch.Size
    axis: int
    length: int
    m: int

    @property
    def padded_length(self) -> int:
        return -(-self.length // self.m) * self.m

    def ungroup(self, grouped: torch.Tensor) -> torch.Tensor:
        """Inverse of :func:`to_groups` for a tensor of the grouped shape (the padding is cut off)."""
        moved_shape = list(self.shape)
        del moved_shape[self.axis]
        flat = grouped.reshape(*moved_shape, self.padded_length)[..., : self.length]
        return flat.movedim(-1, self.axis)


def to_groups(
    tensor: torch.Tensor, pattern: Pattern, axis: int, remainder: str = "error", fill: float = 0.0
) -> tuple[torch.Tensor, GroupedView]:
    """View ``tensor`` as ``[..., groups, M]`` along ``axis``, padding a partial group with ``fill``."""
    import torch

    if tensor.ndim == 0:
        raise ShapeError("cannot group a scalar; N:M patterns need at least one axis")
    axis = normalize_axis(axis, tensor.ndim)
    length = tensor.shape[axis]
    check_divisible(length, pattern, axis, remainder)
    view = GroupedView(tensor.shape, axis, length, pattern.m)
    moved = tensor.movedim(axis, -1)
    pad = view.padded_length - length
    if pad:
        moved = torch.nn.functional.pad(moved, (0, pad), value=fill)
    return moved.reshape(*moved.shape[:-1], view.padded_length // pattern.m, pattern.m), view


def tail_mask(view: GroupedView, device: torch.device) -> torch.Tensor | None:
    """Boolean ``[length]`` marking positions in the trailing partial group, or None when M divides the axis."""
    import torch

    full = (view.length // view.m) * view.m
    if full == view.length:
        return None
    positions = torch.arange(view.length, device=device)
    return positions >= full
