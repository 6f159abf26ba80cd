"""Training checkpoints: one format for ``nmdeploy train`` and the Python API, written atomically, read with
``weights_only=True``.

From Python::

    save_checkpoint("run.pt", model, sparsifier, optimizer=optimizer, extra={"epoch": 3})
    ...
    model = build_model()                                # a fresh dense model
    restored = load_checkpoint("run.pt", model, optimizer=optimizer)   # sparsifies it as the run did
    sparsifier = restored.sparsifier

Every checkpoint holds the format tag, the model state (dense weights, mask buffers and learnable scores of the
parametrisations) and the sparsifier's state (:meth:`Sparsifier.state_dict`: settings, layers, step, generators);
optimiser, schedule and ``extra`` when given. ``nmdeploy train`` adds its run configuration, random states, position
and history, so ``nmdeploy export`` and ``--resume`` read both kinds.

A checkpoint of ``nmdeploy train`` also holds the optimiser and learning-rate schedule, the random states of torch,
numpy and Python, the position in the run (the data order follows from the seed and the epoch) and the history
logged so far. On CPU, resuming from it reproduces the losses and masks of an uninterrupted run bit for bit.
"""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from nmdeploy.errors import InputError, first_line
from nmdeploy.files import atomic_output, load_torch_file

_PARAMETRISATION_ENTRY = re.compile(r"(^|\.)parametrizations\.\w+\.\d+\.")
"""A parametrisation's own state entry (``...parametrizations.weight.0.mask``)."""
_PARAMETRISED_WEIGHT = re.compile(r"(^|\.)parametrizations\.\w+\.original$")

if TYPE_CHECKING:
    from torch import nn

    from nmdeploy.train.masking.sparsify import Sparsifier

FORMAT = "nmdeploy-train-checkpoint"
VERSION = 1


@dataclass(frozen=True)
class Position:
    """Where a run stands: ``epoch`` (0-based) and the number of its batches already done, and the total step count."""

    epoch: int
    batch: int
    step: int


def capture_rng() -> dict[str, Any]:
    """The global random states, as plain tensors and lists (``weights_only``-safe)."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
        "python": _python_state_to_lists(random.getstate()),
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng` recorded (a ``data_order`` state of older checkpoints is not needed: the
    data order follows from the seed and the epoch)."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _python_state_to_lists(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


class CheckpointMismatchError(InputError):
    """A checkpoint that does not fit the model, sparsifier or optimiser it is loaded into."""


@dataclass(frozen=True)
class Restored:
    """What :func:`load_checkpoint` gives back besides the objects it filled in."""

    sparsifier: Sparsifier | None
    """The model's sparsifier: the one passed in, or the one built to match the checkpoint (None: dense run)."""
    extra: dict[str, Any]
    payload: dict[str, Any]


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    sparsifier: Sparsifier | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the model and its sparsifier (and the optimiser, schedule and ``extra`` when given) to ``path``,
    atomically. ``extra`` holds plain values and tensors only (it must load with ``weights_only=True``).

    For a model sharded with FSDP2 use :func:`nmdeploy.train.distributed.save_distributed` instead.
    """
    state = model.state_dict()
    if any(_is_dtensor(value) for value in state.values()):
        raise InputError(
            "the model is sharded (FSDP2): save it with nmdeploy.train.distributed.save_distributed, "
            "which writes every rank's shard"
        )
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "model": state,
        "sparsifier": sparsifier.state_dict() if sparsifier is not None else None,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "extra": dict(extra or {}),
    }
    return write_checkpoint(path, payload)


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    sparsifier: Sparsifier | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> Restored:
    """Load a checkpoint of either kind into ``model`` (and ``optimizer``/``scheduler`` when given).

    ``model`` is either already sparsified with ``sparsifier`` (as the run was), or a fresh dense model, which is
    then sparsified as the checkpoint records (the same layers and settings). Missing or unexpected keys and wrong
    shapes raise :class:`CheckpointMismatchError` with one line that names them, before anything is changed.
    """
    payload = read_checkpoint(path)
    source = Path(path)
    sparse_state = payload.get("sparsifier")
    if sparsifier is None and sparse_state is not None and not _is_sparsified(model):
        from nmdeploy.train.masking.sparsify import sparsify_like

        check_model_state(model, payload["model"], source, sparse_state=sparse_state)
        sparsifier = sparsify_like(model, sparse_state)
    check_model_state(model, payload["model"], source)
    if sparsifier is not None:
        if sparse_state is None:
            raise CheckpointMismatchError(f"{source}: checkpoint of a dense run, but the model is sparsified")
        sparsifier.load_state_dict(sparse_state)
    model.load_state_dict(payload["model"])
    if optimizer is not None:
        if payload.get("optimizer") is None:
            raise CheckpointMismatchError(f"{source}: the checkpoint holds no optimiser state")
        try:
            optimizer.load_state_dict(payload["optimizer"])
        except (ValueError, KeyError, RuntimeError) as error:
            raise CheckpointMismatchError(f"{source}: optimiser state does not fit ({first_line(error)})") from None
    if scheduler is not None:
        if payload.get("scheduler") is None:
            raise CheckpointMismatchError(f"{source}: the checkpoint holds no learning-rate schedule state")
        scheduler.load_state_dict(payload["scheduler"])
    return Restored(sparsifier, dict(payload.get("extra") or {}), payload)


def check_model_state(
    model: nn.Module,
    state: dict[str, Any],
    source: Path | str,
    *,
    sparse_state: dict[str, Any] | None = None,
) -> None:
    """Raise :class:`CheckpointMismatchError` (one line) when ``state`` does not fit ``model``.

    With ``sparse_state`` the model is still dense and is about to be sparsified as the checkpoint records.
    """
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    given = {key: tuple(value.shape) for key, value in state.items() if isinstance(value, torch.Tensor)}
    layers = None if sparse_state is None else list(sparse_state.get("layers", []))
    problems = shape_problems(expected, given, sparse_layers=layers)
    if problems:
        raise CheckpointMismatchError(
            f"{source}: the checkpoint does not fit this model ({problems}); build the model the "
            "checkpoint was trained from"
        )


def shape_problems(
    expected: dict[str, tuple[int, ...]], given: dict[str, tuple[int, ...]], *, sparse_layers: list[str] | None = None
) -> str:
    """Missing and unexpected keys and wrong shapes of ``given`` against ``expected``, in one line ("" if none).

    With ``sparse_layers`` the model is still dense: each such layer's ``weight`` is compared with the checkpoint's
    ``parametrizations.weight.original`` and the parametrisations' own entries are not expected.
    """
    if sparse_layers is not None:
        expected = _as_sparsified(expected, sparse_layers)
        given = {key: shape for key, shape in given.items() if not _PARAMETRISATION_ENTRY.search(key)}
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    wrong = [
        f"{key} is {list(given[key])} in the checkpoint, {list(expected[key])} in the model"
        for key in sorted(set(expected) & set(given))
        if expected[key] != given[key]
    ]
    problems = []
    if missing:
        problems.append(f"missing {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected {_listed(unexpected)}")
    if wrong:
        problems.append(f"wrong shape: {_listed(wrong)}")
    return "; ".join(problems)


def _as_sparsified(expected: dict[str, tuple], layers: list[str]) -> dict[str, tuple]:
    """A dense model's keys renamed as sparsify renames them: layer ``x`` (a Linear/Conv) holds ``x.weight`` as
    ``x.parametrizations.weight.original``; ``attention.in_proj_weight`` (an attention projection) holds it as
    ``attention.parametrizations.in_proj_weight.original``."""
    renamed = dict(expected)
    for layer in layers:
        if f"{layer}.weight" in renamed:
            dense, module, attribute = f"{layer}.weight", layer, "weight"
        elif layer in renamed:
            dense = layer
            module, _, attribute = layer.rpartition(".")
        else:
            continue
        prefix = f"{module}." if module else ""
        renamed[f"{prefix}parametrizations.{attribute}.original"] = renamed.pop(dense)
    return renamed


def _listed(items: list[str], shown: int = 4) -> str:
    more = f" (+{len(items) - shown} more)" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def _is_sparsified(model: nn.Module) -> bool:
    return any(_PARAMETRISED_WEIGHT.search(name) for name, _ in model.named_parameters())


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed support
        return False
    return isinstance(value, DTensor)


def write_checkpoint(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (see :func:`make_payload`) to ``path`` through a temporary file, so a kill never leaves
    a truncated checkpoint behind."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(target) as temporary:
        torch.save(payload, temporary)
    return target


def make_payload(
    *,
    config: dict[str, Any],
    model_state: dict[str, torch.Tensor],
    sparsifier_state: dict[str, Any] | None,
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any],
    rng: dict[str, Any],
    position: Position,
    history: dict[str, Any],
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "config": config,
        "model": model_state,
        "sparsifier": sparsifier_state,
        "optimizer": optimizer_state,
        "scheduler": scheduler_state,
        "rng": rng,
        "position": {"epoch": position.epoch, "batch": position.batch, "step": position.step},
        "history": history,
    }


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The validated payload of a checkpoint of either kind; anything else is an :class:`InputError`."""
    source = Path(path)
    if not source.is_file():
        raise InputError(
            f"{source}: no such checkpoint; give a .pt file written by 'nmdeploy train' or save_checkpoint"
        )
    payload = load_torch_file(source, "nmdeploy checkpoint (written by 'nmdeploy train' or save_checkpoint)")
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise InputError(
            f"{source}: not an nmdeploy training checkpoint (written by 'nmdeploy train' or save_checkpoint)"
        )
    if not isinstance(payload.get("model"), dict):
        raise InputError(f"{source}: the checkpoint holds no model state")
    if type(payload.get("version")) is not int or payload.get("version") != VERSION:  # a tensor compares elementwise
        raise InputError(f"{source}: checkpoint version {payload.get('version')} is not {VERSION}; retrain or convert")
    _check_payload(source, payload)
    return payload


_RUN_TABLES = ("config", "optimizer", "scheduler", "rng", "position", "history")
"""What a checkpoint of 'nmdeploy train' (one with a config) holds beyond the model and the sparsifier."""
_OPTIONAL_TABLES = ("sparsifier", "optimizer", "scheduler", "extra")
"""What save_checkpoint may leave out (None)."""


def _check_payload(source: Path, payload: dict[str, Any]) -> None:
    """Every part a resume or an export reads is there, with the right kind of value, and the weights are finite."""
    run = "config" in payload
    required = ("model", *_RUN_TABLES) if run else ("model",)
    for key in (*required, *_OPTIONAL_TABLES):
        value = payload.get(key)
        optional = key in _OPTIONAL_TABLES and key not in required
        if not isinstance(value, dict) and not (optional and value is None):
            raise InputError(f"{source}: the checkpoint has no valid '{key}' entry; it is damaged, use another one")
    for name, value in payload["model"].items():
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{source}: model entry '{name}' is not a tensor; the checkpoint is damaged")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise InputError(f"{source}: weight '{name}' contains NaN or infinite values; use an earlier checkpoint")


@contextlib.contextmanager
def restoring(source: str | Path) -> Iterator[None]:
    """Turn a checkpoint whose states do not fit the model its config builds (missing or extra keys, other shapes)
    into one InputError: the file is untrusted input, not a bug."""
    try:
        yield
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError, AttributeError) as error:
        if isinstance(error, InputError):
            raise
        raise InputError(
            f"{source}: the checkpoint does not fit the model its config builds ({first_line(error)[:200]}); "
            f"it is damaged or from another version"
        ) from error


def position_of(payload: dict[str, Any]) -> Position:
    return Position(**payload["position"])
