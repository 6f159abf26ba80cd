"""``nmdeploy prune MODEL -o OUT``: magnitude N:M pruning along each weight's reduction axis."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.args import OutputArgs, PatternArgs, ReportArgs, RequireArgs, SelectionArgs, add_groups
from nmdeploy.cli.args.weights import left_dense
from nmdeploy.cli.views import uncalibrated_lines
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes import prune
from nmdeploy.tables import render_table

NOT_COMPLIANT = 1  # --require: a TensorRT-eligible weight of the result is left dense
OUTPUT, PATTERN = OutputArgs(in_place=True), PatternArgs(transposable=True, every_weight=True)
SELECTION, REQUIRE, REPORT = SelectionArgs(tied=True), RequireArgs("the pruned model"), ReportArgs()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the ONNX model to prune (never modified unless --in-place)")
    add_groups(parser, OUTPUT, PATTERN, SELECTION, REQUIRE, REPORT)


def run(args: argparse.Namespace) -> int:
    output = OUTPUT.parse(args)
    REQUIRE.parse(args)
    model = OnnxModel.load(args.model)
    result = prune(model, **PATTERN.parse(args).as_options(), **SELECTION.parse(args).as_options())
    path = model.save(output)
    pruned = [row for row in result.report if not row.skipped]
    dense = left_dense(model, args, {row.weight: row.skipped for row in result.report if row.skipped}, "not pruned")
    if REPORT.parse(args).json:
        document = {"model": args.model, "output": str(path), "pattern": str(args.pattern)}
        document |= {"modified": result.modified, "weights": result.report_json(), **dense.to_json()}
        print(json.dumps(document, indent=2))
        return NOT_COMPLIANT if dense.failed else 0
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
    for line in uncalibrated_lines(pruned, "pruned {count} by magnitude alone"):
        print(line)
    print(dense.final_line(f"pruned {len(pruned)} of {len(result.report)} weights to {args.pattern}", path))
    return NOT_COMPLIANT if dense.failed else 0
