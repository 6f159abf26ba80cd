"""``nmdeploy inspect MODEL``: every prunable weight, its reduction axis, N:M compliance and TensorRT verdict."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from nmdeploy.cli.options import add_json_option, add_pattern_option, add_require_options
from nmdeploy.files import check_output_path
from nmdeploy.graph.inspection import allow_dense, inspect_model, plot_inspection
from nmdeploy.graph.model import OnnxModel
from nmdeploy.tables import render_table

NOT_COMPLIANT = 1
COLUMNS = ("node", "op", "weight", "shape", "dtype", "axis", "N:M", "zeros", "T-N:M", "TensorRT")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="an ONNX model (external data next to it is read in place)")
    add_pattern_option(parser)
    add_json_option(parser)
    parser.add_argument("--plot", metavar="FILE", help="also draw compliance and eligibility per weight (.png, .svg)")
    add_require_options(parser, checked="MODEL")


def run(args: argparse.Namespace) -> int:
    model = OnnxModel.load(args.model)
    if args.plot:
        check_output_path(args.plot, inputs=model.input_files())
    inspection = allow_dense(inspect_model(model, args.pattern), model, args.allow_dense)
    summary = inspection.summary()
    if args.plot:
        plot_inspection(inspection, args.plot)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "pattern": inspection.pattern,
                    "summary": summary,
                    "weights": [asdict(r) for r in inspection.rows],
                    "untraced": [asdict(u) for u in inspection.untraced],
                },
                indent=2,
            )
        )
    else:
        _print_table(inspection)
        print(
            f"{summary['weights']} weights found, {summary['eligible']} TensorRT-eligible, {summary['compliant']} "
            f"{inspection.pattern}-compliant; {summary['parameters_compliant']:,} of {summary['parameters']:,} "
            f"parameters covered; {summary['untraced']} constant operands not traced"
        )
    if not args.json:
        for row in inspection.allowed_dense:
            print(f"dense on purpose: {row.weight} ({row.dense_on_purpose})")
    if args.require and inspection.failing:
        names = ", ".join(r.weight for r in inspection.failing[:5])
        print(f"FAILED | {len(inspection.failing)} eligible weights are not {inspection.pattern}: {names}")
        return NOT_COMPLIANT
    return 0


def _print_table(inspection) -> None:
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
                _axis(row.axis),
                _fraction(row.compliant),
                f"{row.sparsity:.2f}",
                _fraction(row.transposable),
                verdict,
            )
        )
    for item in inspection.untraced:
        rows.append((item.node, item.op_type, None, None, None, None, None, None, None, f"not traced: {item.reason}"))
    print(render_table(COLUMNS, rows, right=("shape", "axis", "N:M", "zeros", "T-N:M")))


def _axis(axis: int | None) -> str:
    return "T" if axis is None else str(axis)


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
