"""Stored ONNX tensor values as the pruning and inspection math reads them, the axis pairing of a weight's GEMM,
and the way to torch and back.

Everything but :func:`to_torch` and :func:`to_numpy` works on numpy arrays (ml_dtypes for bfloat16), so pruning
and inspecting a model import no torch; torch is imported only by the functions that make or take tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from nmdeploy.graph.prunable import PrunableWeight

if TYPE_CHECKING:
    import torch
    from onnx import TensorProto

Reader = Callable[["TensorProto"], np.ndarray]
"""A function from a stored tensor to its value (``OnnxModel.read``)."""


def to_torch(array: np.ndarray) -> torch.Tensor:
    """numpy (including ml_dtypes bfloat16) to torch, sharing memory where the array allows it."""
    import torch

    if not array.flags.writeable:
        array = array.copy()
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def to_numpy(tensor: torch.Tensor, like: np.ndarray) -> np.ndarray:
    import torch

    if like.dtype.name == "bfloat16":
        return tensor.contiguous().view(torch.uint16).numpy().view(like.dtype)
    return tensor.numpy()


def _as_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as numpy (bfloat16 through its bits, as ml_dtypes bfloat16)."""
    import ml_dtypes
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


_SAME_SIZE_INTEGER = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def keep_only_(values: Any, keep: Any) -> Any:
    """Set ``values`` to zero where ``keep`` is False, in place; kept values stay bit for bit (-0.0 included).

    Takes numpy arrays or torch tensors (both ``values`` and ``keep`` of one kind). Floats are zeroed through an
    integer view of their bits, so a pruned negative becomes +0.0 rather than the -0.0 a float multiply gives.
    On the CPU the multiply runs in numpy on the same memory: its integer-by-boolean loop is several times faster
    than torch's there (and than masked_fill, whose per-element branch a random mask defeats).
    """
    if isinstance(values, np.ndarray):
        bits = values if values.dtype == np.bool_ else values.view(_SAME_SIZE_INTEGER[values.dtype.itemsize])
        if bits.dtype == np.bool_:
            np.logical_and(bits, keep, out=bits)
        else:
            np.multiply(bits, keep, out=bits)
        return values
    import torch

    integer = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    bits = values.view(integer[values.element_size()]) if values.is_floating_point() else values
    if bits.device.type == "cpu" and keep.device.type == "cpu" and bits.dtype != torch.bool:
        keep_only_(bits.detach().numpy(), keep.numpy())
    else:
        bits.mul_(keep)
    return values


def transposable_axes(weight: PrunableWeight) -> tuple[int, int]:
    """(reduction axis, paired axis) of a transposable mask: the two axes the uses reduce over for a shared weight,
    otherwise the reduction axis and the other GEMM dimension (output channels)."""
    if weight.needs_transposable:
        return weight.axes[0], weight.axes[1]
    axis, rank = weight.axis, len(weight.shape)
    if weight.uses[0].op_type in ("Conv", "ConvTranspose"):
        return axis, 1 - axis
    return axis, rank - 1 if axis == rank - 2 else rank - 2


def _along(values: np.ndarray, axis: int, rank: int) -> np.ndarray:
    """A scalar or per-channel vector shaped to broadcast along ``axis`` of a rank-``rank`` array."""
    if values.ndim == 0:
        return values
    return values.reshape([-1 if d == axis else 1 for d in range(rank)])


def _is_float(values: np.ndarray) -> bool:
    """Floating point, bfloat16 and float8 (ml_dtypes) included: stored values compared and subtracted as floats,
    since an integer cast truncates every float8 value below 1 to 0."""
    return np.issubdtype(values.dtype, np.floating) or values.dtype.name.startswith(("bfloat16", "float8"))


def zero_points(read: Reader, weight: PrunableWeight) -> np.ndarray | None:
    """The stored value that dequantizes to 0 at every position (broadcastable; int64 for integer weights, float32
    for float8 ones), or None for float weights."""
    quantization = weight.dequantization
    if quantization is None:
        return None
    if quantization.zero_point is None:
        return np.zeros((), dtype=np.int64)
    stored = read(quantization.zero_point)
    zero = stored.astype(np.float32 if _is_float(stored) else np.int64)
    return _along(zero, quantization.axis, len(weight.shape))


def _stored_numbers(values: np.ndarray) -> np.ndarray:
    """Stored values as numbers the zero point can be subtracted from: float32 for float types, int64 for integers."""
    return values.astype(np.float32 if _is_float(values) else np.int64)


def dequantized_magnitude(read: Reader, weight: PrunableWeight, values: np.ndarray) -> np.ndarray:
    """|w| in float32, a new array: |(q - zero point) * scale| for quantized weights, |w| of the value otherwise."""
    zero = zero_points(read, weight)
    if zero is None:
        magnitude = values.astype(np.float32)
        return np.abs(magnitude, out=magnitude)
    scale = read(weight.dequantization.scale).astype(np.float32)
    scale = _along(np.abs(scale), weight.dequantization.axis, len(weight.shape))
    return np.abs(_stored_numbers(values) - zero).astype(np.float32) * scale


def nonzero_positions(read: Reader, weight: PrunableWeight, values: Any) -> Any:
    """Where the consumer sees a non-zero weight (a quantized weight is zero where it equals its zero point: for
    float8 compared as floats, so that 0.25 is not truncated to 0 and -0.0 counts as zero).

    A numpy array gives a numpy array; a torch tensor (for torch callers) gives a tensor.
    """
    if not isinstance(values, np.ndarray):
        import torch

        return torch.from_numpy(nonzero_positions(read, weight, _as_array(values)))
    zero = zero_points(read, weight)
    if zero is not None:
        return _stored_numbers(values) != zero
    return values != 0
