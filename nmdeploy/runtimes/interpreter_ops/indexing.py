"""Ops that pick, place or count elements by index: TopK, GatherND, ScatterND, NonZero, OneHot, Trilu, Hardmax.

Detectors' and classifiers' heads end in these. Values stay differentiable where ONNX's are (TopK's values,
GatherND's and ScatterND's data and updates); the indices they produce are int64 as in ONNX.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from nmdeploy.runtimes.interpreter_ops.common import given


def _top_k(inputs: list, attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x, k = inputs[0], int(inputs[1].reshape(-1)[0]) if given(inputs, 1) is not None else attrs["k"]  # k: opset 1-9
    values, indices = torch.topk(x, k, dim=attrs.get("axis", -1), largest=bool(attrs.get("largest", 1)), sorted=True)
    return values, indices.long()


def _wrapped(indices: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Negative indices counted from the end of their axis."""
    return torch.where(indices < 0, indices + sizes, indices)


def _gather_nd(inputs: list, attrs: dict) -> torch.Tensor:
    data, indices = inputs[0], inputs[1].long()
    batch = attrs.get("batch_dims", 0)
    depth = indices.shape[-1]
    flat_data = data.reshape(-1, *data.shape[batch:])
    flat_indices = indices.reshape(-1, *indices.shape[batch:])
    sizes = torch.tensor(data.shape[batch : batch + depth], device=indices.device)
    flat_indices = _wrapped(flat_indices, sizes)
    rows = torch.arange(flat_data.shape[0], device=indices.device).reshape(-1, *[1] * (flat_indices.ndim - 2))
    picked = flat_data[(rows.expand(flat_indices.shape[:-1]), *flat_indices.unbind(-1))]
    return picked.reshape(*data.shape[:batch], *indices.shape[batch:-1], *data.shape[batch + depth :])


def _scatter_nd(inputs: list, attrs: dict) -> torch.Tensor:
    data, indices, updates = inputs[0], inputs[1].long(), inputs[2]
    sizes = torch.tensor(data.shape[: indices.shape[-1]], device=indices.device)
    place = tuple(_wrapped(indices, sizes).unbind(-1))
    return data.index_put(place, updates, accumulate=attrs.get("reduction", "none") == "add")


def _one_hot(inputs: list, attrs: dict) -> torch.Tensor:
    indices, depth, values = inputs[0].long(), int(inputs[1].reshape(-1)[0]), inputs[2]
    indices = torch.where(indices < 0, indices + depth, indices)
    inside = (indices >= 0) & (indices < depth)  # ONNX gives an all-"off" row for an index outside [-depth, depth)
    hot = F.one_hot(torch.where(inside, indices, torch.zeros_like(indices)), depth) * inside.unsqueeze(-1)
    axis = attrs.get("axis", -1) % (indices.ndim + 1)
    hot = hot.movedim(-1, axis).bool()
    return torch.where(hot, values[1], values[0])


def _trilu(inputs: list, attrs: dict) -> torch.Tensor:
    k = given(inputs, 1)
    diagonal = int(k.reshape(-1)[0]) if k is not None else 0
    return torch.triu(inputs[0], diagonal) if attrs.get("upper", 1) else torch.tril(inputs[0], diagonal)


def _hardmax(inputs: list, attrs: dict) -> torch.Tensor:
    x, axis = inputs[0], attrs.get("axis", -1)
    hot = F.one_hot(x.argmax(dim=axis), x.shape[axis]).movedim(-1, axis % x.ndim)
    return hot.to(x.dtype)


def _check_scatter(attrs: dict, opset: int) -> str:
    reduction = attrs.get("reduction", "none")
    return "" if reduction in ("none", "add") else f"reduction={reduction!r} (supported: none, add)"


def _check_top_k(attrs: dict, opset: int) -> str:
    # An unsorted TopK leaves the order to the runtime: no reference order to match.
    return "" if attrs.get("sorted", 1) else "sorted=0 (supported: 1)"


OPS: dict[str, Callable[[list, dict], Any]] = {
    "TopK": _top_k,
    "GatherND": _gather_nd,
    "ScatterND": _scatter_nd,
    "NonZero": lambda i, a: torch.nonzero(i[0]).T.contiguous(),
    "OneHot": _one_hot,
    "Trilu": _trilu,
    "Hardmax": _hardmax,
}
CHECKS: dict[str, Callable[[dict, int], str]] = {"ScatterND": _check_scatter, "TopK": _check_top_k}
