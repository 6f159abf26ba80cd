"""Accuracy/latency regression checks against a baselines file, as users run them in CI.

A baselines file (TOML, one per model family, e.g. ``models/mlp/baselines.toml``) lists model pairs; for each, the
accuracy figures of ``nmdeploy.compare`` per output and the latency ratios candidate / reference per batch size,
each with a baseline value and an absolute tolerance::

    [[model]]
    name = "mlp-2of4"
    reference = "dense.onnx"            # paths are relative to this file
    candidate = "sparse-2of4.onnx"
    data = "digits-test.npz"            # or "random"

    [model.accuracy.logits]             # one table per output name
    mean_cosine = { baseline = 0.918, tolerance = 0.02 }
    top1_agreement = { baseline = 0.848, tolerance = 0.03 }

    [model.latency]
    backend = "ort"
    batch = [1, 32]
    warmup = 5
    iterations = 50

    [model.latency.p50_ratio]           # one entry per batch size
    1 = { baseline = 1.0, tolerance = 0.5 }

Paths resolve relative to the baselines file unless a ``root`` folder is given: a tool that writes the models
elsewhere (``nmdeploy pipeline`` writes them to its output folder) passes that folder.

Latency is only ever judged as a ratio to the reference measured interleaved in the same run, never as absolute
time, so a baseline holds on a different or busier machine. ``update=True`` rewrites the baseline numbers in place
(comments, order and tolerances kept) with the measured ones, atomically.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmdeploy.bench import BACKENDS, BenchReport, benchmark, parse_shapes
from nmdeploy.compare import Comparison, compare_models
from nmdeploy.data import RANDOM
from nmdeploy.errors import InputError
from nmdeploy.files import temporary_beside

# Accuracy figures of nmdeploy.compare.OutputComparison and whether a higher value is better.
ACCURACY_METRICS = {"mean_cosine": True, "top1_agreement": True, "max_abs_error": False, "max_rel_error": False}
LATENCY_METRICS = {"p50_ratio": "p50", "p90_ratio": "p90", "mean_ratio": "mean"}  # all: lower is better
_MODEL_KEYS = {"name", "reference", "candidate", "data", "accuracy", "latency"}
_LATENCY_SETTINGS = {"backend", "batch", "warmup", "iterations", "device", "shapes"}

MetricKey = tuple[str, str, str]
"""(section, group, metric): ("accuracy", output name, metric) or ("latency", metric, batch size)."""


@dataclass(frozen=True)
class Baseline:
    value: float
    tolerance: float


@dataclass(frozen=True)
class LatencySettings:
    backend: str = "ort"
    batch: tuple[int, ...] = (1,)
    warmup: int = 5
    iterations: int = 50
    device: str = "auto"
    shapes: dict[str, tuple[int | str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelBaselines:
    """One candidate/reference pair of a baselines file and the figures it must hold."""

    name: str
    reference: Path
    candidate: Path
    data: str
    baselines: dict[MetricKey, Baseline]
    latency: LatencySettings | None


@dataclass(frozen=True)
class Check:
    """One judged figure: its baseline, tolerance, the measured value and the verdict."""

    model: str
    key: MetricKey
    baseline: float
    tolerance: float
    measured: float | None
    higher_is_better: bool

    @property
    def label(self) -> str:
        section, group, metric = self.key
        return f"{group}.{metric}" if section == "accuracy" else f"{group}@batch{metric}"

    @property
    def status(self) -> str:
        """``regressed`` when worse than baseline by more than the tolerance (or not measured at all), ``improved``
        when better by more than it (a hint to --update), else ``ok``."""
        if self.measured is None or math.isnan(self.measured):
            return "regressed"
        gain = self.measured - self.baseline if self.higher_is_better else self.baseline - self.measured
        # A value exactly on the boundary as written in decimal passes, whatever binary rounding makes of it.
        slack = 1e-9 * max(1.0, abs(self.baseline))
        if gain < -self.tolerance - slack:
            return "regressed"
        return "improved" if gain > self.tolerance + slack else "ok"

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "check": f"{self.key[0]} {self.label}",
            "baseline": self.baseline,
            "tolerance": self.tolerance,
            "measured": self.measured,
            "better": "higher" if self.higher_is_better else "lower",
            "status": self.status,
        }


@dataclass
class RegressionReport:
    path: Path
    checks: list[Check]
    updated: bool = False

    @property
    def regressed(self) -> list[Check]:
        return [check for check in self.checks if check.status == "regressed"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "baselines": str(self.path),
            "updated": self.updated,
            "regressed": len(self.regressed),
            "checks": [check.as_dict() for check in self.checks],
        }


# ---------------------------------------------------------------------------------------------------------------
# Reading the baselines file


def load_baselines(path: str | Path, root: str | Path | None = None) -> list[ModelBaselines]:
    """Parse and validate a baselines file; every mistake is an InputError naming the file and the entry.

    Model and data paths resolve relative to ``root``, by default the file's own folder.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such baselines file")
    try:
        document = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: not valid TOML ({error})") from error
    unknown = sorted(set(document) - {"model"})
    models = document.get("model")
    if unknown or not isinstance(models, list) or not models:
        raise InputError(f"{path}: expected one or more [[model]] tables and nothing else at the top level")
    folder = path.parent if root is None else Path(root)
    parsed = [_parse_model(path, folder, index, entry) for index, entry in enumerate(models)]
    names = [model.name for model in parsed]
    if len(set(names)) < len(names):
        raise InputError(f"{path}: model names must be unique, got {names}")
    return parsed


def _parse_model(path: Path, folder: Path, index: int, entry: dict[str, Any]) -> ModelBaselines:
    where = f"{path}: [[model]] #{index + 1}"
    unknown = sorted(set(entry) - _MODEL_KEYS)
    if unknown:
        raise InputError(f"{where}: unknown key(s) {unknown}; valid: {sorted(_MODEL_KEYS)}")
    for key in ("name", "reference", "candidate"):
        if not isinstance(entry.get(key), str):
            raise InputError(f"{where}: '{key}' must be given as a string")
    where = f"{path}: model '{entry['name']}'"
    reference, candidate = (folder / entry[key] for key in ("reference", "candidate"))
    data = str(entry.get("data", RANDOM))
    data = data if data == RANDOM else str(folder / data)
    baselines: dict[MetricKey, Baseline] = {}
    accuracy = entry.get("accuracy", {})
    if not isinstance(accuracy, dict):
        raise InputError(f"{where}: 'accuracy' must be a table of output names")
    for output, metrics in accuracy.items():
        if not isinstance(metrics, dict):
            raise InputError(f"{where}: accuracy.{output} must be a table of metrics")
        for metric, value in metrics.items():
            if metric not in ACCURACY_METRICS:
                raise InputError(f"{where}: unknown accuracy metric '{metric}'; valid: {sorted(ACCURACY_METRICS)}")
            baselines[("accuracy", output, metric)] = _baseline(f"{where}: accuracy.{output}.{metric}", value)
    latency = None
    if "latency" in entry:
        latency, latency_baselines = _parse_latency(where, entry["latency"])
        baselines.update(latency_baselines)
    if not baselines:
        raise InputError(f"{where}: no accuracy or latency baselines to check")
    return ModelBaselines(entry["name"], reference, candidate, data, baselines, latency)


def _parse_latency(where: str, table: Any) -> tuple[LatencySettings, dict[MetricKey, Baseline]]:
    if not isinstance(table, dict):
        raise InputError(f"{where}: 'latency' must be a table")
    unknown = sorted(set(table) - _LATENCY_SETTINGS - set(LATENCY_METRICS))
    if unknown:
        raise InputError(
            f"{where}: unknown latency key(s) {unknown}; valid: {sorted(_LATENCY_SETTINGS | set(LATENCY_METRICS))}"
        )
    batch = table.get("batch", [1])
    if not isinstance(batch, list) or not batch or not all(isinstance(b, int) and b > 0 for b in batch):
        raise InputError(f"{where}: latency.batch must be a list of positive integers such as [1, 32]")
    backend = table.get("backend", "ort")
    if backend not in BACKENDS:
        raise InputError(f"{where}: latency.backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    for key in ("warmup", "iterations"):
        if key in table and (not isinstance(table[key], int) or table[key] < (key == "iterations")):
            raise InputError(f"{where}: latency.{key} must be a {'positive' if key == 'iterations' else ''} integer")
    shapes = table.get("shapes", {})
    if not isinstance(shapes, dict):
        raise InputError(f'{where}: latency.shapes must be a table such as {{ input_ids = "Bx128" }}')
    settings = LatencySettings(
        backend=backend,
        batch=tuple(batch),
        warmup=table.get("warmup", 5),
        iterations=table.get("iterations", 50),
        device=str(table.get("device", "auto")),
        shapes=parse_shapes(",".join(f"{name}={dims}" for name, dims in shapes.items())),
    )
    baselines = {}
    for metric in LATENCY_METRICS:
        per_batch = table.get(metric, {})
        if not isinstance(per_batch, dict):
            raise InputError(f"{where}: latency.{metric} must be a table of batch size -> baseline")
        for size, value in per_batch.items():
            if not size.isdigit() or int(size) not in settings.batch:
                raise InputError(f"{where}: latency.{metric}.{size}: not one of the measured batch sizes {batch}")
            baselines[("latency", metric, size)] = _baseline(f"{where}: latency.{metric}.{size}", value)
    return settings, baselines


def _baseline(where: str, value: Any) -> Baseline:
    if (
        not isinstance(value, dict)
        or set(value) != {"baseline", "tolerance"}
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value.values())
    ):
        raise InputError(f"{where}: expected {{ baseline = NUMBER, tolerance = NUMBER }} on one line")
    if not all(math.isfinite(v) for v in value.values()):
        raise InputError(f"{where}: baseline and tolerance must be finite numbers, not nan or inf")
    if value["tolerance"] < 0:
        raise InputError(f"{where}: tolerance must not be negative")
    return Baseline(float(value["baseline"]), float(value["tolerance"]))


# ---------------------------------------------------------------------------------------------------------------
# Measuring and judging

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


def judge(model: ModelBaselines, measured: dict[MetricKey, float | None]) -> list[Check]:
    """One check per baseline of ``model``; an accuracy output the candidate does not produce is an input error."""
    outputs = {key[1] for key in measured if key[0] == "accuracy"}
    checks = []
    for key, baseline in model.baselines.items():
        if key[0] == "accuracy" and key[1] not in outputs:
            raise InputError(
                f"model '{model.name}': the models have no output '{key[1]}' (outputs: {', '.join(sorted(outputs))})"
            )
        higher = ACCURACY_METRICS[key[2]] if key[0] == "accuracy" else False
        checks.append(Check(model.name, key, baseline.value, baseline.tolerance, measured.get(key), higher))
    return checks


def run_regression(
    path: str | Path, *, update: bool = False, measure: Measure = measure, root: str | Path | None = None
) -> RegressionReport:
    """Measure every model of the baselines file and judge it; with ``update``, rewrite the baselines first.

    ``root`` is the folder the model and data paths are relative to (default: the baselines file's folder).
    """
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
    checks = [check for model, m in zip(models, measurements, strict=True) for check in judge(model, m)]
    return RegressionReport(path, checks, updated=update)


# ---------------------------------------------------------------------------------------------------------------
# Rewriting the baselines in place

_ENTRY = re.compile(r"^\s*(\"[^\"]*\"|'[^']*'|[A-Za-z0-9_-]+)\s*=\s*\{")
_BASELINE_NUMBER = re.compile(r"(\bbaseline\s*=\s*)([-+]?(?:inf|nan|[0-9_]+(?:\.[0-9_]+)?(?:[eE][-+]?[0-9_]+)?))")


def _table_path(line: str) -> tuple[str, ...] | None:
    """The key path of a ``[table]`` or ``[[array]]`` header line, or None for any other line."""
    if not line.lstrip().startswith("["):
        return None
    try:
        node: Any = tomllib.loads(line)
    except tomllib.TOMLDecodeError:  # a line of a multi-line array, not a header
        return None
    keys: list[str] = []
    while isinstance(node, dict | list) and node:
        node = node[-1] if isinstance(node, list) else node
        if not isinstance(node, dict) or len(node) != 1:
            break
        key, node = next(iter(node.items()))
        keys.append(key)
    return tuple(keys)


def _format_number(value: float) -> str:
    text = f"{value:.6g}"
    return text if any(c in text for c in ".einf") else text + ".0"


def rewrite_baselines(path: Path, values: dict[tuple[int, MetricKey], float]) -> None:
    """Replace the baseline numbers of ``values`` ((model index, key) -> new value) in the file's text, keeping
    everything else, and write it atomically; the result is re-read to prove every number landed."""
    lines = path.read_text().splitlines(keepends=True)
    model_index, table = -1, ()
    written: set[tuple[int, MetricKey]] = set()
    for number, line in enumerate(lines):
        header = _table_path(line)
        if header is not None:
            table = header
            if header == ("model",) and line.lstrip().startswith("[["):
                model_index += 1
            continue
        entry = _ENTRY.match(line)
        if not entry or len(table) != 3 or table[0] != "model":
            continue
        name = tomllib.loads(f"{entry.group(1)} = 0")
        key: MetricKey = (table[1], table[2], next(iter(name)))
        if (model_index, key) in values:
            new = _format_number(values[(model_index, key)])
            lines[number], count = _BASELINE_NUMBER.subn(lambda m, new=new: m.group(1) + new, line, count=1)
            if count:
                written.add((model_index, key))
    missing = sorted(set(values) - written)
    if missing:
        raise InputError(
            f"{path}: cannot rewrite the baseline of {missing[0][1]}: write each baseline on one line as "
            "NAME = { baseline = NUMBER, tolerance = NUMBER } under its [model.accuracy.OUTPUT] or "
            "[model.latency.METRIC] table"
        )
    temporary = temporary_beside(path)
    try:
        temporary.write_text("".join(lines))
        reread = load_baselines(temporary)
        for (index, key), value in values.items():
            if not math.isclose(reread[index].baselines[key].value, float(_format_number(value))):
                raise InputError(f"{path}: rewriting the baselines went wrong at {key}; the file was left as it was")
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------------
# The table


def format_report(report: RegressionReport) -> str:
    """A fixed-width table of every check, regressions marked, and a greppable last line."""
    rows = [(c.model, f"{c.key[0]} {c.label}", c) for c in report.checks]
    model_width = max([5, *(len(r[0]) for r in rows)]) + 2
    check_width = max([5, *(len(r[1]) for r in rows)]) + 2
    lines = [
        f"{'model':<{model_width}}{'check':<{check_width}}{'baseline':>10} {'tol':>8} {'measured':>10} "
        f"{'better':>7}  status"
    ]
    for model, label, check in rows:
        measured = "-" if check.measured is None else f"{check.measured:.4g}"
        status = check.status.upper() if check.status == "regressed" else check.status
        lines.append(
            f"{model:<{model_width}}{label:<{check_width}}{check.baseline:>10.4g} {check.tolerance:>8.3g} "
            f"{measured:>10} {'higher' if check.higher_is_better else 'lower':>7}  {status}"
        )
    regressed = report.regressed
    if report.updated:
        lines.append(f"UPDATED | {report.path}: {len(report.checks)} baselines rewritten with the measured values")
    elif regressed:
        names = ", ".join(f"{c.model} {c.key[0]} {c.label}" for c in regressed)
        lines.append(f"FAILED | {len(regressed)} of {len(report.checks)} checks regressed: {names}")
    else:
        improved = sum(c.status == "improved" for c in report.checks)
        hint = f" ({improved} improved beyond tolerance: consider --update)" if improved else ""
        lines.append(f"PASSED | {len(report.checks)} checks within tolerance{hint}")
    return "\n".join(lines)
