"""Streamed statistics of one activation, updated batch by batch as the statistics engine runs the model.

:class:`AbsHistogram` keeps the running max |x| and a histogram of |x| with a fixed number of bins over [0, upper];
when a batch goes past ``upper`` the range doubles and neighbouring bins merge in pairs, so memory stays one array of
``bins`` counts however much data passes and no count moves to a wrong bin. :class:`ChannelMax` keeps the max |x|
of every channel (SmoothQuant's statistic), :class:`RowSample` a few rows of the tensor. Quantization reads them
(:mod:`nmdeploy.passes.quantization_ranges`); they know nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nmdeploy.errors import InputError

SAMPLE_ROWS = 256  # rows of each GEMM input kept to judge the ranges of the "auto" method
DEFAULT_BINS = 2048


@dataclass
class AbsHistogram:
    """Streamed statistics of one tensor: running max |x|, element count, and a histogram of |x| over [0, upper]
    whose range doubles (bins merging in pairs) whenever a batch goes past it."""

    bins: int = DEFAULT_BINS
    upper: float = 0.0
    max_abs: float = 0.0
    total: int = 0
    counts: np.ndarray = field(default=None)  # type: ignore[assignment]
    zeros: int = 0  # exact zeros (ReLU outputs, padding): in bin 0, and exact whatever the range

    def __post_init__(self) -> None:
        if self.bins < 2 or self.bins % 2:
            raise ValueError(f"a histogram needs an even number of bins (at least 2), got {self.bins}")
        if self.counts is None:
            self.counts = np.zeros(self.bins, dtype=np.int64)

    def update(self, values: np.ndarray, name: str = "tensor") -> None:
        magnitude = np.abs(np.asarray(values, dtype=np.float32)).reshape(-1)
        if not magnitude.size:
            return
        largest = float(magnitude.max())
        if not np.isfinite(largest):
            raise InputError(f"activation '{name}' holds NaN or infinite values on the calibration data")
        if self.upper == 0.0 and largest > 0.0:
            self.upper = largest
        while largest > self.upper:
            merged = self.counts.reshape(-1, 2).sum(axis=1)
            self.counts = np.concatenate([merged, np.zeros(self.bins - merged.size, dtype=np.int64)])
            self.upper *= 2.0
        if self.upper > 0.0:
            positions = np.minimum((magnitude * np.float32(self.bins / self.upper)).astype(np.int64), self.bins - 1)
            self.counts += np.bincount(positions, minlength=self.bins)
        else:
            self.counts[0] += magnitude.size
        self.max_abs = max(self.max_abs, largest)
        self.total += magnitude.size
        self.zeros += int(magnitude.size - np.count_nonzero(magnitude))

    @property
    def width(self) -> float:
        return self.upper / self.bins

    def centres(self) -> np.ndarray:
        return (np.arange(self.bins, dtype=np.float64) + 0.5) * self.width


@dataclass
class ChannelMax:
    """Streamed max |x| of every channel of the last axis (a GEMM input's reduction channels)."""

    values: np.ndarray | None = None

    def update(self, batch: np.ndarray, name: str = "tensor") -> None:
        magnitude = np.abs(np.asarray(batch, dtype=np.float32))
        if not magnitude.size:
            return
        largest = magnitude.reshape(-1, magnitude.shape[-1]).max(axis=0)
        if not np.isfinite(largest).all():
            raise InputError(f"activation '{name}' holds NaN or infinite values on the calibration data")
        self.values = largest if self.values is None else np.maximum(self.values, largest)


@dataclass
class RowSample:
    """Up to ``rows`` rows (vectors along the last axis) of a tensor, taken evenly from the first batches: what the
    "auto" method multiplies by a layer's weight to judge each candidate range by the layer's output error."""

    rows: int = SAMPLE_ROWS
    values: np.ndarray | None = None

    def update(self, batch: np.ndarray, name: str = "tensor") -> None:
        array = np.asarray(batch, dtype=np.float32)
        if not array.size or (self.values is not None and len(self.values) >= self.rows):
            return
        flat = array.reshape(-1, array.shape[-1])
        room = self.rows - (0 if self.values is None else len(self.values))
        taken = flat[np.linspace(0, len(flat) - 1, min(room, max(1, self.rows // 4), len(flat))).astype(np.int64)]
        self.values = taken if self.values is None else np.concatenate([self.values, taken])
