"""Block-diagonal input statistics: the stated approximation for layers whose full H = X^T X exceeds the budget.

Only the second moments within blocks of B consecutive input columns are kept (B a multiple of M, the last block
possibly shorter): K * B numbers instead of K^2. The fit then treats the blocks as independent layers: a pruned
column's error is compensated only by columns of its own block, and the shifted target of each block is solved
against its own moments (the cross moments X~^T (X W^T) stay exact, [K, out]). The damping ridge is the whole
layer's (mean of the full diagonal), so with B = K every function here is exactly its full-statistics counterpart.
:func:`block_diagonal_cost` measures what the approximation costs on a layer whose full H is known.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from nmdeploy.errors import ShapeError
from nmdeploy.masks.reconstruct import (
    SparseGptFit,
    damping_ridge,
    reconstruction_error,
    refit,
    shifted_target,
    sparsegpt_fit,
)


class BlockDiagonal:
    """Within-block second moments of a [rows, K] input, accumulated in place: ``blocks`` [K // B, B, B] and the
    shorter last block ``rest``."""

    def __init__(self, k: int, block: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None):
        if not 0 < block <= k:
            raise ShapeError(f"block size {block} must be in 1..K = {k}")
        self.k, self.block = k, block
        whole = k // block
        self.blocks = torch.zeros(whole, block, block, dtype=dtype, device=device)
        rest = k - whole * block
        self.rest = torch.zeros(rest, rest, dtype=dtype, device=device)

    @classmethod
    def from_full(cls, hessian: torch.Tensor, block: int) -> BlockDiagonal:
        """The diagonal blocks of a full H (to measure the approximation against it)."""
        stats = cls(hessian.shape[0], block, hessian.dtype, hessian.device)
        for index, (start, end) in enumerate(stats.spans()):
            stats.matrix(index).copy_(hessian[start:end, start:end])
        return stats

    @property
    def dtype(self) -> torch.dtype:
        return self.blocks.dtype

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the H these blocks approximate."""
        return (self.k, self.k)

    @property
    def nbytes(self) -> int:
        return (self.blocks.numel() + self.rest.numel()) * self.blocks.element_size()

    def to(self, device: torch.device | str) -> BlockDiagonal:
        """The same statistics on ``device`` (itself where they are there already)."""
        if self.blocks.device == torch.device(device):
            return self
        moved = BlockDiagonal.__new__(BlockDiagonal)
        moved.k, moved.block = self.k, self.block
        moved.blocks, moved.rest = self.blocks.to(device), self.rest.to(device)
        return moved

    def spans(self) -> Iterator[tuple[int, int]]:
        """(start, end) of each block's columns."""
        for start in range(0, self.k, self.block):
            yield start, min(start + self.block, self.k)

    def matrix(self, index: int) -> torch.Tensor:
        """Block ``index``'s moments (a view: fits with ``overwrite`` factorise it in place)."""
        return self.blocks[index] if index < len(self.blocks) else self.rest

    def add(self, rows: torch.Tensor) -> None:
        """Accumulate X^T X of ``rows`` [n, K] within the blocks, in place."""
        if rows.ndim != 2 or rows.shape[1] != self.k:
            raise ShapeError(f"rows of shape {tuple(rows.shape)} do not have K = {self.k} columns")
        rows = rows.to(self.dtype)
        split = len(self.blocks) * self.block
        if len(self.blocks):
            grouped = rows[:, :split].reshape(rows.shape[0], len(self.blocks), self.block).transpose(0, 1)
            self.blocks.baddbmm_(grouped.mT, grouped)
        if split < self.k:
            self.rest.addmm_(rows[:, split:].T, rows[:, split:])

    def diagonal(self) -> torch.Tensor:
        """The diagonal of H (exact: every diagonal entry lies in a block)."""
        parts = [self.blocks.diagonal(dim1=1, dim2=2).reshape(-1), self.rest.diagonal()]
        return torch.cat(parts)


Statistics = torch.Tensor | BlockDiagonal
"""A layer's input statistics: the full H [K, K], or its diagonal blocks. The functions below take either: a full H
is one block of K columns."""


def _blocks(stats: Statistics) -> list[tuple[int, int, torch.Tensor]]:
    if isinstance(stats, BlockDiagonal):
        return [(start, end, stats.matrix(index)) for index, (start, end) in enumerate(stats.spans())]
    return [(0, stats.shape[0], stats)]


def saliency_blockwise(weight: torch.Tensor, stats: Statistics) -> torch.Tensor:
    """|W_ij| * sqrt(H_jj), as :func:`nmdeploy.masks.saliency` (the diagonal is exact)."""
    return weight.abs().to(torch.float32) * stats.diagonal().clamp_min(0).sqrt().to(torch.float32)


def shifted_target_blockwise(
    weight: torch.Tensor,
    stats: Statistics,
    cross_outputs: torch.Tensor,
    damping: float = 0.01,
    *,
    overwrite: bool = False,
) -> torch.Tensor:
    """:func:`nmdeploy.masks.shifted_target` from ``cross_outputs`` [K, out] with each block's own moments
    (``overwrite``: factorised in place and multiplied back, no copy)."""
    k = stats.k if isinstance(stats, BlockDiagonal) else stats.shape[0]
    if cross_outputs.shape != (k, weight.shape[0]):
        raise ShapeError(f"cross moments of shape {tuple(cross_outputs.shape)} do not match ({k}, out)")
    ridge = damping_ridge(stats.diagonal(), damping)
    target = torch.empty_like(weight)
    for start, end, matrix in _blocks(stats):
        target[:, start:end] = shifted_target(
            weight[:, start:end],
            matrix,
            None,
            damping,
            cross_outputs=cross_outputs[start:end],
            ridge=ridge,
            overwrite=overwrite,
        )
    return target


def sparsegpt_blockwise(
    weight: torch.Tensor,
    stats: Statistics,
    n: int,
    m: int,
    damping: float = 0.01,
    allowed: torch.Tensor | None = None,
    *,
    overwrite: bool = False,
    round_kept: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> SparseGptFit:
    """The SparseGPT sweep block by block; errors are on the block-diagonal statistics (what the fit knows).

    ``overwrite`` factorises the blocks in place (the statistics are used up); ``round_kept`` as
    :func:`nmdeploy.masks.reconstruct.sparsegpt_fit`'s."""
    if isinstance(stats, BlockDiagonal) and stats.block % m:
        raise ShapeError(f"block size {stats.block} must be a multiple of M = {m}")
    ridge = damping_ridge(stats.diagonal(), damping)
    result = torch.empty_like(weight)
    masked = converted = 0.0
    precision = stats.dtype
    for start, end, matrix in _blocks(stats):
        part = None if allowed is None else allowed[:, start:end]
        fit = sparsegpt_fit(
            weight[:, start:end],
            matrix,
            n,
            m,
            damping,
            allowed=part,
            ridge=ridge,
            overwrite=overwrite,
            round_kept=round_kept,
        )
        result[:, start:end] = fit.weight
        masked += fit.error_masked
        converted += fit.error_converted
        precision = torch.float64 if fit.precision == torch.float64 else fit.precision
    return SparseGptFit(result, masked, converted, precision)


def refit_blockwise(weight: torch.Tensor, keep: torch.Tensor, stats: Statistics, damping: float = 0.01):
    """:func:`nmdeploy.masks.refit` with each block's kept weights fitted to that block's part of the outputs."""
    ridge = damping_ridge(stats.diagonal(), damping)
    result = torch.empty_like(weight)
    for start, end, matrix in _blocks(stats):
        result[:, start:end] = refit(weight[:, start:end], keep[:, start:end], matrix, ridge=ridge)
    return result


def alps_blockwise(
    weight: torch.Tensor,
    stats: Statistics,
    n: int,
    m: int,
    damping: float = 0.01,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`nmdeploy.masks.alps.alps` block by block (each block's mask and values fitted on its own moments)."""
    from nmdeploy.masks.alps import alps

    if isinstance(stats, BlockDiagonal) and stats.block % m:
        raise ShapeError(f"block size {stats.block} must be a multiple of M = {m}")
    ridge = damping_ridge(stats.diagonal(), damping)
    result = torch.empty_like(weight)
    for start, end, matrix in _blocks(stats):
        part = None if allowed is None else allowed[:, start:end]
        result[:, start:end] = alps(weight[:, start:end], matrix, n, m, allowed=part, ridge=ridge).weight
    return result


def reconstruction_error_blockwise(weight: torch.Tensor, new_weight: torch.Tensor, stats: Statistics) -> float:
    """The output error as the statistics see it (block-diagonal ones know no cross-block terms)."""
    return sum(
        reconstruction_error(weight[:, start:end], new_weight[:, start:end], matrix)
        for start, end, matrix in _blocks(stats)
    )


@dataclass
class BlockCost:
    """What block-diagonal statistics cost one layer: output errors on the full H of the full and the blockwise
    SparseGPT fits, and of the plain mask the full fit chose, for comparison."""

    k: int
    block: int
    error_full: float
    error_blockwise: float
    error_masked: float

    @property
    def increase(self) -> float:
        """Relative increase of the output error: error_blockwise / error_full - 1."""
        return self.error_blockwise / self.error_full - 1 if self.error_full else 0.0

    @property
    def share_of_fit_gain(self) -> float:
        """The part of the fit's gain over the plain mask that the blockwise fit keeps (1: all of it)."""
        gain = self.error_masked - self.error_full
        return (self.error_masked - self.error_blockwise) / gain if gain > 0 else 1.0


def block_diagonal_cost(
    weight: torch.Tensor, hessian: torch.Tensor, n: int, m: int, block: int, damping: float = 0.1
) -> BlockCost:
    """Fit ``weight`` with the full ``hessian`` and with its diagonal blocks of ``block`` columns, and measure both
    results on the full ``hessian``."""
    full = sparsegpt_fit(weight, hessian, n, m, damping)
    blockwise = sparsegpt_blockwise(weight, BlockDiagonal.from_full(hessian, block), n, m, damping, overwrite=True)
    return BlockCost(
        hessian.shape[0],
        block,
        error_full=full.error_converted,
        error_blockwise=reconstruction_error(weight, blockwise.weight, hessian),
        error_masked=full.error_masked,
    )
