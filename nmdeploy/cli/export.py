"""``nmdeploy export CHECKPOINT -o model.onnx [--model MODULE:FUNCTION --input SHAPE]``: bake a training
checkpoint's masks and export it to ONNX."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from nmdeploy.cli.options import add_json_option
from nmdeploy.files import check_output_path
from nmdeploy.tables import render_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="a checkpoint written by 'nmdeploy train' or by save_checkpoint"
    )
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help="the ONNX file to write")
    parser.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        help="for a checkpoint saved from Python: the function (no arguments) that builds the dense model, as "
        "'package.module:function' (the working directory is importable)",
    )
    parser.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="SHAPE[:DTYPE]",
        help="with --model: the shape of an example input to trace, e.g. 1x64:int64 (dtype float32 when left out; "
        "repeat for several inputs; the first axis is exported as the batch axis)",
    )
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    # Imported here: the trainer pulls in torch's compiler stack, which every other verb can do without.
    from nmdeploy.train.export import export_checkpoint

    if os.getcwd() not in sys.path:  # a user's [task] model/data, as 'nmdeploy train' imports them
        sys.path.insert(0, os.getcwd())
    check_output_path(args.output, inputs=[Path(args.checkpoint)])

    result = export_checkpoint(args.checkpoint, args.output, model=args.model, inputs=tuple(args.input))
    if args.json:
        print(json.dumps({**asdict(result), "path": str(result.path)}, indent=2))
        return 0
    rows = [(name, result.pattern, "") for name in result.sparsified]
    rows += [(name, "dense", reason) for name, reason in result.skipped.items()]
    print(render_table(("layer", "weights", "why dense"), rows))
    what = f"{len(result.sparsified)} layers {result.pattern}" if result.pattern else "dense model"
    print(f"PASSED | export: {result.task}, {what}, written to {result.path}")
    return 0
