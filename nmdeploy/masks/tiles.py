"""Views of a matrix (or a batch of matrices) as M x M tiles over (output axis, reduction axis), and back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nmdeploy.errors import ShapeError
from nmdeploy.masks.groups import check_divisible, normalize_axis
from nmdeploy.masks.pattern import Pattern


@dataclass(frozen=True)
class TiledView:
    """How a tensor became ``[tiles, M, M]`` (tile rows follow the output axis, tile columns the reduction axis)."""

    shape: torch.Size
    axis: int
    out_axis: int
    m: int
    batch_shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.shape[self.out_axis]

    @property
    def cols(self) -> int:
        return self.shape[self.axis]

    @property
    def padded(self) -> tuple[int, int]:
        return -(-self.rows // self.m) * self.m, -(-self.cols // self.m) * self.m

    def partial_tiles(self, device: torch.device) -> torch.Tensor:
        """Boolean ``[tiles]``: True for tiles that reach into the padding."""
        rows_p, cols_p = self.padded
        row_partial = torch.arange(rows_p // self.m, device=device) * self.m + self.m > self.rows
        col_partial = torch.arange(cols_p // self.m, device=device) * self.m + self.m > self.cols
        grid = row_partial[:, None] | col_partial[None, :]
        batch = 1
        for size in self.batch_shape:
            batch *= size
        return grid.reshape(1, -1).expand(batch, -1).reshape(-1)

    def untile(self, tiles: torch.Tensor) -> torch.Tensor:
        """Inverse of :func:`to_tiles` (padding is cut off)."""
        rows_p, cols_p = self.padded
        m = self.m
        grid = tiles.reshape(*self.batch_shape, rows_p // m, cols_p // m, m, m).transpose(-3, -2)
        matrix = grid.reshape(*self.batch_shape, rows_p, cols_p)[..., : self.rows, : self.cols]
        return matrix.movedim((-2, -1), (self.out_axis, self.axis))


def to_tiles(
    tensor: torch.Tensor, pattern: Pattern, *, axis: int, out_axis: int, remainder: str = "error", fill: float = 0.0
) -> tuple[torch.Tensor, TiledView]:
    """Split ``tensor`` into ``[tiles, M, M]`` blocks of M output channels by M reduction-axis elements."""
    if tensor.ndim < 2:
        raise ShapeError(f"M x M tiles need a matrix, got a tensor of rank {tensor.ndim}")
    axis = normalize_axis(axis, tensor.ndim)
    out_axis = normalize_axis(out_axis, tensor.ndim)
    if axis == out_axis:
        raise ShapeError(f"the reduction axis and the output axis must differ, both are {axis}")
    check_divisible(tensor.shape[axis], pattern, axis, remainder, what="reduction axis")
    check_divisible(tensor.shape[out_axis], pattern, out_axis, remainder, what="output axis")
    matrix = tensor.movedim((out_axis, axis), (-2, -1))
    view = TiledView(tensor.shape, axis, out_axis, pattern.m, tuple(matrix.shape[:-2]))
    rows_p, cols_p = view.padded
    if (rows_p, cols_p) != (view.rows, view.cols):
        matrix = torch.nn.functional.pad(matrix, (0, cols_p - view.cols, 0, rows_p - view.rows), value=fill)
    m = pattern.m
    grid = matrix.reshape(*view.batch_shape, rows_p // m, m, cols_p // m, m).transpose(-3, -2)
    return grid.reshape(-1, m, m), view
