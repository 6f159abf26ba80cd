"""``nmdeploy export CHECKPOINT -o model.onnx``: bake a training checkpoint's masks and export it to ONNX."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from nmdeploy.cli.options import add_json_option
from nmdeploy.files import check_output_path

HELP = "export a training checkpoint to ONNX with its N:M masks baked into the weights"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a checkpoint.pt written by 'nmdeploy train'")
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help="the ONNX file to write")
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    # Imported here: the trainer pulls in torch's compiler stack, which every other verb can do without.
    from nmdeploy.train.export import export_checkpoint

    if os.getcwd() not in sys.path:  # a user's [task] model/data, as 'nmdeploy train' imports them
        sys.path.insert(0, os.getcwd())
    check_output_path(args.output, inputs=[Path(args.checkpoint)])

    result = export_checkpoint(args.checkpoint, args.output)
    if args.json:
        print(json.dumps({**asdict(result), "path": str(result.path)}, indent=2))
        return 0
    for name in result.sparsified:
        print(f"{name:<40} {result.pattern}")
    for name, reason in result.skipped.items():
        print(f"{name:<40} dense: {reason}")
    what = f"{len(result.sparsified)} layers {result.pattern}" if result.pattern else "dense model"
    print(f"PASSED | export: {result.task}, {what}, written to {result.path}")
    return 0
