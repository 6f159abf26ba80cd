"""What every op of the interpreter shares: attributes parsed once, optional inputs, integer lists, padding."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

from nmdeploy.graph.convolution import explicit_pads
from nmdeploy.graph.tensors import to_torch

OUTPUTS = "_outputs"
"""The key under which a node's attributes carry its number of outputs (ONNX attribute names never start with _):
Split without sizes divides its input among as many outputs as the node has."""


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


def ints(tensor: torch.Tensor | None) -> list[int] | None:
    return None if tensor is None else [int(v) for v in tensor.reshape(-1).tolist()]


def axes_input(inputs: list, attrs: dict, position: int) -> list[int] | None:
    """Axes given as an attribute (older opsets) or as an input (newer ones)."""
    if len(inputs) > position and inputs[position] is not None:
        return ints(inputs[position])
    return attrs.get("axes")


def given(inputs: list, position: int) -> torch.Tensor | None:
    """An optional input that is present and not empty (exporters pass an empty tensor for "not given")."""
    value = inputs[position] if len(inputs) > position else None
    return value if value is not None and value.numel() else None


def explicit_padding(attrs: dict, x: torch.Tensor, kernel: Sequence[int]) -> tuple[list[int], list[int]]:
    """(begin, end) pads per spatial axis: the ``pads`` given, or those auto_pad SAME_UPPER/SAME_LOWER implies."""
    return explicit_pads(
        attrs.get("auto_pad", "NOTSET"),
        attrs.get("pads", ()),
        x.shape[2:],
        kernel,
        attrs.get("strides", ()),
        attrs.get("dilations", ()),
    )


def pad_constant(x: torch.Tensor, begin: list[int], end: list[int], value: float = 0.0) -> torch.Tensor:
    return F.pad(x, [p for pair in zip(reversed(begin), reversed(end), strict=True) for p in pair], value=value)
