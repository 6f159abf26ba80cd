"""A new baselines file from one measurement (``regress --init``, and a pipeline's first run on a user's model).

Every figure the pair shows gets a baseline, and each tolerance comes from what was measured, by the rules below
(written into the file's header, so a reader knows where each number came from): accuracy figures are exact on fixed
data, so their tolerance is a share of the loss the conversion already caused, with a floor; latency ratios are the
median of repeated interleaved benchmarks, and their tolerance covers three times the spread of those runs, with a
floor for the noise that runs close together in time do not show.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from nmdeploy.errors import InputError
from nmdeploy.evaluation.regress.judging import RegressionReport, judge
from nmdeploy.evaluation.regress.measuring import (
    Median,
    accuracy_figures,
    bench_runs,
    compare_pair,
    latency_medians,
)
from nmdeploy.evaluation.regress.schema import (
    MIN_UPDATE_RUNS,
    USER_METRIC,
    LatencySettings,
    MetricKey,
    load_baselines,
)
from nmdeploy.files import write_atomically
from nmdeploy.runtimes.data import RANDOM

LATENCY_FLOOR = 0.4  # share of the baseline ratio; see RULES

RULES = (
    "mean_cosine or spread_agreement (whichever auto judges the output by), top1_agreement and agreement (integer",
    "  outputs): max(0.005, 10% of 1 - baseline) and max(0.01, 10% of 1 - baseline)",
    "max_abs_error (lower is better): max(1e-4, 50% of baseline)",
    "metric (the model's own, higher is better): max(0.005, 1% of |baseline|)",
    "latency p50_ratio (candidate / reference, lower is better): the median of the runs; tolerance max(40% of",
    "  baseline, 3 x the runs' spread (largest - smallest)): back-to-back runs share one quiet or busy moment, and",
    "  on a shared CPU the median of a later invocation was seen a third away from them",
)


def tolerance(key: MetricKey, figure: float) -> float:
    """The tolerance a new baseline of ``figure`` gets, by :data:`RULES`."""
    if key == USER_METRIC:
        value = max(0.005, 0.01 * abs(figure))
    elif key[0] == "latency":
        value = max(LATENCY_FLOOR * figure, 3 * figure.spread if isinstance(figure, Median) else 0.0)
    elif key[2] in ("mean_cosine", "spread_agreement"):
        value = max(0.005, 0.1 * (1 - figure))
    elif key[2] in ("top1_agreement", "agreement"):
        value = max(0.01, 0.1 * (1 - figure))
    else:
        value = max(1e-4, 0.5 * figure)
    return float(f"{value:.3g}")


# What a new file checks; of mean_cosine and spread_agreement, the one auto judges each output by.
STORED = {"mean_cosine", "spread_agreement", "top1_agreement", "agreement", "max_abs_error", "value", "p50_ratio"}


@dataclass(frozen=True)
class BaselinePair:
    """One [[model]] entry of a new baselines file: a pair as measured (``figures``), its data and settings;
    ``latency``: the benchmark settings its latency figures were measured with, None for an accuracy-only entry."""

    name: str
    reference: Path
    candidate: Path
    data: str | Path
    figures: Mapping[MetricKey, float | None]
    latency: LatencySettings | None = None
    metric: str | None = None
    outputs: Sequence[str] | None = None


def write_new_baselines(path: str | Path, pairs: Sequence[BaselinePair], header: tuple[str, ...] = ()) -> Path:
    """Write a baselines file with an entry per pair from its figures (as measured), refusing to replace an existing
    file or to store baselines of a candidate that crashed."""
    import tomlkit

    path = Path(path)
    if path.exists():
        raise InputError(f"{path} already exists; judge against it with nmdeploy regress, or refresh it with --update")
    for pair in pairs:
        failure = next((value.failure for value in pair.figures.values() if getattr(value, "failure", None)), None)
        if failure is not None:  # a baseline measured on a crashing candidate would pass it from then on
            raise InputError(f"{path}: no baselines written: {failure}")
    document = tomlkit.document()
    for line in (*header, "Tolerances are absolute, derived from the measurement that wrote this file:", *RULES):
        document.add(tomlkit.comment(line))
    document.add(tomlkit.comment("Refresh the numbers deliberately with: nmdeploy regress THIS_FILE --update"))
    models = tomlkit.aot()
    for pair in pairs:
        models.append(_entry(path, pair))
    document.add("model", models)
    write_atomically(path, tomlkit.dumps(document))
    load_baselines(path)  # what was written must read back
    return path


def _entry(path: Path, pair: BaselinePair):
    """The [[model]] table of one pair (paths relative to the file at ``path``)."""
    import tomlkit

    entry = tomlkit.table()
    entry.add("name", pair.name)
    entry.add("reference", _relative(pair.reference, path.parent))
    entry.add("candidate", _relative(pair.candidate, path.parent))
    entry.add("data", RANDOM if str(pair.data) == RANDOM else _relative(Path(pair.data), path.parent))
    if pair.metric is not None:
        entry.add("metric", pair.metric)
    if pair.outputs:
        entry.add("outputs", list(pair.outputs))
    kept = {key: value for key, value in pair.figures.items() if key[2] in STORED and key[0] == "accuracy"}
    kept = {
        key: value
        for key, value in kept.items()
        if value is not None and getattr(value, "chosen", True) and not getattr(value, "problem", None)
    }
    if kept:
        accuracy = tomlkit.table(is_super_table=True)
        for (_, group, figure_name), value in kept.items():
            if group not in accuracy:
                accuracy.add(group, tomlkit.table())
            accuracy[group].add(figure_name, _baseline((_, group, figure_name), value))
        entry.add("accuracy", accuracy)
    latency = pair.latency
    if latency is not None:
        table = tomlkit.table()
        table.add("backend", latency.backend)
        table.add("batch", list(latency.batch))
        table.add("warmup", latency.warmup)
        table.add("iterations", latency.iterations)
        table.add("duration", latency.duration)
        if latency.batch_axes:
            axes = {name: "none" if axis is None else axis for name, axis in latency.batch_axes.items()}
            table.add("batch_axes", axes)
        table.add("runs", max(latency.runs, MIN_UPDATE_RUNS))
        ratios = tomlkit.table()
        for key, value in pair.figures.items():
            if key[0] == "latency" and key[1] == "p50_ratio" and value is not None:
                ratios.add(key[2], _baseline(key, value))
        table.add("p50_ratio", ratios)
        entry.add("latency", table)
    return entry


def init_baselines(
    path: str | Path,
    *,
    reference: Path,
    candidate: Path,
    data: str | Path,
    latency: LatencySettings,
    metric: str | None = None,
    outputs: Sequence[str] | None = None,
    progress: bool = False,
) -> RegressionReport:
    """Measure the pair once (compare, and the median of repeated benchmarks) and write a new baselines file."""
    path = Path(path)
    if path.exists():
        raise InputError(f"{path} already exists; judge against it with nmdeploy regress, or refresh it with --update")
    for model in (reference, candidate):
        if not Path(model).is_file():
            raise InputError(f"{model}: no such model file")
    figures = accuracy_figures(compare_pair(reference, candidate, data, metric, outputs))
    runs = replace(latency, runs=max(latency.runs, MIN_UPDATE_RUNS))
    figures.update(
        latency_medians(bench_runs(reference, candidate, None if str(data) == RANDOM else data, runs, progress))
    )
    pair = BaselinePair(Path(candidate).stem, Path(reference), Path(candidate), data, figures, runs, metric, outputs)
    write_new_baselines(path, [pair])
    checks = [check for model in load_baselines(path) for check in judge(model, figures)]
    return RegressionReport(path, checks, created=True)


def _baseline(key: MetricKey, value: float):
    import tomlkit

    table = tomlkit.inline_table()
    table.update({"baseline": float(f"{value:.6g}"), "tolerance": tolerance(key, value)})
    return table


def _relative(target: Path, folder: Path) -> str:
    """``target`` relative to the baselines file's folder where it can be, else absolute."""
    try:
        return Path(os.path.relpath(target.resolve(), folder.resolve())).as_posix()
    except ValueError:  # another drive on Windows
        return str(target.resolve())
