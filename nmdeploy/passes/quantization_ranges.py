"""Quantization math on numpy arrays: symmetric scales, quantizing values to INT8 or FP8 E4M3, and the clipping
range of an activation from streamed statistics (max, percentile, MSE search, entropy).

The range methods are a registry (:data:`RANGE_METHODS`, :mod:`nmdeploy.registry`): each is a function
``(histogram, precision, percentile) -> amax`` registered with ``@range_method(name, help=..., **options)``;
``precisions`` limits the types it serves (with ``why``), ``auto_candidate=False`` keeps it out of the ``auto``
choice. ``--range-method``'s help and every check read the registry.

Activations are seen one batch at a time, through the streamed statistics of :mod:`nmdeploy.calibration.observers`
(an :class:`AbsHistogram` of |x| per tensor); the range functions read only that histogram. Everything is symmetric
(zero point 0), as TensorRT's explicit quantization wants, so only |x| matters. :func:`smoothing_scales` are
SmoothQuant's per-channel factors, from the calibration's per-channel maxima.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from nmdeploy.calibration.observers import AbsHistogram
from nmdeploy.errors import InputError
from nmdeploy.masks.rounding import GRID_MAX
from nmdeploy.registry import Registry

QUANTIZED_MAX: dict[str, float] = GRID_MAX
"""The largest quantized magnitude of each precision: INT8 symmetric [-127, 127] (TensorRT leaves -128 out), FP8
E4M3FN's largest finite value."""

QUANTIZED_DTYPES: dict[str, np.dtype] = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}

RANGE_METHODS: Registry = Registry("range method")
range_method = RANGE_METHODS.register
DEFAULT_PERCENTILE = 99.99
ENTROPY_LEVELS = 128  # positive INT8 levels that the entropy search quantizes the histogram into


def scales_for(amax: np.ndarray | float, precision: str) -> np.ndarray:
    """float32 scales mapping |x| <= amax onto the quantized range; a channel whose scale would not be a positive
    normal float32 (all zero, or so small, 1e-44, that amax / 448 underflows) gets scale 1, so its values quantize to
    zero and no scale is zero or subnormal (TensorRT takes positive scales only)."""
    amax = np.asarray(amax, dtype=np.float32)
    scales = amax / np.float32(QUANTIZED_MAX[precision])
    return np.where(scales >= np.finfo(np.float32).tiny, scales, np.float32(1.0)).astype(np.float32)


def quantize(values: np.ndarray, scale: np.ndarray | float, precision: str) -> np.ndarray:
    """``values / scale`` in the quantized type (``scale`` broadcast against ``values``): INT8 rounded half to even
    and clipped to [-127, 127]; FP8 E4M3FN clipped to +-448, then rounded to nearest. Zero maps to zero exactly."""
    limit = QUANTIZED_MAX[precision]
    scaled = np.clip(np.asarray(values, dtype=np.float32) / np.asarray(scale, dtype=np.float32), -limit, limit)
    if precision == "int8":
        return np.rint(scaled).astype(np.int8)
    return scaled.astype(QUANTIZED_DTYPES[precision])


def fake_quantize(values: np.ndarray, amax: float, precision: str) -> np.ndarray:
    """What a quantize-dequantize pair with the scale for ``amax`` makes of ``values`` (float32)."""
    scale = scales_for(amax, precision)
    return quantize(values, scale, precision).astype(np.float32) * scale


def channel_amax(weight: np.ndarray, axis: int) -> np.ndarray:
    """max |w| of every slice along ``axis`` (the output channels), as a vector."""
    magnitude = np.abs(np.asarray(weight, dtype=np.float32))
    others = tuple(d for d in range(magnitude.ndim) if d != axis)
    return magnitude.max(axis=others) if others else magnitude


def check_range_method(method: str, precision: str) -> str:
    """``method`` if it is registered and serves ``precision``, else an InputError that says what does."""
    entry = RANGE_METHODS.entry(method)
    served = entry.options.get("precisions")
    if served is not None and precision not in served:
        others = [item.name for item in RANGE_METHODS.entries() if item.options.get("auto_candidate", True)]
        others = [name for name in others if _serves(name, precision)]
        raise InputError(f"the {method} method {entry.options['why']}; use {_or(others)} for {precision}")
    return method


def _serves(method: str, precision: str) -> bool:
    served = RANGE_METHODS.entry(method).options.get("precisions")
    return served is None or precision in served


def _or(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def activation_amax(
    histogram: AbsHistogram, method: str, precision: str, *, percentile: float = DEFAULT_PERCENTILE
) -> float:
    """The clipping range of one activation by the registered ``method`` ("max", "percentile", "mse", "entropy",
    ...); an all-zero activation's is 0 whatever the method."""
    compute = RANGE_METHODS.lookup(method)
    check_range_method(method, precision)
    if histogram.max_abs == 0.0:
        return histogram.max_abs
    return float(compute(histogram, precision, percentile))


def relative_error(histogram: AbsHistogram, amax: float, precision: str) -> float:
    """The share of the tensor's energy that quantize-dequantize with the range ``amax`` loses: sum (x - q(x))^2 /
    sum x^2 over the histogram (every bin's count at its centre); 0 for an all-zero tensor."""
    centres, counts = _occupied(histogram)
    energy = float(np.dot(counts, centres**2))
    if energy == 0.0:
        return 0.0
    return float(np.dot(counts, (centres - fake_quantize(centres, amax, precision)) ** 2)) / energy


def percentile_amax(histogram: AbsHistogram, percentile: float) -> float:
    """The upper edge of the bin where the cumulative count of |x| reaches ``percentile`` % (never past max |x|)."""
    if not 0.0 < percentile <= 100.0:
        raise InputError(f"percentile must be in (0, 100], got {percentile}")
    cumulative = np.cumsum(histogram.counts)
    position = int(np.searchsorted(cumulative, cumulative[-1] * percentile / 100.0))
    return min(histogram.max_abs, (position + 1) * histogram.width)


def mse_amax(histogram: AbsHistogram, precision: str, candidates: int = 128) -> float:
    """The clipping range, among ``candidates`` evenly spaced up to max |x|, whose quantize-dequantize error
    (squared, every bin's count at its centre) is smallest."""
    centres, counts = _occupied(histogram)
    grid = histogram.max_abs * np.arange(1, candidates + 1) / candidates
    errors = [float(np.dot(counts, (centres - fake_quantize(centres, amax, precision)) ** 2)) for amax in grid]
    return float(grid[int(np.argmin(errors))])


def entropy_amax(histogram: AbsHistogram, levels: int = ENTROPY_LEVELS, candidates: int = 128) -> float:
    """TensorRT's entropy calibration on |x|: the clipping bin count i whose reference distribution (bins below i,
    the rest folded into the last) loses the least information (KL divergence) when merged into ``levels`` levels.

    Exact zeros are left out: they quantize exactly whatever the range, and a ReLU's spike of them would otherwise
    pull the range down (the digits CNN: top-1 98.67 % with them, 99.11 % = 2:4 fp32 without)."""
    counts = histogram.counts.astype(np.float64)
    counts[0] -= histogram.zeros
    last = int(np.nonzero(counts)[0].max()) + 1
    if last <= levels:
        return histogram.max_abs
    best, best_divergence = last, np.inf
    for i in np.unique(np.linspace(levels, last, candidates).astype(np.int64)):
        divergence = clipping_divergence(counts, int(i), levels)
        if divergence < best_divergence:
            best, best_divergence = int(i), divergence
    return min(histogram.max_abs, best * histogram.width)


def clipping_divergence(counts: np.ndarray, clip: int, levels: int) -> float:
    """KL(P || Q): P the first ``clip`` bins with the outliers added to the last; Q those bins merged into
    ``levels`` groups, each group's mass spread evenly over its non-empty bins."""
    reference = counts[:clip].copy()
    reference[-1] += counts[clip:].sum()
    starts = (np.arange(levels) * clip) // levels
    occupied = (counts[:clip] > 0).astype(np.float64)
    mass = np.add.reduceat(counts[:clip], starts)
    filled = np.add.reduceat(occupied, starts)
    group = np.repeat(np.arange(levels), np.diff(np.append(starts, clip)))
    expanded = np.where(occupied > 0, mass[group] / np.maximum(filled[group], 1.0), 0.0)
    p = reference / reference.sum()
    q = expanded / max(expanded.sum(), 1e-300)
    present = p > 0
    return float(np.sum(p[present] * np.log(p[present] / np.maximum(q[present], 1e-12))))


def _occupied(histogram: AbsHistogram) -> tuple[np.ndarray, np.ndarray]:
    occupied = histogram.counts > 0
    return histogram.centres()[occupied], histogram.counts[occupied].astype(np.float64)


def choose_range(
    histogram: AbsHistogram,
    sample: np.ndarray,
    weights: list[np.ndarray],
    precision: str,
    *,
    percentile: float = DEFAULT_PERCENTILE,
) -> tuple[str, float]:
    """The "auto" method for a GEMM input: of the ranges max, percentile, mse and entropy (INT8) give, the one whose
    quantize-dequantize of ``sample`` changes the layers' outputs (``sample @ w`` for each ``weights`` [K, N]) least,
    relative to their size; ties go to the earlier method."""
    candidates = [
        entry.name
        for entry in RANGE_METHODS.entries()
        if entry.options.get("auto_candidate", True) and _serves(entry.name, precision)
    ]
    best = ("max", histogram.max_abs, np.inf)
    for method in candidates:
        amax = activation_amax(histogram, method, precision, percentile=percentile)
        error = fake_quantize(sample, amax, precision) - sample
        loss = sum(float(np.sum((error @ w) ** 2)) / max(float(np.sum((sample @ w) ** 2)), 1e-30) for w in weights)
        if loss < best[2]:
            best = (method, amax, loss)
    return best[0], best[1]


@range_method("max", help="max |x|")
def max_range(histogram: AbsHistogram, precision: str, percentile: float) -> float:
    return histogram.max_abs


@range_method("percentile", help="a percentile of |x| (--percentile)")
def percentile_range(histogram: AbsHistogram, precision: str, percentile: float) -> float:
    return percentile_amax(histogram, percentile)


@range_method("mse", help="the range with the least quantization error")
def mse_range(histogram: AbsHistogram, precision: str, percentile: float) -> float:
    return mse_amax(histogram, precision)


@range_method("entropy", help="TensorRT's entropy search, int8 only", precisions=("int8",), why="searches INT8 levels")
def entropy_range(histogram: AbsHistogram, precision: str, percentile: float) -> float:
    return entropy_amax(histogram)


@range_method(
    "auto",
    help="per GEMM input, of the others the one that changes its layers' outputs least; elsewhere entropy for int8, "
    "max for fp8",
    auto_candidate=False,
)
def auto_range(histogram: AbsHistogram, precision: str, percentile: float) -> float:
    raise InputError("the auto method needs the layers' weights and a sample of rows: see choose_range")


def smoothing_scales(activation_max: np.ndarray, weight_max: np.ndarray, alpha: float) -> np.ndarray:
    """SmoothQuant's per-channel factors s = max|x|^alpha / max|w|^(1 - alpha): dividing the activation's channels
    by s and multiplying the weights' matching rows by s leaves the product unchanged and moves the activation's
    outlier channels into the (per-channel quantized) weights. Channels with no signal keep s = 1."""
    if not 0.0 <= alpha <= 1.0:
        raise InputError(f"smoothing strength must be in [0, 1], got {alpha}")
    activation_max = np.asarray(activation_max, dtype=np.float64)
    weight_max = np.asarray(weight_max, dtype=np.float64)
    usable = (activation_max > 0) & (weight_max > 0)
    scales = np.ones_like(activation_max)
    scales[usable] = activation_max[usable] ** alpha / weight_max[usable] ** (1.0 - alpha)
    return np.clip(scales, 1e-5, 1e5).astype(np.float32)
