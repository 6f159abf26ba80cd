"""Measuring the figures a baselines file names: compare and bench, or figures already measured."""

from __future__ import annotations

from collections.abc import Callable

from nmdeploy.evaluation.bench import BenchReport, benchmark
from nmdeploy.evaluation.compare import Comparison, compare_models
from nmdeploy.evaluation.regress.schema import ACCURACY_METRICS, LATENCY_METRICS, MetricKey, ModelBaselines
from nmdeploy.runtimes.data import RANDOM

Measure = Callable[[ModelBaselines], dict[MetricKey, float | None]]


def measure(model: ModelBaselines, progress: bool = False) -> dict[MetricKey, float | None]:
    """Run compare (when accuracy is checked) and an interleaved reference/candidate benchmark (when latency is)."""
    measured: dict[MetricKey, float | None] = {}
    if any(key[0] == "accuracy" for key in model.baselines):
        measured.update(accuracy_figures(compare_models(model.reference, model.candidate, model.data)))
    if model.latency is not None:
        settings = model.latency
        report = benchmark(
            [model.reference, model.candidate],
            backend=settings.backend,
            batches=settings.batch,
            warmup=settings.warmup,
            iterations=settings.iterations,
            shapes=settings.shapes,
            data=None if model.data == RANDOM else model.data,
            device=settings.device,
            progress=progress,
        )
        measured.update(latency_figures(report))
    return measured


def accuracy_figures(comparison: Comparison) -> dict[MetricKey, float | None]:
    """The judged accuracy figures of a comparison, keyed as in a baselines file."""
    return {
        ("accuracy", output.name, metric): getattr(output, metric)
        for output in comparison.outputs
        for metric in ACCURACY_METRICS
    }


def latency_figures(report: BenchReport) -> dict[MetricKey, float | None]:
    """The judged latency ratios (candidate / reference) of a two-model benchmark, keyed as in a baselines file."""
    return {
        ("latency", metric, str(ratio.batch)): getattr(ratio, field_name)
        for ratio in report.ratios
        for metric, field_name in LATENCY_METRICS.items()
    }
