"""Calibration data: one object per conversion, streamed in batches of bounded size; its fit / held-out split a value.

:class:`CalibrationData` reads an .npz file, a folder of them, a Python iterable of feed dicts or ``"random"``; it
never changes once made. :meth:`~CalibrationData.split` cuts the rows into mini-batches and holds out a seeded share
of them (:class:`SplitSettings`), and returns the :class:`CalibrationSplit`, an immutable value: whoever runs a
conversion makes it once and hands it to the fit, recovery and the budget, so every consumer reads the same rows
and none writes the data back to disk. Given a ``held_out`` source of its own (the user's validation data, ideally
of the kind the model will see in deployment), every calibration row is fitted on and the held-out rows come from
it.

Every .npz member is read as a stream by the one reader of data files (:func:`nmdeploy.runtimes.data.npz_batches`):
its .npy header first, then at most ``max_samples`` entries along the first axis at a time, so a file of any size
costs one batch of memory (compressed members included, since zip members decompress as they are read). By default a
batch holds about ``BATCH_ELEMENTS`` input elements: a file of 32 tokenised sentences stays one run, 224x224 images
go 6 at a time. A file is split only where every model input has a free batch axis and all arrays agree on its
length; otherwise the file is one batch, as the model's fixed shapes demand. Rows lie along each input's batch axis
(:mod:`nmdeploy.runtimes.batch_axes`: axis 1 of a [2, B, 128] state, none for a scalar, which goes whole with every
piece); a file whose rows are not all on axis 0 is read whole, then cut.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from nmdeploy.errors import InputError
from nmdeploy.runtimes.batch_axes import BatchAxes, model_batch_axes
from nmdeploy.runtimes.data import (
    RANDOM,
    InputSpec,
    RowCount,
    check_batch,
    cut_batch,
    data_files,
    graph_inputs,
    npz_batches,
    random_batches,
)

FeedDict = dict[str, np.ndarray]
Source = str | Path | Iterable[FeedDict]

BATCH_ELEMENTS = 1 << 20  # input elements per batch when no sample count is given


def calibration_batches(
    source: str | Path,
    inputs: Sequence[InputSpec],
    max_samples: int | None = None,
    *,
    model: onnx.ModelProto | None = None,
    axes: BatchAxes | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Feed dicts of at most ``max_samples`` rows each (along ``axes``, default the model's; where the model's shapes
    allow splitting; None: about BATCH_ELEMENTS input elements), checked against ``inputs``; ``"random"`` gives the
    seeded random batches of :func:`nmdeploy.runtimes.data.random_batches` (ids valid for ``model``'s tables when
    given)."""
    if max_samples is not None and max_samples < 1:
        raise InputError(f"calibration batch size must be at least 1, got {max_samples}")
    axes = axes or model_batch_axes(model)
    if str(source) == RANDOM:
        for batch in random_batches(inputs, model=model, axes=axes):
            yield from cut_batch(batch, inputs, _rows(max_samples, axes), axes)
        return
    for path in data_files(source):
        yield from npz_batches(path, inputs, _rows(max_samples, axes), axes)


@dataclass(frozen=True)
class SplitSettings:
    """How calibration rows are cut for judging on held-out rows: mini-batches of ``rows`` rows, a seeded share
    ``held_out`` of them held out (``seed`` fixes which)."""

    rows: int = 8
    held_out: float = 0.2
    seed: int = 0


@dataclass(frozen=True)
class CalibrationSplit:
    """Calibration rows cut into mini-batches; ``held_out`` ones are never trained or fitted on."""

    train: tuple[FeedDict, ...]
    held_out: tuple[FeedDict, ...]
    sources: tuple[int, ...] = ()  # the calibration batch each train mini-batch came from
    axes: BatchAxes = field(default_factory=lambda: BatchAxes({}))  # where each input's rows lie

    def train_batches(self) -> list[FeedDict]:
        """The training mini-batches regrouped by their calibration batch (fewer, larger runs for statistics)."""
        groups: dict[int, list[FeedDict]] = {}
        for source, batch in zip(self.sources, self.train, strict=True):
            groups.setdefault(source, []).append(batch)
        return [self.axes.join(group) for group in groups.values()]

    @property
    def held_out_rows(self) -> int:
        return sum(self.axes.rows(batch, "held-out batch") for batch in self.held_out)


class CalibrationData:
    """A model's calibration inputs: ``source`` is an .npz, a folder of them, ``"random"`` or an iterable of feed
    dicts (a one-shot iterator is read once and kept); batches of at most ``max_samples`` rows (None: about
    BATCH_ELEMENTS input elements), each checked against the model's inputs. ``held_out``: a source of the same
    kinds whose rows every fidelity judgement reads instead of a share of ``source`` (None: a seeded share)."""

    def __init__(
        self,
        source: Source,
        model: onnx.ModelProto,
        max_samples: int | None = None,
        held_out: Source | None = None,
        batch_axes: dict[str, int | None] | None = None,
    ):
        if max_samples is not None and max_samples < 1:
            raise InputError(f"calibration batch size must be at least 1, got {max_samples}")
        self.source, self.model, self.max_samples = _readable_twice(source), model, max_samples
        self.held_out_source = None if held_out is None else _readable_twice(held_out)
        self.inputs = graph_inputs(model)
        self.axes = model_batch_axes(model, batch_axes)
        self.row_by_row = False  # fed one row per batch: the model runs only at batch 1 (calibration/batch_probe.py)
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
        batch_axes: dict[str, int | None] | None = None,
    ) -> CalibrationData:
        """``source`` itself when it is calibration data already (its own held-out rows shared: ``held_out`` is then
        what was read from it, e.g. ``ConversionOptions.held_out``), else new data for ``model`` judged on
        ``held_out``."""
        if not isinstance(source, CalibrationData):
            return cls(source, model, max_samples, held_out, batch_axes)
        if held_out is not None and source.held_out_source is None:
            raise ValueError("held-out data goes to the CalibrationData that is shared, not beside it")
        return source

    @property
    def files(self) -> list[Path]:
        """The .npz files read, held-out ones included (none for random or in-memory data)."""
        return [path for source in (self.source, self.held_out_source) for path in _files(source)]

    def batches(self) -> Iterator[FeedDict]:
        """Every calibration row, in bounded batches (never the held-out source's)."""
        return self._batches_of(self.source, "calibration")

    def _batches_of(self, source: Source, what: str) -> Iterator[FeedDict]:
        if isinstance(source, str | Path):
            yield from calibration_batches(source, self.inputs, self.max_samples, model=self.model, axes=self.axes)
            return
        for index, batch in enumerate(source):
            if not isinstance(batch, dict):
                raise InputError(f"{what} batch {index}: a {type(batch).__name__}, not a dict of input arrays")
            arrays = {name: np.asarray(value) for name, value in batch.items()}
            checked = check_batch(arrays, self.inputs, f"{what} batch {index}")
            yield from cut_batch(checked, self.inputs, _rows(self.max_samples, self.axes), self.axes)

    def one_row_per_run(self) -> CalibrationData:
        """The same data fed one row per batch (a model that runs only at batch 1), marked ``row_by_row``."""
        rows = copy.copy(self)
        rows.max_samples, rows.row_by_row = 1, True
        return rows

    def split(self, settings: SplitSettings) -> CalibrationSplit:
        """Mini-batches of ``settings.rows`` rows, a seeded share of them held out (every row of the held-out
        source instead, where the data has one). The same settings always give the same split."""
        rows = settings.rows
        chunks, sources = _chunks(self.batches(), rows, self.axes)
        if self.held_out_source is not None:
            held, _ = _chunks(self._batches_of(self.held_out_source, "held-out"), rows, self.axes)
            if not chunks or not held:
                empty = "calibration" if not chunks else "held-out"
                raise InputError(f"the {empty} data holds no rows: give at least {rows} rows to fit and to judge on")
            return CalibrationSplit(tuple(chunks), tuple(held), tuple(sources), self.axes)
        if len(chunks) < 2:
            raise InputError(
                f"a held-out split needs at least 2 mini-batches of {rows} calibration rows (one to fit on, one held "
                f"out); the calibration data gives {len(chunks)}"
            )
        order = np.random.default_rng(settings.seed).permutation(len(chunks))
        kept = set(order[: max(1, round(settings.held_out * len(chunks)))].tolist())
        train = [i for i in range(len(chunks)) if i not in kept]
        return CalibrationSplit(
            tuple(chunks[i] for i in train),
            tuple(chunks[i] for i in sorted(kept)),
            tuple(sources[i] for i in train),
            self.axes,
        )


def _chunks(batches: Iterable[FeedDict], rows: int, axes: BatchAxes) -> tuple[list[FeedDict], list[int]]:
    """Mini-batches of at most ``rows`` rows (along each input's batch axis), and the batch each came from."""
    chunks, sources = [], []
    for index, batch in enumerate(batches):
        for piece in axes.pieces(batch, rows, f"calibration batch {index}"):
            chunks.append(piece)
            sources.append(index)
    return chunks, sources


def _files(source: Source | None) -> list[Path]:
    return data_files(source) if isinstance(source, str | Path) and str(source) != RANDOM else []


def _readable_twice(source: Source) -> Source:
    return list(source) if not isinstance(source, str | Path) and iter(source) is source else source


def _samples_per_batch(max_samples: int | None, shapes: dict[str, tuple[int, ...]], axes: BatchAxes) -> int:
    if max_samples is not None:
        return max_samples
    per_sample = 0
    for name, shape in shapes.items():
        axis = axes.axis(name)
        if axis is not None and axis < len(shape):
            per_sample += int(np.prod(shape[:axis] + shape[axis + 1 :], dtype=np.int64))
    return max(1, BATCH_ELEMENTS // max(1, per_sample))


def _rows(max_samples: int | None, axes: BatchAxes) -> RowCount:
    """Rows per batch of a file or feed dict of given shapes: ``max_samples``, else about BATCH_ELEMENTS elements."""
    return lambda shapes: _samples_per_batch(max_samples, dict(shapes), axes)
