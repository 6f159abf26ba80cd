"""The main job: take the bundled reference models through the whole deployment pipeline and check the result.

For each model: export (digits: trained first, in seconds) -> inspect -> calibrated 2:4 conversion -> fp16 cast ->
compare with the dense model -> dense-vs-2:4 latency on ONNX Runtime -> regression check against
``models/<name>/baselines.toml``; with TensorRT and a CUDA GPU it also builds a sparse fp16 engine and reports
which layers ran sparse. Every artefact lands in ``out_dir/<name>/``; ``out_dir/summary.{json,md}`` sum it up.

The baselines files name their models relative to a pipeline model folder (``dense.onnx``, ``converted-2of4.onnx``,
``evaluation``), and the regression step resolves them against ``out_dir/<name>/``. Compare and bench are measured
once: the regression step judges the same figures rather than measuring again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nmdeploy.bench import BenchReport, benchmark
from nmdeploy.budget import convert_within_budget
from nmdeploy.compare import Comparison, compare_models
from nmdeploy.errors import InputError, MissingDependencyError
from nmdeploy.files import write_atomically
from nmdeploy.graph.model import OnnxModel
from nmdeploy.inspection import Inspection, inspect_model
from nmdeploy.passes.convert import ConvertPass
from nmdeploy.precision import CastOutcome, cast_model_file
from nmdeploy.recovery import RecoveryOptions
from nmdeploy.reference import MODELS_FOLDER
from nmdeploy.regress import (
    LatencySettings,
    MetricKey,
    ModelBaselines,
    RegressionReport,
    accuracy_figures,
    latency_figures,
    load_baselines,
    measure,
    run_regression,
)
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

log = logging.getLogger(__name__)

MODELS = ("digits", "minilm")
PATTERN = "2:4"
DENSE = "dense.onnx"
CONVERTED = "converted-2of4.onnx"
CAST = "converted-2of4-fp16.onnx"
ENGINE = "converted-2of4-fp16.engine"
CALIBRATION = "calibration"
EVALUATION = "evaluation"
BASELINES = "baselines.toml"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PreparedModel:
    """A dense model exported into its folder, with calibration and evaluation batches beside it."""

    name: str
    folder: Path
    dense: Path
    calibration: Path
    evaluation: Path
    convert_include: str | None  # which weights the conversion targets (None: every prunable weight)
    engine_shapes: tuple[str, ...]  # TensorRT optimisation profile, NAME:MIN,OPT,MAX
    single_thread: bool  # a small model: torch threads only add synchronisation
    classifier: bool  # whether top-1 agreement of the outputs means anything (not for embeddings)
    labelled: tuple[np.ndarray, np.ndarray] | None = None  # held-out inputs and labels, for task accuracy


@dataclass
class ModelReport:
    """What the pipeline measured for one model; ``regression`` decides whether it passed."""

    name: str
    folder: Path
    classifier: bool
    weights: int
    converted: int
    compliant: int  # prunable weights that are 2:4 after conversion
    parameters_compliant: int
    parameters: int
    comparison: dict[str, Any]  # converted vs dense, the first output: mean_cosine, top1_agreement, errors
    cast_comparison: dict[str, Any]  # fp16 vs fp32 converted, the first output
    cast_note: str | None
    latency_ratios: dict[int, float]  # batch size -> p50 latency converted / dense on ONNX Runtime
    task_accuracy: dict[str, float] | None  # dense / converted / cast top-1 on held-out labels, where there are labels
    regression: RegressionReport
    engine: dict[str, Any]  # {"skipped": reason} or the engine report summary
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.regression.regressed

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "folder": str(self.folder),
            "classifier": self.classifier,
            "passed": self.passed,
            "weights": self.weights,
            "converted": self.converted,
            "compliant": self.compliant,
            "parameters_compliant": self.parameters_compliant,
            "parameters": self.parameters,
            "comparison": self.comparison,
            "cast_comparison": self.cast_comparison,
            "cast_note": self.cast_note,
            "ort_p50_ratio": {str(batch): ratio for batch, ratio in self.latency_ratios.items()},
            "task_accuracy": self.task_accuracy,
            "regression": self.regression.as_dict(),
            "engine": self.engine,
            "seconds": self.seconds,
        }


@dataclass
class PipelineReport:
    out_dir: Path
    models: list[ModelReport]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(model.passed for model in self.models)

    def as_dict(self) -> dict[str, Any]:
        return {
            "out_dir": str(self.out_dir),
            "passed": self.passed,
            "seconds": self.seconds,
            "models": [model.as_dict() for model in self.models],
        }


# ---------------------------------------------------------------------------------------------------------------
# The pipeline


def run_pipeline(
    out_dir: str | Path,
    *,
    models: Sequence[str] = MODELS,
    update_baselines: bool = False,
    baselines_dir: str | Path = MODELS_FOLDER,
    progress: Progress | None = None,
    fidelity: FidelitySettings | None = None,
) -> PipelineReport:
    """Run every step for each of ``models`` into ``out_dir`` and judge it against ``baselines_dir/<name>/``.

    ``update_baselines`` rewrites the baselines with the measured figures (deliberately, tolerances kept).
    ``progress`` receives one line per step; when it is given, the long steps also draw bars on a terminal.
    ``fidelity`` turns on recovery and/or the fidelity budget in the conversion step.
    """
    unknown = [name for name in models if name not in MODELS]
    if unknown or not models:
        raise InputError(f"unknown model(s) {unknown or '(none)'}; choose from {', '.join(MODELS)}")
    baselines = {name: Path(baselines_dir) / name / BASELINES for name in models}
    missing = [str(path) for path in baselines.values() if not path.is_file()]
    if missing:
        raise InputError(f"no baselines file {missing[0]}: run from a checkout of nmdeploy, or pass its models folder")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda line: log.info("%s", line))
    engine_skip = engine_skip_reason()
    start = time.perf_counter()
    reports = [
        _run_model(
            name, out / name, baselines[name], update_baselines, engine_skip, say, progress is not None, fidelity
        )
        for name in dict.fromkeys(models)
    ]
    report = PipelineReport(out, reports, time.perf_counter() - start)
    write_atomically(out / "summary.json", json.dumps(report.as_dict(), indent=2, default=_json_value) + "\n")
    write_atomically(out / "summary.md", summary_markdown(report))
    return report


def _run_model(
    name: str,
    folder: Path,
    baselines: Path,
    update: bool,
    engine_skip: str | None,
    say: Progress,
    bars: bool,
    fidelity: FidelitySettings | None = None,
) -> ModelReport:
    seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def step(label: str) -> Iterator[None]:
        say(f"{name}: {label} ...")
        begin = time.perf_counter()
        yield
        seconds[label] = round(time.perf_counter() - begin, 2)
        say(f"{name}: {label} done in {seconds[label]:.1f} s")

    folder.mkdir(parents=True, exist_ok=True)
    entry = _pipeline_entry(baselines, folder)  # a mistake in the baselines file shows before the long steps
    with step("export"):
        prepared = PREPARE[name](folder)
    with _torch_threads(1 if prepared.single_thread else None):
        with step("inspect"):
            dense_inspection = inspect_file(prepared.dense, folder / "inspect-dense.json")
        with step("convert"):
            conversion = convert(prepared, folder / CONVERTED, folder / "convert.json", bars, fidelity)
        with step("inspect converted"):
            converted_inspection = inspect_file(folder / CONVERTED, folder / "inspect-converted.json")
        with step("cast fp16"):
            cast = cast_to_fp16(folder / CONVERTED, folder / CAST, prepared.evaluation, folder / "cast.json")
        with step("compare"):
            comparison = compare_models(prepared.dense, folder / CONVERTED, prepared.evaluation)
            write_json(folder / "compare.json", _comparison_dict(comparison))
        with step("bench (ONNX Runtime)"):
            latency = (
                entry.latency if entry is not None and entry.latency is not None else LatencySettings(batch=(1, 32))
            )
            bench = bench_pair(
                prepared.dense, folder / CONVERTED, prepared.evaluation, latency, folder / "bench.json", bars
            )
        with step("regress"):
            measured = {**accuracy_figures(comparison), **latency_figures(bench)}
            regression = regress(baselines, folder, entry, measured, update)
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
                    )
                }
    with step("TensorRT engine"):
        engine = build_engine_report(prepared, folder / CAST, folder / ENGINE, engine_skip)
    summary = converted_inspection.summary()
    return ModelReport(
        name=name,
        folder=folder,
        classifier=prepared.classifier,
        weights=dense_inspection.summary()["weights"],
        converted=sum(1 for row in conversion if row.get("step") == "convert" and "skipped" not in row),
        compliant=summary["compliant"],
        parameters_compliant=summary["parameters_compliant"],
        parameters=summary["parameters"],
        comparison=comparison.outputs[0].as_dict(),
        cast_comparison=cast.comparison.outputs[0].as_dict() if cast.comparison else {},
        cast_note=cast.upcast_reason,
        latency_ratios={ratio.batch: ratio.p50 for ratio in bench.ratios},
        task_accuracy=task,
        regression=regression,
        engine=engine,
        seconds=seconds,
    )


# ---------------------------------------------------------------------------------------------------------------
# Export


def prepare_digits(folder: Path) -> PreparedModel:
    """Train the digits CNN (seeded, one thread, seconds) and export it with 512 calibration and 450 test images."""
    from nmdeploy.reference.digits import DigitsCNN, digits_npz, digits_splits, export_digits_onnx, train_digits

    splits = digits_splits(seed=0)
    model = DigitsCNN(seed=0)
    train_digits(model, splits, seed=0)
    dense = export_digits_onnx(model, folder / DENSE)
    calibration, evaluation = _fresh_folder(folder / CALIBRATION), _fresh_folder(folder / EVALUATION)
    digits_npz(splits.train_x[:512], calibration, batch=64)
    digits_npz(splits.test_x, evaluation, batch=150)
    return PreparedModel(
        "digits",
        folder,
        dense,
        calibration,
        evaluation,
        convert_include=None,
        engine_shapes=("image:1x1x8x8,64x1x8x8,256x1x8x8",),
        single_thread=True,
        classifier=True,
        labelled=(splits.test_x.numpy(), splits.test_y.numpy()),
    )


def prepare_minilm(folder: Path) -> PreparedModel:
    """Export the pretrained MiniLM encoder and tokenise the calibration and evaluation sentences (32 per batch)."""
    from nmdeploy.reference import minilm

    with warnings.catch_warnings():
        # The exporter's note on negative indices of aten::index: the indices here come from the attention mask.
        warnings.filterwarnings("ignore", message="Exporting aten::index", category=UserWarning)
        dense = minilm.export_minilm_onnx(folder / DENSE)
    calibration, evaluation = _fresh_folder(folder / CALIBRATION), _fresh_folder(folder / EVALUATION)
    minilm.write_sentence_npz(minilm.sentences("calibration"), calibration)
    minilm.write_sentence_npz(minilm.sentences("evaluation"), evaluation)
    profile = "1x16,32x64,64x128"
    return PreparedModel(
        "minilm",
        folder,
        dense,
        calibration,
        evaluation,
        # The 36 Linear weights of the six encoder blocks; the exporter names their MatMuls /bert/encoder/...
        convert_include="encoder",
        engine_shapes=tuple(f"{name}:{profile}" for name in minilm.INPUT_NAMES),
        single_thread=False,
        classifier=False,
    )


PREPARE: dict[str, Callable[[Path], PreparedModel]] = {"digits": prepare_digits, "minilm": prepare_minilm}


def _fresh_folder(folder: Path) -> Path:
    """An empty batch folder: stale batches of an earlier run would otherwise be read as data."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("batch-*.npz"):
        stale.unlink()
    return folder


# ---------------------------------------------------------------------------------------------------------------
# The steps


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
    write_json(report, {**document, "report": rows})
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
            "comparison": _comparison_dict(outcome.comparison) if outcome.comparison else None,
            "report": outcome.report,
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


def _pipeline_entry(baselines: Path, folder: Path) -> ModelBaselines | None:
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
    from nmdeploy.engine_report import build_with_report

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


# ---------------------------------------------------------------------------------------------------------------
# Output


def summary_table(report: PipelineReport) -> str:
    """The short final table: one row per model."""
    columns = ("model", "weights 2:4", "cosine", "top-1", "fp16 cosine", "task accuracy", "ORT p50 ratio", "regress")
    widths = (8, 11, 8, 6, 11, 15, 19, 0)
    rows = [columns] + [_row(model) for model in report.models]
    lines = ["  ".join(f"{cell:<{width}}" for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _row(model: ModelReport) -> tuple[str, ...]:
    top1 = model.comparison.get("top1_agreement") if model.classifier else None
    cast_cosine = model.cast_comparison.get("mean_cosine")
    task = model.task_accuracy
    return (
        model.name,
        f"{model.compliant}/{model.weights}",
        f"{model.comparison['mean_cosine']:.4f}",
        "-" if top1 is None else f"{top1:.3f}",
        "-" if cast_cosine is None else f"{cast_cosine:.6f}",
        "-" if task is None else f"{task['dense']:.3f} -> {task['converted']:.3f}",
        " ".join(f"{ratio:.2f}@{batch}" for batch, ratio in model.latency_ratios.items()),
        _verdict(model),
    )


def summary_line(report: PipelineReport) -> str:
    """The greppable last line: PASSED or FAILED, with what was checked."""
    checks = sum(len(model.regression.checks) for model in report.models)
    names = ", ".join(model.name for model in report.models)
    converted = sum(model.converted for model in report.models)
    if report.passed:
        return (
            f"PASSED | pipeline ({names}): {converted} weights converted to {PATTERN}, {checks} regression checks "
            f"within tolerance, {report.seconds:.0f} s -> {report.out_dir}"
        )
    failed = [f"{c.model} {c.key[0]} {c.label}" for model in report.models for c in model.regression.regressed]
    return f"FAILED | pipeline ({names}): {len(failed)} of {checks} regression checks regressed: {', '.join(failed)}"


def summary_markdown(report: PipelineReport) -> str:
    """summary.md: the table, each model's engine step and artefacts, and the verdict."""
    lines = ["# nmdeploy pipeline", "", "```", summary_table(report), "```", ""]
    for model in report.models:
        lines += [f"## {model.name}", ""]
        lines.append(
            f"- {model.converted} weights converted; {model.parameters_compliant:,} of {model.parameters:,} prunable "
            f"parameters are {PATTERN}"
        )
        if model.cast_note:
            lines.append(f"- fp16 check ran upcast: {model.cast_note}")
        lines.append(f"- engine: {_engine_text(model.engine)}")
        lines.append(f"- steps (s): {', '.join(f'{k} {v:g}' for k, v in model.seconds.items())}")
        lines.append(f"- artefacts: `{model.folder}`")
        lines.append("")
    lines += [summary_line(report), ""]
    return "\n".join(lines)


def engine_lines(report: PipelineReport) -> list[str]:
    """The TensorRT step: one line per engine built, or one line saying why it was skipped."""
    reasons = {model.engine.get("skipped") for model in report.models}
    if len(reasons) == 1 and None not in reasons:
        return [f"TensorRT engines: skipped ({reasons.pop()})"]
    return [f"{model.name}: engine {_engine_text(model.engine)}" for model in report.models]


def _engine_text(engine: dict[str, Any]) -> str:
    if "skipped" in engine:
        return f"skipped ({engine['skipped']})"
    return (
        f"TensorRT {engine['tensorrt']}: {engine['sparse']} sparse, {engine['dense-chosen']} eligible but dense, "
        f"{engine['missed']} missed of {engine['predicted_eligible']} predicted eligible -> {engine['engine']}"
    )


def _verdict(model: ModelReport) -> str:
    if model.regression.updated:
        return "updated"
    return f"FAILED ({len(model.regression.regressed)})" if model.regression.regressed else "passed"


def _comparison_dict(comparison: Comparison) -> dict[str, Any]:
    return {
        "batches": comparison.batches,
        "metric": comparison.metric,
        "outputs": [output.as_dict() for output in comparison.outputs],
    }


def write_json(path: Path, document: Any) -> Path:
    return write_atomically(path, json.dumps(document, indent=2, default=_json_value) + "\n")


def _json_value(value: Any) -> Any:
    """JSON for what reports hold besides plain types: paths, numpy scalars and arrays, tuples of them."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    return str(value)


@contextlib.contextmanager
def _torch_threads(count: int | None) -> Iterator[None]:
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
