"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): every rank writes its own shards, and a run can
resume on another number of processes.

::

    save_distributed("ckpt", model, sparsifier, optimizer=optimizer)     # on every rank: ckpt/step-00000400/
    ...
    restored = load_distributed("ckpt", model, sparsifier, optimizer=optimizer)   # the latest complete one

A checkpoint is one folder ``step-NNNNNNNN`` under the given directory: DCP's shard files and ``.metadata`` with
the model state (weights sharded as FSDP2 holds them, masks and method buffers whole), the optimiser state (sharded
like the weights), the sparsifier's generators and each rank's torch random state; beside them ``nmdeploy.json``
holds everything that is not a tensor (sparsifier settings and step, optimiser hyper-parameters, schedule state,
``extra``). Tensors are read with ``weights_only=True`` and DCP's ``.metadata`` with an unpickler that admits only
DCP's own metadata classes, so a checkpoint never runs code.

Writes are atomic as a whole: the ranks write into ``.tmp-step-NNNNNNNN`` and rank 0 renames it into place once
every shard and the metadata are on disk; a run killed during a save leaves the previous checkpoint as the latest,
and its temporary folder is removed by the next save. Older checkpoints beyond ``keep`` are removed after a commit.

Resuming on another number of processes: DCP reshards weights and optimiser moments to the new layout; MVUE's
gradient streams are seeded by (seed, rank, step), so they need no saved state; each rank restores its own torch
random state where the checkpoint has one (rank 0's otherwise).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import pickle
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nmdeploy.errors import InputError, first_line
from nmdeploy.files import commit_folder, write_atomically
from nmdeploy.train.checkpoint import CheckpointMismatchError, Restored, _is_sparsified, shape_problems

if TYPE_CHECKING:
    from torch import nn

    from nmdeploy.train.masking.sparsify import Sparsifier

FORMAT = "nmdeploy-distributed-checkpoint"
VERSION = 1
META = "nmdeploy.json"
_STEP_FOLDER = re.compile(r"^step-(\d{8,})$")
_TEMPORARY_PREFIX = ".tmp-step-"


def save_distributed(
    directory: str | Path,
    model: nn.Module,
    sparsifier: Sparsifier | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
    step: int | None = None,
    keep: int = 2,
) -> Path:
    """Save a sharded checkpoint of ``step`` (default: the sparsifier's step count) under ``directory``; call it on
    every rank. Returns the committed folder. ``extra`` must be JSON data; ``keep`` checkpoints are kept."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if step is None:
        if sparsifier is None:
            raise InputError("save_distributed needs step= when there is no sparsifier to count the steps")
        step = sparsifier.step_count
    if keep < 1:
        raise InputError(f"keep must be at least 1, got {keep}")
    root = Path(directory)
    final = root / f"step-{step:08d}"
    temporary = root / f"{_TEMPORARY_PREFIX}{step:08d}"
    rank, distributed = _rank(), _distributed()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_TEMPORARY_PREFIX}*"):  # left by a run killed while saving
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()

    tensors: dict[str, Any] = {"model": get_model_state_dict(model)}
    meta: dict[str, Any] = {"format": FORMAT, "version": VERSION, "step": step, "world": _world()}
    if sparsifier is not None:
        sparse_state = sparsifier.state_dict()
        tensors["generators"] = sparse_state.pop("generators")
        meta["sparsifier"] = sparse_state
    if optimizer is not None:
        optimizer_state = get_optimizer_state_dict(model, optimizer)
        tensors["optimizer"] = optimizer_state["state"]
        meta["optimizer_groups"] = optimizer_state["param_groups"]
    if scheduler is not None:
        meta["scheduler"] = scheduler.state_dict()
    meta["extra"] = dict(extra or {})
    tensors["rng"] = {f"rank{rank}": _rng_state()}
    try:
        text = json.dumps(meta, indent=1)
    except TypeError as error:
        raise InputError(f"checkpoint data that is not JSON ({error}): extra and the schedule state must be") from None

    with _single_process_quiet(distributed):
        dcp.save(tensors, checkpoint_id=temporary, no_dist=not distributed)
    if rank == 0:
        write_atomically(temporary / META, text)
        if final.exists():  # the same step saved again: the new one wins
            shutil.rmtree(final)
        commit_folder(temporary, final)
        for old in _committed(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest committed checkpoint folder under ``directory``, or None."""
    committed = _committed(Path(directory))
    return committed[-1] if committed else None


def load_distributed(
    path: str | Path,
    model: nn.Module,
    sparsifier: Sparsifier | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> Restored:
    """Load a sharded checkpoint (a ``step-*`` folder, or the directory above it: its latest) into ``model`` and
    the rest, on any number of processes; call it on every rank. A fresh dense ``model`` is first sparsified as the
    checkpoint records. Mismatches raise :class:`CheckpointMismatchError` before anything changes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    folder = _resolve(Path(path))
    meta = _read_meta(folder)
    reader = safe_reader(folder)
    entries = reader.read_metadata().state_dict_metadata
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    # DCP reads non-tensor entries with a full unpickler; save_distributed writes tensors only, so any such entry
    # is refused before a single byte of data is read.
    foreign = sorted(key for key, entry in entries.items() if not isinstance(entry, TensorStorageMetadata))
    if foreign:
        raise InputError(f"{folder}: entries that are not tensors ({', '.join(foreign[:3])}); not written by nmdeploy")
    saved = {key: tuple(entry.size) for key, entry in entries.items()}
    sparse_state = meta.get("sparsifier")
    if sparse_state is not None and sparsifier is None and not _is_sparsified(model):
        from nmdeploy.train.masking.sparsify import sparsify_like

        _check_model(model, saved, folder, sparse_state)
        sparsifier = sparsify_like(model, {**sparse_state, "generators": {}})
    _check_model(model, saved, folder, None)
    if sparsifier is not None and sparse_state is None:
        raise CheckpointMismatchError(f"{folder}: checkpoint of a dense run, but the model is sparsified")
    if optimizer is not None and "optimizer_groups" not in meta:
        raise CheckpointMismatchError(f"{folder}: the checkpoint holds no optimiser state")
    if scheduler is not None and "scheduler" not in meta:
        raise CheckpointMismatchError(f"{folder}: the checkpoint holds no learning-rate schedule state")

    tensors: dict[str, Any] = {"model": get_model_state_dict(model)}
    if sparsifier is not None:
        tensors["generators"] = _allocate(entries, "generators.")
    if optimizer is not None:
        tensors["optimizer"] = get_optimizer_state_dict(model, optimizer)["state"]
    rank = _rank()
    rng_key = f"rank{rank}" if any(k.startswith(f"rng.rank{rank}.") for k in saved) else "rank0"
    tensors["rng"] = {rng_key: _allocate(entries, f"rng.{rng_key}.")}
    try:
        with _single_process_quiet(_distributed()):
            dcp.load(tensors, storage_reader=reader, no_dist=not _distributed())
    except (RuntimeError, ValueError, KeyError) as error:  # DCP wraps per-rank failures
        raise CheckpointMismatchError(f"{folder}: cannot load the checkpoint ({first_line(error)})") from None

    set_model_state_dict(model, tensors["model"])
    if sparsifier is not None:
        sparsifier.load_state_dict({**sparse_state, "generators": tensors["generators"]})
    if optimizer is not None:
        groups = meta["optimizer_groups"]
        try:
            set_optimizer_state_dict(model, optimizer, {"state": tensors["optimizer"], "param_groups": groups})
        except (ValueError, KeyError, RuntimeError) as error:
            raise CheckpointMismatchError(f"{folder}: optimiser state does not fit ({first_line(error)})") from None
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    _restore_rng(tensors["rng"][rng_key])
    return Restored(sparsifier, dict(meta.get("extra") or {}), meta)


# ------------------------------------------------------------------------------------------------ safe reading


_ALLOWED = {
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",)


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch dtypes and paths, nothing that could run code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or module in _ALLOWED_MODULES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


@functools.cache
def _safe_reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class _SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            source = Path(self.path) / ".metadata"
            try:
                metadata = _MetadataUnpickler(io.BytesIO(source.read_bytes())).load()
            except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as error:
                raise InputError(f"{self.path}: unreadable checkpoint metadata ({first_line(error)})") from None
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            if metadata.planner_data is None:
                metadata.planner_data = {}
            return metadata

    return _SafeFileSystemReader


def safe_reader(path: Path) -> Any:
    """DCP's file-system reader, reading ``.metadata`` with :class:`_MetadataUnpickler` (the class is defined on
    first use, so importing this module does not import DCP)."""
    return _safe_reader_class()(path)


# ------------------------------------------------------------------------------------------------ helpers


def _committed(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_FOLDER.match(child.name)
        if match and (child / META).is_file() and (child / ".metadata").is_file():
            found.append((int(match.group(1)), child))
    return [child for _, child in sorted(found)]


def _resolve(path: Path) -> Path:
    if (path / META).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise InputError(f"{path}: no committed checkpoint here; give a folder written by save_distributed")
    return latest


def _read_meta(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as error:
        raise InputError(f"{folder}: unreadable {META} ({first_line(error)})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise InputError(f"{folder}: not an nmdeploy distributed checkpoint (written by save_distributed)")
    if meta.get("version") != VERSION:
        raise InputError(f"{folder}: checkpoint version {meta.get('version')} is not {VERSION}")
    return meta


def _check_model(model: nn.Module, saved: dict[str, tuple], folder: Path, sparse_state: dict | None) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    expected = {key: tuple(value.shape) for key, value in get_model_state_dict(model).items()}
    given = {key.removeprefix("model."): shape for key, shape in saved.items() if key.startswith("model.")}
    problems = shape_problems(expected, given, sparse_layers=None if sparse_state is None else sparse_state["layers"])
    if problems:
        raise CheckpointMismatchError(
            f"{folder}: the checkpoint does not fit this model ({problems}); build the model it was trained from"
        )


def _allocate(entries: dict[str, Any], prefix: str) -> dict[str, torch.Tensor]:
    """Empty tensors to load the saved entries under ``prefix`` into (entries this process has no template for)."""
    return {
        key.removeprefix(prefix): torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if key.startswith(prefix) and hasattr(entry, "size")
    }


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _restore_rng(state: dict[str, torch.Tensor]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank() -> int:
    return torch.distributed.get_rank() if _distributed() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if _distributed() else 1


def _barrier() -> None:
    if _distributed():
        torch.distributed.barrier()


@contextlib.contextmanager
def _single_process_quiet(distributed: bool) -> Iterator[None]:
    """Without a process group DCP warns that it assumes a single process, which is what is meant here."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


__all__ = ["latest_checkpoint", "load_distributed", "safe_reader", "save_distributed"]
