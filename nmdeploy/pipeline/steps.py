"""The pipeline's steps on one prepared model: inspect, convert, cast, bench, regress, task accuracy, engine."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nmdeploy.calibration.recovery import RecoveryOptions
from nmdeploy.errors import InputError, MissingDependencyError
from nmdeploy.evaluation.bench import BenchReport, benchmark
from nmdeploy.evaluation.budget import convert_within_budget
from nmdeploy.evaluation.precision import CastOutcome, cast_model_file
from nmdeploy.evaluation.regress import (
    LatencySettings,
    MetricKey,
    ModelBaselines,
    RegressionReport,
    load_baselines,
    measure,
    run_regression,
)
from nmdeploy.graph.inspection import Inspection, inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.convert import ConvertPass
from nmdeploy.pipeline.models import CONVERTED, DENSE, EVALUATION, PATTERN, PreparedModel
from nmdeploy.pipeline.report import comparison_dict, write_json
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner


def inspect_file(model: Path, report: Path) -> Inspection:
    """``nmdeploy inspect`` of ``model`` against 2:4, written as JSON to ``report``."""
    inspection = inspect_model(OnnxModel.load(model), PATTERN)
    write_json(
        report,
        {
            "model": str(model),
            "pattern": inspection.pattern,
            "summary": inspection.summary(),
            "weights": [asdict(row) for row in inspection.rows],
            "untraced": [asdict(item) for item in inspection.untraced],
        },
    )
    return inspection


@dataclass(frozen=True)
class FidelitySettings:
    """Conversion that keeps the model: recovery steps (None: none) and a fidelity floor (None: convert all)."""

    recover: int | None = None
    min_fidelity: float | None = None


def convert(
    prepared: PreparedModel, output: Path, report: Path, bars: bool = False, fidelity: FidelitySettings | None = None
) -> list[dict[str, Any]]:
    """Calibrated 2:4 conversion with the recommended settings (sparsegpt, sequential fitting).

    With ``fidelity``, recovery fine-tunes the converted model and/or the budget chooses the layers (its decisions
    go to the report under ``budget``).
    """
    fidelity = fidelity or FidelitySettings()
    recover = None if fidelity.recover is None else RecoveryOptions(steps=fidelity.recover)
    options = dict(
        calibration=prepared.calibration,
        pattern=PATTERN,
        include=prepared.convert_include,
        progress=None if bars else False,  # None: a bar only on a terminal
        recover=recover,
    )
    model = OnnxModel.load(prepared.dense)
    document: dict[str, Any] = {"model": str(prepared.dense), "output": str(output)}
    if fidelity.min_fidelity is not None:
        budget = convert_within_budget(model, min_fidelity=fidelity.min_fidelity, **options)
        model, rows = budget.model, budget.report
        document["budget"] = budget.to_json()
    else:
        rows = ConvertPass(**options)(model).report
    model.save(output)
    write_json(report, {**document, "report": [row.to_json() for row in rows]})
    return rows


def cast_to_fp16(model: Path, output: Path, data: Path, report: Path) -> CastOutcome:
    """fp16 weights and compute (sensitive ops and I/O kept fp32), checked against the fp32 model on ``data``."""
    outcome = cast_model_file(model, output, precision="fp16", data=data)
    write_json(
        report,
        {
            "model": str(model),
            "output": str(outcome.output),
            "precision": outcome.precision,
            "upcast_reason": outcome.upcast_reason,
            "comparison": comparison_dict(outcome.comparison) if outcome.comparison else None,
            "report": [row.to_json() for row in outcome.report],
        },
    )
    return outcome


def bench_pair(
    dense: Path, candidate: Path, data: Path, settings: LatencySettings, report: Path, bars: bool = False
) -> BenchReport:
    """Dense and converted timed interleaved on ONNX Runtime (CPU), on the first evaluation batch."""
    result = benchmark(
        [dense, candidate],
        backend="ort",
        batches=settings.batch,
        warmup=settings.warmup,
        iterations=settings.iterations,
        shapes=settings.shapes,
        data=data,
        progress=bars and sys.stderr.isatty(),
    )
    write_json(report, result.as_dict())
    return result


def regress(
    baselines: Path,
    folder: Path,
    entry: ModelBaselines | None,
    measured: dict[MetricKey, float | None],
    update: bool,
) -> RegressionReport:
    """Judge the baselines file against ``folder``; the pipeline's own pair reuses the figures just measured."""

    def figures(model: ModelBaselines) -> dict[MetricKey, float | None]:
        if entry is not None and model.name == entry.name:
            return measured
        return measure(model)  # any further pair a user added to the file

    return run_regression(baselines, update=update, measure=figures, root=folder)


def pipeline_entry(baselines: Path, folder: Path) -> ModelBaselines | None:
    """The baselines entry that judges this pipeline's dense/converted pair on its evaluation data, if any."""
    for entry in load_baselines(baselines, folder):
        if (entry.reference, entry.candidate, entry.data) == (
            folder / DENSE,
            folder / CONVERTED,
            str(folder / EVALUATION),
        ):
            if entry.latency is not None and entry.latency.backend != "ort":
                raise InputError(f"{baselines}: model '{entry.name}': the pipeline benchmarks on ONNX Runtime ('ort')")
            return entry
    return None


def labelled_accuracy(model: Path, inputs: np.ndarray, labels: np.ndarray, batch: int = 256) -> float:
    """Top-1 accuracy of an ONNX classifier on held-out labelled inputs, in ONNX Runtime."""
    with OnnxRuntimeRunner(model) as runner:
        name = runner.inputs[0].name
        output = runner.output_names[0]
        predictions = np.concatenate(
            [
                runner.infer({name: inputs[start : start + batch]})[output].argmax(axis=-1)
                for start in range(0, len(inputs), batch)
            ]
        )
    return float((predictions == labels).mean())


def engine_skip_reason() -> str | None:
    """Why no TensorRT engine can be built here, or None when TensorRT and a CUDA GPU are both present."""
    from nmdeploy.runtimes.tensorrt import import_tensorrt

    try:
        import_tensorrt()
    except MissingDependencyError as error:
        return str(error)
    import torch

    return None if torch.cuda.is_available() else "TensorRT is installed but no CUDA GPU is visible"


def build_engine_report(prepared: PreparedModel, model: Path, engine: Path, skip: str | None) -> dict[str, Any]:
    """A sparse fp16 TensorRT engine and its per-layer sparsity report, or why the step was skipped."""
    if skip is not None:
        return {"skipped": skip}
    from nmdeploy.runtimes.engine_report import build_with_report

    outcome = build_with_report(model, engine, sparse=True, shapes=prepared.engine_shapes)
    report = {
        "engine": str(outcome.engine),
        "tensorrt": outcome.tensorrt_version,
        "build_seconds": outcome.seconds,
        "warnings": outcome.warnings,
        **outcome.report.as_dict(),
    }
    write_json(prepared.folder / "engine.json", report)
    return {"engine": str(outcome.engine), "tensorrt": outcome.tensorrt_version, **outcome.report.summary()}


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """Run with ``count`` torch threads (None: unchanged); the previous count is restored."""
    if count is None:
        yield
        return
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
