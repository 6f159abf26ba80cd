"""One code path for every model the pipeline runs: a job says how to get the PreparedModel and which baselines
judge it; the steps then run the same way on a bundled model and on a user's."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nmdeploy.errors import InputError
from nmdeploy.evaluation.regress import (
    MIN_UPDATE_RUNS,
    BaselinePair,
    LatencySettings,
    ModelBaselines,
    accuracy_figures,
    compare_pair,
    latency_medians,
    write_new_baselines,
)
from nmdeploy.files import write_atomically
from nmdeploy.passes.conversion_report import ConvertedWeight
from nmdeploy.pipeline.models import CAST, CONVERTED, PATTERN, PreparedModel, engine_name, quantized_name
from nmdeploy.pipeline.render import summary_markdown
from nmdeploy.pipeline.report import (
    ModelReport,
    PipelineReport,
    comparison_dict,
    json_value,
    judged_figures,
    write_json,
)
from nmdeploy.pipeline.steps import (
    ConvertSettings,
    bench_pair,
    build_engine_report,
    cast_to_fp16,
    convert,
    engine_skip_reason,
    inspect_file,
    labelled_accuracy,
    pipeline_entry,
    quantization_summary,
    regress,
    torch_threads,
)
from nmdeploy.pipeline.steps import quantize as quantize_step

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ModelJob:
    """One model's run: where its artefacts go, how its PreparedModel is made, and what judges it."""

    name: str
    folder: Path
    prepare: Callable[[], PreparedModel]
    dense: Path  # where ``prepare`` leaves (or finds) the dense model and the evaluation data: the judged pair
    evaluation: Path
    baselines: Path
    root: Path | None  # the folder the baselines' paths are relative to (None: the file's own folder)
    latency: LatencySettings  # used where the baselines give no [model.latency]
    starter: bool = False  # write a new baselines file from the measured figures when there is none
    prepare_step: str | None = "export"  # the label of ``prepare`` in the step list (None: instant, not listed)
    metric: str | None = None  # the user's module:function, compared and written into a new baselines file


def run_jobs(
    out: Path,
    jobs: Sequence[ModelJob],
    *,
    update: bool = False,
    progress: Progress | None = None,
    settings: ConvertSettings | None = None,
    precision: str = "fp16",
    quantize: Mapping[str, Any] | None = None,
) -> PipelineReport:
    """Run every job, then write ``out/summary.json`` and ``out/summary.md``. ``precision`` int8 or fp8 adds a
    quantize step after the conversion (judged against the dense model too) and builds the engine from it; with a
    fidelity floor (``settings.min_fidelity``) the conversion's precision budget chooses per layer among 2:4 and
    dense, each in fp16 or that precision, and writes the Q/DQ model in place of the quantize step. ``quantize``
    replaces the recipe's quantization options (QuantizePass keywords) in either."""
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda line: log.info("%s", line))
    engine_skip = engine_skip_reason()
    start = time.perf_counter()
    bars = progress is not None
    reports = [_run_model(job, update, engine_skip, say, bars, settings, precision, quantize) for job in jobs]
    report = PipelineReport(out, reports, time.perf_counter() - start)
    write_atomically(out / "summary.json", json.dumps(report.as_dict(), indent=2, default=json_value) + "\n")
    write_atomically(out / "summary.md", summary_markdown(report))
    return report


def _run_model(
    job: ModelJob,
    update: bool,
    engine_skip: str | None,
    say: Progress,
    bars: bool,
    settings: ConvertSettings | None,
    precision: str = "fp16",
    quantize: Mapping[str, Any] | None = None,
) -> ModelReport:
    seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def step(label: str) -> Iterator[None]:
        say(f"{job.name}: {label} ...")
        begin = time.perf_counter()
        yield
        seconds[label] = round(time.perf_counter() - begin, 2)
        say(f"{job.name}: {label} done in {seconds[label]:.1f} s")

    folder = job.folder
    folder.mkdir(parents=True, exist_ok=True)
    judged = (job.dense, folder / CONVERTED, job.evaluation)
    entry = quantized_entry = None  # a mistake in the baselines file shows before the long steps
    deployed_pair = (job.dense, folder / quantized_name(precision), job.evaluation)  # with an 8-bit precision
    if job.baselines.is_file() or not job.starter:
        entry = pipeline_entry(job.baselines, job.root, *judged)
        if precision != "fp16":  # a file without such an entry leaves the 8-bit model unjudged, and says so
            quantized_entry = pipeline_entry(job.baselines, job.root, *deployed_pair)
    latency = entry.latency if entry is not None and entry.latency is not None else job.latency
    if update or not job.baselines.is_file():  # a stored latency baseline is a median of several runs, never one
        latency = replace(latency, runs=max(latency.runs, MIN_UPDATE_RUNS))
    metric = entry.metric if entry is not None and entry.metric is not None else job.metric
    outputs = judged_outputs(entry, settings)
    with step(job.prepare_step) if job.prepare_step else contextlib.nullcontext():
        prepared = job.prepare()
    with torch_threads(1 if prepared.single_thread else None):
        with step("inspect"):
            dense_inspection = inspect_file(prepared.dense, folder / "inspect-dense.json")
        deployed, quantization = folder / CAST, None
        # A fidelity floor with an 8-bit precision: the conversion's precision budget writes the Q/DQ model itself.
        budgeted = precision != "fp16" and settings is not None and settings.min_fidelity is not None
        if precision != "fp16":
            deployed = folder / quantized_name(precision)
        with step("convert"):
            target = (precision, deployed, quantize) if budgeted else None
            conversion = convert(prepared, folder / CONVERTED, folder / "convert.json", bars, settings, target)
        with step("inspect converted"):
            converted_inspection = inspect_file(folder / CONVERTED, folder / "inspect-converted.json")
        with step("cast fp16"):
            cast = cast_to_fp16(folder / CONVERTED, folder / CAST, prepared.evaluation, folder / "cast.json", outputs)
        with step("compare"):
            comparison = compare_pair(prepared.dense, folder / CONVERTED, prepared.evaluation, metric, outputs)
            write_json(folder / "compare.json", comparison_dict(comparison))
        if budgeted:
            quantization = quantization_summary(conversion, precision, deployed)
        elif precision != "fp16":
            with step(f"quantize {precision}"):
                rows = None if settings is None else settings.calib_batch
                quantization = quantize_step(
                    prepared, folder / CONVERTED, deployed, folder / "quantize.json", precision, quantize, rows
                )
        if precision != "fp16":
            with step(f"compare {precision}"):
                quantized = compare_pair(prepared.dense, deployed, prepared.evaluation, metric, outputs)
                write_json(folder / f"compare-{precision}.json", comparison_dict(quantized))
                quantization["comparison"] = judged_figures(quantized)
                quantized_measured = accuracy_figures(quantized)
                if quantized_entry is None and job.baselines.is_file():
                    quantization["unjudged"] = (
                        f"no entry of {job.baselines} judges it; a new --baselines file records one"
                    )
        with step("bench (ONNX Runtime)"):
            bench = bench_pair(
                prepared.dense, folder / CONVERTED, prepared.evaluation, latency, folder / "bench.json", bars
            )
        with step("regress"):
            measured = {**accuracy_figures(comparison), **latency_medians(bench)}
            created = not job.baselines.is_file()
            name = f"{job.name}-{PATTERN.replace(':', 'of')}"
            if created:
                pairs = [
                    BaselinePair(
                        name,
                        prepared.dense,
                        folder / CONVERTED,
                        prepared.evaluation,
                        measured,
                        latency,
                        metric,
                        outputs,
                    )
                ]
                if precision != "fp16":  # the model the engine is built from, judged for accuracy
                    pairs.append(
                        BaselinePair(
                            f"{name}-{precision}",
                            prepared.dense,
                            deployed,
                            prepared.evaluation,
                            quantized_measured,
                            None,
                            metric,
                            outputs,
                        )
                    )
                write_new_baselines(
                    job.baselines,
                    pairs,
                    header=(
                        f"Regression baselines written by nmdeploy pipeline for {prepared.dense.name}: the dense",
                        f"model against its {PATTERN} conversion"
                        + (f" and its {precision} deployment" if precision != "fp16" else "")
                        + ". Paths are relative to this file.",
                        f"Check the conversion again with: nmdeploy regress {job.baselines.name}",
                    ),
                )
                entry = pipeline_entry(job.baselines, None, *judged)
                if precision != "fp16":
                    quantized_entry = pipeline_entry(job.baselines, None, *deployed_pair)
            just_measured = {entry.name: measured} if entry is not None else {}
            if quantized_entry is not None:
                just_measured[quantized_entry.name] = quantized_measured
            regression = regress(job.baselines, job.root, just_measured, update and not created)
            regression.created = created
            write_json(folder / "regress.json", regression.as_dict())
        task = None
        if prepared.labelled is not None:
            with step("task accuracy"):
                task = {
                    label: labelled_accuracy(path, *prepared.labelled)
                    for label, path in (
                        ("dense", prepared.dense),
                        ("converted", folder / CONVERTED),
                        ("cast", folder / CAST),
                        *(((precision, deployed),) if quantization is not None else ()),
                    )
                }
    with step("TensorRT engine"):
        engine = build_engine_report(prepared, deployed, folder / engine_name(precision), engine_skip)
    summary = converted_inspection.summary()
    return ModelReport(
        name=job.name,
        folder=folder,
        weights=dense_inspection.summary()["weights"],
        converted=sum(1 for row in conversion if isinstance(row, ConvertedWeight) and not row.skipped),
        compliant=summary["compliant"],
        parameters_compliant=summary["parameters_compliant"],
        parameters=summary["parameters"],
        comparison=judged_figures(comparison),
        cast_comparison=judged_figures(cast.comparison),
        cast_note=cast.upcast_reason,
        latency_ratios={int(key[2]): value for key, value in measured.items() if key[:2] == ("latency", "p50_ratio")},
        task_accuracy=task,
        regression=regression,
        engine=engine,
        seconds=seconds,
        quantization=quantization,
    )


def judged_outputs(entry: ModelBaselines | None, settings: ConvertSettings | None) -> tuple[str, ...] | None:
    """The outputs every step judges: the ones ``--outputs`` names, which must agree with those a baselines entry
    judges (a conversion fitted toward other outputs than the file checks would be judged on what it did not aim
    at)."""
    chosen = settings.outputs if settings is not None else None
    stored = entry.named_outputs if entry is not None else None
    if chosen and stored and set(chosen) != set(stored):
        raise InputError(
            f"--outputs {','.join(chosen)} differs from the outputs the baselines entry '{entry.name}' judges "
            f"({','.join(stored)}); give the same outputs, or another --baselines file"
        )
    return chosen or (entry.judged_outputs if entry is not None else None)
