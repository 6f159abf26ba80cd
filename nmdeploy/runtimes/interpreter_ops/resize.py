"""ONNX Resize: every mode (nearest, linear, cubic), coordinate transformation and aspect-ratio policy, axis by axis.

Each resized axis gathers its taps from the input with ``index_select`` and weighs them, so gradients flow to the
input through every mode. Positions that ``tf_crop_and_resize`` maps outside the input take
``extrapolation_value``. Antialiasing (a wider filter when downsampling) is refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from nmdeploy.runtimes.interpreter_ops.common import given, ints

MODES = ("nearest", "linear", "cubic")
COORDINATES = (
    "half_pixel",
    "pytorch_half_pixel",
    "half_pixel_symmetric",
    "asymmetric",
    "align_corners",
    "tf_crop_and_resize",
)
ASPECT_POLICIES = ("stretch", "not_larger", "not_smaller")
NEAREST_ROUNDING: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "round_prefer_floor": lambda x: torch.ceil(x - 0.5),
    "round_prefer_ceil": lambda x: torch.floor(x + 0.5),
    "floor": torch.floor,
    "ceil": torch.ceil,
}


def _source(attrs: dict, length: int, resized: int, scale: float, roi: tuple[float, float]) -> torch.Tensor:
    """Where each output position of one axis samples its input, in input coordinates (ONNX Resize's formulas)."""
    position = torch.arange(resized, dtype=torch.float64)
    mode = attrs.get("coordinate_transformation_mode", "half_pixel")
    if mode == "asymmetric":
        return position / scale
    if mode == "align_corners":
        return position * ((length - 1) / (resized - 1)) if resized > 1 else torch.zeros(resized, dtype=torch.float64)
    if mode == "tf_crop_and_resize":
        start, end = roi
        if resized == 1:
            return torch.full((1,), 0.5 * (start + end) * (length - 1), dtype=torch.float64)
        return start * (length - 1) + position * ((end - start) * (length - 1) / (resized - 1))
    if mode == "pytorch_half_pixel" and resized == 1:
        return torch.zeros(1, dtype=torch.float64)
    source = (position + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        source = source + length / 2 * (1 - resized / (scale * length))
    return source


def _cubic_weights(fraction: torch.Tensor, a: float) -> list[torch.Tensor]:
    """Keys' cubic convolution weights of the taps at floor - 1 .. floor + 2 for the offset ``fraction``."""
    weights = []
    for distance in (fraction + 1, fraction, 1 - fraction, 2 - fraction):
        near = ((a + 2) * distance - (a + 3)) * distance * distance + 1
        far = ((a * distance - 5 * a) * distance + 8 * a) * distance - 4 * a
        weights.append(torch.where(distance <= 1, near, far))
    return weights


def _taps(attrs: dict, source: torch.Tensor, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(input positions, weights) of the taps each output position sums, for the node's mode."""
    mode = attrs.get("mode", "nearest")
    if mode == "nearest":
        rounding = NEAREST_ROUNDING[attrs.get("nearest_mode", "round_prefer_floor")]
        return [rounding(source).clamp(0, length - 1).long()], [torch.ones_like(source)]
    low = torch.floor(source)
    fraction = source - low
    if mode == "linear":
        positions, weights = [low, low + 1], [1 - fraction, fraction]
    else:
        positions = [low - 1, low, low + 1, low + 2]
        weights = _cubic_weights(fraction, attrs.get("cubic_coeff_a", -0.75))
    if mode == "cubic" and attrs.get("exclude_outside", 0):
        # Taps outside the input get no weight; the others are renormalised to sum to 1.
        inside = [(p >= 0) & (p <= length - 1) for p in positions]
        weights = [torch.where(i, w, torch.zeros_like(w)) for i, w in zip(inside, weights, strict=True)]
        total = sum(weights)
        weights = [w / total for w in weights]
    return [p.clamp(0, length - 1).long() for p in positions], weights


def _output_sizes(x: torch.Tensor, attrs: dict, axes: list[int], scales, sizes) -> tuple[list[int], list[float]]:
    """The resized length and the scale of every axis in ``axes``, with ``keep_aspect_ratio_policy`` applied."""
    lengths = [x.shape[axis] for axis in axes]
    if sizes is None:
        return [int(math.floor(length * scale)) for length, scale in zip(lengths, scales, strict=True)], list(scales)
    policy = attrs.get("keep_aspect_ratio_policy", "stretch")
    if policy == "stretch":
        return list(sizes), [size / length for size, length in zip(sizes, lengths, strict=True)]
    ratios = [size / length for size, length in zip(sizes, lengths, strict=True)]
    scale = min(ratios) if policy == "not_larger" else max(ratios)
    return [int(math.floor(length * scale + 0.5)) for length in lengths], [scale] * len(axes)


def resize(inputs: list, attrs: dict) -> torch.Tensor:
    if len(inputs) == 2:  # opset 10: X and scales, sampled as Upsample did (asymmetric, nearest by floor)
        legacy = {"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
        return resize([inputs[0], None, inputs[1]], {**attrs, **legacy})
    x, roi, scales, sizes = inputs[0], given(inputs, 1), given(inputs, 2), given(inputs, 3)
    scales = None if scales is None else scales.detach().reshape(-1).tolist()
    axes = [a % x.ndim for a in attrs.get("axes", range(x.ndim))]
    roi = None if roi is None else roi.detach().reshape(-1).tolist()
    resized_sizes, axis_scales = _output_sizes(x, attrs, axes, scales, ints(sizes) if sizes is not None else None)
    crop = attrs.get("coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize"
    for position, axis in enumerate(axes):
        length, resized, scale = x.shape[axis], resized_sizes[position], axis_scales[position]
        if resized == length and scale == 1.0 and not crop:
            continue
        window = (roi[position], roi[position + len(axes)]) if roi is not None else (0.0, 1.0)
        source = _source(attrs, length, resized, scale, window)
        positions, weights = _taps(attrs, source, length)
        shape = [1] * x.ndim
        shape[axis] = resized
        picked = [x.index_select(axis, p.to(x.device)) for p in positions]
        if len(picked) == 1:
            result = picked[0]
        else:
            weighed = zip(picked, weights, strict=True)
            result = sum(tap * w.to(x.dtype).to(x.device).reshape(shape) for tap, w in weighed)
        if crop:
            outside = ((source < 0) | (source > length - 1)).to(x.device).reshape(shape)
            extrapolated = torch.full((), attrs.get("extrapolation_value", 0.0), dtype=x.dtype, device=x.device)
            result = torch.where(outside, extrapolated, result)
        x = result
    return x


def check_resize(attrs: dict, opset: int) -> str:
    choices = {
        "mode": ("nearest", MODES),
        "coordinate_transformation_mode": ("half_pixel", COORDINATES),
        "nearest_mode": ("round_prefer_floor", tuple(NEAREST_ROUNDING)),
        "keep_aspect_ratio_policy": ("stretch", ASPECT_POLICIES),
    }
    if opset < 10:
        return f"opset {opset} (Resize is defined from opset 10)"
    for name, (default, supported) in choices.items():
        value = attrs.get(name, default)
        if value not in supported:
            return f"{name}={value!r} (supported: {', '.join(supported)})"
    if attrs.get("antialias", 0):
        return "antialias=1 (supported: 0)"
    return ""
