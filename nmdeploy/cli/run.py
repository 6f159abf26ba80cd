"""``nmdeploy run RECIPE MODEL -o OUT``: run a pass pipeline from a TOML recipe."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.options import add_data_option, add_json_option, add_output_options, check_output
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.recipes import load_recipe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", metavar="RECIPE", help="recipe file or bundled recipe name")
    parser.add_argument("model", metavar="MODEL", help="the ONNX model (never modified unless --in-place)")
    add_output_options(parser)
    add_data_option(
        parser, "--calib", purpose="calibration inputs for the recipe's convert and quantize steps (replacing its own)"
    )
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    pipeline = load_recipe(args.recipe, calibration=args.calib)
    check_output(args.model, args.output, args.in_place)
    model = OnnxModel.load(args.model)
    result = pipeline(model)
    path = model.save(args.output)
    if args.json:
        print(
            json.dumps(
                {
                    "recipe": args.recipe,
                    "output": str(path),
                    "modified": result.modified,
                    "report": result.report_json(),
                },
                indent=2,
            )
        )
    else:
        for row in result.report_json():
            print("  ".join(f"{key}={value}" for key, value in row.items()))
        print(
            f"PASSED | {args.recipe}: {len(pipeline.passes)} passes, "
            f"{'modified' if result.modified else 'unchanged'} -> {path}"
        )
    return 0
