"""Activation statistics for calibrated conversion: per prunable weight, H = X^T X of its GEMM input along K.

The model runs segment by segment through the backend registry (:mod:`.segments`: ONNX Runtime on the CPU, the torch
interpreter on a device), cut at the fitting stages, each segment run once per stream (dense and converted) on the
values cached at the cut before it (:mod:`.store`, spilled to disk past a limit), over calibration data read in
batches of bounded size (:mod:`nmdeploy.calibration.data`). H and the cross moments against the dense model are
accumulated chunk by chunk in float64 (:mod:`.taps`), so memory is bounded by the statistics of one stage, one
batch's activations and the cut, never by the calibration set.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from nmdeploy.calibration.statistics.engine import (
    DEFAULT_CACHE_LIMIT,
    RUNNERS,
    CalibrationSummary,
    StageStatistics,
)
from nmdeploy.calibration.statistics.stages import fitting_stages
from nmdeploy.calibration.statistics.taps import InputStatistics, reduction_length
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.prunable import PrunableWeight

__all__ = [
    "DEFAULT_CACHE_LIMIT",
    "RUNNERS",
    "CalibrationSummary",
    "InputStatistics",
    "StageStatistics",
    "collect_statistics",
    "fitting_stages",
    "reduction_length",
]


def collect_statistics(
    model: OnnxModel,
    weights: Iterable[PrunableWeight],
    batches: Iterable[dict[str, np.ndarray]],
    *,
    cache_limit: int = DEFAULT_CACHE_LIMIT,
    runner: str = "onnxruntime",
    device: str = "cpu",
) -> tuple[dict[str, InputStatistics], dict[str, str]]:
    """H = X^T X on the model as it is, for every weight that can be collected, and the reason for every one that
    cannot; one run over ``batches`` (in ONNX Runtime, or in the torch interpreter on ``device``)."""
    results = [
        (stats, skipped)
        for _, stats, skipped in StageStatistics(
            model, [list(weights)], batches, cache_limit=cache_limit, runner=runner, device=device
        )
    ]
    return results[0]
