"""Calibration data: one object per conversion, streamed in batches of bounded size and split once.

:class:`CalibrationData` reads an .npz file, a folder of them, a Python iterable of feed dicts or ``"random"``. Its
:meth:`~CalibrationData.split` cuts the rows into mini-batches and holds out a seeded share of them, once: the fit,
recovery and the fidelity budget all read the same :class:`CalibrationSplit`, so no consumer re-splits and none
writes the data back to disk. Given a ``held_out`` source of its own (the user's validation data, ideally of the
kind the model will see in deployment), every calibration row is fitted on and the held-out rows come from it.

Every .npz member is read as a stream: its .npy header first, then at most ``max_samples`` entries along the first
axis at a time, so a file of any size costs one batch of memory (compressed members included, since zip members
decompress as they are read). By default a batch holds about ``BATCH_ELEMENTS`` input elements: a file of 32
tokenised sentences stays one run, 224x224 images go 6 at a time. A file is split only where every model input has
a free first axis and all arrays agree on its length; otherwise the file is one batch, as the model's fixed shapes
demand.
"""

from __future__ import annotations

import tokenize
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from nmdeploy.errors import InputError
from nmdeploy.limits import check_npz_archive
from nmdeploy.runtimes.data import RANDOM, InputSpec, check_batch, data_files, graph_inputs, random_batches

FeedDict = dict[str, np.ndarray]
Source = str | Path | Iterable[FeedDict]

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


@dataclass
class CalibrationSplit:
    """Calibration rows cut into mini-batches; ``held_out`` ones are never trained or fitted on."""

    train: list[FeedDict]
    held_out: list[FeedDict]
    sources: list[int] = field(default_factory=list)  # the calibration batch each train mini-batch came from

    def train_batches(self) -> list[FeedDict]:
        """The training mini-batches regrouped by their calibration batch (fewer, larger runs for statistics)."""
        groups: dict[int, list[FeedDict]] = {}
        for source, batch in zip(self.sources, self.train, strict=True):
            groups.setdefault(source, []).append(batch)
        return [{name: np.concatenate([b[name] for b in group]) for name in group[0]} for group in groups.values()]

    @property
    def held_out_rows(self) -> int:
        return sum(len(next(iter(batch.values()))) for batch in self.held_out)


class CalibrationData:
    """A model's calibration inputs: ``source`` is an .npz, a folder of them, ``"random"`` or an iterable of feed
    dicts (a one-shot iterator is read once and kept); batches of at most ``max_samples`` rows (None: about
    BATCH_ELEMENTS input elements), each checked against the model's inputs. ``held_out``: a source of the same
    kinds whose rows every fidelity judgement reads instead of a share of ``source`` (None: a seeded share)."""

    def __init__(
        self, source: Source, model: onnx.ModelProto, max_samples: int | None = None, held_out: Source | None = None
    ):
        if max_samples is not None and max_samples < 1:
            raise InputError(f"calibration batch size must be at least 1, got {max_samples}")
        self.source, self.model, self.max_samples = _readable_twice(source), model, max_samples
        self.held_out_source = None if held_out is None else _readable_twice(held_out)
        self.inputs = graph_inputs(model)
        self._split: CalibrationSplit | None = None
        self._split_key: tuple[int, float, int] | None = None
        if isinstance(held_out, str | Path):
            if str(held_out) == RANDOM:
                raise InputError(
                    "held-out data 'random' judges fidelity on noise: give real rows (an .npz or a folder)"
                )
            if {p.resolve() for p in _files(source)} & {p.resolve() for p in _files(held_out)}:
                raise InputError(
                    f"the held-out data {held_out} shares files with the calibration data {source}: fidelity judged "
                    "on rows the fit saw promises too much; give held-out rows the fit never reads"
                )

    @classmethod
    def of(
        cls,
        source: Source | CalibrationData,
        model: onnx.ModelProto,
        max_samples: int | None = None,
        held_out: Source | None = None,
    ) -> CalibrationData:
        """``source`` itself when it is calibration data already (its split and its own held-out rows shared:
        ``held_out`` is then what was read from it, e.g. ``ConvertOptions.held_out``), else new data for ``model``
        judged on ``held_out``."""
        if not isinstance(source, CalibrationData):
            return cls(source, model, max_samples, held_out)
        if held_out is not None and source.held_out_source is None:
            raise ValueError("held-out data goes to the CalibrationData that is shared, not beside it")
        return source

    @property
    def files(self) -> list[Path]:
        """The .npz files read, held-out ones included (none for random or in-memory data)."""
        return [path for source in (self.source, self.held_out_source) for path in _files(source)]

    def batches(self) -> Iterator[FeedDict]:
        """Every row, in bounded batches (the whole data, whether or not it was split)."""
        return self._batches_of(self.source, "calibration")

    def _batches_of(self, source: Source, what: str) -> Iterator[FeedDict]:
        if isinstance(source, str | Path):
            yield from calibration_batches(source, self.inputs, self.max_samples, model=self.model)
            return
        for index, batch in enumerate(source):
            if not isinstance(batch, dict):
                raise InputError(f"{what} batch {index}: a {type(batch).__name__}, not a dict of input arrays")
            arrays = {name: np.asarray(value) for name, value in batch.items()}
            yield from _split(check_batch(arrays, self.inputs, f"{what} batch {index}"), self.inputs, self.max_samples)

    def one_row_per_batch(self) -> bool:
        """Feed one row per batch from now on (a model that runs only at batch 1); False once the data was split,
        when its mini-batches are fixed."""
        if self._split is not None:
            return False
        self.max_samples = 1
        return True

    def fit_batches(self) -> Iterable[FeedDict]:
        """What a fit reads: the training split once the data was split, else every row."""
        return self._split.train_batches() if self._split is not None else self.batches()

    def split(self, rows: int, held_out: float, seed: int) -> CalibrationSplit:
        """Mini-batches of ``rows`` rows, a seeded share ``held_out`` of them held out; made once (every later call
        must ask for the same split, so that no consumer trains on another's held-out rows)."""
        key = (rows, held_out, seed)
        if self._split is not None:
            if key != self._split_key:
                raise AssertionError(f"calibration data split {self._split_key} already; asked for {key}")
            return self._split
        chunks, sources = _chunks(self.batches(), rows)
        if self.held_out_source is not None:
            held, _ = _chunks(self._batches_of(self.held_out_source, "held-out"), rows)
            if not chunks or not held:
                empty = "calibration" if not chunks else "held-out"
                raise InputError(f"the {empty} data holds no rows: give at least {rows} rows to fit and to judge on")
            self._split, self._split_key = CalibrationSplit(chunks, held, sources), key
            return self._split
        if len(chunks) < 2:
            raise InputError(
                f"a held-out split needs at least 2 mini-batches of {rows} calibration rows (one to fit on, one held "
                f"out); the calibration data gives {len(chunks)}"
            )
        order = np.random.default_rng(seed).permutation(len(chunks))
        kept = set(order[: max(1, round(held_out * len(chunks)))].tolist())
        train = [i for i in range(len(chunks)) if i not in kept]
        self._split = CalibrationSplit(
            [chunks[i] for i in train], [chunks[i] for i in sorted(kept)], [sources[i] for i in train]
        )
        self._split_key = key
        return self._split


def _chunks(batches: Iterable[FeedDict], rows: int) -> tuple[list[FeedDict], list[int]]:
    """Mini-batches of at most ``rows`` rows, and the batch each came from."""
    chunks, sources = [], []
    for index, batch in enumerate(batches):
        counts = {len(array) if array.ndim else 0 for array in batch.values()}
        if len(counts) != 1:
            raise InputError("splitting calibration batches along their first axis: the inputs disagree on it")
        (count,) = counts
        for start in range(0, count, rows):
            chunks.append({name: array[start : start + rows] for name, array in batch.items()})
            sources.append(index)
    return chunks, sources


def _files(source: Source | None) -> list[Path]:
    return data_files(source) if isinstance(source, str | Path) and str(source) != RANDOM else []


def _readable_twice(source: Source) -> Source:
    return list(source) if not isinstance(source, str | Path) and iter(source) is source else source


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
        except (OSError, ValueError, zipfile.BadZipFile, EOFError, SyntaxError, tokenize.TokenError) as error:
            # numpy parses the header's dict with Python's tokenizer: damage there raises its errors
            raise InputError(f"{where}: member '{member}' is not a readable .npy array ({error})") from None
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
