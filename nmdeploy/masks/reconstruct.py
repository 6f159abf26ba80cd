"""Layer-wise reconstruction math for calibrated N:M conversion, on the second-moment matrix of a layer's input.

For a weight W [out, K] that reduces over K and calibration inputs X [samples, K], every quantity here needs only
H = X^T X [K, K] (accumulated over any amount of data):
* saliency: |W_ij| * ||X_j||, activation-aware importance (the Wanda score), ranks weights for the mask;
* refit: given a mask, the kept weights of each output row that minimise ||X w - X w'||^2 exactly, i.e. the
  damped least-squares solution w'_S = w_S + H_SS^-1 H_SP w_P (the AdaPrune objective, solved in closed form);
* reconstruction_error: sum over rows of (w - w')^T H (w - w'), the squared output error on the calibration data.

Precision follows the statistics: float64 H is fitted in float64; float32 H (half the memory, what a wide layer
can afford) is fitted in float32, and a factorisation that fails in float32 is repeated in float64 from the
statistics. ``overwrite=True`` factorises the statistics themselves (no K x K copy at all; the caller gives them
up), which leaves no statistics to repeat from, so it raises :class:`FactorisationError` instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nmdeploy.errors import InputError, ShapeError

_ROWS_PER_SOLVE = 64
# Bytes of per-row systems refit solves at once: rows of a wide layer each solve a (K N / M)^2 system.
_SOLVE_BYTES = 1 << 27
_PANEL = 512  # columns per panel of the in-place and triangular loops: GEMM-sized, K x _PANEL temporaries


class FactorisationError(InputError):
    """The damped statistics are not positive definite in the precision they were factorised in."""


def _check(weight: torch.Tensor, hessian: torch.Tensor, damping: float | None = None) -> None:
    if weight.ndim != 2:
        raise ShapeError(f"reconstruction works on a [out, K] matrix, got shape {tuple(weight.shape)}")
    k = weight.shape[1]
    if hessian.shape != (k, k):
        raise ShapeError(f"second-moment matrix of shape {tuple(hessian.shape)} does not match K = {k}")
    if not _finite(weight):
        raise InputError("the weight contains NaN or infinite values; fix the model first")
    if not _finite(hessian):
        raise InputError("the calibration statistics contain NaN or infinite values; check the calibration data")
    if damping is not None and not (math.isfinite(damping) and damping >= 0):
        raise InputError(f"damping must be a finite number >= 0, not {damping}")


def _finite(matrix: torch.Tensor) -> bool:
    """Whether every element is finite: one reduction per band of rows, so a K x K matrix is never copied whole (a
    sum is finite only when every element is, or the values overflow, refused too)."""
    step = max(1, (1 << 22) // max(1, matrix.shape[-1]))
    return all(
        math.isfinite(float(matrix[start : start + step].abs().sum(dtype=torch.float64)))
        for start in range(0, matrix.shape[0], step)
    )


def fit_dtype(hessian: torch.Tensor) -> torch.dtype:
    """The precision a fit on these statistics runs in: float64 statistics in float64, any other in float32."""
    return torch.float64 if hessian.dtype == torch.float64 else torch.float32


def damping_ridge(diagonal: torch.Tensor, damping: float) -> float:
    """The value added to H's diagonal: ``damping`` times its mean (block-diagonal fits pass the whole layer's)."""
    return damping * max(float(diagonal.mean(dtype=torch.float64)), 1e-12)


def saliency(weight: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """|W_ij| * sqrt(H_jj): a weight matters as much as its magnitude times its input's norm."""
    _check(weight, hessian)
    return weight.abs().to(torch.float32) * hessian.diagonal().clamp_min(0).sqrt().to(torch.float32)


def reconstruction_error(weight: torch.Tensor, new_weight: torch.Tensor, hessian: torch.Tensor) -> float:
    """sum_rows (w - w')^T H (w - w') = ||X W^T - X W'^T||^2 on the data H was accumulated from."""
    _check(weight, hessian)
    delta = weight.to(torch.float64) - new_weight.to(torch.float64)
    # The product in H's precision: a float32 H is never copied to float64.
    return float(((delta.to(hessian.dtype) @ hessian).to(torch.float64) * delta).sum())


def shifted_target(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    cross: torch.Tensor | None,
    damping: float = 0.01,
    *,
    cross_outputs: torch.Tensor | None = None,
    ridge: float | None = None,
    overwrite: bool = False,
):
    """The dense weight W* that best reproduces the dense outputs from shifted inputs; same dtype.

    When a layer's inputs X~ differ from the dense X (earlier layers were converted), the outputs to match are
    X W^T, and ||X~ W'^T - X W^T||^2 = ||X~ (W' - W*)^T||^2 + const with W* = W C^T H~^-1, C = X~^T X, H~ = X~^T X~.
    Fitting any mask to W* on H~ therefore also corrects the error the earlier layers left behind. ``damping``
    pulls W* towards W (a ridge centred on the dense weight), so unchanged inputs give W* = W exactly. Give either
    ``cross`` = C [K, K] or ``cross_outputs`` = C W^T = X~^T (X W^T) [K, out], which is all W* needs.
    ``overwrite`` factorises ``hessian`` in place and multiplies the factor back afterwards (K^3 / 3 more work,
    no copy); it holds H again, to float32 rounding, when this returns.
    """
    _check(weight, hessian, damping)
    if (cross is None) == (cross_outputs is None):
        raise TypeError("shifted_target needs exactly one of cross and cross_outputs")
    expected = hessian.shape if cross is not None else (hessian.shape[0], weight.shape[0])
    given = cross if cross is not None else cross_outputs
    if given.shape != expected:
        raise ShapeError(f"cross moments of shape {tuple(given.shape)} do not match {tuple(expected)}")
    dtype = fit_dtype(hessian)
    ridge = damping_ridge(hessian.diagonal(), damping) if ridge is None else ridge
    w = weight.to(dtype)
    projected = cross.to(dtype) @ w.T if cross is not None else cross_outputs.to(dtype)
    rhs = projected + ridge * w.T
    if overwrite and hessian.dtype == dtype and hessian.is_contiguous():
        hessian.diagonal().add_(ridge)
        lower = _cholesky_in_place(hessian)
        if lower is None:
            raise FactorisationError(
                "the shifted target's damped statistics are not positive definite in float32; raise --damping"
            )
        # Two triangular solves: torch's cholesky_solve copies the factor (a second K x K buffer, measured).
        forward = torch.linalg.solve_triangular(lower, rhs, upper=False)
        solution = torch.linalg.solve_triangular(lower.mT, forward, upper=True)
        _multiply_back(hessian)
        hessian.diagonal().sub_(ridge)
        return solution.T.to(weight.dtype)
    for precision in (dtype, torch.float64) if dtype != torch.float64 else (dtype,):
        h = hessian.to(precision, copy=True)
        h.diagonal().add_(ridge)
        lower = _cholesky_in_place(h)
        if lower is not None:
            return torch.cholesky_solve(rhs.to(precision), lower).T.to(weight.dtype)
        del h, lower
    h = hessian.to(torch.float64, copy=True)
    h.diagonal().add_(ridge)
    return torch.linalg.lstsq(h, rhs.to(torch.float64)).solution.T.to(weight.dtype)


def _cholesky_in_place(matrix: torch.Tensor) -> torch.Tensor | None:
    """Cholesky of the symmetric C-contiguous ``matrix`` in its own memory: returns the lower factor L as a
    column-major view of it (``matrix`` itself then reads as L^T), or None where it is not positive definite."""
    view = matrix.mT  # column-major, the layout LAPACK factorises in place
    info = torch.empty((), dtype=torch.int32, device=matrix.device)
    torch.linalg.cholesky_ex(view, out=(view, info))
    return view if int(info) == 0 else None


def _multiply_back(matrix: torch.Tensor) -> None:
    """``matrix`` holds R = L^T (upper, row-major) of A = L L^T = R^T R; overwrite it with A, in row panels from
    the bottom (a panel's rows of A need only R's rows above its end), then mirror the lower triangle up."""
    k = matrix.shape[0]
    for end in range(k, 0, -_PANEL):
        start = max(0, end - _PANEL)
        panel = matrix[:end, start:end].T @ matrix[:end, :end]
        matrix[start:end, :end] = panel
    for end in range(k, 0, -_PANEL):  # the same panels: each wrote its own diagonal block whole
        start = max(0, end - _PANEL)
        matrix[start:end, end:] = matrix[end:, start:end].T


def refit(
    weight: torch.Tensor,
    keep: torch.Tensor,
    hessian: torch.Tensor,
    damping: float = 0.01,
    *,
    ridge: float | None = None,
) -> torch.Tensor:
    """The kept weights of each row refitted to the dense outputs (pruned entries are exactly 0); same dtype.

    Rows may keep different numbers of entries (a row that keeps existing zeros out of its support, say).
    ``damping`` adds ``damping * mean(diag(H))`` to the diagonal (``ridge``: that value itself), which keeps the
    solve stable when inputs are correlated or few. ``hessian`` is only read: each row's system is gathered from
    it, a bounded number of rows at a time.
    """
    _check(weight, hessian, damping)
    if keep.shape != weight.shape:
        raise ShapeError(f"mask of shape {tuple(keep.shape)} does not match the weight's {tuple(weight.shape)}")
    k = weight.shape[1]
    dtype = fit_dtype(hessian)
    ridge = damping_ridge(hessian.diagonal(), damping) if ridge is None else ridge
    w = weight.to(dtype)
    result = torch.where(keep, w, torch.zeros_like(w))
    widest = int(keep.sum(dim=1).max()) if keep.numel() else 0
    if widest == 0:
        return result.to(weight.dtype)
    # Kept column indices per row, padded to the widest row with dummy positions whose equations are 1 * d = 0,
    # so every row solves a system of the same size.
    columns = torch.arange(k, device=w.device).expand_as(keep)
    ranked = torch.where(keep, columns, columns + k).sort(dim=1).values[:, :widest]
    dummy = ranked >= k
    ranked = ranked.where(~dummy, 0)
    pulled = torch.where(keep, torch.zeros_like(w), w) @ hessian.to(dtype)  # row r: H w_P
    rows_per_solve = max(1, min(_ROWS_PER_SOLVE, _SOLVE_BYTES // (widest * widest * w.element_size())))
    eye = torch.eye(widest, dtype=dtype, device=w.device)
    for start in range(0, w.shape[0], rows_per_solve):
        rows, padding = ranked[start : start + rows_per_solve], dummy[start : start + rows_per_solve]
        h_ss = hessian[rows[:, :, None], rows[:, None, :]].to(dtype)
        h_ss.masked_fill_(padding[:, :, None] | padding[:, None, :], 0.0)
        h_ss += (ridge + padding[:, None, :].to(dtype)) * eye  # ridge on the diagonal, 1 on the dummy entries
        rhs = pulled[start : start + rows_per_solve].gather(1, rows).masked_fill_(padding, 0.0)
        correction = _solve_spd(h_ss, rhs.unsqueeze(-1)).squeeze(-1).masked_fill_(padding, 0.0)
        result[start : start + rows_per_solve].scatter_add_(1, rows, correction)
    return result.to(weight.dtype)


def _solve_spd(matrices: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve symmetric positive definite systems by Cholesky (half the work of LU); systems that fail in float32
    are solved again in float64, and those only semi-definite (undamped, rank-deficient statistics) by least
    squares."""
    factor, info = torch.linalg.cholesky_ex(matrices)
    result = torch.cholesky_solve(rhs, factor)
    failed = info != 0
    if bool(failed.any()) and matrices.dtype != torch.float64:
        result[failed] = _solve_spd(matrices[failed].double(), rhs[failed].double()).to(result.dtype)
    elif bool(failed.any()):
        result[failed] = torch.linalg.lstsq(matrices[failed], rhs[failed]).solution
    return result


@dataclass
class SparseGptFit:
    """A SparseGPT sweep's result: the N:M weight (same dtype as given), its output errors on the statistics it was
    fitted on, and the precision its factorisation ran in."""

    weight: torch.Tensor
    error_masked: float  # the chosen mask without the fit: (w - w * keep)^T H (w - w * keep), summed over rows
    error_converted: float  # the fitted weight: (w - w')^T H (w - w')
    precision: torch.dtype


def sparsegpt(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    n: int,
    m: int,
    damping: float = 0.01,
    block: int = 128,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """N:M pruning by the OBS column sweep of SparseGPT (Frantar & Alistarh, 2023); same shape and dtype.

    Columns are visited left to right; at the start of every group of M the N weights with the largest
    w^2 / [H^-1]_jj are kept, and the error of each pruned or kept column is spread over the columns not yet
    visited through the Cholesky factor of H^-1. The loop runs over columns (vectorised over rows): its cost is
    O(K^3 + rows * K^2), far below one least-squares solve per row for wide layers.

    ``allowed`` (bool, weight-shaped) limits the support: only allowed positions may stay non-zero. A given N:M
    mask (a transposable one, say) makes the sweep a fast refit of that mask; the non-zeros of an
    unstructured-sparse weight keep its zeros.
    """
    return sparsegpt_fit(weight, hessian, n, m, damping, block, allowed).weight


def sparsegpt_fit(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    n: int,
    m: int,
    damping: float = 0.01,
    block: int = 128,
    allowed: torch.Tensor | None = None,
    *,
    ridge: float | None = None,
    overwrite: bool = False,
    round_kept: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> SparseGptFit:
    """:func:`sparsegpt` with its errors, which come from the factor the sweep already holds (so they need no H).

    One K x K working matrix is factorised in place (H + ridge, its inverse, the inverse's Cholesky factor, all in
    the same memory): a copy of ``hessian``, or with ``overwrite`` the statistics themselves, which hold the factor
    afterwards.

    ``round_kept`` maps a column of kept values (one per row) onto the values they may take (a quantization grid,
    :mod:`nmdeploy.masks.rounding`): each kept weight is rounded when its column is visited and its rounding error
    spreads over the columns not yet visited, as a pruned weight's does (GPTQ, Frantar et al. 2022; SparseGPT's
    joint sparsification and quantization). With ``allowed`` the current support and N = M it rounds a fixed
    pattern's weights to the grid with the least output error the sweep can give.
    """
    _check(weight, hessian, damping)
    rows, k = weight.shape
    if allowed is not None and allowed.shape != weight.shape:
        raise ShapeError(
            f"allowed mask of shape {tuple(allowed.shape)} does not match the weight {tuple(weight.shape)}"
        )
    if k % m:
        raise ShapeError(f"pattern {n}:{m} needs the reduction axis length to be a multiple of {m}, got {k}")
    dtype = fit_dtype(hessian)
    dead = hessian.diagonal() == 0
    ridge = damping_ridge(hessian.diagonal(), damping) if ridge is None else ridge
    if overwrite and hessian.dtype == dtype and hessian.is_contiguous():
        inverse_factor = _inverse_factor_in_place(hessian, ridge, dead)
        if inverse_factor is None:
            raise FactorisationError(
                f"the damped statistics ({k} x {k}) are not positive definite in {str(dtype).split('.')[-1]}; "
                "raise --damping"
            )
    else:
        inverse_factor = None
        for precision in (dtype, torch.float64) if dtype != torch.float64 else (dtype,):
            inverse_factor = _inverse_factor_in_place(hessian.to(precision, copy=True), ridge, dead)
            if inverse_factor is not None:
                dtype = precision
                break
        if inverse_factor is None:
            raise FactorisationError(
                f"the statistics ({k} x {k}) are not positive definite even in float64; give a damping above 0"
            )
    w = weight.to(dtype, copy=True)
    w[:, dead] = 0.0
    original = w.clone()
    block = max(m, block // m * m)  # whole groups per block
    keep_all = torch.zeros(rows, k, dtype=torch.bool, device=w.device)
    for start in range(0, k, block):
        end = min(start + block, k)
        w1 = w[:, start:end].clone()
        errors = torch.zeros_like(w1)
        factor = inverse_factor[start:end, start:end]
        # The mask of a group is fixed at its first column, so the sweep runs column by column only inside the
        # group (M narrow columns) and passes the group's errors on to the rest of the block in one product.
        for i in range(0, end - start, m):
            g = slice(i, i + m)
            permitted = None if allowed is None else allowed[:, start + i : start + i + m]
            if n >= m:  # nothing to choose: the support is kept (rounding a fixed pattern)
                keep = torch.ones_like(w1[:, g], dtype=torch.bool) if permitted is None else permitted
            else:
                group = w1[:, g] ** 2 / factor.diagonal()[g] ** 2
                if permitted is not None:
                    group = torch.where(permitted, group, -1.0)
                keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(n, dim=1).indices, True)
                if permitted is not None:
                    keep &= permitted
            keep_all[:, start + i : start + i + m] = keep
            columns = w1[:, g]
            local = factor[g, g]
            for j in range(m):
                column = columns[:, j]
                kept = column if round_kept is None else round_kept(column)
                value = kept.where(keep[:, j], 0.0)
                error = (column - value) / local[j, j]
                columns[:, j:] -= error[:, None] * local[j, j:][None, :]
                columns[:, j] = value
                errors[:, i + j] = error
            w1[:, i + m :] -= errors[:, g] @ factor[g, i + m :]
        w[:, start:end] = w1
        w[:, end:] -= errors @ inverse_factor[start:end, end:]
    # The dead inputs' weights were zeroed above; they never reach the outputs, so they add no error.
    converted = _errors_from_inverse_factor(original - w, inverse_factor, ridge, dead)
    masked = _errors_from_inverse_factor(original.mul_(~keep_all), inverse_factor, ridge, dead)  # w - w * keep
    return SparseGptFit(w.to(weight.dtype), float(masked.sum()), float(converted.sum()), dtype)


def _inverse_factor_in_place(matrix: torch.Tensor, ridge: float, dead: torch.Tensor) -> torch.Tensor | None:
    """Overwrite ``matrix`` (H) with U, where U is upper and U^T U = (H + ridge I)^-1, and return U (a view of it);
    inputs that never fire get 1 on the diagonal, so the factorisation stays defined. None where it is not
    positive definite.

    U comes without forming the inverse (LAPACK's potri is an order of magnitude slower than the factorisation on
    some CPUs): with J the reversal, J H J = L L^T gives H = R R^T for the upper R = J L J, so U = R^-1 = J L^-1 J.
    """
    matrix[dead, dead] = 1.0
    matrix.diagonal().add_(ridge)
    _reverse_in_place(matrix)
    lower = _cholesky_in_place(matrix)
    if lower is None:
        return None
    _invert_lower_in_place(lower)
    # The row-major buffer reads as (L^-1)^T; reversed, as (J L^-1 J)^T = U^T, so U is its transposed view.
    _reverse_in_place(matrix)
    return matrix.mT


def _reverse_in_place(matrix: torch.Tensor) -> None:
    """J A J (rows and columns reversed) of a contiguous square matrix: its memory read backwards, swapped in
    chunks from both ends."""
    flat = matrix.view(-1)
    total = flat.numel()
    for start in range(0, total // 2, 1 << 20):
        end = min(start + (1 << 20), total // 2)
        head = flat[start:end].clone()
        flat[start:end] = flat[total - end : total - start].flip(0)
        flat[total - end : total - start] = head.flip(0)


def _invert_lower_in_place(lower: torch.Tensor) -> None:
    """L^-1 of a lower-triangular L (zeros above the diagonal) in its own memory, column panels from the last:
    a panel's rows below its diagonal block become -(L^-1 of the trailing part) L_panel L_block^-1."""
    k = lower.shape[0]
    for end in range(k, 0, -_PANEL):
        start = max(0, end - _PANEL)
        eye = torch.eye(end - start, dtype=lower.dtype, device=lower.device)
        block_inverse = torch.linalg.solve_triangular(lower[start:end, start:end], eye, upper=False)
        if end < k:
            product = torch.empty(k - end, end - start, dtype=lower.dtype, device=lower.device)
            for first in range(end, k, _PANEL):  # the trailing inverse is lower triangular: its rows up to r
                last = min(first + _PANEL, k)
                product[first - end : last - end] = lower[first:last, end:last] @ lower[end:last, start:end]
            lower[end:, start:end] = -(product @ block_inverse)
        lower[start:end, start:end] = block_inverse


def _errors_from_inverse_factor(
    deltas: torch.Tensor, inverse_factor: torch.Tensor, ridge: float, dead: torch.Tensor
) -> torch.Tensor:
    """Per row of ``deltas``, d^T H d with H the undamped statistics, from U (U^T U = (H + ridge I + dead)^-1):
    d^T (H + ridge I + dead) d = ||d U^-1||^2, a triangular solve in column panels; the ridge and the dead inputs'
    diagonal are then taken off again. Rows go a few at a time, so the temporaries stay small beside the weight."""
    k = deltas.shape[1]
    errors = torch.empty(deltas.shape[0], dtype=torch.float64, device=deltas.device)
    step = max(1, (1 << 20) // max(1, k))
    for first in range(0, deltas.shape[0], step):
        rows = deltas[first : first + step]
        solved = torch.empty_like(rows)
        for start in range(0, k, _PANEL):
            end = min(start + _PANEL, k)
            rhs = rows[:, start:end] - solved[:, :start] @ inverse_factor[:start, start:end]
            diagonal = inverse_factor[start:end, start:end].triu()
            solved[:, start:end] = torch.linalg.solve_triangular(diagonal, rhs, upper=True, left=False)
        wide = rows.to(torch.float64)
        errors[first : first + step] = (
            solved.to(torch.float64).square().sum(dim=1)
            - ridge * wide.square().sum(dim=1)
            - wide[:, dead].square().sum(dim=1)
        )
    return errors
