"""The ONNX -> torch interpreter: a model's main graph as one torch call per node, differentiable and device-agnostic.

It covers the ONNX ops our reference models use (MLPs, CNNs, BERT-style encoders from torch's exporters, PaddleOCR's
CNNs); attribute values an op's implementation does not cover are refused by name when the program is built.
onnx2torch was the alternative; 1.5.15 needs torchvision and has no converter for opset-20 Gelu, so it cannot run our
exports with torch 2.13. The torch backend (:mod:`nmdeploy.runtimes.torch`), conversion statistics on a device and
recovery all run models through :class:`GraphProgram`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

from nmdeploy.errors import InputError
from nmdeploy.graph import dtypes
from nmdeploy.graph.convolution import explicit_pads
from nmdeploy.graph.tensors import to_torch

# ---------------------------------------------------------------------------------------------------------------
# The interpreter's ops: each takes the node's inputs (None for omitted optional ones) and its attributes


def as_tensor(array: np.ndarray) -> torch.Tensor:
    """numpy to torch keeping 0-d arrays 0-d (np.ascontiguousarray, used by graph.tensors.to_torch, makes them 1-d)."""
    return to_torch(array).reshape(array.shape)


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    values = {}
    for attribute in node.attribute:
        value = helper.get_attribute_value(attribute)
        if isinstance(value, onnx.TensorProto):
            value = as_tensor(numpy_helper.to_array(value))
        elif isinstance(value, bytes):
            value = value.decode()
        values[attribute.name] = value
    return values


def _ints(tensor: torch.Tensor | None) -> list[int] | None:
    return None if tensor is None else [int(v) for v in tensor.reshape(-1).tolist()]


def _axes(inputs: list, attrs: dict, position: int) -> list[int] | None:
    """Axes given as an attribute (older opsets) or as an input (newer ones)."""
    if len(inputs) > position and inputs[position] is not None:
        return _ints(inputs[position])
    return attrs.get("axes")


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype.is_floating_point:
        return a / b
    return torch.div(a, b, rounding_mode="trunc")


def _gemm(inputs: list, attrs: dict) -> torch.Tensor:
    a, b = inputs[0], inputs[1]
    a = a.t() if attrs.get("transA", 0) else a
    b = b.t() if attrs.get("transB", 0) else b
    result = attrs.get("alpha", 1.0) * (a @ b)
    if len(inputs) > 2 and inputs[2] is not None:
        result = result + attrs.get("beta", 1.0) * inputs[2]
    return result


def _explicit_pads(attrs: dict, x: torch.Tensor, kernel: Sequence[int]) -> tuple[list[int], list[int]]:
    """(begin, end) pads per spatial axis: the ``pads`` given, or those auto_pad SAME_UPPER/SAME_LOWER implies."""
    return explicit_pads(
        attrs.get("auto_pad", "NOTSET"),
        attrs.get("pads", ()),
        x.shape[2:],
        kernel,
        attrs.get("strides", ()),
        attrs.get("dilations", ()),
    )


def _pad(x: torch.Tensor, begin: list[int], end: list[int], value: float = 0.0) -> torch.Tensor:
    return F.pad(x, [p for pair in zip(reversed(begin), reversed(end), strict=True) for p in pair], value=value)


def _conv(inputs: list, attrs: dict) -> torch.Tensor:
    x, weight = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    spatial = weight.ndim - 2
    begin, end = _explicit_pads(attrs, x, weight.shape[2:])
    if begin != end:
        x = _pad(x, begin, end)
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


_RESIZE_MODES = ("nearest", "linear")
_RESIZE_COORDINATES = ("half_pixel", "pytorch_half_pixel", "half_pixel_symmetric", "asymmetric", "align_corners")
_NEAREST_ROUNDING: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "round_prefer_floor": lambda x: torch.ceil(x - 0.5),
    "round_prefer_ceil": lambda x: torch.floor(x + 0.5),
    "floor": torch.floor,
    "ceil": torch.ceil,
}


def _resize_source(attrs: dict, length: int, resized: int, scale: float) -> torch.Tensor:
    """Where each output position of one axis samples its input, in input coordinates (ONNX Resize's formulas)."""
    position = torch.arange(resized, dtype=torch.float64)
    mode = attrs.get("coordinate_transformation_mode", "half_pixel")
    if mode == "asymmetric":
        return position / scale
    if mode == "align_corners":
        return position * ((length - 1) / (resized - 1)) if resized > 1 else torch.zeros(resized, dtype=torch.float64)
    if mode == "pytorch_half_pixel" and resized == 1:
        return torch.zeros(1, dtype=torch.float64)
    source = (position + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        source = source + length / 2 * (1 - resized / (scale * length))
    return source


def _given(inputs: list, position: int) -> torch.Tensor | None:
    """An optional input that is present and not empty (exporters pass an empty tensor for "not given")."""
    value = inputs[position] if len(inputs) > position else None
    return value if value is not None and value.numel() else None


def _resize(inputs: list, attrs: dict) -> torch.Tensor:
    x, scales, sizes = inputs[0], _given(inputs, 2), _given(inputs, 3)
    scales = None if scales is None else scales.detach().reshape(-1).tolist()
    sizes = _ints(sizes)
    axes = [a % x.ndim for a in attrs.get("axes", range(x.ndim))]
    for position, axis in enumerate(axes):
        length = x.shape[axis]
        if sizes is not None:
            resized = sizes[position]
            scale = resized / length
        else:
            scale = scales[position]
            resized = int(length * scale)
        if resized == length and scale == 1.0:
            continue
        source = _resize_source(attrs, length, resized, scale)
        if attrs.get("mode", "nearest") == "nearest":
            rounding = _NEAREST_ROUNDING[attrs.get("nearest_mode", "round_prefer_floor")]
            index = rounding(source).clamp(0, length - 1).long().to(x.device)
            x = x.index_select(axis, index)
            continue
        low = torch.floor(source)
        weight = (source - low).to(x.dtype).to(x.device)
        below = low.clamp(0, length - 1).long().to(x.device)
        above = (low + 1).clamp(0, length - 1).long().to(x.device)
        shape = [1] * x.ndim
        shape[axis] = resized
        weight = weight.reshape(shape)
        x = x.index_select(axis, below) * (1 - weight) + x.index_select(axis, above) * weight
    return x


def _pool(kind: str) -> Callable[[list, dict], torch.Tensor]:
    def pool(inputs: list, attrs: dict) -> torch.Tensor:
        x = inputs[0]
        kernel = attrs["kernel_shape"]
        spatial = len(kernel)
        begin, end = _explicit_pads(attrs, x, kernel)
        if begin != end:  # MaxPool only (the check refuses AveragePool): padding that never wins the maximum
            x = _pad(x, begin, end, value=-math.inf)
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


def _reshape(inputs: list, attrs: dict) -> torch.Tensor:
    x, shape = inputs[0], _ints(inputs[1])
    if not attrs.get("allowzero", 0):
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return x.reshape(shape)


def _slice(inputs: list, attrs: dict) -> torch.Tensor:
    x = inputs[0]
    starts, ends = _ints(inputs[1]), _ints(inputs[2])
    axes = _ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else list(range(len(starts)))
    steps = _ints(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else [1] * len(starts)
    index: list[slice] = [slice(None)] * x.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        size = x.shape[axis]
        if step < 0:
            raise InputError("Slice with negative steps is not supported by the torch backend; use --backend ort")
        start = max(0, min(size, start + size if start < 0 else start))
        end = max(0, min(size, end + size if end < 0 else end))
        index[axis] = slice(start, end, step)
    return x[tuple(index)]


def _reduce(function: Callable[..., torch.Tensor]) -> Callable[[list, dict], torch.Tensor]:
    def reduce(inputs: list, attrs: dict) -> torch.Tensor:
        x, axes = inputs[0], _axes(inputs, attrs, 1)
        keep = bool(attrs.get("keepdims", 1))
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return x
            axes = list(range(x.ndim))
        return function(x, dim=axes, keepdim=keep)

    return reduce


def _cumsum(inputs: list, attrs: dict) -> torch.Tensor:
    """ONNX CumSum: ``exclusive`` leaves each element out of its own sum, ``reverse`` sums from the end (RoBERTa and
    MPNet exports number positions with it)."""
    x, axis = inputs[0], int(inputs[1].reshape(-1)[0])
    if attrs.get("reverse", 0):
        x = x.flip(axis)
    total = torch.cumsum(x, dim=axis, dtype=x.dtype)  # torch widens int32 to int64; ONNX keeps the type
    if attrs.get("exclusive", 0):
        total = total - x
    return total.flip(axis) if attrs.get("reverse", 0) else total


def _constant(inputs: list, attrs: dict) -> torch.Tensor:
    if "value" in attrs:
        return attrs["value"]
    for key, dtype in (("value_float", torch.float32), ("value_floats", torch.float32), ("value_int", torch.int64)):
        if key in attrs:
            return torch.tensor(attrs[key], dtype=dtype)
    if "value_ints" in attrs:
        return torch.tensor(attrs["value_ints"], dtype=torch.int64)
    raise InputError(f"Constant with attributes {sorted(attrs)} is not supported by the torch backend")


def _layer_norm(inputs: list, attrs: dict) -> torch.Tensor:
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    axis = attrs.get("axis", -1) % x.ndim
    return F.layer_norm(x, x.shape[axis:], scale, bias, attrs.get("epsilon", 1e-5))


def _batch_norm(inputs: list, attrs: dict) -> torch.Tensor:
    x, scale, bias, mean, var = inputs[:5]
    # The running statistics are constants of an inference graph; only scale and bias can be fine-tuned.
    return F.batch_norm(x, mean.detach(), var.detach(), scale, bias, training=False, eps=attrs.get("epsilon", 1e-5))


def _gather(inputs: list, attrs: dict) -> torch.Tensor:
    data, indices = inputs[0], inputs[1]
    axis = attrs.get("axis", 0) % data.ndim
    indices = torch.where(indices < 0, indices + data.shape[axis], indices).long()
    picked = torch.index_select(data, axis, indices.reshape(-1))
    return picked.reshape(data.shape[:axis] + indices.shape + data.shape[axis + 1 :])


def _gather_elements(inputs: list, attrs: dict) -> torch.Tensor:
    data, indices = inputs[0], inputs[1]
    axis = attrs.get("axis", 0) % data.ndim
    return torch.gather(data, axis, torch.where(indices < 0, indices + data.shape[axis], indices).long())


def _flatten(inputs: list, attrs: dict) -> torch.Tensor:
    x = inputs[0]
    axis = attrs.get("axis", 1)
    axis = axis + x.ndim if axis < 0 else axis  # axis == rank is allowed: everything goes into the first dim
    return x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1)


def _unsqueeze(inputs: list, attrs: dict) -> torch.Tensor:
    x, axes = inputs[0], _axes(inputs, attrs, 1)
    rank = x.ndim + len(axes)
    for axis in sorted(a % rank for a in axes):
        x = x.unsqueeze(axis)
    return x


def _squeeze(inputs: list, attrs: dict) -> torch.Tensor:
    x, axes = inputs[0], _axes(inputs, attrs, 1)
    if axes is None:
        return x.squeeze()
    return x.squeeze(tuple(a % x.ndim for a in axes))


def _clip(inputs: list, attrs: dict) -> torch.Tensor:
    low = inputs[1] if len(inputs) > 1 and inputs[1] is not None else attrs.get("min")
    high = inputs[2] if len(inputs) > 2 and inputs[2] is not None else attrs.get("max")
    return torch.clamp(inputs[0], low, high)


def _shape(inputs: list, attrs: dict) -> torch.Tensor:
    dims = list(inputs[0].shape)[attrs.get("start", 0) : attrs.get("end")]
    return torch.tensor(dims, dtype=torch.int64, device=inputs[0].device)


def _constant_of_shape(inputs: list, attrs: dict) -> torch.Tensor:
    value = attrs.get("value", torch.zeros(1))
    return torch.full(_ints(inputs[0]), value.reshape(-1)[0].item(), dtype=value.dtype, device=inputs[0].device)


def _variadic(function: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[list, dict], torch.Tensor]:
    def apply(inputs: list, attrs: dict) -> torch.Tensor:
        result = inputs[0]
        for other in inputs[1:]:
            result = function(result, other)
        return result

    return apply


_OPS: dict[str, Callable[[list, dict], Any]] = {
    "Add": lambda i, a: i[0] + i[1],
    "Sub": lambda i, a: i[0] - i[1],
    "Mul": lambda i, a: i[0] * i[1],
    "Div": lambda i, a: _div(i[0], i[1]),
    "Pow": lambda i, a: torch.pow(i[0], i[1]),
    "Sqrt": lambda i, a: torch.sqrt(i[0]),
    "Exp": lambda i, a: torch.exp(i[0]),
    "Log": lambda i, a: torch.log(i[0]),
    "Neg": lambda i, a: -i[0],
    "Abs": lambda i, a: torch.abs(i[0]),
    "Reciprocal": lambda i, a: torch.reciprocal(i[0]),
    "Erf": lambda i, a: torch.erf(i[0]),
    "Tanh": lambda i, a: torch.tanh(i[0]),
    "Sigmoid": lambda i, a: torch.sigmoid(i[0]),
    "HardSigmoid": lambda i, a: torch.clamp(a.get("alpha", 0.2) * i[0] + a.get("beta", 0.5), 0.0, 1.0),
    "HardSwish": lambda i, a: F.hardswish(i[0]),
    "Relu": lambda i, a: F.relu(i[0]),
    "LeakyRelu": lambda i, a: F.leaky_relu(i[0], a.get("alpha", 0.01)),
    "Gelu": lambda i, a: F.gelu(i[0], approximate=a.get("approximate", "none")),
    "Softmax": lambda i, a: torch.softmax(i[0], a.get("axis", -1)),
    "LogSoftmax": lambda i, a: torch.log_softmax(i[0], a.get("axis", -1)),
    "Clip": _clip,
    "Max": _variadic(torch.maximum),
    "Min": _variadic(torch.minimum),
    "Sum": _variadic(torch.add),
    "Equal": lambda i, a: i[0] == i[1],
    "Less": lambda i, a: i[0] < i[1],
    "Greater": lambda i, a: i[0] > i[1],
    "GreaterOrEqual": lambda i, a: i[0] >= i[1],
    "LessOrEqual": lambda i, a: i[0] <= i[1],
    "Xor": lambda i, a: i[0] ^ i[1],
    "IsNaN": lambda i, a: torch.isnan(i[0]),
    "IsInf": lambda i, a: torch.isinf(i[0]),
    "Floor": lambda i, a: torch.floor(i[0]),
    "Ceil": lambda i, a: torch.ceil(i[0]),
    "Sin": lambda i, a: torch.sin(i[0]),
    "Cos": lambda i, a: torch.cos(i[0]),
    "Not": lambda i, a: ~i[0],
    "And": lambda i, a: i[0] & i[1],
    "Or": lambda i, a: i[0] | i[1],
    "Where": lambda i, a: torch.where(i[0], i[1], i[2]),
    "Identity": lambda i, a: i[0],
    "Dropout": lambda i, a: i[0],
    "Cast": lambda i, a: i[0].to(dtypes.torch_dtype(a["to"])),
    "MatMul": lambda i, a: torch.matmul(i[0], i[1]),
    "Gemm": _gemm,
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "Resize": _resize,
    "BatchNormalization": _batch_norm,
    "LayerNormalization": _layer_norm,
    "MaxPool": _pool("MaxPool"),
    "AveragePool": _pool("AveragePool"),
    "GlobalAveragePool": lambda i, a: i[0].mean(dim=tuple(range(2, i[0].ndim)), keepdim=True),
    "GlobalMaxPool": lambda i, a: i[0].amax(dim=tuple(range(2, i[0].ndim)), keepdim=True),
    "Flatten": _flatten,
    "Reshape": _reshape,
    "Transpose": lambda i, a: i[0].permute(a.get("perm", list(reversed(range(i[0].ndim))))),
    "Squeeze": _squeeze,
    "Unsqueeze": _unsqueeze,
    "Concat": lambda i, a: torch.cat([t for t in i if t is not None], dim=a["axis"]),
    "CumSum": _cumsum,
    "Slice": _slice,
    "Gather": _gather,
    "GatherElements": _gather_elements,
    "Shape": _shape,
    "Expand": lambda i, a: i[0] * torch.ones(_ints(i[1]), dtype=i[0].dtype, device=i[0].device),
    "ConstantOfShape": _constant_of_shape,
    "Constant": _constant,
    "Range": lambda i, a: torch.arange(i[0].item(), i[1].item(), i[2].item(), dtype=i[0].dtype, device=i[0].device),
    "ReduceMean": _reduce(torch.mean),
    "ReduceSum": _reduce(torch.sum),
    "ReduceMax": _reduce(torch.amax),
    "ReduceMin": _reduce(torch.amin),
    "ReduceL1": _reduce(partial(torch.linalg.vector_norm, ord=1)),
    "ReduceL2": _reduce(partial(torch.linalg.vector_norm, ord=2)),
    "ReduceSumSquare": _reduce(lambda x, dim, keepdim: torch.sum(x * x, dim=dim, keepdim=keepdim)),
    "ReduceLogSumExp": _reduce(torch.logsumexp),
}
SUPPORTED_OPS = tuple(sorted(_OPS))


# What each op's implementation above covers; a node outside it is refused when the program is built, with the
# attribute named, rather than computed differently from ONNX Runtime.


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


def _check_resize(attrs: dict, opset: int) -> str:
    choices = {
        "mode": ("nearest", _RESIZE_MODES),
        "coordinate_transformation_mode": ("half_pixel", _RESIZE_COORDINATES),
        "nearest_mode": ("round_prefer_floor", tuple(_NEAREST_ROUNDING)),
        "keep_aspect_ratio_policy": ("stretch", ("stretch",)),
    }
    if opset < 11:
        return f"opset {opset} (inputs X, scales; supported from opset 11: X, roi, scales, sizes)"
    for name, (default, supported) in choices.items():
        value = attrs.get(name, default)
        if value not in supported:
            return f"{name}={value!r} (supported: {', '.join(supported)})"
    if attrs.get("antialias", 0):
        return "antialias=1 (supported: 0)"
    return ""


_CHECKS: dict[str, Callable[[dict, int], str]] = {
    "Conv": _check_padding,
    "ConvTranspose": _check_conv_transpose,
    "MaxPool": _check_padding,
    "AveragePool": _check_average_pool,
    "Resize": _check_resize,
}


# ---------------------------------------------------------------------------------------------------------------
# The interpreter


def _opset(model: onnx.ModelProto) -> int:
    return next((entry.version for entry in model.opset_import if entry.domain in ("", "ai.onnx")), 1)


def unsupported_nodes(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, str]]:
    """The nodes of the main graph that the interpreter cannot run, each with the reason: other domains, ops not
    in SUPPORTED_OPS, or an attribute value outside what the op's implementation covers."""
    opset, found = _opset(model), []
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in _OPS:
            found.append((node, f"{describe_node(node)} (supported ops: {', '.join(SUPPORTED_OPS)})"))
        elif node.op_type in _CHECKS:
            reason = _CHECKS[node.op_type](node_attributes(node), opset)
            if reason:
                found.append((node, f"{describe_node(node)} with {reason}"))
    return found


def describe_node(node: onnx.NodeProto) -> str:
    """``'name' (domain.Op)``: how messages name a node."""
    return f"'{node.name or node.output[0]}' ({node.domain + '.' if node.domain else ''}{node.op_type})"


class GraphProgram:
    """The main graph compiled once into one torch call per node, attributes parsed up front.

    :meth:`run` executes it on a mapping of named tensors (initializers and inputs). Every op is a plain torch
    function, so the result is differentiable in any float tensor given to it: the backend runs it under
    ``inference_mode``, recovery fine-tuning runs it with gradients. A value given by name replaces the Constant node
    that would produce it, so weights stored in Constant nodes can be trained like initializers.
    ``linear_overrides`` replaces the weight of named MatMul/Gemm nodes by a prepared one (the semi-structured copies
    of the torch backend). Constant nodes' values are made on ``device``, where the values given to :meth:`run` are:
    torch mixes devices only for 0-d tensors, and exporters write 1-element constants.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        linear_overrides: dict[str, torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
    ):
        missing = unsupported_nodes(model)
        if missing:
            raise InputError(f"the torch interpreter cannot run node {missing[0][1]}")
        overrides = linear_overrides or {}
        self.output_names = tuple(output.name for output in model.graph.output)
        self._steps = [
            (tuple(node.input), tuple(node.output), _step(node, overrides.get(node.name or node.output[0]), device))
            for node in model.graph.node
        ]

    def run(self, values: dict[str, torch.Tensor], keep: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """The graph outputs, and the intermediate tensors named in ``keep``, computed from ``values``."""
        values = dict(values)
        for inputs, outputs, step in self._steps:
            if isinstance(step, _ConstantStep) and outputs[0] in values:
                continue  # a value given by name replaces the Constant node's (recovery trains stored constants)
            result = step([values[name] if name else None for name in inputs])
            for name, value in zip(outputs, result if isinstance(result, tuple) else (result,), strict=False):
                if name:
                    values[name] = value
        return {name: values[name] for name in (*self.output_names, *keep)}


class _ConstantStep:
    """A Constant node's step: its value, parsed once; recognised by :meth:`GraphProgram.run`."""

    def __init__(self, attrs: dict, device: torch.device | str):
        self.value = _constant([], attrs).to(device)

    def __call__(self, inputs: list) -> torch.Tensor:
        return self.value


def _step(
    node: onnx.NodeProto, sparse_weight: torch.Tensor | None, device: torch.device | str
) -> Callable[[list], Any]:
    """The node's computation with its attributes parsed once, not on every inference."""
    attrs = node_attributes(node)
    if node.op_type == "Constant":
        return _ConstantStep(attrs, device)
    if sparse_weight is not None:
        return lambda inputs: _prepared_linear(node.op_type, attrs, inputs, sparse_weight)
    op = _OPS[node.op_type]
    return lambda inputs: op(inputs, attrs)


def _prepared_linear(op_type: str, attrs: dict, inputs: list, weight: torch.Tensor) -> torch.Tensor:
    """MatMul/Gemm through a prepared [out, in] weight (semi-structured): F.linear on the input as a matrix."""
    x = inputs[0]
    result = F.linear(x.reshape(-1, x.shape[-1]).contiguous(), weight).reshape(*x.shape[:-1], -1)
    if op_type == "Gemm":
        result = attrs.get("alpha", 1.0) * result
        if len(inputs) > 2 and inputs[2] is not None:
            result = result + attrs.get("beta", 1.0) * inputs[2]
    return result
