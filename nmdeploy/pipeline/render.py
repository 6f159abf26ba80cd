"""The pipeline's report as a terminal table, a final PASSED/FAILED line and summary.md."""

from __future__ import annotations

from typing import Any

from nmdeploy.graph.quantization import SPARSE_KERNEL_OUTPUTS
from nmdeploy.pipeline.models import PATTERN
from nmdeploy.pipeline.report import ModelReport, PipelineReport
from nmdeploy.tables import render_table


def summary_table(report: PipelineReport) -> str:
    """The short final table: one row per model."""
    columns = ("model", "weights 2:4", "fidelity", "top-1", "fp16 cosine", "task accuracy", "ORT p50 ratio", "regress")
    return render_table(columns, [_row(model) for model in report.models], right=columns[1:5])


def _row(model: ModelReport) -> tuple[str, ...]:
    top1 = model.comparison.get("top1_agreement")
    cast_cosine = model.cast_comparison.get("mean_cosine")
    task = model.task_accuracy
    return (
        model.name,
        f"{model.compliant}/{model.weights}",
        _fidelity(model.comparison),
        "-" if top1 is None else f"{top1:.3f}",
        "-" if cast_cosine is None else f"{cast_cosine:.6f}",
        "-" if task is None else f"{task['dense']:.3f} -> {task['converted']:.3f}",
        " ".join(f"{ratio:.2f}@{batch}" for batch, ratio in model.latency_ratios.items()),
        _verdict(model),
    )


def _fidelity(figures: dict[str, Any]) -> str:
    """The converted model's judged figure and what judged it ("0.9987 cosine", "0.71 spread")."""
    value = figures.get("fidelity")
    if value is None:
        return f"cannot judge ({figures.get('fidelity_metric', 'auto')})"
    return f"{value:.4f} {figures.get('fidelity_metric', '')}".rstrip()


def summary_line(report: PipelineReport) -> str:
    """The greppable last line: PASSED or FAILED, with what was checked."""
    checks = sum(len(model.regression.checks) for model in report.models)
    names = ", ".join(model.name for model in report.models)
    converted = sum(model.converted for model in report.models)
    created = [str(model.regression.path) for model in report.models if model.regression.created]
    if report.passed and created:
        # Nothing was judged: the figures just measured became the baselines the next run is judged against.
        return (
            f"CREATED | pipeline ({names}): {converted} weights converted to {PATTERN}, {checks} baselines written to "
            f"{', '.join(created)} (judge the next run with nmdeploy regress), {report.seconds:.0f} s -> "
            f"{report.out_dir}"
        )
    if report.passed:
        quantized = [model.quantization for model in report.models if model.quantization is not None]
        layers = ""
        if quantized:  # one precision per run
            count = sum(item["sparse_quantized_layers"] for item in quantized)
            layers = f", {count} layers 2:4 + {SPARSE_KERNEL_OUTPUTS[quantized[0]['precision']]}"
            unjudged = [model.name for model in report.models if (model.quantization or {}).get("unjudged")]
            if unjudged:  # the model the engine is built from: never let the verdict read as covering it
                layers += (
                    f" ({quantized[0]['precision']} model{'s' if len(unjudged) > 1 else ''} of "
                    f"{', '.join(unjudged)} NOT judged: no baselines entry)"
                )
        return (
            f"PASSED | pipeline ({names}): {converted} weights converted to {PATTERN}{layers}, {checks} regression "
            f"checks within tolerance, {report.seconds:.0f} s -> {report.out_dir}"
        )
    failed = [check.description for model in report.models for check in model.regression.regressed]
    return f"FAILED | pipeline ({names}): {len(failed)} of {checks} regression checks regressed: {'; '.join(failed)}"


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
        if model.quantization is not None:
            lines.append(f"- {quantization_text(model)}")
        lines.append(f"- engine: {_engine_text(model.engine)}")
        lines.append(f"- steps (s): {', '.join(f'{k} {v:g}' for k, v in model.seconds.items())}")
        lines.append(f"- artefacts: `{model.folder}`")
        lines.append("")
    lines += [summary_line(report), ""]
    return "\n".join(lines)


def quantization_text(model: ModelReport) -> str:
    """The quantize step in one line: layers 2:4 and 8-bit in and out, fidelity against the dense model."""
    quantization = model.quantization or {}
    label = quantization["precision"].upper()
    needs = SPARSE_KERNEL_OUTPUTS[quantization["precision"]]
    figures = quantization.get("comparison", {})
    top1 = figures.get("top1_agreement")
    task = (model.task_accuracy or {}).get(quantization["precision"])
    choices = quantization.get("choices")  # the precision budget's per-layer choices, where it chose
    chosen = ", ".join(f"{count} x {choice}" for choice, count in choices.items()) if choices else ""
    chosen = f" (the budget chose {chosen})" if chosen else ""
    return (
        f"{label} Q/DQ{chosen}: {quantization['sparse_quantized_layers']} of {quantization['layers']} layers "
        f"2:4 + {needs}; against dense: cosine {figures.get('mean_cosine', float('nan')):.4f}"
        + ("" if top1 is None else f", top-1 agreement {top1:.3f}")
        + ("" if task is None else f", task accuracy {task:.3f}")
        + f" -> {quantization['model']}"
    )


def engine_lines(report: PipelineReport) -> list[str]:
    """The TensorRT step: one line per engine built, or one line saying why it was skipped."""
    reasons = {model.engine.get("skipped") for model in report.models}
    if len(reasons) == 1 and None not in reasons:
        return [f"TensorRT engines: skipped ({reasons.pop()})"]
    return [f"{model.name}: engine {_engine_text(model.engine)}" for model in report.models]


def _engine_text(engine: dict[str, Any]) -> str:
    if "skipped" in engine:
        return f"skipped ({engine['skipped']})"
    quantized = "".join(f"; {line}" for line in engine.get("quantized", ()))
    return (
        f"TensorRT {engine['tensorrt']}: {engine['sparse']} sparse, {engine['dense-chosen']} eligible but dense, "
        f"{engine['missed']} missed of {engine['predicted_eligible']} predicted eligible{quantized} -> "
        f"{engine['engine']}"
    )


def _verdict(model: ModelReport) -> str:
    if model.regression.created:
        return "created"
    if model.regression.updated:
        return "updated"
    return f"FAILED ({len(model.regression.regressed)})" if model.regression.regressed else "passed"
