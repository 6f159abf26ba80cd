"""The pipeline's report as a terminal table, a final PASSED/FAILED line and summary.md."""

from __future__ import annotations

from typing import Any

from nmdeploy.pipeline.models import PATTERN
from nmdeploy.pipeline.report import ModelReport, PipelineReport
from nmdeploy.tables import render_table


def summary_table(report: PipelineReport) -> str:
    """The short final table: one row per model."""
    columns = ("model", "weights 2:4", "cosine", "top-1", "fp16 cosine", "task accuracy", "ORT p50 ratio", "regress")
    return render_table(columns, [_row(model) for model in report.models], right=columns[1:5])


def _row(model: ModelReport) -> tuple[str, ...]:
    top1 = model.comparison.get("top1_agreement")
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
    created = [str(model.regression.path) for model in report.models if model.regression.created]
    if report.passed and created:
        # Nothing was judged: the figures just measured became the baselines the next run is judged against.
        return (
            f"CREATED | pipeline ({names}): {converted} weights converted to {PATTERN}, {checks} baselines written to "
            f"{', '.join(created)} (judge the next run with nmdeploy regress), {report.seconds:.0f} s -> "
            f"{report.out_dir}"
        )
    if report.passed:
        return (
            f"PASSED | pipeline ({names}): {converted} weights converted to {PATTERN}, {checks} regression checks "
            f"within tolerance, {report.seconds:.0f} s -> {report.out_dir}"
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
    if model.regression.created:
        return "created"
    if model.regression.updated:
        return "updated"
    return f"FAILED ({len(model.regression.regressed)})" if model.regression.regressed else "passed"
