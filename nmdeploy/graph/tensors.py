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


def output_axis(weight: PrunableWeight, axis: int) -> int:
    """The axis a transposable mask pairs with ``axis``: the other GEMM dimension of the weight."""
    rank = len(weight.shape)
    if weight.uses[0].op_type in ("Conv", "ConvTranspose"):
        return 1 - axis
    return rank - 1 if axis == rank - 2 else rank - 2
