"""Training checkpoints: everything a run needs to continue exactly where it stopped, written atomically.

A checkpoint holds the run configuration, the model state (dense weights, mask buffers and learnable scores of the
parametrisations), the sparsifier's method state (step, schedules, permutations, gradient-mask generator), the
optimiser and learning-rate schedule, the random states of torch, numpy and Python plus the data-order generator,
the position in the run and the history logged so far. On CPU, resuming from it reproduces the losses and masks of
an uninterrupted run bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmdeploy.errors import InputError
from nmdeploy.files import load_torch_file, temporary_beside

FORMAT = "nmdeploy-train-checkpoint"
VERSION = 1


@dataclass(frozen=True)
class Position:
    """Where a run stands: ``epoch`` (0-based) and the number of its batches already done, and the total step count."""

    epoch: int
    batch: int
    step: int


def capture_rng(data_order: torch.Generator) -> dict[str, Any]:
    """The global random states plus the data-order generator, as plain tensors and lists (``weights_only``-safe)."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
        "python": _python_state_to_lists(random.getstate()),
        "data_order": data_order.get_state(),
    }


def restore_rng(state: dict[str, Any], data_order: torch.Generator) -> None:
    """Put back what :func:`capture_rng` recorded."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    data_order.set_state(state["data_order"])


def _python_state_to_lists(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (see :func:`make_payload`) to ``path`` through a temporary file, so a kill never leaves
    a truncated checkpoint behind."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_beside(target)
    try:
        torch.save(payload, temporary)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)
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


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`; anything else is an :class:`InputError`."""
    source = Path(path)
    if not source.is_file():
        raise InputError(f"{source}: no such checkpoint; give a .pt file written by 'nmdeploy train'")
    payload = load_torch_file(source, "nmdeploy checkpoint (written by 'nmdeploy train')")
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise InputError(f"{source}: not an nmdeploy training checkpoint (written by 'nmdeploy train')")
    if payload.get("version") != VERSION:
        raise InputError(f"{source}: checkpoint version {payload.get('version')} is not {VERSION}; retrain or convert")
    _check_payload(source, payload)
    return payload


_PAYLOAD_TABLES = ("config", "model", "optimizer", "scheduler", "rng", "position", "history")


def _check_payload(source: Path, payload: dict[str, Any]) -> None:
    """Every part a resume or an export reads is there, with the right kind of value, and the weights are finite."""
    for key in _PAYLOAD_TABLES + ("sparsifier",):
        value = payload.get(key)
        if not isinstance(value, dict) and not (key == "sparsifier" and key in payload and value is None):
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
            f"{source}: the checkpoint does not fit the model its config builds ({_first_line(error)[:200]}); "
            f"it is damaged or from another version"
        ) from error


def position_of(payload: dict[str, Any]) -> Position:
    return Position(**payload["position"])


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
