"""Convolutions, pooling and padding: the ops that read a spatial layout."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from nmdeploy.runtimes.interpreter_ops.common import explicit_padding, given, ints, pad_constant
from nmdeploy.runtimes.interpreter_ops.resize import resize


def _conv(inputs: list, attrs: dict) -> torch.Tensor:
    x, weight = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    spatial = weight.ndim - 2
    begin, end = explicit_padding(attrs, x, weight.shape[2:])
    if begin != end:
        x = pad_constant(x, begin, end)
        begin = [0] * spatial
    conv = (F.conv1d, F.conv2d, F.conv3d)[spatial - 1]
    return conv(
        x,
        weight,
        bias,
        stride=attrs.get("strides", 1),
        padding=begin,
        dilation=attrs.get("dilations", 1),
        groups=attrs.get("group", 1),
    )


def _conv_transpose(inputs: list, attrs: dict) -> torch.Tensor:
    x, weight = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    spatial = weight.ndim - 2
    pads = attrs.get("pads", [0] * 2 * spatial)
    begin, end = pads[:spatial], pads[spatial:]
    symmetric = begin == end
    result = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[spatial - 1](
        x,
        weight,
        bias,
        stride=attrs.get("strides", 1),
        padding=begin if symmetric else 0,
        output_padding=attrs.get("output_padding", 0),
        groups=attrs.get("group", 1),
        dilation=attrs.get("dilations", 1),
    )
    if symmetric:
        return result
    # Uneven pads trim the full output by a different amount at each end of every spatial axis.
    crop = [slice(first, size - last) for first, last, size in zip(begin, end, result.shape[2:], strict=True)]
    return result[(slice(None), slice(None), *crop)]


def _pool(kind: str) -> Callable[[list, dict], torch.Tensor]:
    def pool(inputs: list, attrs: dict) -> torch.Tensor:
        x = inputs[0]
        kernel = attrs["kernel_shape"]
        spatial = len(kernel)
        begin, end = explicit_padding(attrs, x, kernel)
        if begin != end:  # MaxPool only (the check refuses AveragePool): padding that never wins the maximum
            x = pad_constant(x, begin, end, value=-math.inf)
            begin = [0] * spatial
        options = {
            "stride": attrs.get("strides", [1] * spatial),  # ONNX's default, not torch's (the kernel size)
            "padding": begin,
            "ceil_mode": bool(attrs.get("ceil_mode", 0)),
        }
        if kind == "MaxPool":
            return (F.max_pool1d, F.max_pool2d, F.max_pool3d)[spatial - 1](
                x, kernel, dilation=attrs.get("dilations", 1), **options
            )
        include_pad = bool(attrs.get("count_include_pad", 0))
        return (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[spatial - 1](
            x, kernel, count_include_pad=include_pad, **options
        )

    return pool


def _depth_to_space(inputs: list, attrs: dict) -> torch.Tensor:
    x, size = inputs[0], attrs["blocksize"]
    batch, channels, height, width = x.shape
    if attrs.get("mode", "DCR") == "CRD":
        return F.pixel_shuffle(x, size)
    x = x.reshape(batch, size, size, channels // size**2, height, width).permute(0, 3, 4, 1, 5, 2)
    return x.reshape(batch, channels // size**2, height * size, width * size)


def _space_to_depth(inputs: list, attrs: dict) -> torch.Tensor:
    x, size = inputs[0], attrs["blocksize"]
    batch, channels, height, width = x.shape
    x = x.reshape(batch, channels, height // size, size, width // size, size).permute(0, 3, 5, 1, 2, 4)
    return x.reshape(batch, channels * size * size, height // size, width // size)


def _local_response_norm(inputs: list, attrs: dict) -> torch.Tensor:
    """ONNX LRN: the window over channels runs from c - floor((size - 1) / 2) to c + ceil((size - 1) / 2)."""
    x, size = inputs[0], attrs["size"]
    squares = F.pad(x * x, [0, 0] * (x.ndim - 2) + [(size - 1) // 2, size // 2])
    window = squares.unfold(1, size, 1).sum(-1)
    return x / (attrs.get("bias", 1.0) + attrs.get("alpha", 1e-4) / size * window) ** attrs.get("beta", 0.75)


def _group_norm(inputs: list, attrs: dict) -> torch.Tensor:
    """GroupNormalization; scale and bias per channel (opset 21) or per group (opset 18)."""
    x, scale, bias = inputs[:3]
    groups = attrs["num_groups"]
    shape = x.shape
    grouped = x.reshape(shape[0], groups, -1)
    mean = grouped.mean(-1, keepdim=True)
    variance = grouped.var(-1, unbiased=False, keepdim=True)
    normalised = ((grouped - mean) / torch.sqrt(variance + attrs.get("epsilon", 1e-5))).reshape(shape)
    if scale.numel() != shape[1]:
        scale, bias = (t.repeat_interleave(shape[1] // groups) for t in (scale, bias))
    broadcast = [1, -1] + [1] * (x.ndim - 2)
    return normalised * scale.reshape(broadcast) + bias.reshape(broadcast)


def _upsample(inputs: list, attrs: dict) -> torch.Tensor:
    """Upsample (opsets 7-9, Resize's predecessor): output position i reads input i / scale, nearest by floor."""
    scales = inputs[1] if len(inputs) > 1 and inputs[1] is not None else torch.tensor(attrs["scales"])
    return resize([inputs[0], scales.float()], {"mode": attrs.get("mode", "nearest")})  # Resize's opset-10 form


_PAD_MODES = ("constant", "reflect", "edge", "wrap")


def _padded_positions(mode: str, length: int, begin: int, end: int) -> torch.Tensor:
    """For one axis, the input position each output position copies under ``mode`` (negative pads crop)."""
    position = torch.arange(-begin, length + end)
    if mode == "edge":
        return position.clamp(0, length - 1)
    if mode == "wrap":
        return position.remainder(length)
    period = 2 * (length - 1)  # reflect: mirrored about the first and last element, which are not repeated
    if period == 0:
        return torch.zeros_like(position)
    folded = position.abs().remainder(period)
    return torch.where(folded >= length, period - folded, folded)


def _pad(inputs: list, attrs: dict) -> torch.Tensor:
    """ONNX Pad in every mode: pads as an input (opset 11+) or an attribute, optional axes (opset 18+)."""
    x = inputs[0]
    pads = ints(given(inputs, 1)) if given(inputs, 1) is not None else list(attrs.get("pads", []))
    value = given(inputs, 2)
    value = float(value.reshape(-1)[0]) if value is not None else float(attrs.get("value", 0.0))
    axes = ints(given(inputs, 3)) if given(inputs, 3) is not None else list(range(x.ndim))
    axes = [a % x.ndim for a in axes]
    begin, end = [0] * x.ndim, [0] * x.ndim
    for position, axis in enumerate(axes):
        begin[axis], end[axis] = pads[position], pads[position + len(axes)]
    mode = attrs.get("mode", "constant")
    if mode == "constant":
        return pad_constant(x, begin, end, value)
    for axis in range(x.ndim):
        if begin[axis] or end[axis]:
            index = _padded_positions(mode, x.shape[axis], begin[axis], end[axis]).to(x.device)
            x = x.index_select(axis, index)
    return x


def _check_pad(attrs: dict, opset: int) -> str:
    mode = attrs.get("mode", "constant")
    return "" if mode in _PAD_MODES else f"mode={mode!r} (supported: {', '.join(_PAD_MODES)})"


def _check_padding(attrs: dict, opset: int) -> str:
    auto_pad = attrs.get("auto_pad", "NOTSET")
    supported = ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER")
    return "" if auto_pad in supported else f"auto_pad={auto_pad!r} (supported: {', '.join(supported)})"


def _check_average_pool(attrs: dict, opset: int) -> str:
    # Uneven padding changes which positions an average counts; only even pads map onto torch's pooling.
    pads, auto_pad = attrs.get("pads", []), attrs.get("auto_pad", "NOTSET")
    if pads[: len(pads) // 2] != pads[len(pads) // 2 :]:
        return f"asymmetric pads={pads}"
    return "" if auto_pad in ("NOTSET", "VALID") else f"auto_pad={auto_pad!r} (supported: NOTSET, VALID)"


def _check_conv_transpose(attrs: dict, opset: int) -> str:
    if "output_shape" in attrs:
        return "output_shape (give pads and output_padding instead)"
    auto_pad = attrs.get("auto_pad", "NOTSET")
    return "" if auto_pad in ("NOTSET", "VALID") else f"auto_pad={auto_pad!r} (supported: NOTSET, VALID)"


CHECKS: dict[str, Callable[[dict, int], str]] = {
    "Conv": _check_padding,
    "ConvTranspose": _check_conv_transpose,
    "MaxPool": _check_padding,
    "AveragePool": _check_average_pool,
    "Pad": _check_pad,
}


OPS: dict[str, Callable[[list, dict], torch.Tensor]] = {
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "MaxPool": _pool("MaxPool"),
    "AveragePool": _pool("AveragePool"),
    "Pad": _pad,
    "DepthToSpace": _depth_to_space,
    "SpaceToDepth": _space_to_depth,
    "LRN": _local_response_norm,
    "GroupNormalization": _group_norm,
    "Upsample": _upsample,
}
