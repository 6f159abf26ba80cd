"""Streamed statistics of chosen activations over calibration data, for quantization's activation ranges.

The statistics engine runs the model (segment by segment, in bounded batches: every calibration row, or the
training rows of a :class:`CalibrationSplit`, so that rows held out for a conversion stay unseen) with an observer
per tensor, and each batch only updates that tensor's statistics (an :class:`AbsHistogram`, or a
:class:`ChannelMax` for smoothing), so memory is one batch's activations plus the statistics, whatever the data
set's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

import numpy as np

from nmdeploy.calibration.data import CalibrationData, CalibrationSplit, Source
from nmdeploy.calibration.observers import DEFAULT_BINS, SAMPLE_ROWS, AbsHistogram, ChannelMax, RowSample
from nmdeploy.graph.model import OnnxModel

Calibration = Source | CalibrationData | CalibrationSplit | str | Path


class _Statistic(Protocol):
    def update(self, values, name: str) -> None: ...


def activation_histograms(
    model: OnnxModel,
    tensors: Iterable[str],
    calibration: Calibration,
    *,
    batch_size: int | None = None,
    bins: int = DEFAULT_BINS,
) -> tuple[dict[str, AbsHistogram], int]:
    """|x| histograms of the main-graph values ``tensors`` over ``calibration`` (an .npz, a folder of them,
    "random", an iterable of feed dicts, :class:`CalibrationData` shared with a conversion, or the
    :class:`CalibrationSplit` of one: its training rows), and the number of samples seen."""
    histograms = {name: AbsHistogram(bins) for name in dict.fromkeys(tensors)}
    return histograms, observe(model, histograms, calibration, batch_size)


def activation_histograms_and_rows(
    model: OnnxModel,
    tensors: Iterable[str],
    sampled: Iterable[str],
    calibration: Calibration,
    *,
    batch_size: int | None = None,
    rows: int = SAMPLE_ROWS,
) -> tuple[dict[str, AbsHistogram], dict[str, RowSample], int]:
    """:func:`activation_histograms` of ``tensors`` and, in the same run, a :class:`RowSample` of each of ``sampled``
    (a subset of them), and the number of samples seen."""
    histograms = {name: AbsHistogram() for name in dict.fromkeys(tensors)}
    samples = {name: RowSample(rows) for name in dict.fromkeys(sampled) if name in histograms}
    both = {name: _Both(histogram, samples.get(name)) for name, histogram in histograms.items()}
    return histograms, samples, observe(model, both, calibration, batch_size)


class _Both:
    def __init__(self, histogram: AbsHistogram, sample: RowSample | None):
        self.histogram, self.sample = histogram, sample

    def update(self, values, name: str) -> None:
        self.histogram.update(values, name)
        if self.sample is not None:
            self.sample.update(values, name)


def activation_channel_max(
    model: OnnxModel, tensors: Iterable[str], calibration: Calibration, *, batch_size: int | None = None
) -> tuple[dict[str, ChannelMax], int]:
    """Max |x| per last-axis channel of each of ``tensors`` over ``calibration``, and the samples seen."""
    maxima = {name: ChannelMax() for name in dict.fromkeys(tensors)}
    return maxima, observe(model, maxima, calibration, batch_size)


def observe(
    model: OnnxModel, statistics: Mapping[str, _Statistic], calibration: Calibration, batch_size: int | None
) -> int:
    """Update ``statistics[name]`` with every batch's value of activation ``name``; the samples seen."""
    from nmdeploy.calibration.statistics import StageStatistics

    if not statistics:
        return 0
    batches = calibration_batches(model, calibration, batch_size)
    observers = {name: _observer(statistic, name) for name, statistic in statistics.items()}
    engine = StageStatistics(model, [[]], batches, compare_dense=False, observers=observers)
    for _ in engine:
        pass
    return engine.summary.samples


def calibration_batches(
    model: OnnxModel, calibration: Calibration, batch_size: int | None = None
) -> Iterable[dict[str, np.ndarray]]:
    """The batches of ``calibration`` for ``model``: a split's training rows, or every row of the data."""
    if isinstance(calibration, CalibrationSplit):
        return calibration.train_batches()
    return CalibrationData.of(calibration, model.proto, batch_size).batches()


def _observer(statistic: _Statistic, name: str):
    def update(values) -> None:
        statistic.update(values if not hasattr(values, "numpy") else values.detach().cpu().numpy(), name)

    return update
