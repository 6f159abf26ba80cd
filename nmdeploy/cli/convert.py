"""``nmdeploy convert MODEL -o OUT --calib DATA``: calibrated N:M conversion, layer by layer on calibration data."""

from __future__ import annotations

import argparse
import json
import logging
import math
import time

from nmdeploy.cli.options import (
    add_data_option,
    add_device_option,
    add_filter_options,
    add_json_option,
    add_output_options,
    add_outputs_option,
    add_pattern_option,
    add_require_options,
    check_output,
    left_dense,
    left_dense_clauses,
    left_dense_json,
)
from nmdeploy.conversion.budget import BudgetReport
from nmdeploy.conversion.convert import ConversionSummary, ConvertedWeight, ConvertOptions, ConvertPass
from nmdeploy.conversion.data import CalibrationData
from nmdeploy.conversion.methods import DEFAULT_METHOD, method_names, methods_help
from nmdeploy.conversion.recovery import DEFAULT_STEPS, PRECISIONS, RecoveryReport
from nmdeploy.conversion.statistics import DEFAULT_CACHE_LIMIT, RUNNERS
from nmdeploy.errors import InputError
from nmdeploy.files import check_output_path
from nmdeploy.graph.inspection import allow_dense_patterns
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.permute import PermutedWeight
from nmdeploy.runtimes.data import RANDOM
from nmdeploy.runtimes.devices import resolve_device
from nmdeploy.tables import render_table

log = logging.getLogger(__name__)
NOT_COMPLIANT = 1  # --require: a TensorRT-eligible weight of the result is left dense


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the dense or unstructured-sparse ONNX model")
    add_output_options(parser)
    add_pattern_option(parser)
    add_data_option(parser, "--calib", purpose="calibration inputs")
    parser.add_argument("--method", choices=method_names(), default=DEFAULT_METHOD, help=methods_help())
    parser.add_argument(
        "--fit",
        choices=("sequential", "parallel"),
        default="sequential",
        help="sequential: each layer fitted on the inputs of the model converted so far, matching the dense "
        "outputs (default); parallel: every layer on dense inputs, one calibration run",
    )
    parser.add_argument(
        "--transposable",
        action="store_true",
        help="transposable N:M masks (exact solver), so the transposed weight is N:M too",
    )
    parser.add_argument(
        "--permute",
        action="store_true",
        help="first reorder input channels, with their producers' outputs, where that provably keeps the function, "
        "so that the N:M groups keep more saliency",
    )
    parser.add_argument(
        "--damping",
        type=float,
        default=0.1,
        help="fit damping, relative to mean diag(X^T X): larger generalises better from few calibration samples",
    )
    parser.add_argument(
        "--calib-batch",
        type=int,
        metavar="N",
        help="at most N calibration samples per run (default: about 1M input elements per run); "
        "large arrays are split, so memory does not grow with the files",
    )
    parser.add_argument(
        "--cache-limit",
        type=float,
        default=DEFAULT_CACHE_LIMIT / 2**20,
        metavar="MB",
        help="activations cached between fitting stages kept in memory up to MB (default %(default)g); the rest "
        "goes to a private temporary folder, removed afterwards",
    )
    parser.add_argument(
        "--max-memory",
        type=float,
        metavar="MB",
        help="memory the conversion may hold (default: half the memory available when it starts); a layer whose "
        "statistics do not fit gets block-diagonal ones (a stated approximation) or, failing that, stays dense",
    )
    add_device_option(parser)
    parser.add_argument(
        "--statistics",
        choices=("auto", *RUNNERS),
        default="auto",
        help="what runs the model for the statistics: onnxruntime (CPU), torch (the torch interpreter on --device), "
        "or auto (default: torch on a GPU, ONNX Runtime on the CPU, where it is faster)",
    )
    add_filter_options(parser)
    add_require_options(parser, checked="the converted model")
    add_fidelity_options(parser)
    add_json_option(parser)


def add_fidelity_options(parser: argparse.ArgumentParser) -> None:
    """--recover, --min-fidelity, --metric and --seed: conversion that keeps the model."""
    group = parser.add_argument_group("fidelity")
    group.add_argument(
        "--recover",
        nargs="?",
        type=int,
        const=DEFAULT_STEPS,
        metavar="STEPS",
        help=f"after conversion, fine-tune the kept weights, biases and normalisations (masks fixed) for up to STEPS "
        f"steps (default {DEFAULT_STEPS}) by distilling the dense model on the calibration data, with early "
        "stopping on a held-out fifth of it",
    )
    group.add_argument(
        "--min-fidelity",
        type=float,
        metavar="F",
        help="convert only the layers that keep the held-out fidelity (--metric) at F or above, choosing the most "
        "parameters TensorRT runs sparse; judged after recovery with --recover",
    )
    group.add_argument(
        "--metric",
        default="auto",
        metavar="METRIC",
        help="fidelity for --recover and --min-fidelity: auto (default: mean output cosine, except probability maps "
        "dominated by near-zero values, e.g. detection or segmentation maps, judged by 1 - MSE / 2 Var of the dense "
        "map), cosine, spread (1 - MSE / 2 Var for every output), top1, mask-iou@T (IoU of the outputs thresholded "
        "at T), or MODULE:FUNCTION(reference_outputs, candidate_outputs, feeds) -> float, as nmdeploy compare takes",
    )
    group.add_argument(
        "--recover-precision",
        default="auto",
        metavar="{" + ",".join(PRECISIONS) + "}",
        help="precision of recovery's training passes: bfloat16 or float16 (CUDA only) matrix products (float32 "
        "weights), float32, or auto (default: bfloat16 where the CPU has native bfloat16, about twice as fast; on a "
        "GPU bfloat16 where it has it, else float16; held-out checks stay float32)",
    )
    group.add_argument(
        "--held-out",
        metavar="DATA",
        help="judge --min-fidelity and --recover's early stop on these rows (ideally of the kind the model will see "
        "in deployment) instead of a held-out fifth of --calib, which is then fitted on whole",
    )
    add_outputs_option(group)
    group.add_argument("--seed", type=int, default=0, help="seed of the held-out split and the recovery batches")


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if not args.calib:
        raise InputError(
            "convert needs calibration data: --calib DATA (an .npz or a folder of them), "
            "or --calib random for a functional test"
        )
    if args.calib == RANDOM:
        log.warning("--calib random: the conversion will run, but accuracy needs real calibration data")
    if not (math.isfinite(args.damping) and args.damping > 0):
        raise InputError(f"--damping must be a positive number, not {args.damping}; the default is 0.1")
    check_output(args.model, args.output, args.in_place)
    allow_dense_patterns(args.allow_dense)
    resolve_device(args.device)
    metric, recover = fidelity_options(args)
    model = OnnxModel.load(args.model)
    model.check_save_target(args.output)
    data = CalibrationData(args.calib, model.proto, args.calib_batch, held_out=args.held_out)
    check_output_path(args.output, inputs=data.files)
    options = ConvertOptions(
        calibration=data,
        pattern=args.pattern,
        method=args.method,
        sequential=args.fit == "sequential",
        transposable=args.transposable,
        permute=args.permute,
        damping=args.damping,
        progress=None,
        include=args.include,
        exclude=args.exclude,
        eligible_only=args.eligible_only,
        batch_size=args.calib_batch,
        cache_limit=int(args.cache_limit * 2**20),
        recover=recover,
        min_fidelity=args.min_fidelity,
        metric=metric,
        outputs=args.outputs,
        device=args.device,
        statistics=args.statistics,
        max_memory_mb=args.max_memory,
        held_out=args.held_out,
    )
    rows = ConvertPass(options)(model).report
    budget = next((row for row in rows if isinstance(row, BudgetReport)), None)
    rows = [row for row in rows if not isinstance(row, BudgetReport)]
    path = model.save(args.output)
    summary = next(row for row in rows if isinstance(row, ConversionSummary))
    skipped = {row.weight: row.skipped for row in rows if isinstance(row, ConvertedWeight) and row.skipped}
    if budget is not None:
        skipped.update({row.weight: f"--min-fidelity: {row.reason}" for row in budget.layers if not row.converted})
    result, reasons = left_dense(model, args, skipped, "not converted")
    failed = args.require and bool(result.failing)
    total_seconds = time.perf_counter() - started
    if args.json:
        document = {
            "model": args.model,
            "output": str(path),
            "summary": {**summary.to_json(), "total_seconds": total_seconds},
            "report": [row.to_json() for row in rows],
            "left_dense": left_dense_json(result, reasons),
            "passed": (not failed) if args.require else None,  # None: nothing was judged
        }
        if budget is not None:
            document["budget"] = budget.to_json()
        print(json.dumps(document, indent=2))
        return NOT_COMPLIANT if failed else 0
    labels = {row.weight: row.node_label for row in result.rows}
    permuted = [
        (
            labels.get(row.weight, row.weight),
            "permuted" if row.permuted else "no",
            f"{row.retained_before:.3f}" if row.permuted else None,
            f"{row.retained_after:.3f}" if row.permuted else None,
            f"with {', '.join(row.producers)}" if row.permuted else row.skipped or "no better order found",
        )
        for row in rows
        if isinstance(row, PermutedWeight)
    ]
    if permuted:
        columns = ("node", "permutation", "saliency kept before", "after", "note")
        print(render_table(columns, permuted, right=("saliency kept before", "after")))
    report = [row for row in rows if isinstance(row, ConvertedWeight)]
    converted = [row for row in report if not row.skipped]
    print(
        render_table(
            ("node", "method", "saliency kept", "error masked", "error converted", "zeros kept", "note"),
            [_converted_cells(row) for row in report],
            right=("saliency kept", "error masked", "error converted", "zeros kept"),
        )
    )
    for row in (row for row in rows if isinstance(row, RecoveryReport)):
        print(
            f"recovery: held-out {row.metric} {row.held_out_before:.4f} -> {row.held_out_after:.4f} "
            f"(best of {row.steps_run} steps at step {row.best_step}, {row.trained_tensors} tensors, "
            f"{row.precision} training in {row.seconds:.1f} s; "
            + (
                "no step beat the one-shot model, which is kept)"
                if row.onnxruntime_max_error is None
                else f"ONNX Runtime agrees within {row.onnxruntime_max_error:.1e})"
            )
            + f"; judged on {', '.join(repr(name) for name in row.outputs)}"
        )
    if budget is not None:
        print_budget(budget, labels)
    recovered = any(isinstance(row, RecoveryReport) for row in rows)
    print(_summary_line(summary, total_seconds, budget is not None, recovered))
    for note in summary.approximations or ():
        print(f"approximation: {note}")
    zeros = sum(row.zeros_before for row in converted)
    kept = f", {sum(row.zeros_kept for row in converted)}/{zeros} existing zeros kept" if zeros else ""
    outcome = f"converted {len(converted)} weights to {args.pattern}{kept}"
    outcome = "; ".join([outcome, *left_dense_clauses(result, reasons)])
    if failed:
        print(f"FAILED | {outcome} (--require) -> {path}")
        return NOT_COMPLIANT
    print(f"PASSED | {outcome} -> {path}")
    return 0


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


def _summary_line(summary: ConversionSummary, total_seconds: float, budget: bool, recovered: bool) -> str:
    # The pass times calibration, fitting and recovery; loading, saving, checking the result and the budget's
    # probes are the rest of the verb's wall time.
    timed = ("the accepted conversion" if budget else "conversion") + (" with recovery" if recovered else "")
    line = f"{timed} {summary.seconds:.1f} s of {total_seconds:.1f} s total wall time"
    line += f", peak RSS {summary.peak_rss_mb:.0f} MB"
    if summary.max_memory_mb is not None:
        line += f" (memory budget {summary.max_memory_mb:.0f} MB)"
    if summary.calibration_samples is not None:
        spilled = f"{summary.spilled_mb:.0f} MB spilled to disk" if summary.spilled else "nothing spilled to disk"
        line += (
            f", {summary.calibration_samples} calibration samples in {summary.calibration_batches} batches, "
            f"{summary.segments} segments, cached activations peak {summary.cached_peak_mb:.0f} MB, {spilled}"
        )
    return line


def fidelity_options(args: argparse.Namespace):
    """The checked metric and recovery options; bad values are one-line errors before anything is read."""
    from nmdeploy.conversion.recovery import RecoveryOptions
    from nmdeploy.fidelity import check_min_fidelity, resolve_metric

    if args.min_fidelity is not None:
        check_min_fidelity(args.min_fidelity)
    metric = resolve_metric(args.metric)
    recover = None
    if args.recover is not None:
        recover = RecoveryOptions(
            steps=args.recover,
            seed=args.seed,
            metric=metric,
            precision=args.recover_precision,
            outputs=args.outputs,
        )
    return metric, recover


def print_budget(budget: BudgetReport, labels: dict[str, str]) -> None:
    cells = [
        (
            labels.get(row.weight, row.weight),
            budget.pattern if row.converted else "dense",
            None if row.sensitivity is None else f"{row.sensitivity:.4f}",
            row.reason,
        )
        for row in budget.layers
    ]
    print(render_table(("node", "kept as", "sensitivity", "reason"), cells, right=("sensitivity",)))
    share = budget.converted_parameters / max(budget.eligible_parameters, 1)
    print(
        f"budget: held-out {budget.metric} {budget.fidelity:.4f} >= {budget.min_fidelity} (measured on "
        f"{budget.held_out_rows} rows); {budget.converted_parameters}/{budget.eligible_parameters} eligible "
        f"parameters converted ({share:.0%})"
    )
    if budget.outputs is not None:
        print(f"budget: {budget.outputs.describe()}")
