"""ALPS-style N:M pruning (Meng, Behdin, Wang, Mazumder 2024): ADMM on the layer's reconstruction objective, then an
exact least-squares refit of the support it settles on.

For a weight W^ [out, K] and H = X^T X, the layer objective is tr((W - W^) H (W - W^)^T) with W in the set S of N:M
matrices. ADMM splits W (dense, the objective) from D (in S, the constraint) with a scaled dual V and penalty rho:

* W <- (W^ H - V + rho D) (H + rho I)^-1, one eigendecomposition H = Q diag(l) Q^T serving every rho;
* D <- the N largest |W + V / rho| of every group of M (the Euclidean projection onto S);
* V <- V + rho (W - D);

rho grows as the support settles (by 1.3, 1.2 or 1.1 every few steps, the more the support still moves the faster),
which drives W and D together; the mask is D's support once it stops changing. The paper then refines the kept
weights by preconditioned conjugate gradients; here the refit is the exact per-row solve of
:func:`nmdeploy.masks.reconstruct.refit`, the optimum PCG approaches.

Every step is two [out, K] x [K, K] products and a top-N per group, vectorised over rows and groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nmdeploy.errors import ShapeError
from nmdeploy.masks.groups import split_groups
from nmdeploy.masks.reconstruct import _check, damping_ridge, fit_dtype, refit
from nmdeploy.masks.select import topn_in_groups

_CHECK_EVERY = 3  # steps between penalty updates, as the paper's schedule
_START_PENALTY = 0.01  # rho at the first step, relative to mean diag(H)
_MAX_PENALTY = 1e4


@dataclass
class AlpsFit:
    """The fitted N:M weight (same dtype as given), its mask and how many ADMM steps chose it."""

    weight: torch.Tensor
    keep: torch.Tensor
    steps: int


def _project(values: torch.Tensor, n: int, m: int, allowed: torch.Tensor | None) -> torch.Tensor:
    """The mask of the N largest |values| in every group of M along the rows (positions not allowed never kept)."""
    scores = values.abs()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -1.0)
    grouped, dim = split_groups(scores, m, 1)
    keep = topn_in_groups(grouped, n, dim=dim).reshape(scores.shape)
    return keep if allowed is None else keep & allowed


def alps(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    n: int,
    m: int,
    damping: float = 0.01,
    *,
    allowed: torch.Tensor | None = None,
    max_steps: int = 60,
    ridge: float | None = None,
) -> AlpsFit:
    """N:M weight minimising the layer's output error on ``hessian``: ADMM for the mask, exact refit for the values.

    ``damping`` (or ``ridge``, the absolute value) is added to H's diagonal, as in the other fits. ``allowed``
    limits the support (existing zeros stay zero). ``max_steps`` caps the ADMM steps; it stops earlier once the
    support has not moved for two penalty updates. ``hessian`` is only read.
    """
    _check(weight, hessian, damping)
    k = weight.shape[1]
    if k % m:
        raise ShapeError(f"pattern {n}:{m} needs the reduction axis length to be a multiple of {m}, got {k}")
    if allowed is not None and allowed.shape != weight.shape:
        raise ShapeError(f"allowed mask of shape {tuple(allowed.shape)} does not match the weight's")
    dtype = fit_dtype(hessian)
    ridge = damping_ridge(hessian.diagonal(), damping) if ridge is None else ridge
    scale = max(float(hessian.diagonal().mean(dtype=torch.float64)), 1e-12)
    # Work on H / mean diag(H), so the penalty schedule is the same for every layer whatever its input scale.
    normalised = hessian.to(dtype, copy=True).div_(scale)
    normalised.diagonal().add_(ridge / scale)
    eigenvalues, basis = torch.linalg.eigh(normalised)
    eigenvalues.clamp_min_(0)
    original = weight.to(dtype)
    target = original @ normalised  # W^ H: what every W step starts from
    del normalised
    keep = _project(original * hessian.diagonal().to(dtype).clamp_min(0).sqrt(), n, m, allowed)  # the Wanda mask
    sparse = original * keep
    dual = torch.zeros_like(original)
    penalty = _START_PENALTY
    moved = 0
    settled = 0
    steps = 0
    for steps in range(1, max_steps + 1):
        dense = ((target - dual + penalty * sparse) @ basis / (eigenvalues + penalty)) @ basis.T
        shifted = dense + dual / penalty
        new_keep = _project(shifted, n, m, allowed)
        moved += int((new_keep != keep).sum())
        keep = new_keep
        sparse = shifted * keep
        dual += penalty * (dense - sparse)
        if steps % _CHECK_EVERY == 0:
            kept = max(1, int(keep.sum()))
            settled = settled + 1 if moved == 0 else 0
            if settled >= 2 or penalty >= _MAX_PENALTY:
                break
            penalty *= 1.3 if moved >= 0.1 * kept else 1.2 if moved >= 0.005 * kept else 1.1
            moved = 0
    fitted = refit(weight, keep, hessian, ridge=ridge)
    return AlpsFit(fitted, keep, steps)
