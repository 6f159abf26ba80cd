"""Layer-wise reconstruction math for calibrated N:M conversion, on the second-moment matrix of a layer's input.

For a weight W [out, K] that reduces over K and calibration inputs X [samples, K], every quantity here needs only
H = X^T X [K, K] (accumulated over any amount of data):
* saliency: |W_ij| * ||X_j||, activation-aware importance (the Wanda score), ranks weights for the mask;
* refit: given a mask, the kept weights of each output row that minimise ||X w - X w'||^2 exactly, i.e. the
  damped least-squares solution w'_S = w_S + H_SS^-1 H_SP w_P (the AdaPrune objective, solved in closed form);
* reconstruction_error: sum over rows of (w - w')^T H (w - w'), the squared output error on the calibration data.
"""

from __future__ import annotations

import torch

from nmdeploy.errors import ShapeError

_ROWS_PER_SOLVE = 64


def _check(weight: torch.Tensor, hessian: torch.Tensor) -> None:
    if weight.ndim != 2:
        raise ShapeError(f"reconstruction works on a [out, K] matrix, got shape {tuple(weight.shape)}")
    k = weight.shape[1]
    if hessian.shape != (k, k):
        raise ShapeError(f"second-moment matrix of shape {tuple(hessian.shape)} does not match K = {k}")


def saliency(weight: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """|W_ij| * sqrt(H_jj): a weight matters as much as its magnitude times its input's norm."""
    _check(weight, hessian)
    return weight.abs().to(torch.float32) * hessian.diagonal().clamp_min(0).sqrt().to(torch.float32)


def reconstruction_error(weight: torch.Tensor, new_weight: torch.Tensor, hessian: torch.Tensor) -> float:
    """sum_rows (w - w')^T H (w - w') = ||X W^T - X W'^T||^2 on the data H was accumulated from."""
    _check(weight, hessian)
    delta = weight.to(torch.float64) - new_weight.to(torch.float64)
    return float(((delta @ hessian.to(torch.float64)) * delta).sum())


def refit(weight: torch.Tensor, keep: torch.Tensor, hessian: torch.Tensor, damping: float = 0.01) -> torch.Tensor:
    """The kept weights of each row refitted to the dense outputs (pruned entries are exactly 0); same dtype.

    Every row must keep the same number of entries (true of any 1-D or transposable N:M mask). ``damping`` adds
    ``damping * mean(diag(H))`` to the diagonal, which keeps the solve stable when inputs are correlated or few.
    """
    _check(weight, hessian)
    if keep.shape != weight.shape:
        raise ShapeError(f"mask of shape {tuple(keep.shape)} does not match the weight's {tuple(weight.shape)}")
    kept_per_row = keep.sum(dim=1)
    if kept_per_row.numel() and not bool((kept_per_row == kept_per_row[0]).all()):
        raise ShapeError("refit needs the same number of kept weights in every row (an N:M mask)")
    h = hessian.to(torch.float64)
    h = h + damping * h.diagonal().mean().clamp_min(1e-12) * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    w = weight.to(torch.float64)
    kept = int(kept_per_row[0]) if kept_per_row.numel() else 0
    result = torch.where(keep, w, torch.zeros_like(w))
    if kept == 0:
        return result.to(weight.dtype)
    # Indices of the kept columns of each row, in order: [rows, kept].
    support = torch.sort(keep.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :kept]
    support = support.sort(dim=1).values
    pulled = torch.where(keep, torch.zeros_like(w), w) @ h  # row r: H w_P (H is symmetric)
    for start in range(0, w.shape[0], _ROWS_PER_SOLVE):
        rows = support[start : start + _ROWS_PER_SOLVE]
        h_ss = h[rows[:, :, None], rows[:, None, :]]
        rhs = pulled[start : start + _ROWS_PER_SOLVE].gather(1, rows)
        correction = torch.linalg.solve(h_ss, rhs.unsqueeze(-1)).squeeze(-1)
        block = result[start : start + _ROWS_PER_SOLVE]
        block.scatter_add_(1, rows, correction)
    return result.to(weight.dtype)
