"""Measuring the figures a baselines file names: compare and bench, or figures already measured.

Latency is the median of repeated interleaved benchmarks: one run of a small model on a busy machine can be off by
a third, and a baseline stored from it fails (or "improves") the next run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from nmdeploy.evaluation.bench import BenchReport, benchmark
from nmdeploy.evaluation.compare import Comparison, compare_models
from nmdeploy.evaluation.regress.schema import (
    ACCURACY_METRICS,
    LATENCY_METRICS,
    MIN_UPDATE_RUNS,
    USER_METRIC,
    LatencySettings,
    MetricKey,
    ModelBaselines,
)
from nmdeploy.fidelity import is_builtin_metric, load_metric
from nmdeploy.runtimes.data import RANDOM

Measure = Callable[[ModelBaselines], dict[MetricKey, float | None]]


class Median(float):
    """The median of repeated runs: the figure itself wherever a number is read, with the runs it came from."""

    runs: tuple[float, ...]

    def __new__(cls, runs: Sequence[float]) -> Median:
        figure = super().__new__(cls, statistics.median(runs))
        figure.runs = tuple(float(run) for run in runs)
        return figure

    @property
    def spread(self) -> float:
        """Largest minus smallest run."""
        return max(self.runs) - min(self.runs)


def measure(model: ModelBaselines, progress: bool = False) -> dict[MetricKey, float | None]:
    """Run compare (when accuracy is checked) and repeated interleaved benchmarks (when latency is)."""
    measured: dict[MetricKey, float | None] = {}
    if any(key[0] == "accuracy" for key in model.baselines):
        comparison = compare_pair(model.reference, model.candidate, model.data, model.metric, model.judged_outputs)
        measured.update(accuracy_figures(comparison))
    if model.latency is not None:
        data = None if model.data == RANDOM else model.data
        measured.update(latency_medians(bench_runs(model.reference, model.candidate, data, model.latency, progress)))
    return measured


def measure_for_update(model: ModelBaselines) -> dict[MetricKey, float | None]:
    """``measure`` with at least ``MIN_UPDATE_RUNS`` benchmark runs: what a stored baseline is made of."""
    if model.latency is not None and model.latency.runs < MIN_UPDATE_RUNS:
        model = replace(model, latency=replace(model.latency, runs=MIN_UPDATE_RUNS))
    return measure(model)


def compare_pair(
    reference: Path,
    candidate: Path,
    data: str | Path,
    metric: str | None = None,
    outputs: Sequence[str] | None = None,
) -> Comparison:
    """The one comparison regress and the pipeline judge: the judged outputs (``outputs``, or by default the float
    outputs that are not copies of an input), plus the metric when named (a built-in measure such as
    ``perplexity``, or the user's ``module:function``)."""
    if metric is not None and not is_builtin_metric(metric):
        return compare_models(reference, candidate, data, load_metric(metric), outputs)
    return compare_models(reference, candidate, data, metric, outputs)


def bench_runs(
    reference: Path, candidate: Path, data: str | Path | None, settings: LatencySettings, progress: bool = False
) -> list[BenchReport]:
    """``settings.runs`` interleaved reference/candidate benchmarks, one after another."""
    return [
        benchmark(
            [reference, candidate],
            backend=settings.backend,
            batches=settings.batch,
            warmup=settings.warmup,
            iterations=settings.iterations,
            duration=settings.duration,
            batch_axes=settings.batch_axes or None,
            shapes=settings.shapes,
            data=data,
            device=settings.device,
            progress=progress,
        )
        for _ in range(settings.runs)
    ]


class AccuracyFigure(float):
    """An accuracy figure as measured, with whether ``auto`` judges its output by it (``chosen``: what a new
    baselines file stores) and, where the data cannot move it, why (``problem``: never judged against a baseline)."""

    chosen: bool
    problem: str | None
    failure: str | None
    """Why the pair failed whatever this figure says (the candidate crashing at a batch the reference runs), or
    None; a figure with a failure is judged regressed."""
    note: str | None  # what the value is where its name does not say it (the scale standing in for the cosine)

    def __new__(
        cls,
        value: float,
        chosen: bool = True,
        problem: str | None = None,
        failure: str | None = None,
        note: str | None = None,
    ) -> AccuracyFigure:
        figure = super().__new__(cls, value)
        figure.chosen, figure.problem, figure.failure, figure.note = chosen, problem, failure, note
        return figure


# Figures of one output that a measure of nmdeploy.fidelity judges, by the names of the measures auto judges it by
# (the rows' scale goes with the cosine; a baseline's largest absolute error sees a change of scale).
_MEASURED_BY = {"mean_cosine": ("cosine", "scale"), "spread_agreement": ("spread",)}


def accuracy_figures(comparison: Comparison) -> dict[MetricKey, float | None]:
    """The judged accuracy figures of a comparison, keyed as in a baselines file: ``mean_cosine`` and
    ``spread_agreement`` as :class:`AccuracyFigure` (chosen where ``auto`` judges the output by them; carrying why
    where they cannot judge it); ``mean_cosine`` is the lower of the cosine and the rows' scale agreement, the figure
    ``auto`` judges; an integer output's ``agreement`` alone."""
    figures: dict[MetricKey, float | None] = {}
    for output in comparison.outputs:
        if output.integer:  # labels and indices: only their agreement means anything
            figure = output.agreement_figure()
            figures[("accuracy", output.name, "agreement")] = AccuracyFigure(figure.value, True, figure.problem)
            continue
        chosen = output.auto_figure().metric
        for metric in ACCURACY_METRICS:
            if metric == "agreement":
                continue
            value, note = getattr(output, metric), None
            if metric == "mean_cosine" and output.scale_agreement < value:
                # held to the rows' scale, as auto holds it: a cosine cannot see a 0.3x output
                value, note = output.scale_agreement, f"the rows' scale agreement, below their cosine {value:.4g}"
            if metric in _MEASURED_BY:
                figure = output.cosine_figure() if metric == "mean_cosine" else output.spread_figure()
                value = AccuracyFigure(value, chosen in _MEASURED_BY[metric], figure.problem, note=note)
            elif metric == "top1_agreement" and value is not None:
                value = AccuracyFigure(value, True, output.top1_figure().problem)
            figures[("accuracy", output.name, metric)] = value
    if comparison.metric is not None:
        figures[USER_METRIC] = comparison.metric
    elif comparison.metric_name not in ("auto", "custom"):  # a built-in measure the file names: its model figure
        unjudged = comparison.unjudged
        figures[USER_METRIC] = AccuracyFigure(
            comparison.fidelity if not unjudged else 0.0, True, unjudged[0].problem if unjudged else None
        )
    if comparison.batch_failure is not None:  # the candidate crashes at a batch the reference runs: nothing passes
        figures = {
            key: AccuracyFigure(
                math.nan if value is None else value,
                getattr(value, "chosen", True),
                getattr(value, "problem", None),
                comparison.batch_failure,
                getattr(value, "note", None),
            )
            for key, value in figures.items()
        }
    return figures


def latency_figures(report: BenchReport) -> dict[MetricKey, float | None]:
    """The judged latency ratios (candidate / reference) of a two-model benchmark, keyed as in a baselines file."""
    return {
        ("latency", metric, str(ratio.batch)): getattr(ratio, field_name)
        for ratio in report.ratios
        for metric, field_name in LATENCY_METRICS.items()
    }


def latency_medians(reports: Sequence[BenchReport]) -> dict[MetricKey, float | None]:
    """Each latency ratio's median over repeated benchmarks, carrying the runs (see :class:`Median`)."""
    runs = [latency_figures(report) for report in reports]
    return {key: Median([figures[key] for figures in runs]) for key in runs[0]}
