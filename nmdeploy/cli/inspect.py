"""``nmdeploy inspect MODEL``: every prunable weight, its reduction axis, N:M compliance and TensorRT verdict."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from nmdeploy.cli.args import OutputArgs, PatternArgs, ReportArgs, RequireArgs, add_groups
from nmdeploy.cli.args.weights import untraced_clauses
from nmdeploy.cli.views import inspection_table, uncalibrated_lines
from nmdeploy.files import check_output_path
from nmdeploy.graph.inspection import allow_dense, inspect_model, plot_inspection
from nmdeploy.graph.model import OnnxModel

NOT_COMPLIANT = 1
PATTERN, REPORT, REQUIRE = PatternArgs(), ReportArgs(), RequireArgs("MODEL")
PLOT = OutputArgs("FILE", "also draw compliance and eligibility per weight (.png, .svg)", required=False, flag="--plot")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="an ONNX model (external data next to it is read in place)")
    add_groups(parser, PATTERN, REPORT, PLOT, REQUIRE)


def run(args: argparse.Namespace) -> int:
    require = REQUIRE.parse(args)
    model = OnnxModel.load(args.model)
    plot = PLOT.parse(args)
    if plot:
        check_output_path(plot, inputs=model.input_files())
    inspection = allow_dense(inspect_model(model, PATTERN.parse(args).pattern), model, require.allow_dense)
    summary = inspection.summary()
    if plot:
        plot_inspection(inspection, plot)
    if REPORT.parse(args).json:
        document = {"model": args.model, "pattern": inspection.pattern, "summary": summary}
        document |= {
            "weights": [asdict(r) for r in inspection.rows],
            "untraced": [asdict(u) for u in inspection.untraced],
            "unverified": [asdict(u) for u in inspection.unverified],
        }
        print(json.dumps(document, indent=2))
    else:
        print(inspection_table(inspection))
        print(
            f"{summary['weights']} weights found, {summary['eligible']} TensorRT-eligible, {summary['compliant']} "
            f"{inspection.pattern}-compliant; {summary['parameters_compliant']:,} of {summary['parameters']:,} "
            f"parameters covered; {summary['untraced']} constant operands not traced"
        )
        for row in (r for r in inspection.rows if r.dense_on_purpose and (r.compliant or 0.0) < 1.0):
            print(f"dense on purpose: {row.weight} ({row.dense_on_purpose})")
        for line in uncalibrated_lines(inspection.rows, "convert leaves {count} dense"):
            print(line)
        if require.required and inspection.requirement:
            print(inspection.requirement)
    if require.required and inspection.required_failed:
        failing = inspection.failing
        names = ", ".join(r.weight for r in failing[:5])
        verb = "is" if len(failing) == 1 else "are"
        said = (
            [f"{inspection.required_weights(len(failing))} {verb} not {inspection.pattern}: {names}"] if failing else []
        )
        print(f"FAILED | {'; '.join(said + untraced_clauses(inspection))}")
        return NOT_COMPLIANT
    return 0
