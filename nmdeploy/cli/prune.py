"""``nmdeploy prune MODEL -o OUT``: magnitude N:M pruning along each weight's reduction axis."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.options import (
    add_filter_options,
    add_json_option,
    add_output_options,
    add_pattern_option,
    check_output,
)
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
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    check_output(args.model, args.output, args.in_place)
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
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "output": str(path),
                    "pattern": str(args.pattern),
                    "modified": result.modified,
                    "weights": result.report_json(),
                },
                indent=2,
            )
        )
        return 0
    rows = [
        (
            row.weight,
            row.axis,
            "skipped" if row.skipped else row.method,
            None if row.skipped else f"{row.retained:.3f}",
            row.skipped or ("" if row.changed else "already N:M"),
        )
        for row in result.report
    ]
    print(render_table(("weight", "axis", "method", "magnitude kept", "note"), rows, right=("axis", "magnitude kept")))
    print(f"PASSED | pruned {len(pruned)} of {len(result.report)} weights to {args.pattern} -> {path}")
    return 0
