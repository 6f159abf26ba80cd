"""Layer-wise reconstruction math for calibrated N:M conversion, on the second-moment matrix of a layer's input.

For a weight W [out, K] that reduces over K and calibration inputs X [samples, K], every quantity here needs only
H = X^T X [K, K] (accumulated over any amount of data):
* saliency: |W_ij| * ||X_j||, activation-aware importance (the Wanda score), ranks weights for the mask;
* refit: given a mask, the kept weights of each output row that minimise ||X w - X w'||^2 exactly, i.e. the
  damped least-squares solution w'_S = w_S + H_SS^-1 H_SP w_P (the AdaPrune objective, solved in closed form);
* reconstruction_error: sum over rows of (w - w')^T H (w - w'), the squared output error on the calibration data.
"""

from __future__ import annotations

import math

import torch

from nmdeploy.errors import InputError, ShapeError

_ROWS_PER_SOLVE = 64


def _check(weight: torch.Tensor, hessian: torch.Tensor, damping: float | None = None) -> None:
    if weight.ndim != 2:
        raise ShapeError(f"reconstruction works on a [out, K] matrix, got shape {tuple(weight.shape)}")
    k = weight.shape[1]
    if hessian.shape != (k, k):
        raise ShapeError(f"second-moment matrix of shape {tuple(hessian.shape)} does not match K = {k}")
    # One reduction each: a sum is finite only when every element is (or the values overflow, refused too).
    if not math.isfinite(float(weight.double().abs().sum())):
        raise InputError("the weight contains NaN or infinite values; fix the model first")
    if not math.isfinite(float(hessian.double().abs().sum())):
        raise InputError("the calibration statistics contain NaN or infinite values; check the calibration data")
    if damping is not None and not (math.isfinite(damping) and damping >= 0):
        raise InputError(f"damping must be a finite number >= 0, not {damping}")


def saliency(weight: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """|W_ij| * sqrt(H_jj): a weight matters as much as its magnitude times its input's norm."""
    _check(weight, hessian)
    return weight.abs().to(torch.float32) * hessian.diagonal().clamp_min(0).sqrt().to(torch.float32)


def reconstruction_error(weight: torch.Tensor, new_weight: torch.Tensor, hessian: torch.Tensor) -> float:
    """sum_rows (w - w')^T H (w - w') = ||X W^T - X W'^T||^2 on the data H was accumulated from."""
    _check(weight, hessian)
    delta = weight.to(torch.float64) - new_weight.to(torch.float64)
    return float(((delta @ hessian.to(torch.float64)) * delta).sum())


def shifted_target(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    cross: torch.Tensor | None,
    damping: float = 0.01,
    *,
    cross_outputs: torch.Tensor | None = None,
):
    """The dense weight W* that best reproduces the dense outputs from shifted inputs; same dtype.

    When a layer's inputs X~ differ from the dense X (earlier layers were converted), the outputs to match are
    X W^T, and ||X~ W'^T - X W^T||^2 = ||X~ (W' - W*)^T||^2 + const with W* = W C^T H~^-1, C = X~^T X, H~ = X~^T X~.
    Fitting any mask to W* on H~ therefore also corrects the error the earlier layers left behind. ``damping``
    pulls W* towards W (a ridge centred on the dense weight), so unchanged inputs give W* = W exactly. Give either
    ``cross`` = C [K, K] or ``cross_outputs`` = C W^T = X~^T (X W^T) [K, out], which is all W* needs.
    """
    _check(weight, hessian, damping)
    if (cross is None) == (cross_outputs is None):
        raise TypeError("shifted_target needs exactly one of cross and cross_outputs")
    expected = hessian.shape if cross is not None else (hessian.shape[0], weight.shape[0])
    given = cross if cross is not None else cross_outputs
    if given.shape != expected:
        raise ShapeError(f"cross moments of shape {tuple(given.shape)} do not match {tuple(expected)}")
    w = weight.to(torch.float64)
    h = hessian.to(torch.float64)
    ridge = damping * h.diagonal().mean().clamp_min(1e-12)
    h = h + ridge * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    projected = cross.to(torch.float64) @ w.T if cross is not None else cross_outputs.to(torch.float64)
    rhs = projected + ridge * w.T
    return _solve_spd(h, rhs).T.to(weight.dtype)


def refit(weight: torch.Tensor, keep: torch.Tensor, hessian: torch.Tensor, damping: float = 0.01) -> torch.Tensor:
    """The kept weights of each row refitted to the dense outputs (pruned entries are exactly 0); same dtype.

    Rows may keep different numbers of entries (a row that keeps existing zeros out of its support, say).
    ``damping`` adds ``damping * mean(diag(H))`` to the diagonal, which keeps the solve stable when inputs are
    correlated or few.
    """
    _check(weight, hessian, damping)
    if keep.shape != weight.shape:
        raise ShapeError(f"mask of shape {tuple(keep.shape)} does not match the weight's {tuple(weight.shape)}")
    k = weight.shape[1]
    h = hessian.to(torch.float64)
    h = h + damping * h.diagonal().mean().clamp_min(1e-12) * torch.eye(k, dtype=h.dtype, device=h.device)
    w = weight.to(torch.float64)
    result = torch.where(keep, w, torch.zeros_like(w))
    widest = int(keep.sum(dim=1).max()) if keep.numel() else 0
    if widest == 0:
        return result.to(weight.dtype)
    # Kept column indices per row, padded to the widest row with distinct dummy columns K, K+1, ... whose
    # equations are 1 * d = 0, so every row solves a system of the same size.
    padded_h = torch.eye(2 * k, dtype=h.dtype, device=h.device)
    padded_h[:k, :k] = h
    columns = torch.arange(k, device=w.device).expand_as(keep)
    ranked = torch.where(keep, columns, columns + k).sort(dim=1).values[:, :widest]
    pulled = torch.nn.functional.pad(torch.where(keep, torch.zeros_like(w), w) @ h, (0, k))  # row r: H w_P
    result = torch.nn.functional.pad(result, (0, k))
    for start in range(0, w.shape[0], _ROWS_PER_SOLVE):
        rows = ranked[start : start + _ROWS_PER_SOLVE]
        h_ss = padded_h[rows[:, :, None], rows[:, None, :]]
        rhs = pulled[start : start + _ROWS_PER_SOLVE].gather(1, rows)
        correction = _solve_spd(h_ss, rhs.unsqueeze(-1)).squeeze(-1)
        result[start : start + _ROWS_PER_SOLVE].scatter_add_(1, rows, correction)
    return result[:, :k].to(weight.dtype)


def _solve_spd(matrices: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve symmetric positive definite systems by Cholesky (half the work of LU), with a least-squares fallback
    for the batch elements that are only semi-definite (undamped, rank-deficient statistics)."""
    factor, info = torch.linalg.cholesky_ex(matrices)
    result = torch.cholesky_solve(rhs, factor)
    failed = info != 0
    if bool(failed.any()):
        result[failed] = torch.linalg.lstsq(matrices[failed], rhs[failed]).solution
    return result


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
    _check(weight, hessian, damping)
    rows, k = weight.shape
    if allowed is not None and allowed.shape != weight.shape:
        raise ShapeError(
            f"allowed mask of shape {tuple(allowed.shape)} does not match the weight {tuple(weight.shape)}"
        )
    if k % m:
        raise ShapeError(f"pattern {n}:{m} needs the reduction axis length to be a multiple of {m}, got {k}")
    h = hessian.to(torch.float64).clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0  # inputs that never fire: any weight works, so keep the factorisation defined
    h += damping * h.diagonal().mean().clamp_min(1e-12) * torch.eye(k, dtype=h.dtype, device=h.device)
    inverse_factor = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    w = weight.to(torch.float64).clone()
    w[:, dead] = 0.0
    block = max(m, block // m * m)  # whole groups per block
    for start in range(0, k, block):
        end = min(start + block, k)
        w1 = w[:, start:end].clone()
        errors = torch.zeros_like(w1)
        factor = inverse_factor[start:end, start:end]
        # The mask of a group is fixed at its first column, so the sweep runs column by column only inside the
        # group (M narrow columns) and passes the group's errors on to the rest of the block in one product.
        for i in range(0, end - start, m):
            g = slice(i, i + m)
            group = w1[:, g] ** 2 / factor.diagonal()[g] ** 2
            if allowed is not None:
                permitted = allowed[:, start + i : start + i + m]
                group = torch.where(permitted, group, -1.0)
            keep = torch.zeros_like(group, dtype=torch.bool).scatter_(1, group.topk(n, dim=1).indices, True)
            if allowed is not None:
                keep &= permitted
            columns = w1[:, g]
            local = factor[g, g]
            for j in range(m):
                column = columns[:, j]
                error = torch.where(keep[:, j], 0.0, column) / local[j, j]
                columns[:, j:] -= error[:, None] * local[j, j:][None, :]
                columns[:, j] = column.where(keep[:, j], 0.0)
                errors[:, i + j] = error
            w1[:, i + m :] -= errors[:, g] @ factor[g, i + m :]
        w[:, start:end] = w1
        w[:, end:] -= errors @ inverse_factor[start:end, end:]
    return w.to(weight.dtype)
