"""Tensors that FSDP2 (``torch.distributed.fsdp.fully_shard``) shards into DTensors, seen whole where a mask needs
the whole weight.

Between steps FSDP2 keeps each parameter as a DTensor sharded along dim 0 (output channels); in forward and backward
it all-gathers them, so the parametrisations and the masked backward see plain full tensors there. Mask selection
runs between steps, on the sharded state: N:M groups lie along input channels and would survive row sharding, but
transposable tiles cross shard boundaries whenever a shard's row count is not a multiple of M, and permutation
searches and the forward's mask buffer need every row anyway. So a weight is gathered (``full_tensor``) when its
mask is due, and every rank computes the same mask from the same full weight; the mask buffers stay whole on every
rank (:meth:`nmdeploy.train.Sparsifier.buffer_bytes` reports their size).
"""

from __future__ import annotations

import torch


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter sharded by FSDP2 between steps)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed support
        return False
    return isinstance(tensor, DTensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every rank for a DTensor (a collective: every rank must call it), else as is."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (whole, the same on every rank) laid out as ``like``: this rank's shard as a DTensor when ``like``
    is one (no communication), else ``value`` itself."""
    if not is_sharded(like):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
