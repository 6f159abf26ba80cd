"""Element-wise, shape, indexing, reduction and normalisation ops."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from nmdeploy.errors import InputError
from nmdeploy.graph import dtypes
from nmdeploy.runtimes.interpreter_ops.common import OUTPUTS, axes_input, given, ints


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


def _reshape(inputs: list, attrs: dict) -> torch.Tensor:
    x, shape = inputs[0], ints(inputs[1])
    if not attrs.get("allowzero", 0):
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return x.reshape(shape)


def _slice(inputs: list, attrs: dict) -> torch.Tensor:
    x = inputs[0]
    starts, ends = ints(inputs[1]), ints(inputs[2])
    axes = ints(inputs[3]) if len(inputs) > 3 and inputs[3] is not None else list(range(len(starts)))
    steps = ints(inputs[4]) if len(inputs) > 4 and inputs[4] is not None else [1] * len(starts)
    index: list[slice] = [slice(None)] * x.ndim
    backwards = []
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        size = x.shape[axis]
        start, end = start + size if start < 0 else start, end + size if end < 0 else end
        if step < 0:  # torch slices go forwards only: the positions are gathered (ONNX clamps to [-1, size - 1])
            positions = torch.arange(max(-1, min(size - 1, start)), max(-1, min(size - 1, end)), step)
            backwards.append((axis % x.ndim, positions.to(x.device)))
            continue
        index[axis] = slice(max(0, min(size, start)), max(0, min(size, end)), step)
    x = x[tuple(index)]
    for axis, positions in backwards:
        x = x.index_select(axis, positions)
    return x


def _reduce(function: Callable[..., torch.Tensor]) -> Callable[[list, dict], torch.Tensor]:
    def reduce(inputs: list, attrs: dict) -> torch.Tensor:
        x, axes = inputs[0], axes_input(inputs, attrs, 1)
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


def constant_value(attrs: dict) -> torch.Tensor:
    """A Constant node's value from whichever of its attributes holds it."""
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
    x, axes = inputs[0], axes_input(inputs, attrs, 1)
    rank = x.ndim + len(axes)
    for axis in sorted(a % rank for a in axes):
        x = x.unsqueeze(axis)
    return x


def _squeeze(inputs: list, attrs: dict) -> torch.Tensor:
    x, axes = inputs[0], axes_input(inputs, attrs, 1)
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
    return torch.full(ints(inputs[0]), value.reshape(-1)[0].item(), dtype=value.dtype, device=inputs[0].device)


def _variadic(function: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[list, dict], torch.Tensor]:
    def apply(inputs: list, attrs: dict) -> torch.Tensor:
        result = inputs[0]
        for other in inputs[1:]:
            result = function(result, other)
        return result

    return apply


def _split(inputs: list, attrs: dict) -> tuple[torch.Tensor, ...]:
    """ONNX Split: sizes as an input (opset 13+) or attribute, else ``num_outputs`` parts of ceil(length / n) (the
    last smaller), else equal parts, one per output of the node."""
    x = inputs[0]
    axis = attrs.get("axis", 0) % x.ndim
    sizes = ints(given(inputs, 1)) if given(inputs, 1) is not None else attrs.get("split")
    if not sizes:
        parts = attrs.get("num_outputs", attrs[OUTPUTS])
        step = -(-x.shape[axis] // parts)
        sizes = [min(step, x.shape[axis] - start) for start in range(0, x.shape[axis], step)]
    return tuple(torch.split(x, list(sizes), dim=axis))


def _arg_extreme(function: Callable[..., torch.Tensor]) -> Callable[[list, dict], torch.Tensor]:
    def arg(inputs: list, attrs: dict) -> torch.Tensor:
        x, axis, keep = inputs[0], attrs.get("axis", 0), bool(attrs.get("keepdims", 1))
        if attrs.get("select_last_index", 0):  # the last of equal extremes: search the flipped axis
            flipped = function(x.flip(axis), dim=axis, keepdim=keep)
            return x.shape[axis] - 1 - flipped
        return function(x, dim=axis, keepdim=keep)

    return arg


def _instance_norm(inputs: list, attrs: dict) -> torch.Tensor:
    x, scale, bias = inputs[:3]
    return F.instance_norm(x, weight=scale, bias=bias, eps=attrs.get("epsilon", 1e-5))


def _prelu(inputs: list, attrs: dict) -> torch.Tensor:
    x, slope = inputs[0], inputs[1]
    return torch.where(x >= 0, x, x * slope)


def _product(x: torch.Tensor, dim: list[int], keepdim: bool) -> torch.Tensor:
    for axis in sorted((a % x.ndim for a in dim), reverse=True):  # torch.prod takes one axis at a time
        x = torch.prod(x, dim=axis, keepdim=keepdim)
    return x


def _mod(inputs: list, attrs: dict) -> torch.Tensor:
    # fmod=1: the sign of the dividend (C's fmod); fmod=0, integers only: the sign of the divisor (Python's %).
    return torch.fmod(inputs[0], inputs[1]) if attrs.get("fmod", 0) else torch.remainder(inputs[0], inputs[1])


def _selu(inputs: list, attrs: dict) -> torch.Tensor:
    x = inputs[0]
    alpha, gamma = attrs.get("alpha", 1.67326319217681884765625), attrs.get("gamma", 1.05070102214813232421875)
    return gamma * torch.where(x > 0, x, alpha * (torch.exp(x) - 1))


OPS: dict[str, Callable[[list, dict], Any]] = {
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
    "BatchNormalization": _batch_norm,
    "LayerNormalization": _layer_norm,
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
    "Expand": lambda i, a: i[0] * torch.ones(ints(i[1]), dtype=i[0].dtype, device=i[0].device),
    "ConstantOfShape": _constant_of_shape,
    "Constant": lambda i, a: constant_value(a),
    "Range": lambda i, a: torch.arange(i[0].item(), i[1].item(), i[2].item(), dtype=i[0].dtype, device=i[0].device),
    "ReduceMean": _reduce(torch.mean),
    "ReduceSum": _reduce(torch.sum),
    "ReduceMax": _reduce(torch.amax),
    "ReduceMin": _reduce(torch.amin),
    "ReduceL1": _reduce(partial(torch.linalg.vector_norm, ord=1)),
    "ReduceL2": _reduce(partial(torch.linalg.vector_norm, ord=2)),
    "ReduceSumSquare": _reduce(lambda x, dim, keepdim: torch.sum(x * x, dim=dim, keepdim=keepdim)),
    "ReduceLogSumExp": _reduce(torch.logsumexp),
    "Split": _split,
    "Einsum": lambda i, a: torch.einsum(a["equation"], *i),
    "Tile": lambda i, a: i[0].repeat(ints(i[1])),
    "Size": lambda i, a: torch.tensor(i[0].numel(), dtype=torch.int64, device=i[0].device),
    "Sign": lambda i, a: torch.sign(i[0]),
    "PRelu": _prelu,
    "Elu": lambda i, a: F.elu(i[0], a.get("alpha", 1.0)),
    "Softplus": lambda i, a: F.softplus(i[0]),
    "Softsign": lambda i, a: F.softsign(i[0]),
    "ArgMax": _arg_extreme(torch.argmax),
    "ArgMin": _arg_extreme(torch.argmin),
    "InstanceNormalization": _instance_norm,
    "ReduceProd": _reduce(_product),
    "Round": lambda i, a: torch.round(i[0]),
    "Mod": _mod,
    "Selu": _selu,
    "Celu": lambda i, a: F.celu(i[0], a.get("alpha", 1.0)),
    "Mish": lambda i, a: F.mish(i[0]),
    "ThresholdedRelu": lambda i, a: torch.where(i[0] > a.get("alpha", 1.0), i[0], torch.zeros_like(i[0])),
}
