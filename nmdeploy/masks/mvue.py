"""Unbiased minimum-variance N:M pruning (MVUE) for neural gradients, after Chmiel et al. (ICLR 2023).

Each group of M keeps exactly N elements, drawn at random, and rescales every kept element by one over its inclusion
probability, so that the pruned tensor equals the input in expectation. Gradients need this: the bias of
deterministic top-N accumulates over SGD steps, whereas zero-mean noise averages out. Among unbiased keep-N schemes
the inclusion probabilities ``p_i = min(1, c*|a_i|)`` with ``sum(p) = N`` (water-filling) give the least variance
``sum(a_i**2 * (1/p_i - 1))``; for 1:2 and 2:4 they reproduce the closed forms of the paper.
"""

from __future__ import annotations

import torch

from nmdeploy.errors import InputError
from nmdeploy.masks.groups import GroupedView, Remainder, check_remainder, tail_mask, to_groups
from nmdeploy.masks.pattern import Pattern, PatternLike

__all__ = ["mvue_probabilities", "mvue_prune", "mvue_variance"]


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def _checked_input(tensor: torch.Tensor, pattern: Pattern, axis: int, remainder: str) -> torch.Tensor:
    """Validate everything up front and return the tensor in the compute dtype."""
    check_remainder(remainder)
    if not torch.is_floating_point(tensor):
        raise InputError(f"MVUE needs a floating-point tensor, got {tensor.dtype}")
    # An unbiased estimate of a non-finite value does not exist, and NaN would poison every probability of its group.
    if tensor.numel() and not torch.isfinite(tensor).all():
        raise InputError(
            f"MVUE {pattern} along axis {axis}: the tensor contains NaN or infinite values; "
            f"an unbiased N:M estimate needs finite inputs"
        )
    return tensor.to(_compute_dtype(tensor))


def _sorted_probabilities(grouped: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Water-filling inclusion probabilities of ``[..., M]`` groups, in descending-magnitude order.

    Returns ``(p_sorted, order, saturated)``: ``grouped.gather(-1, order)`` is sorted by descending magnitude,
    ``p_sorted`` holds its probabilities and ``saturated`` marks the leading entries kept with certainty (p = 1).
    """
    m = grouped.shape[-1]
    x, order = torch.sort(grouped.abs(), dim=-1, descending=True, stable=True)
    # p does not depend on the scale of a group; dividing by its largest magnitude keeps the sums below from
    # overflowing (values near the dtype's max) or losing precision (subnormal values).
    peak = x[..., :1]
    x = x / torch.where(peak > 0, peak, 1.0)
    # tail[..., k] = x[..., k:].sum(), summed from the smallest up so that a run of zeros sums to exactly 0.
    tail = x.flip(-1).cumsum(-1).flip(-1)[..., :n]
    head = x[..., :n]
    # With the k largest saturated at p = 1, the rest get p = (N - k) * x / tail[k]; the solution is the smallest k
    # whose largest unsaturated p stays <= 1. k = N - 1 always qualifies, and so does the first zero when fewer
    # than N elements are non-zero.
    k_range = torch.arange(n, device=grouped.device, dtype=grouped.dtype)
    fits = (n - k_range) * head <= tail
    fits[..., -1] = True  # true in exact arithmetic; rounding must not push k out of range
    k = (~fits).to(torch.int64).cumprod(-1).sum(-1, keepdim=True)  # index of the first k that fits
    rest = torch.gather(tail, -1, k)
    budget = (n - k).to(grouped.dtype)
    has_rest = rest > 0
    slope = torch.where(has_rest, budget / torch.where(has_rest, rest, 1.0), 0.0)
    # When only zeros remain unsaturated they share the leftover probability evenly; they are kept as 0 anyway.
    shared = torch.where(has_rest, 0.0, budget / (m - k).to(grouped.dtype))
    p_sorted = torch.addcmul(shared, slope, x).clamp_(max=1.0)
    saturated = torch.arange(m, device=grouped.device) < k
    p_sorted.masked_fill_(saturated, 1.0)
    return p_sorted, order, saturated


def _probabilities(grouped: torch.Tensor, n: int) -> torch.Tensor:
    p_sorted, order, _ = _sorted_probabilities(grouped, n)
    return torch.empty_like(p_sorted).scatter_(-1, order, p_sorted)


def _fixed_point_bits(m: int) -> int:
    # As fine as int64 allows (59 bits for 2:4): cumulative sums over a group, of the probabilities (at most N + 1
    # intervals) and of the room left below 1 (at most M), must stay below 2**63.
    return 62 - (m + 1).bit_length()


def _systematic_sample(
    p_sorted: torch.Tensor, saturated: torch.Tensor, n: int, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Systematic sampling of exactly N distinct items per group with inclusion probabilities ``p_sorted``.

    The probabilities become integers in units of ``2**-bits`` whose per-item value is at most one unit interval
    and whose group sum is exactly N intervals, so the N sample points ``u, u+1, ..., u+N-1`` always land in N
    distinct items, whatever float rounding did to ``p``. Returns the kept mask and the probability actually used
    per item (in the compute dtype), which is what the kept values must be divided by to stay unbiased. The price
    is that an item with ``p`` below ``2**-bits`` (about 2e-18 for 2:4) is never kept, far below the output's own
    rounding.
    """
    bits = _fixed_point_bits(p_sorted.shape[-1])
    one = 1 << bits
    # Truncation is floor here (p >= 0), and exact: the scale is a power of two, and p <= 1 gives at most `one`
    # (exactly `one` for the saturated items).
    units = (p_sorted * one).to(torch.int64)
    # The float sum of p misses N by a few ulps; move that residual onto the largest unsaturated items (the list is
    # sorted by descending magnitude), never past 0 or one unit interval, so every group sums to exactly N intervals.
    # Kept values are divided by the probabilities actually used, so the estimate stays unbiased.
    residual = n * one - units.sum(-1, keepdim=True)
    capacity = torch.where(residual >= 0, one - units, units.masked_fill(saturated, 0))
    moved = torch.minimum((residual.abs() - capacity.cumsum(-1) + capacity).clamp_(min=0), capacity)
    units += residual.sign() * moved

    # Item i covers [bounds[i], bounds[i+1]); it is kept when one of u, u + 1, ..., u + N - 1 (in units) falls
    # there, which ceil((bounds - u) / one) counts. The numerators are non-negative, so a shift is exact, and
    # the counts telescope to exactly N per group, each 0 or 1 because no item spans more than one interval.
    start = torch.randint(0, one, (*units.shape[:-1], 1), generator=generator, device=units.device, dtype=torch.int64)
    bounds = torch.nn.functional.pad(units.cumsum(-1), (1, 0))
    passed = (bounds + (one - 1 - start)) >> bits
    kept = passed[..., 1:] != passed[..., :-1]
    used = units.to(p_sorted.dtype).mul_(2.0**-bits)
    return kept, used


def _restore_dense_tail(
    result: torch.Tensor, view: GroupedView, remainder: str, value: torch.Tensor | float
) -> torch.Tensor:
    """Put ``value`` back on the trailing partial group under the "dense" policy."""
    if remainder != "dense":
        return result
    tail = tail_mask(view, result.device)
    if tail is None:
        return result
    tail = tail.reshape(-1, *([1] * (result.ndim - view.axis - 1)))
    return torch.where(tail, value, result)


def mvue_probabilities(
    tensor: torch.Tensor, pattern: PatternLike = "2:4", axis: int = -1, remainder: Remainder = "error"
) -> torch.Tensor:
    """Inclusion probabilities of the MVUE sampler for each element, in float32 (float64 for float64 input).

    Every full group of M along ``axis`` sums to N. Under ``remainder="dense"`` the partial tail is kept
    with probability 1; under ``"pad"`` it is treated as padded with zeros.
    """
    pattern = Pattern.parse(pattern)
    values = _checked_input(tensor, pattern, axis, remainder)
    grouped, view = to_groups(values, pattern, axis, remainder)
    probabilities = view.ungroup(_probabilities(grouped, pattern.n))
    return _restore_dense_tail(probabilities, view, remainder, 1.0)


def mvue_variance(
    tensor: torch.Tensor, pattern: PatternLike = "2:4", axis: int = -1, remainder: Remainder = "error"
) -> torch.Tensor:
    """Per-element variance ``a**2 * (1/p - 1)`` of :func:`mvue_prune`; a group's sum is its minimum variance.

    Returned in float32 (float64 for float64 input); zero where ``p = 1`` or ``a = 0``, and on a "dense" tail.
    """
    pattern = Pattern.parse(pattern)
    values = _checked_input(tensor, pattern, axis, remainder)
    grouped, view = to_groups(values, pattern, axis, remainder)
    p = _probabilities(grouped, pattern.n)
    magnitude = grouped.abs()
    # |a| * (1 - p) first, so that p = 1 gives 0 even for huge |a|; |a| / p is bounded by the group's scale,
    # whereas a**2 alone may overflow. p = 0 only happens for a = 0 (or |a| underflowing against the group's
    # largest), where the squared error a**2 is what remains.
    per_element = magnitude * (1 - p) * (magnitude / torch.where(p > 0, p, 1.0))
    variance = view.ungroup(per_element)
    return _restore_dense_tail(variance, view, remainder, 0.0)


def mvue_prune(
    tensor: torch.Tensor,
    pattern: PatternLike = "2:4",
    axis: int = -1,
    *,
    generator: torch.Generator | None = None,
    remainder: Remainder = "error",
) -> torch.Tensor:
    """Sample an N:M-sparse tensor whose expectation is ``tensor`` and whose variance is minimal.

    Exactly N positions per group of M along ``axis`` are kept (zeros may be among them when a group has fewer
    than N non-zero elements); a kept element becomes ``a_i / p_i``, the others 0. A fresh mask is drawn on every
    call, from ``generator`` when given. The result has the input's shape and dtype; fp16/bf16 are computed in
    float32 and rounded back, so a rescaled value can overflow a narrow dtype. ``remainder`` as in
    :func:`nmdeploy.masks.groups.to_groups`: "dense" leaves the partial tail untouched, "pad" samples it as if
    padded with zeros.
    """
    pattern = Pattern.parse(pattern)
    values = _checked_input(tensor, pattern, axis, remainder)
    grouped, view = to_groups(values, pattern, axis, remainder)
    p_sorted, order, saturated = _sorted_probabilities(grouped, pattern.n)
    kept, used = _systematic_sample(p_sorted, saturated, pattern.n, generator)
    dropped = ~kept
    # A dropped item may have p = 0; dividing by 1 there keeps NaN and inf out of the intermediate values.
    pruned_sorted = torch.gather(grouped, -1, order).div_(used.masked_fill_(dropped, 1.0)).masked_fill_(dropped, 0.0)
    pruned = view.ungroup(torch.empty_like(pruned_sorted).scatter_(-1, order, pruned_sorted))
    pruned = _restore_dense_tail(pruned, view, remainder, values)
    return pruned.to(tensor.dtype)
