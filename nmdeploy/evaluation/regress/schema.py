"""The baselines file: its typed form, read and validated with one line per mistake."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmdeploy.errors import InputError
from nmdeploy.fidelity import is_builtin_metric
from nmdeploy.imports import import_callable
from nmdeploy.limits import read_toml
from nmdeploy.runtimes.backends import BACKENDS, DEFAULT_BACKEND
from nmdeploy.runtimes.data import RANDOM
from nmdeploy.runtimes.shapes import parse_dims

# Accuracy figures of nmdeploy.evaluation.compare.OutputComparison and whether a higher value is better.
ACCURACY_METRICS = {
    "mean_cosine": True,  # per row, held to the rows' scale agreement where lower (auto's figure)
    "spread_agreement": True,  # 1 - MSE / 2 Var(reference) across rows: outputs of a few values per row
    "top1_agreement": True,
    "agreement": True,  # integer outputs (labels, indices): equal values corrected for chance, or shared items
    "max_abs_error": False,
    "max_rel_error": False,
}
LATENCY_METRICS = {"p50_ratio": "p50", "p90_ratio": "p90", "mean_ratio": "mean"}  # all: lower is better
_MODEL_KEYS = {"name", "reference", "candidate", "data", "metric", "outputs", "accuracy", "latency"}
_LATENCY_SETTINGS = {"backend", "batch", "warmup", "iterations", "duration", "runs", "device", "shapes", "batch_axes"}
MIN_UPDATE_RUNS = 3  # --update and --init store the median of at least this many benchmark runs, never one

MetricKey = tuple[str, str, str]
"""(section, group, metric): ("accuracy", output name, metric) or ("latency", metric, batch size)."""

USER_METRIC: MetricKey = ("accuracy", "metric", "value")
"""The model's own ``metric = "module:function"``, checked as ``[model.accuracy.metric] value = {...}``."""


def higher_is_better(key: MetricKey) -> bool:
    """Accuracy figures and the user's metric are better higher; latency ratios lower."""
    return key == USER_METRIC or (key[0] == "accuracy" and ACCURACY_METRICS[key[2]])


@dataclass(frozen=True)
class Baseline:
    value: float
    tolerance: float


@dataclass(frozen=True)
class LatencySettings:
    backend: str = DEFAULT_BACKEND
    batch: tuple[int, ...] = (1,)
    warmup: int = 5
    iterations: int = 10  # at least this many timed runs per model and batch size (trtexec's --iterations)
    runs: int = MIN_UPDATE_RUNS  # benchmarks repeated; the median ratio is judged
    device: str = "auto"
    shapes: dict[str, tuple[int | str, ...]] = field(default_factory=dict)
    duration: float = 0.5  # and at least this many seconds of timed rounds per batch size (trtexec's --duration)
    batch_axes: dict[str, int | None] = field(default_factory=dict)  # input name -> its rows' axis (None: none)


@dataclass(frozen=True)
class ModelBaselines:
    """One candidate/reference pair of a baselines file and the figures it must hold."""

    name: str
    reference: Path
    candidate: Path
    data: str
    baselines: dict[MetricKey, Baseline]
    latency: LatencySettings | None
    metric: str | None = None  # a built-in measure or the user's "module:function", measured as compare --metric does
    outputs: tuple[str, ...] | None = None  # the outputs judged, as --outputs chooses them (None: the default)

    @property
    def judged_outputs(self) -> tuple[str, ...] | None:
        """The outputs compare judges: ``outputs`` where given, else None: the outputs that are not copies of an
        input, as compare judges them. Not only those the accuracy tables name: an output the models gained
        since the file was written (a KV cache's ``present.*``) is judged too, and one without a baseline fails the
        run (``judging.judge``) rather than passing unjudged."""
        return self.outputs or None

    @property
    def named_outputs(self) -> tuple[str, ...] | None:
        """The outputs the file judges by name: ``outputs``, else those its accuracy tables name, else None."""
        if self.outputs:
            return self.outputs
        named = tuple(dict.fromkeys(group for section, group, _ in self.baselines if section == "accuracy"))
        return tuple(name for name in named if name != USER_METRIC[1]) or None


def load_baselines(path: str | Path, root: str | Path | None = None) -> list[ModelBaselines]:
    """Parse and validate a baselines file; every mistake is an InputError naming the file and the entry.

    Model and data paths resolve relative to ``root``, by default the file's own folder.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such baselines file")
    try:
        document = read_toml(path, "baselines file")
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
    metric = entry.get("metric")
    if metric is not None:
        if not isinstance(metric, str):
            raise InputError(f'{where}: metric must be a string such as "perplexity" or "mymetrics:iou"')
        if not is_builtin_metric(metric):
            import_callable(metric, f"{where}: metric = {metric!r}", allow_classes=False)  # as fidelity.load_metric
    outputs = entry.get("outputs")
    if outputs is not None and (
        not isinstance(outputs, list) or not outputs or not all(isinstance(o, str) and o for o in outputs)
    ):
        raise InputError(f'{where}: outputs must be a list of output names such as ["logits"]')
    baselines: dict[MetricKey, Baseline] = {}
    accuracy = entry.get("accuracy", {})
    if not isinstance(accuracy, dict):
        raise InputError(f"{where}: 'accuracy' must be a table of output names")
    for output, metrics in accuracy.items():
        if not isinstance(metrics, dict):
            raise InputError(f"{where}: accuracy.{output} must be a table of metrics")
        for name, value in metrics.items():
            key = ("accuracy", output, name)
            if key == USER_METRIC and metric is None:
                raise InputError(f'{where}: accuracy.metric.value needs the model\'s metric = "module:function"')
            if key != USER_METRIC and name not in ACCURACY_METRICS:
                raise InputError(f"{where}: unknown accuracy metric '{name}'; valid: {sorted(ACCURACY_METRICS)}")
            baselines[key] = _baseline(f"{where}: accuracy.{output}.{name}", value)
    if metric is not None and USER_METRIC not in baselines:
        raise InputError(
            f"{where}: metric = {metric!r} is never checked; add [model.accuracy.metric] with "
            "value = { baseline = NUMBER, tolerance = NUMBER } (higher is better)"
        )
    latency = None
    if "latency" in entry:
        latency, latency_baselines = _parse_latency(where, entry["latency"])
        baselines.update(latency_baselines)
    if not baselines:
        raise InputError(f"{where}: no accuracy or latency baselines to check")
    return ModelBaselines(
        entry["name"], reference, candidate, data, baselines, latency, metric, tuple(outputs) if outputs else None
    )


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
    backend = table.get("backend", DEFAULT_BACKEND)
    if backend not in BACKENDS:
        raise InputError(f"{where}: latency.backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    for key in ("warmup", "iterations", "runs"):
        if key in table and (not isinstance(table[key], int) or table[key] < (key != "warmup")):
            raise InputError(f"{where}: latency.{key} must be a {'positive' if key != 'warmup' else ''} integer")
    duration = table.get("duration", LatencySettings.duration)
    if isinstance(duration, bool) or not isinstance(duration, int | float) or not 0 <= duration < float("inf"):
        raise InputError(f"{where}: latency.duration must be a number of seconds, 0 or more")
    axes = table.get("batch_axes", {})
    if not isinstance(axes, dict) or not all(
        (isinstance(axis, int) and not isinstance(axis, bool) and axis >= 0) or axis == "none" for axis in axes.values()
    ):
        raise InputError(f'{where}: latency.batch_axes must be a table such as {{ state = 1, sr = "none" }}')
    shapes = table.get("shapes", {})
    if not isinstance(shapes, dict):
        raise InputError(f'{where}: latency.shapes must be a table such as {{ input_ids = "Bx128" }}')
    settings = LatencySettings(
        backend=backend,
        batch=tuple(batch),
        warmup=table.get("warmup", LatencySettings.warmup),
        iterations=table.get("iterations", LatencySettings.iterations),
        runs=table.get("runs", MIN_UPDATE_RUNS),
        duration=float(duration),
        batch_axes={name: None if axis == "none" else axis for name, axis in axes.items()},
        device=str(table.get("device", "auto")),
        shapes={
            name: parse_dims(str(dims), where=f"{where}: latency.shapes.{name} = {dims!r}", batch=True)
            for name, dims in shapes.items()
        },
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
