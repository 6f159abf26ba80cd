"""``nmdeploy export CHECKPOINT -o model.onnx [--model MODULE:FUNCTION --input SHAPE]``: bake a training
checkpoint's masks and export it to ONNX."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from nmdeploy.cli.args import ExportArgs, OutputArgs, ReportArgs, add_groups
from nmdeploy.files import check_output_path
from nmdeploy.tables import render_table

OUTPUT, EXPORT, REPORT = OutputArgs("OUT", "the ONNX file to write"), ExportArgs(), ReportArgs()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="a checkpoint written by 'nmdeploy train' or by save_checkpoint"
    )
    add_groups(parser, OUTPUT, EXPORT, REPORT)


def run(args: argparse.Namespace) -> int:
    # Imported here: the trainer pulls in torch's compiler stack, which every other verb can do without.
    from nmdeploy.train.export import export_checkpoint

    traced = EXPORT.parse(args)
    output = OUTPUT.parse(args)
    check_output_path(output, inputs=[Path(args.checkpoint)])
    result = export_checkpoint(args.checkpoint, output, **traced)
    if REPORT.parse(args).json:
        print(json.dumps({**asdict(result), "path": str(result.path)}, indent=2))
        return 0
    rows = [(name, result.pattern, "") for name in result.sparsified]
    rows += [(name, "dense", reason) for name, reason in result.skipped.items()]
    print(render_table(("layer", "weights", "why dense"), rows))
    what = f"{len(result.sparsified)} layers {result.pattern}" if result.pattern else "dense model"
    print(f"PASSED | export: {result.task}, {what}, written to {result.path}")
    return 0
