"""``nmdeploy build MODEL -o ENGINE [--sparse]``: a strongly typed TensorRT engine and its per-layer sparsity report."""

from __future__ import annotations

import argparse
import json
import sys

from nmdeploy.cli.options import add_json_option, add_profile_options, parsed_profile
from nmdeploy.errors import InputError
from nmdeploy.runtimes.engine_report import DENSE_CHOSEN, MISSED, SPARSE, build_with_report
from nmdeploy.tables import render_table

NOT_SPARSE = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the ONNX model (cast it to fp16/bf16 first for sparse kernels)")
    parser.add_argument("-o", "--output", required=True, metavar="ENGINE", help="where to write the engine")
    parser.add_argument("--sparse", action="store_true", help="let TensorRT use 2:4 sparse kernels (SPARSE_WEIGHTS)")
    add_profile_options(parser)
    parser.add_argument(
        "--timing-cache", metavar="FILE", help="load the tactic timing cache from FILE and save it back"
    )
    parser.add_argument("--workspace", type=int, metavar="MiB", help="workspace memory limit for the builder")
    parser.add_argument(
        "--require",
        action="store_true",
        help="with --sparse: FAILED (exit 1; the engine is still written) when a layer predicted eligible did not "
        "run a sparse kernel (TensorRT timed a dense one faster, or did not find it eligible)",
    )
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    if args.require and not args.sparse:
        raise InputError("--require checks which layers ran sparse kernels: add --sparse")
    outcome = build_with_report(
        args.model,
        args.output,
        sparse=args.sparse,
        shapes=parsed_profile(args),
        timing_cache=args.timing_cache,
        workspace_mib=args.workspace,
    )
    for warning in outcome.warnings:
        print(f"nmdeploy build: warning: {warning}", file=sys.stderr)
    report = outcome.report
    summary = report.summary()
    not_sparse = [row for row in report.rows if row.status in (DENSE_CHOSEN, MISSED)]
    failed = args.require and bool(not_sparse)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "engine": str(outcome.engine),
                    "tensorrt": outcome.tensorrt_version,
                    "strongly_typed": outcome.strongly_typed,
                    "sparse": args.sparse,
                    "build_seconds": outcome.seconds,
                    "warnings": outcome.warnings,
                    **report.as_dict(),
                    "passed": (not failed) if args.require else None,  # None: nothing was judged
                },
                indent=2,
            )
        )
        return NOT_SPARSE if failed else 0
    rows = [
        (row.node, "eligible" if row.predicted_eligible else "no", row.status, row.trt_layer) for row in report.rows
    ]
    print(render_table(("ONNX node", "predicted", "TensorRT", "TensorRT layer"), rows))
    missed = [row.node for row in report.rows if row.status == MISSED]
    if missed:
        print(f"predicted eligible but not taken by TensorRT: {', '.join(missed)}")
    if not args.sparse:
        print("note: built without --sparse, so TensorRT did not consider sparse kernels")
    counts = (
        f"TensorRT {outcome.tensorrt_version}: {summary[SPARSE]} sparse, {summary[DENSE_CHOSEN]} eligible but dense, "
        f"{summary[MISSED]} missed of {summary['predicted_eligible']} predicted eligible (evidence: {report.evidence})"
    )
    if failed:
        dense = ", ".join(f"{row.node} ({row.status})" for row in not_sparse[:5])
        print(f"FAILED | {counts}; not sparse: {dense} (--require) -> {outcome.engine}")
        return NOT_SPARSE
    print(f"PASSED | {counts} -> {outcome.engine}")
    return 0
