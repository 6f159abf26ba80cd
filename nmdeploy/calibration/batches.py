"""Calibration data in batches of bounded size, whatever the files hold.

Every .npz member is read as a stream: its .npy header first, then at most ``max_samples`` entries along the first
axis at a time, so a file of any size costs one batch of memory (compressed members included, since zip members
decompress as they are read). By default a batch holds about ``BATCH_ELEMENTS`` input elements: a file of 32
tokenised sentences stays one run, 224x224 images go 6 at a time. A file is split only where every model input has
a free first axis and all arrays agree on its length; otherwise the file is one batch, as the model's fixed shapes
demand.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx

from nmdeploy.errors import InputError
from nmdeploy.limits import check_npz_archive
from nmdeploy.runtimes.data import RANDOM, InputSpec, check_batch, data_files, random_batches

BATCH_ELEMENTS = 1 << 20  # input elements per batch when no sample count is given


def calibration_batches(
    source: str | Path,
    inputs: Sequence[InputSpec],
    max_samples: int | None = None,
    *,
    model: onnx.ModelProto | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Feed dicts of at most ``max_samples`` entries each (where the model's shapes allow splitting; None: about
    BATCH_ELEMENTS input elements), checked against ``inputs``; ``"random"`` gives the seeded random batches of
    :func:`nmdeploy.runtimes.data.random_batches` (ids valid for ``model``'s tables when given)."""
    if max_samples is not None and max_samples < 1:
        raise InputError(f"calibration batch size must be at least 1, got {max_samples}")
    if str(source) == RANDOM:
        for batch in random_batches(inputs, model=model):
            yield from _split(batch, inputs, max_samples)
        return
    for path in data_files(source):
        yield from _file_batches(path, inputs, max_samples)


def _splittable(inputs: Sequence[InputSpec], lengths: dict[str, int]) -> bool:
    return all(spec.shape and spec.shape[0] is None for spec in inputs) and len(set(lengths.values())) == 1


def _samples_per_batch(max_samples: int | None, shapes: Iterable[tuple[int, ...]]) -> int:
    if max_samples is not None:
        return max_samples
    per_sample = sum(int(np.prod(shape[1:], dtype=np.int64)) for shape in shapes)
    return max(1, BATCH_ELEMENTS // max(1, per_sample))


def _split(batch: dict[str, np.ndarray], inputs: Sequence[InputSpec], max_samples: int | None):
    lengths = {spec.name: batch[spec.name].shape[0] if batch[spec.name].ndim else 0 for spec in inputs}
    if not _splittable(inputs, lengths):
        yield batch
        return
    max_samples = _samples_per_batch(max_samples, (array.shape for array in batch.values()))
    total = next(iter(lengths.values()))
    for start in range(0, total, max_samples):
        yield {name: array[start : start + max_samples] for name, array in batch.items()}


def _file_batches(path: Path, inputs: Sequence[InputSpec], max_samples: int | None) -> Iterator[dict[str, np.ndarray]]:
    check_npz_archive(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as error:
        raise InputError(f"{path}: not a readable .npz file ({error})") from error
    with archive:
        members = {Path(name).stem if name.endswith(".npy") else name: name for name in archive.namelist()}
        missing = [spec.name for spec in inputs if spec.name not in members]
        if missing:
            expected = ", ".join(spec.describe() for spec in inputs)
            raise InputError(f"{path}: no array for input '{missing[0]}'; the model expects {expected}")
        streams = {}
        try:
            for spec in inputs:
                streams[spec.name] = _MemberStream(archive, members[spec.name], f"{path}")
            lengths = {name: stream.length for name, stream in streams.items()}
            if not _splittable(inputs, lengths) or any(stream.fortran for stream in streams.values()):
                batch = {name: stream.read_all() for name, stream in streams.items()}
                yield check_batch(batch, inputs, str(path))
                return
            total = next(iter(lengths.values()))
            max_samples = _samples_per_batch(max_samples, (stream.shape for stream in streams.values()))
            for start in range(0, max(total, 1), max_samples):
                count = min(max_samples, total - start)
                batch = {name: stream.read_rows(count) for name, stream in streams.items()}
                yield check_batch(batch, inputs, str(path))
        finally:
            for stream in streams.values():
                stream.close()


class _MemberStream:
    """One .npy member of an .npz, read sequentially along its first axis."""

    def __init__(self, archive: zipfile.ZipFile, member: str, where: str):
        self.where = where
        try:
            self.handle = archive.open(member)
            version = np.lib.format.read_magic(self.handle)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(self.handle)
        except (OSError, ValueError, zipfile.BadZipFile, EOFError) as error:
            raise InputError(f"{where}: member '{member}' is not a readable .npy array ({error})") from error
        if dtype.hasobject:
            raise InputError(f"{where}: member '{member}' holds Python objects; calibration needs numeric arrays")
        self.shape, self.fortran, self.dtype = tuple(shape), fortran, dtype
        self.length = self.shape[0] if self.shape else 0
        self.row_items = int(np.prod(self.shape[1:], dtype=np.int64)) if self.shape else 1

    def read_rows(self, count: int) -> np.ndarray:
        return self._read(count * self.row_items).reshape((count, *self.shape[1:]))

    def read_all(self) -> np.ndarray:
        values = self._read(int(np.prod(self.shape, dtype=np.int64)))
        return values.reshape(self.shape, order="F" if self.fortran else "C")

    def _read(self, items: int) -> np.ndarray:
        values = np.empty(items, dtype=self.dtype)
        buffer = memoryview(values.view(np.uint8))
        filled = 0
        while filled < len(buffer):
            count = self.handle.readinto(buffer[filled:])
            if not count:
                raise InputError(f"{self.where}: an array ends early; the file is truncated")
            filled += count
        return values

    def close(self) -> None:
        self.handle.close()
