"""A folder of .npz shards (``shard-00000.npz``, ...), the data form every verb's ``--data``/``--calib`` reads.

The shards are written into a temporary folder beside the output and the folder is renamed into place once, so a
reader (or a run killed half way) sees no output folder or the whole one. An existing output folder must be empty:
nmdeploy never deletes a user's files to make room.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.files import check_writable_parent, commit_folder, temporary_folder_beside
from nmdeploy.rows import ReportRow, optional
from nmdeploy.runtimes.base import InputSpec
from nmdeploy.runtimes.batch_axes import BatchAxes

log = logging.getLogger(__name__)

SHARD_NAME = "shard-{:05d}.npz"
DEFAULT_ROWS = 32


@dataclass
class DataSetReport(ReportRow):
    """What ``nmdeploy data`` wrote: rows and shards, each input's dtype and shard shape (None where shards differ),
    the time taken, and what the source adds (sequence lengths, image size, rows left over a fixed batch)."""

    output: str
    source: str
    rows: int
    shards: int
    inputs: list[dict]
    seconds: float
    sequence_lengths: list[int] | None = optional()
    image_size: list[int] | None = optional()
    dropped_rows: int | None = optional()


def check_output_folder(output: Path, inputs: Sequence[Path] = ()) -> None:
    """Refuse, before any work, an output that is a file, a non-empty folder, or inside (or equal to) an input."""
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise InputError(f"{output} is a file; give -o a folder path (absent or empty)")
    if output.is_dir() and any(output.iterdir()):
        raise InputError(f"{output} is not empty; remove it or choose another -o folder")
    resolved = output.resolve()
    for used in inputs:
        used = Path(used).resolve()
        if resolved == used or (used.is_dir() and used in resolved.parents):
            raise InputError(f"{output} is inside the input {used}; choose an -o folder outside it")
    check_writable_parent(output)


def _rowed(inputs: Sequence[InputSpec], axes: BatchAxes) -> list[tuple[InputSpec, int]]:
    """The inputs that have rows, with their batch axis (a scalar has none)."""
    return [(spec, axis) for spec in inputs if (axis := axes.axis(spec.name)) is not None and axis < len(spec.shape)]


def rows_per_shard(inputs: Sequence[InputSpec], rows: int, axes: BatchAxes | None = None) -> int:
    """``rows``, or the model's fixed batch size when its inputs have one along their batch ``axes`` (a shard must
    then hold exactly that)."""
    if rows < 1:
        raise InputError(f"--batch must be at least 1, got {rows}")
    fixed = {spec.shape[axis] for spec, axis in _rowed(inputs, axes or BatchAxes({})) if spec.shape[axis] is not None}
    if len(fixed) > 1:
        raise InputError(f"the model's inputs disagree on their batch size ({sorted(fixed)}); nothing can feed them")
    if not fixed:
        return rows
    size = fixed.pop()
    if size != rows:
        log.warning("the model takes batches of exactly %d rows: shards hold %d, not --shard-rows %d", size, size, rows)
    return size


def write_shards(
    output: Path,
    source: str,
    inputs: Sequence[InputSpec],
    batches: Iterable[dict[str, np.ndarray]],
    rows: int,
    axes: BatchAxes | None = None,
) -> DataSetReport:
    """Write ``batches`` (checked feed dicts) as shards of at most ``rows`` rows (along each input's batch axis in
    ``axes``; default axis 0), regrouped where every input with rows has them on a free axis, then commit the folder
    as ``output``. Nothing is left behind when the batches fail or are empty (an error)."""
    started = time.perf_counter()
    output = Path(output)
    created = _make_parents(output.parent)
    try:
        with temporary_folder_beside(output) as folder:
            writer = _ShardWriter(folder, inputs, rows, axes or BatchAxes({}))
            for batch in batches:
                writer.add(batch)
            writer.flush()
            if not writer.shards:
                raise InputError(f"{source}: no data; nothing was written")
            commit_folder(folder, output)
    except BaseException:
        for parent in reversed(created):
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    described = [
        {"name": spec.name, "dtype": spec.dtype.name, "shape": list(writer.shapes[spec.name])} for spec in inputs
    ]
    return DataSetReport(
        str(output), source, writer.rows, writer.shards, described, round(time.perf_counter() - started, 3)
    )


def _make_parents(folder: Path) -> list[Path]:
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir()
    return list(reversed(missing))


class _ShardWriter:
    """Regroups feed dicts into shards of ``rows`` rows; batches of other shapes besides the rows, or other values
    of an input without rows (a sample rate), start a new shard."""

    def __init__(self, folder: Path, inputs: Sequence[InputSpec], rows: int, axes: BatchAxes):
        self.folder, self.inputs, self.size, self.axes = folder, inputs, rows, axes
        rowed = _rowed(inputs, axes)
        self.splittable = bool(rowed) and all(spec.shape[axis] is None for spec, axis in rowed)
        self.pending: list[dict[str, np.ndarray]] = []
        self.shards = self.rows = 0
        self.shapes: dict[str, tuple[int | None, ...]] = {}

    def add(self, batch: dict[str, np.ndarray]) -> None:
        if not self.splittable:
            self._write(batch)
            return
        axes = self.axes
        if self.pending and not axes.joinable([self.pending[0], batch]):
            self.flush()
        self.pending.append(batch)
        total = sum(axes.rows(item) for item in self.pending)
        if total >= self.size:
            joined = axes.join(self.pending)
            start = 0
            while total - start >= self.size:
                self._write(axes.take(joined, slice(start, start + self.size)))
                start += self.size
            self.pending = [axes.take(joined, slice(start, None))] if start < total else []

    def flush(self) -> None:
        if self.pending:
            self._write(self.axes.join(self.pending))
            self.pending = []

    def _write(self, batch: dict[str, np.ndarray]) -> None:
        np.savez(self.folder / SHARD_NAME.format(self.shards), **batch)
        self.shards += 1
        self.rows += self.axes.rows(batch)
        for name, array in batch.items():
            known = self.shapes.get(name)
            shape = tuple(array.shape)
            self.shapes[name] = (
                shape if known is None else tuple(a if a == b else None for a, b in zip(known, shape, strict=True))
            )
