"""Moving stored ONNX tensor values to torch and back, and the axis pairing of a weight's GEMM."""

from __future__ import annotations

import numpy as np
import torch

from nmdeploy.graph.weights import PrunableWeight


def to_torch(array: np.ndarray) -> torch.Tensor:
    """numpy (including ml_dtypes bfloat16) to torch, sharing memory where the array allows it."""
    if not array.flags.writeable:
        array = array.copy()
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def to_numpy(tensor: torch.Tensor, like: np.ndarray) -> np.ndarray:
    if like.dtype.name == "bfloat16":
        return tensor.contiguous().view(torch.uint16).numpy().view(like.dtype)
    return tensor.numpy()


_SAME_SIZE_INTEGER = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def keep_only_(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Set ``values`` to zero where ``keep`` is False, in place; kept values stay bit for bit (-0.0 included).

    Floats are zeroed through an integer view of their bits, so a pruned negative becomes +0.0 rather than the -0.0
    a float multiply gives. On the CPU the multiply runs in numpy on the same memory: its integer-by-boolean loop is
    several times faster than torch's there (and than masked_fill, whose per-element branch a random mask defeats).
    """
    bits = values.view(_SAME_SIZE_INTEGER[values.element_size()]) if values.is_floating_point() else values
    if bits.device.type == "cpu" and keep.device.type == "cpu" and bits.dtype != torch.bool:
        array = bits.detach().numpy()
        np.multiply(array, keep.numpy(), out=array)
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


def _along(values: torch.Tensor, axis: int, rank: int) -> torch.Tensor:
    """A scalar or per-channel vector shaped to broadcast along ``axis`` of a rank-``rank`` tensor."""
    if values.ndim == 0:
        return values
    return values.reshape([-1 if d == axis else 1 for d in range(rank)])


def zero_points(read, weight: PrunableWeight) -> torch.Tensor | None:
    """The stored value that dequantizes to 0 at every position (broadcastable), or None for float weights.

    ``read`` is a function from TensorProto to numpy (``OnnxModel.read``).
    """
    quantization = weight.dequantization
    if quantization is None:
        return None
    if quantization.zero_point is None:
        return torch.zeros((), dtype=torch.int64)
    return _along(to_torch(read(quantization.zero_point)).to(torch.int64), quantization.axis, len(weight.shape))


def dequantized_magnitude(read, weight: PrunableWeight, values: torch.Tensor) -> torch.Tensor:
    """|w| of the value the consumer sees: |(q - zero point) * scale| for integer weights, |w| otherwise."""
    zero = zero_points(read, weight)
    if zero is None:
        return values.float().abs()
    scale = _along(to_torch(read(weight.dequantization.scale)).float(), weight.dequantization.axis, len(weight.shape))
    return (values.to(torch.int64) - zero).abs().float() * scale.abs()


def nonzero_positions(read, weight: PrunableWeight, values: torch.Tensor) -> torch.Tensor:
    """Where the consumer sees a non-zero weight (an integer weight is zero where it equals its zero point)."""
    zero = zero_points(read, weight)
    if zero is not None:
        return values.to(torch.int64) != zero
    if values.device.type == "cpu" and values.dtype != torch.bfloat16:
        # numpy's compare loop is several times faster than torch's on the CPU; both share the memory.
        return torch.from_numpy(values.detach().numpy() != 0)
    return values != 0
