"""Streamed statistics of chosen activations over calibration data, for quantization's activation ranges.

The conversion package's statistics engine runs the model (segment by segment, in bounded batches, the calibration
data's fit rows: the held-out ones stay unseen when the data was split for a conversion) with an observer per
tensor, and each batch only updates one :class:`AbsHistogram` per tensor, so memory is one batch's activations plus
``bins`` counts per tensor whatever the data set's size.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from nmdeploy.conversion.data import CalibrationData, Source
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.quantization_ranges import DEFAULT_BINS, AbsHistogram


def activation_histograms(
    model: OnnxModel,
    tensors: Iterable[str],
    calibration: Source | CalibrationData | str | Path,
    *,
    batch_size: int | None = None,
    bins: int = DEFAULT_BINS,
) -> tuple[dict[str, AbsHistogram], int]:
    """|x| histograms of the main-graph values ``tensors`` over ``calibration`` (an .npz, a folder of them,
    "random", an iterable of feed dicts, or :class:`CalibrationData` shared with a conversion), and the number of
    samples seen."""
    from nmdeploy.conversion.statistics import StageStatistics

    histograms = {name: AbsHistogram(bins) for name in dict.fromkeys(tensors)}
    if not histograms:
        return {}, 0
    data = CalibrationData.of(calibration, model.proto, batch_size)
    observers = {name: _observer(histogram, name) for name, histogram in histograms.items()}
    statistics = StageStatistics(model, [[]], data.fit_batches(), compare_dense=False, observers=observers)
    for _ in statistics:
        pass
    return histograms, statistics.summary.samples


def _observer(histogram: AbsHistogram, name: str):
    def observe(values) -> None:
        histogram.update(values if not hasattr(values, "numpy") else values.detach().cpu().numpy(), name)

    return observe
