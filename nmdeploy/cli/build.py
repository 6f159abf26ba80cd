"""``nmdeploy build MODEL -o ENGINE [--sparse]``: a strongly typed TensorRT engine and its per-layer sparsity report."""

from __future__ import annotations

import argparse
import json
import sys

from nmdeploy.cli.args import EngineArgs, OutputArgs, ReportArgs, ShapesArgs, add_groups

NOT_SPARSE = 1
OUTPUT, ENGINE = OutputArgs("ENGINE", "where to write the engine"), EngineArgs()
PROFILE, REPORT = ShapesArgs(profile=True), ReportArgs()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the ONNX model (cast it to fp16/bf16 first for sparse kernels)")
    add_groups(parser, OUTPUT, ENGINE, PROFILE, REPORT)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.runtimes.engine_report import DENSE_CHOSEN, MISSED, SPARSE, build_with_report
    from nmdeploy.tables import render_table

    engine = ENGINE.parse(args)
    outcome = build_with_report(
        args.model,
        OUTPUT.parse(args),
        sparse=engine.sparse,
        shapes=PROFILE.parse(args),
        timing_cache=engine.timing_cache,
        workspace_mib=engine.workspace_mib,
    )
    for warning in outcome.warnings:
        print(f"nmdeploy build: warning: {warning}", file=sys.stderr)
    report, summary = outcome.report, outcome.report.summary()
    not_sparse = [row for row in report.rows if row.status in (DENSE_CHOSEN, MISSED)]
    failed = engine.require and bool(not_sparse)
    if REPORT.parse(args).json:
        document = {"model": args.model, "engine": str(outcome.engine), "tensorrt": outcome.tensorrt_version}
        document |= {"strongly_typed": outcome.strongly_typed, "sparse": engine.sparse}
        document |= {"build_seconds": outcome.seconds, "warnings": outcome.warnings, **report.as_dict()}
        print(json.dumps(document | {"passed": (not failed) if engine.require else None}, indent=2))
        return NOT_SPARSE if failed else 0
    rows = [
        (row.node, "eligible" if row.predicted_eligible else "no", row.status, row.precision or "-", row.trt_layer)
        for row in report.rows
    ]
    print(render_table(("ONNX node", "predicted", "TensorRT", "precision", "TensorRT layer"), rows))
    for line in report.quantized_lines():
        print(line)
    missed = [row.node for row in report.rows if row.status == MISSED]
    if missed:
        print(f"predicted eligible but not taken by TensorRT: {', '.join(missed)}")
    if not engine.sparse:
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
