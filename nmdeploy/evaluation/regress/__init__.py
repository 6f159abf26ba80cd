"""Accuracy/latency regression checks against a baselines file, as users run them in CI.

A baselines file (TOML, one per model family, e.g. ``models/mlp/baselines.toml``) lists model pairs; for each,
the accuracy figures of ``nmdeploy.evaluation.compare`` per output and the latency ratios candidate / reference per
batch size, each with a baseline value and an absolute tolerance::

    [[model]]
    name = "mlp-2of4"
    reference = "dense.onnx"            # paths are relative to this file
    candidate = "sparse-2of4.onnx"
    data = "digits-test.npz"            # or "random"
    metric = "mymetrics:iou"            # optional: the user's own figure, as compare --metric takes

    [model.accuracy.logits]             # one table per output name
    mean_cosine = { baseline = 0.918, tolerance = 0.02 }
    top1_agreement = { baseline = 0.848, tolerance = 0.03 }

    [model.accuracy.metric]             # the metric above (higher is better), averaged over the batches
    value = { baseline = 0.71, tolerance = 0.01 }

    [model.latency]
    backend = "ort"
    batch = [1, 32]
    warmup = 5
    iterations = 50
    runs = 3                            # benchmarks repeated; the median ratio counts (--update: at least 3)

    [model.latency.p50_ratio]           # one entry per batch size
    1 = { baseline = 1.0, tolerance = 0.5 }

Paths resolve relative to the baselines file unless a ``root`` folder is given: a tool that writes the models
elsewhere (``nmdeploy pipeline`` writes them to its output folder) passes that folder.

Latency is only ever judged as a ratio to the reference measured interleaved in the same run, never as absolute
time, so a baseline holds on a different or busier machine. ``update=True`` rewrites the baseline numbers in place
(comments, order and tolerances kept) with the measured ones, atomically; ``init_baselines`` writes a new file from
one measurement, with tolerances derived from it (``initial.py``).
"""

from __future__ import annotations

import math
from pathlib import Path

from nmdeploy.errors import InputError
from nmdeploy.evaluation.regress import measuring
from nmdeploy.evaluation.regress.initial import BaselinePair, init_baselines, write_new_baselines
from nmdeploy.evaluation.regress.judging import Check, RegressionReport, judge
from nmdeploy.evaluation.regress.measuring import (
    Measure,
    Median,
    accuracy_figures,
    bench_runs,
    compare_pair,
    latency_figures,
    latency_medians,
    measure,
    measure_for_update,
)
from nmdeploy.evaluation.regress.rewrite import rewrite_baselines
from nmdeploy.evaluation.regress.schema import (
    ACCURACY_METRICS,
    LATENCY_METRICS,
    MIN_UPDATE_RUNS,
    USER_METRIC,
    Baseline,
    LatencySettings,
    MetricKey,
    ModelBaselines,
    load_baselines,
)
from nmdeploy.evaluation.regress.table import format_report

__all__ = [
    "BaselinePair",
    "ACCURACY_METRICS",
    "LATENCY_METRICS",
    "Baseline",
    "Check",
    "LatencySettings",
    "MIN_UPDATE_RUNS",
    "Measure",
    "Median",
    "MetricKey",
    "ModelBaselines",
    "RegressionReport",
    "USER_METRIC",
    "accuracy_figures",
    "bench_runs",
    "compare_pair",
    "format_report",
    "init_baselines",
    "judge",
    "latency_figures",
    "latency_medians",
    "load_baselines",
    "measure",
    "measure_for_update",
    "rewrite_baselines",
    "run_regression",
    "write_new_baselines",
]


def run_regression(
    path: str | Path, *, update: bool = False, measure: Measure | None = None, root: str | Path | None = None
) -> RegressionReport:
    """Measure every model of the baselines file and judge it; with ``update``, rewrite the baselines first.

    ``measure`` defaults to compare and ``[model.latency] runs`` benchmarks (with ``update``, at least
    ``MIN_UPDATE_RUNS``: a stored latency baseline is the median of several runs, never one). ``root`` is the folder
    the model and data paths are relative to (default: the baselines file's folder).
    """
    if measure is None:
        measure = measure_for_update if update else measuring.measure
    path = Path(path)
    models = load_baselines(path, root)
    for model in models:
        for file in (model.reference, model.candidate):
            if not file.is_file():
                raise InputError(f"{path}: model '{model.name}': {file} does not exist")
    measurements = [measure(model) for model in models]
    if update:
        values = {
            (index, key): value
            for index, (model, measured) in enumerate(zip(models, measurements, strict=True))
            for key, value in measured.items()
            if key in model.baselines and value is not None and not math.isnan(value)
        }
        rewrite_baselines(path, values)
        models = load_baselines(path, root)
    checks = [check for model, m in zip(models, measurements, strict=True) for check in judge(model, m, path)]
    return RegressionReport(path, checks, updated=update)
