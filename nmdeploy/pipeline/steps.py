"""The pipeline's steps on one prepared model: inspect, convert, cast, bench, regress, task accuracy, engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from nmdeploy.calibration.data import CalibrationData
from nmdeploy.conversion.budget import BudgetReport
from nmdeploy.conversion.controller import Conversion, ConversionOptions
from nmdeploy.conversion.precision_budget_report import PrecisionBudgetReport, PrecisionBudgetResult
from nmdeploy.conversion.recipes import step_options
from nmdeploy.conversion.recovery import RecoveryOptions
from nmdeploy.errors import InputError, MissingDependencyError
from nmdeploy.evaluation.bench import BenchReport
from nmdeploy.evaluation.precision import CastOutcome, cast_model_file
from nmdeploy.evaluation.regress import (
    LatencySettings,
    MetricKey,
    ModelBaselines,
    RegressionReport,
    bench_runs,
    load_baselines,
    measure,
    run_regression,
)
from nmdeploy.graph.inspection import Inspection, inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.conversion_report import conversion_outcome
from nmdeploy.pipeline.models import PATTERN, PreparedModel
from nmdeploy.pipeline.report import comparison_dict, write_json
from nmdeploy.rows import ReportRow
from nmdeploy.runtimes.backends import open_runner


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
class ConvertSettings:
    """How the conversion step converts: the method, recovery (a number of steps or RecoveryOptions, whose metric
    and outputs become these; None: none), a fidelity floor (None: convert every targeted weight) and the fidelity
    metric both use (auto, cosine, spread, top1, mask-iou@T or ``module:function``), judged on ``held_out`` rows
    where given (else a seeded share of the calibration rows); ``fitting``: the fit's other options (ConvertOptions
    fields: fit order and target, permutation, damping, transposable masks, memory, statistics runner), as
    ``convert`` takes them."""

    method: str = "sparsegpt"
    fitting: Mapping[str, Any] | None = None
    recover: RecoveryOptions | int | None = None
    min_fidelity: float | None = None
    metric: str = "auto"
    eligible_only: bool = False  # only the weights TensorRT can run sparse
    outputs: tuple[str, ...] | None = None  # the outputs judged (None: outputs that are not input copies)
    device: str = "cpu"  # where the statistics, fit and recovery run
    batch_axes: dict[str, int | None] | None = None  # --batch-axis: input name -> the axis of its rows (or None)
    held_out: str | Path | None = None  # --held-out: the rows the floor and recovery judge on

    def __post_init__(self) -> None:
        # A combination convert refuses (--transposable with --permute, --fit-target with --fit parallel, --held-out
        # without a floor or recovery) is refused here, before the pipeline writes anything.
        self.conversion_options("random")

    def conversion_options(self, calibration: Any, **placed: Any) -> ConversionOptions:
        """The controller's options for these settings on ``calibration`` (data holding ``held_out`` where it is
        given); ``placed``: those the run sets itself (the weights a model targets, progress, the precision
        budget's)."""
        from nmdeploy.fidelity import resolve_metric

        metric = resolve_metric(self.metric)
        recover = RecoveryOptions(steps=self.recover) if isinstance(self.recover, int) else self.recover
        recover = None if recover is None else replace(recover, metric=metric, outputs=self.outputs)
        return ConversionOptions(
            calibration=calibration,
            pattern=PATTERN,
            method=self.method,
            eligible_only=self.eligible_only,
            recover=recover,
            min_fidelity=self.min_fidelity,
            metric=metric,
            outputs=self.outputs,
            device=self.device,
            held_out=self.held_out,
            **placed,
            **dict(self.fitting or {}),
        )

    @property
    def calib_batch(self) -> int | None:
        """Calibration rows per run (``--calib-batch``; None: the data's own batches)."""
        return dict(self.fitting or {}).get("batch_size")

    def as_json(self) -> dict[str, Any]:
        """The options the conversion step ran with, for its report."""
        recover = self.recover.steps if isinstance(self.recover, RecoveryOptions) else self.recover
        given = {"method": self.method, **dict(self.fitting or {}), "recover": recover}
        given |= {"min_fidelity": self.min_fidelity, "metric": self.metric, "held_out": self.held_out}
        return {key: str(value) if isinstance(value, Path) else value for key, value in given.items()}


def convert(
    prepared: PreparedModel,
    output: Path,
    report: Path,
    bars: bool = False,
    settings: ConvertSettings | None = None,
    quantized: tuple[str, Path, Mapping[str, Any] | None] | None = None,
) -> list[ReportRow]:
    """Calibrated 2:4 conversion of the weights ``prepared`` targets (default: sparsegpt, sequential fitting).

    With recovery, the converted model is fine-tuned; with a fidelity floor, the budget chooses the layers (its
    decisions go to the report under ``budget``). ``quantized`` (an 8-bit precision, a path and quantization
    options, with a floor): the precision budget chooses per layer among 2:4 and dense, each in fp16 or that
    precision, as ``convert --min-fidelity F --precision P`` does, quantizing as :func:`quantization_options` say;
    its Q/DQ model goes to that path and ``output`` gets the same mix before quantization.
    """
    settings = settings or ConvertSettings()
    model = OnnxModel.load(prepared.dense)
    calibration = prepared.calibration
    if settings.batch_axes or settings.held_out is not None:
        rows = settings.calib_batch
        calibration = CalibrationData(calibration, model.proto, rows, settings.held_out, settings.batch_axes)
    budgeted: dict[str, Any] = {}
    if quantized is not None:
        if settings.min_fidelity is None:
            raise InputError(f"the precision budget ({quantized[0]}) needs a fidelity floor: add --min-fidelity")
        quantization = quantization_options(prepared, quantized[0], quantized[2], settings.calib_batch)
        budgeted = {"precision": quantization.pop("precision"), "quantize": quantization}
    options = settings.conversion_options(
        calibration,
        include=prepared.convert_include,
        exclude=prepared.convert_exclude,
        progress=None if bars else False,  # None: a bar only on a terminal
        **budgeted,
    )
    document: dict[str, Any] = {"model": str(prepared.dense), "output": str(output), "options": settings.as_json()}
    result = Conversion(options)(model)
    rows = result.report
    budget = next((row for row in rows if isinstance(row, BudgetReport | PrecisionBudgetReport)), None)
    if budget is not None:
        document["budget"] = budget.to_json()
    else:  # nothing converted is convert's refusal, not a baseline of the dense model against itself
        conversion_outcome(rows)
    if isinstance(result, PrecisionBudgetResult) and quantized is not None:
        document["quantized"] = str(model.save(quantized[1]))
        model = result.unquantized
    model.save(output)
    write_json(report, {**document, "report": [row.to_json() for row in rows if row is not budget]})
    return rows


def quantization_summary(rows: Sequence[ReportRow], precision: str, output: Path) -> dict[str, Any]:
    """What the pipeline reports of an 8-bit model: layers, quantized layers, 2:4 + 8-bit in/out layers (from the
    quantize step's rows, or the precision budget's, which add each layer's choice)."""
    from nmdeploy.passes.quantize import QuantizationSummary

    summary = next((row for row in rows if isinstance(row, QuantizationSummary)), None)
    budget = next((row for row in rows if isinstance(row, PrecisionBudgetReport)), None)
    found = {
        "precision": precision,
        "model": str(output),
        "method": summary.method if summary is not None else None,  # None: the budget quantized no layer
        "layers": summary.layers if summary is not None else len(budget.layers) if budget is not None else 0,
        "quantized_layers": summary.quantized_layers if summary is not None else 0,
        "sparse_quantized_layers": summary.sparse_integer_layers if summary is not None else 0,
    }
    if budget is not None:
        choices: dict[str, int] = {}
        for layer in budget.layers:
            choices[layer.choice] = choices.get(layer.choice, 0) + 1
        found["choices"] = choices
    return found


def cast_to_fp16(
    model: Path, output: Path, data: Path, report: Path, outputs: Sequence[str] | None = None
) -> CastOutcome:
    """fp16 weights and compute (sensitive ops and I/O kept fp32), checked against the fp32 model on ``data``
    (its judged ``outputs``)."""
    outcome = cast_model_file(model, output, precision="fp16", data=data, outputs=outputs)
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


def quantization_options(
    prepared: PreparedModel, precision: str, given: Mapping[str, Any] | None = None, rows: int | None = None
) -> dict[str, Any]:
    """The QuantizePass keywords of the pipeline's 8-bit layers: the quantize step's of recipe
    ``tensorrt-2of4-<precision>``, with those ``given`` (the quantization flags) in their place, calibrating
    ``rows`` rows per run where given (``--calib-batch``, as the conversion does)."""
    recipe = step_options(f"tensorrt-2of4-{precision}", "quantize", calibration=str(prepared.calibration))
    batch = {} if rows is None else {"batch_size": rows}
    return {**recipe, **dict(given or {}), **batch, "precision": precision}


def quantize(
    prepared: PreparedModel,
    model: Path,
    output: Path,
    report: Path,
    precision: str,
    options: Mapping[str, Any] | None = None,
    rows: int | None = None,
) -> dict[str, Any]:
    """INT8 or FP8 Q/DQ on the converted 2:4 ``model``, with the quantize step's options of the recipe
    ``tensorrt-2of4-<precision>`` (``options`` in their place), calibrated on the model's calibration data ``rows``
    rows per run where given; the per-layer report goes to ``report``. Returns the summary: layers, quantized
    layers, 2:4 + 8-bit in/out layers."""
    from nmdeploy.passes.quantize import QuantizePass

    keywords = quantization_options(prepared, precision, options, rows)
    step = QuantizePass(calibration=str(prepared.calibration), **keywords)
    loaded = OnnxModel.load(model)
    rows = step(loaded).report
    loaded.save(output)
    write_json(report, {"model": str(model), "output": str(output), "report": [row.to_json() for row in rows]})
    return quantization_summary(rows, precision, output)


def bench_pair(
    dense: Path, candidate: Path, data: Path, settings: LatencySettings, report: Path, bars: bool = False
) -> list[BenchReport]:
    """Dense and converted timed interleaved on ONNX Runtime (CPU), on the first evaluation batch, ``settings.runs``
    times (regress judges the median ratio)."""
    results = bench_runs(dense, candidate, data, settings, progress=bars)
    write_json(report, {"runs": [result.as_dict() for result in results]})
    return results


def regress(
    baselines: Path,
    root: Path | None,
    measured: Mapping[str, dict[MetricKey, float | None]],
    update: bool,
) -> RegressionReport:
    """Judge the baselines file (paths relative to ``root``, None: to the file); the pipeline's own pairs (its
    2:4 conversion, its 8-bit deployment) reuse the figures just measured, by entry name (``measured``)."""

    def figures(model: ModelBaselines) -> dict[MetricKey, float | None]:
        if model.name in measured:
            return measured[model.name]
        return measure(model)  # any further pair a user added to the file

    return run_regression(baselines, update=update, measure=figures, root=root)


def pipeline_entry(
    baselines: Path, root: Path | None, dense: Path, converted: Path, evaluation: Path
) -> ModelBaselines | None:
    """The baselines entry that judges this pipeline's dense/converted pair on its evaluation data, if any."""
    wanted = (dense.resolve(), converted.resolve(), evaluation.resolve())
    for entry in load_baselines(baselines, root):
        if (entry.reference.resolve(), entry.candidate.resolve(), Path(entry.data).resolve()) == wanted:
            if entry.latency is not None and entry.latency.backend != "ort":
                raise InputError(f"{baselines}: model '{entry.name}': the pipeline benchmarks on ONNX Runtime ('ort')")
            return entry
    return None


def labelled_accuracy(model: Path, inputs: np.ndarray, labels: np.ndarray, batch: int = 256) -> float:
    """Top-1 accuracy of an ONNX classifier on held-out labelled inputs, in ONNX Runtime."""
    with open_runner("ort", model) as runner:
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
    """A sparse strongly typed TensorRT engine of ``model`` (the fp16 cast, or the INT8 / FP8 Q/DQ model) and its
    per-layer sparsity and precision report, or why the step was skipped."""
    if skip is not None:
        return {"skipped": skip}
    from nmdeploy.runtimes.engine_report import build_with_report

    outcome = build_with_report(model, engine, sparse=True, shapes=prepared.engine_shapes or None)
    report = {
        "engine": str(outcome.engine),
        "tensorrt": outcome.tensorrt_version,
        "build_seconds": outcome.seconds,
        "warnings": outcome.warnings,
        **outcome.report.as_dict(),
    }
    write_json(prepared.folder / "engine.json", report)
    return {
        "engine": str(outcome.engine),
        "tensorrt": outcome.tensorrt_version,
        **outcome.report.summary(),
        "quantized": outcome.report.quantized_lines(),
    }


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
