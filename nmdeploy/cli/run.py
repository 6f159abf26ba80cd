"""``nmdeploy run RECIPE MODEL -o OUT``: run a pass pipeline from a TOML recipe."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.args import CalibrationArgs, OutputArgs, ReportArgs, add_groups

OUTPUT, REPORT = OutputArgs(in_place=True), ReportArgs()
CALIBRATION = CalibrationArgs(
    purpose="calibration inputs for the recipe's convert and quantize steps (replacing its own)", batch=False
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE", help="recipe file or bundled recipe name")
    parser.add_argument("model", metavar="MODEL", help="the ONNX model (never modified unless --in-place)")
    add_groups(parser, OUTPUT, CALIBRATION, REPORT)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.conversion.recipes import load_recipe
    from nmdeploy.graph.model import OnnxModel
    from nmdeploy.passes.base import PassRow
    from nmdeploy.passes.verify import VerifiedWeight

    pipeline = load_recipe(args.recipe, calibration=CALIBRATION.parse(args).source)
    output = OUTPUT.parse(args)
    model = OnnxModel.load(args.model)
    result = pipeline(model)
    path = model.save(output)
    # A PASSED says what it rests on: how many weights the recipe's verify steps checked (none without one).
    verified = {
        entry.row.weight
        for entry in result.report
        if isinstance(entry, PassRow) and isinstance(entry.row, VerifiedWeight)
    }
    if REPORT.parse(args).json:
        document = {"recipe": args.recipe, "output": str(path), "modified": result.modified, "verified": len(verified)}
        print(json.dumps(document | {"report": result.report_json()}, indent=2))
        return 0
    for row in result.report_json():
        print("  ".join(f"{key}={value}" for key, value in row.items()))
    changed = "modified" if result.modified else "unchanged"
    weights = f"{len(verified)} weight{'' if len(verified) == 1 else 's'} verified"
    print(f"PASSED | {args.recipe}: {len(pipeline.passes)} passes, {weights}, {changed} -> {path}")
    return 0
