"""``nmdeploy prune MODEL -o OUT``: magnitude N:M pruning along each weight's reduction axis."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.options import (
    add_filter_options,
    add_json_option,
    add_output_options,
    add_pattern_option,
    add_require_options,
    check_output,
    left_dense,
    left_dense_clauses,
    left_dense_json,
)
from nmdeploy.graph.inspection import allow_dense_patterns
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes import prune
from nmdeploy.tables import render_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the ONNX model to prune (never modified unless --in-place)")
    add_output_options(parser)
    add_pattern_option(parser)
    parser.add_argument(
        "--transposable",
        action="store_true",
        help="transposable masks (exact solver) for every weight, not only shared ones",
    )
    add_filter_options(parser)
    add_require_options(parser, checked="the pruned model")
    add_json_option(parser)


NOT_COMPLIANT = 1  # --require: a TensorRT-eligible weight of the result is left dense


def run(args: argparse.Namespace) -> int:
    check_output(args.model, args.output, args.in_place)
    allow_dense_patterns(args.allow_dense)
    model = OnnxModel.load(args.model)
    result = prune(
        model,
        pattern=args.pattern,
        transposable=args.transposable,
        include=args.include,
        exclude=args.exclude,
        eligible_only=args.eligible_only,
    )
    path = model.save(args.output)
    pruned = [row for row in result.report if not row.skipped]
    skipped = {row.weight: row.skipped for row in result.report if row.skipped}
    written, reasons = left_dense(model, args, skipped, "not pruned")
    failed = args.require and bool(written.failing)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "output": str(path),
                    "pattern": str(args.pattern),
                    "modified": result.modified,
                    "weights": result.report_json(),
                    "left_dense": left_dense_json(written, reasons),
                    "passed": (not failed) if args.require else None,  # None: nothing was judged
                },
                indent=2,
            )
        )
        return NOT_COMPLIANT if failed else 0
    rows = [
        (
            row.node or row.weight,
            row.axis,
            "skipped" if row.skipped else row.method,
            None if row.skipped else f"{row.retained:.3f}",
            row.skipped or ("" if row.changed else "already N:M"),
        )
        for row in result.report
    ]
    print(render_table(("node", "axis", "method", "magnitude kept", "note"), rows, right=("axis", "magnitude kept")))
    outcome = "; ".join(
        [
            f"pruned {len(pruned)} of {len(result.report)} weights to {args.pattern}",
            *left_dense_clauses(written, reasons),
        ]
    )
    if failed:
        print(f"FAILED | {outcome} (--require) -> {path}")
        return NOT_COMPLIANT
    print(f"PASSED | {outcome} -> {path}")
    return 0
