"""How verbs show their results as text: the tables and summary lines too long to sit in a verb's module.

Each function takes the library's typed report and returns text; nothing here computes or judges.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from nmdeploy.tables import render_table

if TYPE_CHECKING:
    from nmdeploy.conversion.budget import BudgetReport
    from nmdeploy.conversion.recovery import RecoveryReport
    from nmdeploy.evaluation.bench import BenchReport
    from nmdeploy.graph.inspection import Inspection
    from nmdeploy.passes.conversion_report import ConversionSummary, ConvertedWeight
    from nmdeploy.passes.permute import PermutedWeight

INSPECTION_COLUMNS = ("node", "op", "weight", "shape", "dtype", "axis", "N:M", "zeros", "T-N:M", "TensorRT")
RATIO_COLUMNS = ("batch", "p50 ratio", "p90 ratio", "mean ratio")


def inspection_table(inspection: Inspection) -> str:
    """``inspect``'s table: one row per weight, then the constant operands not traced to a weight."""

    def fraction(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = []
    for row in inspection.rows:
        verdict = ("eligible" + ("" if row.likely_to_win else " (may not win)") if row.eligible else "no") + (
            ": " + "; ".join(row.reasons) if row.reasons else ""
        )
        rows.append(
            (
                ",".join(row.nodes),
                "/".join(row.op_types),
                row.weight,
                "x".join(map(str, row.shape)),
                row.dtype,
                "T" if row.axis is None else str(row.axis),
                fraction(row.compliant),
                f"{row.sparsity:.2f}",
                fraction(row.transposable),
                verdict,
            )
        )
    for item in inspection.untraced:
        rows.append((item.node, item.op_type, None, None, None, None, None, None, None, f"not traced: {item.reason}"))
    return render_table(INSPECTION_COLUMNS, rows, right=("shape", "axis", "N:M", "zeros", "T-N:M"))


def uncalibrated_lines(rows, verb: str) -> list[str]:
    """One line (folded at 120 characters) per reason the calibrated fit cannot reach some weights (rows with
    ``uncalibrated``, ``node_label`` or ``node`` and ``weight``): ``verb`` with their ``{count}``, a few of their
    names, and the reason."""
    grouped: dict[str, list] = {}
    for row in rows:
        if getattr(row, "uncalibrated", None):
            grouped.setdefault(row.uncalibrated, []).append(row)
    lines = []
    for reason, group in grouped.items():
        names = [getattr(row, "node_label", None) or getattr(row, "node", None) or row.weight for row in group]
        count = f"{len(group)} weight{'s' * (len(group) > 1)}"
        shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        text = f"{verb.format(count=count)} ({shown}): {reason}"
        lines.append(textwrap.fill(text, 120, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False))
    return lines


def bench_report(report: BenchReport) -> str:
    """``bench``'s latency table, inputs and threads, the ratios to the first model, and the summary line."""
    columns = ("model", "batch", "p50 ms", "p90 ms", "p99 ms", "samples/s", "runs")
    rows = [
        (
            model,
            batch,
            f"{latency.p50_ms:.3f}",
            f"{latency.p90_ms:.3f}",
            f"{latency.p99_ms:.3f}",
            f"{latency.throughput:.1f}",
            latency.runs,
        )
        for batch, stats in report.latencies.items()
        for model, latency in zip(report.models, stats, strict=True)
    ]
    lines = [render_table(columns, rows, right=columns[1:]), *report.notes]
    for batch, shapes in report.input_shapes.items():
        given = ", ".join(f"{name} {'x'.join(map(str, shape)) or 'scalar'}" for name, shape in shapes.items())
        lines.append(f"inputs at batch {batch}: {given}")
    lines.append(report.threads)
    summary = f"{len(report.models)} model(s) x {len(report.latencies)} batch size(s) on {report.backend}"
    for candidate in report.models[1:]:
        lines.append(f"{candidate} / {report.models[0]} (interleaved in one run; below 1 is faster):")
        ratios = [
            (ratio.batch, f"{ratio.p50:.3f}", f"{ratio.p90:.3f}", f"{ratio.mean:.3f}")
            for ratio in report.ratios
            if ratio.candidate == candidate
        ]
        lines.append(render_table(RATIO_COLUMNS, ratios, right=RATIO_COLUMNS))
        summary += f", p50 ratio {candidate}/{report.models[0]} {report.p50_ratio_geomean(candidate):.3f} (geomean)"
    lines.append(report.sparse_kernels)
    lines.append(f"measured | bench {summary} (nothing judged: nmdeploy regress judges latency ratios)")
    return "\n".join(lines)


def conversion_text(
    rows: list, budget: BudgetReport | None, summary: ConversionSummary, labels: dict[str, str], total_seconds: float
) -> str:
    """``convert``'s report: permutations, the per-weight table, recovery, the budget's choices, the timing line and
    the approximations made (rows without their budget row; nodes named by ``labels``)."""
    from nmdeploy.conversion.recovery import RecoveryReport
    from nmdeploy.passes.conversion_report import ConvertedWeight
    from nmdeploy.passes.permute import PermutedWeight

    lines = []
    permuted = [_permuted_cells(row, labels) for row in rows if isinstance(row, PermutedWeight)]
    if permuted:
        columns = ("node", "permutation", "saliency kept before", "after", "note")
        lines.append(render_table(columns, permuted, right=("saliency kept before", "after")))
    lines.append(
        render_table(
            ("node", "method", "saliency kept", "error masked", "error converted", "zeros kept", "note"),
            [_converted_cells(row) for row in rows if isinstance(row, ConvertedWeight)],
            right=("saliency kept", "error masked", "error converted", "zeros kept"),
        )
    )
    recovered = [row for row in rows if isinstance(row, RecoveryReport)]
    lines += [recovery_line(row) for row in recovered]
    if budget is not None:
        lines += _budget_lines(budget, labels)
    lines.append(_summary_line(summary, total_seconds, budget is not None, bool(recovered)))
    lines += [f"approximation: {note}" for note in summary.approximations or ()]
    return "\n".join(lines)


def _permuted_cells(row: PermutedWeight, labels: dict[str, str]) -> tuple[str | None, ...]:
    return (
        labels.get(row.weight, row.weight),
        "permuted" if row.permuted else "no",
        f"{row.retained_before:.3f}" if row.permuted else None,
        f"{row.retained_after:.3f}" if row.permuted else None,
        f"with {', '.join(row.producers)}" if row.permuted else row.skipped or "no better order found",
    )


def _converted_cells(row: ConvertedWeight) -> tuple[str | None, ...]:
    node = row.node or row.weight
    if row.skipped:
        return (node, "skipped", None, None, None, None, row.skipped)
    masked = row.error_masked is not None
    return (
        node,
        row.method,
        f"{row.retained_saliency:.3f}",
        f"{row.error_masked:.4g}" if masked else None,
        f"{row.error_converted:.4g}" if masked else None,
        f"{row.zeros_kept}/{row.zeros_before}" if row.zeros_before else None,
        row.statistics if row.statistics and row.statistics != "full" else "",
    )


def recovery_line(row: RecoveryReport, scope: str = "") -> str:
    """Recovery's held-out figure before and after, what it trained and the ONNX Runtime check; ``scope`` says
    what was recovered where that is not the whole result (``" of ..."``)."""
    return (
        f"recovery{scope}: held-out {row.metric} {row.held_out_before:.4f} -> {row.held_out_after:.4f} "
        f"(best of {row.steps_run} steps of {row.batch_rows} rows at step {row.best_step}, {row.trained_tensors} "
        f"tensors, {row.precision} training in {row.seconds:.1f} s; "
        + (
            "no step beat the one-shot model, which is kept)"
            if row.onnxruntime_max_error is None
            else f"ONNX Runtime agrees within {row.onnxruntime_max_error:.1e})"
        )
        + f"; judged on {', '.join(repr(name) for name in row.outputs)}"
        + (f"; {', '.join(repr(name) for name in row.logits)} trained by next-token KL" if row.logits else "")
    )


def _summary_line(summary: ConversionSummary, total_seconds: float, budget: bool, recovered: bool) -> str:
    # The pass times calibration, fitting and recovery; loading, saving, checking the result and the budget's
    # probes are the rest of the verb's wall time.
    timed = ("the accepted conversion" if budget else "conversion") + (" with recovery" if recovered else "")
    line = f"{timed} {summary.seconds:.1f} s of {total_seconds:.1f} s total wall time"
    line += f", peak RSS {summary.peak_rss_mb:.0f} MB"
    if summary.max_memory_mb is not None:
        # The budget bounds the fit's caches and statistics; recovery holds the whole model, its optimiser state
        # and a batch's activations (a language model's logits among them) whatever the budget.
        scope = " of the fit; recovery trains the whole model in memory" if recovered else ""
        line += f" (memory budget {summary.max_memory_mb:.0f} MB{scope})"
    if summary.calibration_samples is not None:
        spilled = f"{summary.spilled_mb:.0f} MB spilled to disk" if summary.spilled else "nothing spilled to disk"
        line += (
            f", {summary.calibration_samples} calibration samples in {summary.calibration_batches} batches, "
            f"{summary.segments} segments, cached activations peak {summary.cached_peak_mb:.0f} MB, {spilled}"
        )
    if summary.fit_target is not None:
        line += f"; each layer fitted to {FIT_TARGET_WORDS[summary.fit_target]}"
    if summary.damping is not None:
        line += f", damping {summary.damping:g}"
    return line


FIT_TARGET_WORDS = {"model": "the dense model's outputs", "layer": "its own dense outputs on the converted inputs"}


def held_out_fidelity(report) -> str:
    """A budget's held-out figure and the lower bound the floor was checked against, or why there is none."""
    from nmdeploy.conversion.budgeting import BOUND_CONFIDENCE

    if report.fidelity_bound is None:
        return (
            f"held-out {report.metric} {report.fidelity:.4f} >= {report.min_fidelity} on {report.held_out_rows} rows "
            f"({report.bound_note}: the figure may overstate what other data gets; give more rows or --held-out)"
        )
    return (
        f"held-out {report.metric} {report.fidelity:.4f}, lower {BOUND_CONFIDENCE:.0%} bound "
        f"{report.fidelity_bound:.4f} >= {report.min_fidelity} on {report.held_out_rows} rows"
        + (f" ({report.bound_note})" if report.bound_note else "")
    )


def _budget_lines(budget: BudgetReport, labels: dict[str, str]) -> list[str]:
    cells = [
        (
            labels.get(row.weight, row.weight),
            budget.pattern if row.converted else "dense",
            None if row.sensitivity is None else f"{row.sensitivity:.4f}",
            row.reason,
        )
        for row in budget.layers
    ]
    share = budget.converted_parameters / max(budget.eligible_parameters, 1)
    lines = [
        render_table(("node", "kept as", "sensitivity", "reason"), cells, right=("sensitivity",)),
        f"budget: {held_out_fidelity(budget)}; {budget.converted_parameters}/{budget.eligible_parameters} eligible "
        f"parameters converted ({share:.0%})",
    ]
    if budget.outputs is not None:
        lines.append(f"budget: {budget.outputs.describe()}")
    if budget.judged:
        lines.append("budget: each judged output " + "; ".join(figure.describe() for figure in budget.judged))
    return lines
