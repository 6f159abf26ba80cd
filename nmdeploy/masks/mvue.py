"""Unbiased minimum-variance N:M pruning (MVUE) for neural gradients, after Chmiel et al. (ICLR 2023).

Each group of M keeps exactly N elements, drawn at random, and rescales every kept element by one over its inclusion
probability, so that the pruned tensor equals the input in expectation. Gradients need this: the bias of
deterministic top-N accumulates over SGD steps, whereas zero-mean noise averages out. Among unbiased keep-N schemes
the inclusion probabilities ``p_i = min(1, c*|a_i|)`` with ``sum(p) = N`` (water-filling) give the least variance
``sum(a_i**2 * (1/p_i - 1))``; for 1:2 and 2:4 they reproduce the closed forms of the paper.

Two samplers realise them. Patterns keeping one or two of at most four (1:2, 1:3, 1:4, 2:3, 2:4; the trainer's
patterns) take a closed-form path: no sort, no fixed point, elementwise operations on the tensor in place (no copy
to move the grouped axis last), which ``torch.compile`` fuses into one loop for large tensors (see
:mod:`nmdeploy.masks.compiled`). Other patterns take the general water-filling path with exact-N systematic
sampling in int64 fixed point. Both keep exactly N per group and have the same inclusion probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from nmdeploy.errors import InputError
from nmdeploy.masks.compiled import CompiledKernel
from nmdeploy.masks.groups import (
    GroupedView,
    Remainder,
    check_divisible,
    check_remainder,
    normalize_axis,
    row_blocks,
    tail_mask,
    to_groups,
)
from nmdeploy.masks.pattern import Pattern, PatternLike

__all__ = ["mvue_probabilities", "mvue_prune", "mvue_variance"]


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def _check_floating(tensor: torch.Tensor, remainder: str) -> None:
    check_remainder(remainder)
    if not torch.is_floating_point(tensor):
        raise InputError(f"MVUE needs a floating-point tensor, got {tensor.dtype}")


def _non_finite_error(pattern: Pattern, axis: int) -> InputError:
    # An unbiased estimate of a non-finite value does not exist, and NaN would poison every probability of its group.
    return InputError(
        f"MVUE {pattern} along axis {axis}: the tensor contains NaN or infinite values; "
        f"an unbiased N:M estimate needs finite inputs"
    )


def _checked_input(tensor: torch.Tensor, pattern: Pattern, axis: int, remainder: str) -> torch.Tensor:
    """Validate everything up front and return the tensor in the compute dtype."""
    _check_floating(tensor, remainder)
    if tensor.numel() and not torch.isfinite(tensor).all():
        raise _non_finite_error(pattern, axis)
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


def _water_filling_probabilities(grouped: torch.Tensor, n: int) -> torch.Tensor:
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


# ------------------------------------------------------------------------------------------------ closed form, M <= 4
#
# Keeping one or two of at most four, water-filling saturates at most the largest element, and only when keeping two
# with 2*|a_max| >= S (S the group's sum of magnitudes, regime B of Chmiel et al.). So, per group:
#   1:M                p_i = |a_i| / S                           kept value sign(a_i) * S
#   2:M, regime A      p_i = 2|a_i| / S                          kept value sign(a_i) * S / 2
#   2:M, regime B      p_max = 1, p_i = |a_i| / (S - |a_max|)    kept values a_max and sign(a_i) * (S - |a_max|)
# The uncertain picks are systematic sampling over the widths |a_i| (the certain element's width set to 0), with the
# group-level tensors shaped [..., 1, R] beside the [..., M, R] groups, so no axis ever has to be moved.

# A group whose largest element is this close to half of the sum is treated as regime B (that element kept for
# certain). Rounding in the sums and boundaries moves an item's sampled width by at most about 8 ulps; with twice that
# margin, no regime-A item can span both points u/2 and u/2 + 1/2, so the two picks are always distinct. The price:
# p_max = 1 instead of p_max > 1 - 32 ulps in such groups, with the other p rescaled to match; still unbiased.
_REGIME_B_MARGIN_ULPS = 32
# A group's sum of magnitudes must stay finite: at most four elements, each no larger than max / 8.
_HUGE_FRACTION = 0.125


def _has_closed_form(pattern: Pattern) -> bool:
    """Whether ``pattern`` takes the closed-form path: N of 1 or 2 below M, M at most 4 (1:2, 1:3, 1:4, 2:3, 2:4)."""
    return pattern.m <= 4 and pattern.n <= 2 and pattern.n < pattern.m


def _indicator(compare: Callable[..., torch.Tensor], left: torch.Tensor, right: torch.Tensor | float) -> torch.Tensor:
    """``compare(left, right)`` as 0.0/1.0 in ``left``'s dtype: float masks keep every later step in fast float
    arithmetic, where mixing bool and float tensors costs several times more on CPU."""
    out = torch.empty_like(left)
    compare(left, right, out=out)
    return out


def _closed_form_layout(
    grouped: torch.Tensor, n: int, scale: float
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, torch.Tensor | None, torch.Tensor | None]:
    """Sampling layout of ``[..., M, R]`` groups (the M axis second to last), one ``[..., R]`` tensor per column.

    Returns ``(widths, saturated, certain, top)``: the uncertain picks are drawn in proportion to ``widths`` (the
    magnitudes divided by ``scale``, 0 for the certain element); ``certain`` is 1.0 in the groups that keep their
    largest element for sure, ``saturated`` 1.0 at that element, per column, and ``top`` the largest width (all three
    None for N = 1). Tensor operations only, no checks: :func:`_checked_scale` judges the result. Columns rather than
    reductions over the M axis: with M <= 4 a few elementwise operations beat PyTorch's reductions with indices and
    scans over a short strided axis by an order of magnitude.
    """
    # New tensors throughout, never writes into views of a shared buffer: compiled, those would force the buffer
    # out to memory instead of fusing everything into one loop.
    widths = [column.abs() if scale == 1 else column.abs().mul_(1 / scale) for column in grouped.unbind(-2)]
    if n == 1:
        return widths, None, None, None
    top = _running(torch.maximum, widths)
    total = _running(torch.add, widths)
    threshold = total * (1 - _REGIME_B_MARGIN_ULPS * torch.finfo(grouped.dtype).eps)
    certain = _indicator(torch.ge, 2 * top, threshold).mul_(_indicator(torch.gt, total, 0.0))
    # The certain element is the first one equal to the top: two may tie (2 * top >= S with the rest zero).
    pending = certain.clone()
    saturated = []
    for width in widths:
        hit = _indicator(torch.eq, width, top).mul_(pending)
        pending -= hit
        saturated.append(hit)
    widths = [torch.addcmul(width, width, hit, value=-1.0) for width, hit in zip(widths, saturated, strict=True)]
    return widths, saturated, certain, top  # widths exactly 0 where hit


def _checked_scale(peak: torch.Tensor, grouped: torch.Tensor, pattern: Pattern, axis: int) -> float:
    """The scale the closed form must divide magnitudes by, judged from a pass at scale 1: ``peak`` is the largest
    group sum (N = 1) or group maximum (N = 2) it met. 1 nearly always; raises for NaN and inf in the input.

    Maximum and sums propagate NaN and inf, so this one number both refuses non-finite input and detects sums that
    could overflow, instead of a separate pass over the tensor.
    """
    value = float(peak)
    if math.isnan(value) or (math.isinf(value) and not torch.isfinite(grouped).all()):
        raise _non_finite_error(pattern, axis)
    if value > torch.finfo(grouped.dtype).max * _HUGE_FRACTION:  # also a sum that overflowed to inf
        return 1 / _HUGE_FRACTION  # a power of two: exact, but for values already at the subnormal edge
    return 1.0


def _running(combine: Callable[..., torch.Tensor], columns: list[torch.Tensor]) -> torch.Tensor:
    """``combine`` folded over the columns (a new tensor)."""
    result = combine(columns[0], columns[1])
    for column in columns[2:]:
        combine(result, column, out=result)
    return result


def _closed_form_probabilities(grouped: torch.Tensor, pattern: Pattern, axis: int) -> torch.Tensor:
    """Inclusion probabilities of ``[..., M, R]`` groups, as the closed-form sampler realises them."""
    scale = 1.0
    if grouped.numel():
        magnitude = grouped.abs()
        scale = _checked_scale((magnitude.sum(-2) if pattern.n == 1 else magnitude).amax(), grouped, pattern, axis)
    widths, saturated, certain, _ = _closed_form_layout(grouped, pattern.n, scale)
    m = pattern.m
    total = torch.stack(widths).sum(0)
    picks = torch.full_like(total, pattern.n) if certain is None else pattern.n - certain
    candidates = torch.full_like(total, m) if certain is None else m - certain
    # Uncertain items share the remaining picks in proportion to their widths; with nothing but zeros left they
    # share them evenly, as water-filling does (they are kept as 0 anyway). widths / total first: 1 / total
    # overflows for a subnormal total.
    has_total = total > 0
    safe_total = torch.where(has_total, total, 1.0)
    even = picks / candidates
    p = [torch.where(has_total, width / safe_total * picks, even) for width in widths]
    if saturated is not None:
        p = [column.masked_fill_(hit > 0, 1.0) for column, hit in zip(p, saturated, strict=True)]
    return torch.stack(p, dim=-2)


def _closed_form_kernel(
    grouped: torch.Tensor, point: torch.Tensor, n: int, scale: float, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pruned ``[..., M, R]`` groups (into ``out`` when given): the kept elements divided by their inclusion
    probabilities, the rest 0; and the peak that :func:`_checked_scale` judges. ``point`` holds one uniform [0, 1)
    value per group (``[..., R]``). Tensor operations only, so that ``torch.compile`` can fuse them into one loop.

    Systematic sampling over the widths laid end to end: a group keeps the item whose interval contains each of its
    points. The interval boundaries are the cumulative widths divided by their total, so the last is exactly 1 and
    the intervals partition [0, 1): every point lands in exactly one item, and that item has a positive width (so it
    is neither zero nor the certain element). With ``count[j]`` the number of points at or above boundary j, item j
    holds ``count[j-1] - count[j]`` of them: exact small integers, in float.
    """
    widths, saturated, certain, top = _closed_form_layout(grouped, n, scale)
    cumulative = [widths[0]]
    for width in widths[1:]:
        cumulative.append(cumulative[-1] + width)
    total = cumulative[-1]
    peak = (total if top is None else top).amax()
    # Raising a zero total to the smallest subnormal leaves every positive total as it is and makes the boundaries
    # of an all-zero group 0, one pass instead of a test and a sum.
    safe_total = total.clamp(min=_smallest_subnormal(grouped.dtype))
    boundaries = [running / safe_total for running in cumulative[:-1]]
    # What a kept uncertain element becomes, up to its sign and the scale: |a_i| / p_i
    unit = total if certain is None else total.clone()
    if certain is None:
        points = [point]
        beyond_last: torch.Tensor | float = 0.0
    else:
        # Regime A: points u/2 and u/2 + 1/2, both exact but for the rounding of the second, which must stay below
        # 1. Regime B: one point u over the widths without the certain element, and the second point moved to 2,
        # past every boundary, where it counts for no item.
        lower = point * 0.5
        upper = (lower + 0.5).clamp_(max=1 - torch.finfo(grouped.dtype).eps / 2).add_(certain * 2.0)
        points = [lower.addcmul_(lower, certain), upper]  # lower * 2 = u exactly
        beyond_last = certain
        unit.mul_(certain.mul(0.5).add_(0.5))
    counts = []
    for boundary in boundaries:
        count = _indicator(torch.le, boundary, points[0])
        for extra in points[1:]:
            count += _indicator(torch.le, boundary, extra)
        counts.append(count)
    kept = [len(points) - counts[0]]
    kept += [before - after for before, after in zip(counts, counts[1:], strict=False)]
    kept.append(counts[-1] if certain is None else counts[-1] - beyond_last)
    members = []
    for index, (column, keep) in enumerate(zip(grouped.unbind(-2), kept, strict=True)):
        # A zero is picked only where the unit is 0 too (nothing else left to keep), so the result is +-0 there. The
        # certain element is never picked (width 0): its keep count is 0 and its value is added back unchanged.
        # Eager, written in place in ``out`` without temporaries; compiled, built as new tensors (dynamo refuses
        # ``out=`` views) that inductor fuses into one loop.
        member = torch.mul(unit, keep) if out is None else torch.mul(unit, keep, out=out.select(-2, index))
        if scale != 1:  # after the product with keep: a kept value may overflow, a dropped one stays 0, not NaN
            member.mul_(scale)
        torch.copysign(member, column, out=member)
        if saturated is not None:
            member.addcmul_(column, saturated[index])
        members.append(member)
    out = torch.stack(members, dim=-2) if out is None else out
    return out, peak


_compiled_kernel = CompiledKernel(_closed_form_kernel)


def _closed_form_sample(
    grouped: torch.Tensor, pattern: Pattern, axis: int, generator: torch.Generator | None
) -> torch.Tensor:
    """:func:`_closed_form_kernel` over ``[rows, M, R]`` groups with fresh uniforms from ``generator``, checked.

    Eager, the kernel runs on cache-sized blocks of rows: its fifty-odd passes over per-member tensors run a fifth
    faster when they stay in cache. Compiled, it is one fused loop over the whole tensor. Both draw the same
    uniforms, so they give the same sample.
    """
    if not grouped.numel():
        return torch.empty_like(grouped)
    point = _uniform(grouped[:, 0].shape, generator, grouped.device, grouped.dtype)
    if _compiled_kernel.applies(grouped):
        pruned, peak = _compiled_kernel(grouped, point, pattern.n, 1.0)
    else:
        pruned = torch.empty_like(grouped)
        blocks = row_blocks(grouped.shape) if grouped.device.type == "cpu" else [slice(None)]
        peak = torch.stack(
            [_closed_form_kernel(grouped[rows], point[rows], pattern.n, 1.0, pruned[rows])[1] for rows in blocks]
        ).max()
    scale = _checked_scale(peak, grouped, pattern, axis)
    if scale != 1:  # rare: sums that could overflow; sampled again from the same uniforms at a smaller scale
        pruned, _ = _closed_form_kernel(grouped, point, pattern.n, scale)
    return pruned


def _uniform(
    shape: torch.Size, generator: torch.Generator | None, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """Uniform [0, 1) values, determined by ``generator``'s state (the default generator when None).

    On the CPU, torch's Mersenne Twister produces floats at about half the speed of numpy's PCG64, and MVUE draws one
    per group on every backward pass; so one 63-bit draw from ``generator`` seeds a PCG64 stream that draws them.
    """
    if device.type != "cpu" or dtype not in (torch.float32, torch.float64):
        return torch.rand(shape, generator=generator, device=device, dtype=dtype)
    seed = int(torch.randint(0, 2**63 - 1, (), generator=generator))
    stream = np.random.Generator(np.random.PCG64(seed))
    return torch.from_numpy(stream.random(tuple(shape), dtype=np.float32 if dtype == torch.float32 else np.float64))


def _smallest_subnormal(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps)


def _grouped_in_place(tensor: torch.Tensor, axis: int, m: int) -> torch.Tensor:
    """``[outer * groups, M, inner]`` view of ``tensor`` grouped along ``axis``; no copy for a contiguous tensor."""
    outer = math.prod(tensor.shape[:axis])
    inner = math.prod(tensor.shape[axis + 1 :])
    return tensor.reshape(outer * (tensor.shape[axis] // m), m, inner)


def _closed_form_prune(
    values: torch.Tensor, pattern: Pattern, axis: int, remainder: str, generator: torch.Generator | None
) -> torch.Tensor:
    """:func:`mvue_prune` for :func:`_has_closed_form` patterns; ``values`` in the compute dtype, not yet checked."""
    if values.ndim == 0:
        return _water_filling_prune(values, pattern, axis, remainder, generator)  # raises the one scalar error
    dim = normalize_axis(axis, values.ndim)  # `axis` as the caller wrote it stays for the messages
    length = values.shape[dim]
    check_divisible(length, pattern, dim, remainder)
    partial = length % pattern.m
    head = values
    if partial and remainder == "dense":
        tail = values.narrow(dim, length - partial, partial)
        if not torch.isfinite(tail).all():
            raise _non_finite_error(pattern, axis)
        head = values.narrow(dim, 0, length - partial)
    elif partial:  # "pad": zeros complete the last group
        padding = list(values.shape)
        padding[dim] = pattern.m - partial
        head = torch.cat([values, values.new_zeros(padding)], dim)
    pruned = _closed_form_sample(_grouped_in_place(head, dim, pattern.m), pattern, axis, generator).reshape(head.shape)
    if partial and remainder == "dense":
        return torch.cat([pruned, tail], dim)
    return pruned.narrow(dim, 0, length)


# ------------------------------------------------------------------------------------------------ dispatch


def _probabilities(grouped: torch.Tensor, pattern: Pattern, axis: int) -> torch.Tensor:
    """Inclusion probabilities of ``[..., M]`` groups, from the closed form where the pattern has one."""
    if _has_closed_form(pattern):
        return _closed_form_probabilities(grouped.unsqueeze(-1), pattern, axis).squeeze(-1)
    return _water_filling_probabilities(grouped, pattern.n)


def _water_filling_prune(
    values: torch.Tensor, pattern: Pattern, axis: int, remainder: str, generator: torch.Generator | None
) -> torch.Tensor:
    """:func:`mvue_prune` for any pattern: sorted water-filling and exact-N fixed-point systematic sampling."""
    if values.numel() and not torch.isfinite(values).all():
        raise _non_finite_error(pattern, axis)
    grouped, view = to_groups(values, pattern, axis, remainder)
    p_sorted, order, saturated = _sorted_probabilities(grouped, pattern.n)
    kept, used = _systematic_sample(p_sorted, saturated, pattern.n, generator)
    dropped = ~kept
    # A dropped item may have p = 0; dividing by 1 there keeps NaN and inf out of the intermediate values.
    pruned_sorted = torch.gather(grouped, -1, order).div_(used.masked_fill_(dropped, 1.0)).masked_fill_(dropped, 0.0)
    pruned = view.ungroup(torch.empty_like(pruned_sorted).scatter_(-1, order, pruned_sorted))
    return _restore_dense_tail(pruned, view, remainder, values)


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
    probabilities = view.ungroup(_probabilities(grouped, pattern, axis))
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
    p = _probabilities(grouped, pattern, axis)
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
    _check_floating(tensor, remainder)
    values = tensor.to(_compute_dtype(tensor))
    prune = _closed_form_prune if _has_closed_form(pattern) else _water_filling_prune
    return prune(values, pattern, axis, remainder, generator).to(tensor.dtype)
