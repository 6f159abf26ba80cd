"""Calibration statistics accumulated across processes (torch.distributed), for calibration sets one process is
too slow for.

Every process (rank) loads the same model and calibration data and runs its own share of each batch's rows through
the statistics engine; after each fitting stage the moments (X^T X, and the cross moments against the dense model)
and the row counts are summed over the ranks, so every rank holds what one process would have accumulated over all
rows. Rank 0 alone fits the stage's weights and sends them to the others, who write them into their model before the
next stage runs on it: every rank's model stays the one rank 0 converts, and the fit's memory is needed once.

The ranks are started by ``torchrun`` (which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), or by anything that
sets those variables; on CPUs they talk over gloo.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nmdeploy.errors import InputError

ENVIRONMENT = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCH = "torchrun --nproc-per-node N -m nmdeploy convert ... --distributed"


def launched_ranks() -> int:
    """The number of processes a launcher started this one among (1 where none did)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class Ranks:
    """This process's place among the ranks that share one calibration: ``rank`` of ``world``."""

    rank: int
    world: int

    @property
    def leader(self) -> bool:
        """Whether this rank fits the weights (and writes the result)."""
        return self.rank == 0

    def share(self, rows: int) -> slice:
        """This rank's contiguous share of ``rows`` rows (the first ranks take one more where they do not divide)."""
        base, extra = divmod(rows, self.world)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))

    def sum_statistics(self, statistics: Iterable[Any]) -> None:
        """Sum every rank's moments and row counts into each rank's :class:`InputStatistics`, in place; buffers that
        several weights share are summed once."""
        import torch.distributed as dist

        seen: set[int] = set()
        for stat in statistics:
            for tensor in _moment_tensors(stat):
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    _all_reduce(tensor)
            count = torch.tensor([stat.samples], dtype=torch.int64)
            dist.all_reduce(count)
            stat.samples = int(count.item())

    def sum_count(self, value: int) -> int:
        import torch.distributed as dist

        count = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(count)
        return int(count.item())

    def from_leader(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object) on every rank."""
        import torch.distributed as dist

        box = [value if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share_weights(self, model: Any, tensors: Sequence[Any]) -> None:
        """Rank 0's values of ``tensors`` (its fit's result) written into every other rank's ``model``."""
        import onnx
        import torch.distributed as dist

        for tensor in tensors:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
            shape = tuple(tensor.dims)
            buffer = torch.empty(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, dtype=torch.uint8)
            if self.leader:
                values = np.array(model.read(tensor), dtype=dtype)  # writable, as torch wants
                buffer.copy_(torch.from_numpy(values.reshape(-1).view(np.uint8)))
            dist.broadcast(buffer, src=0)
            if not self.leader:
                model.write(tensor, buffer.numpy().view(dtype).reshape(shape), copy=False)


def _moment_tensors(stat: Any) -> list[torch.Tensor]:
    from nmdeploy.masks.blockwise import BlockDiagonal

    tensors = []
    for moments in (stat.hessian, stat.cross, stat.cross_outputs):
        if isinstance(moments, BlockDiagonal):
            tensors += [moments.blocks, moments.rest]
        elif moments is not None:
            tensors.append(moments)
    return tensors


def _all_reduce(tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    if tensor.device.type == "cpu":
        dist.all_reduce(tensor)
        return
    host = tensor.cpu()  # gloo sums host tensors; the moments go back where the fit reads them
    dist.all_reduce(host)
    tensor.copy_(host)


def join(backend: str = "gloo") -> Ranks:
    """Join the ranks the launcher started (the process group set up once per process), or an InputError saying
    how to start them."""
    import torch.distributed as dist

    missing = [name for name in ENVIRONMENT if name not in os.environ]
    if missing:
        raise InputError(f"--distributed: {', '.join(missing)} not set; start the processes with {LAUNCH}")
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend)
        except (RuntimeError, ValueError) as error:
            raise InputError(f"--distributed: the ranks could not connect ({str(error)[:200]})") from error
    return Ranks(dist.get_rank(), dist.get_world_size())


def leave() -> None:
    """Leave the process group, where this process joined one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
