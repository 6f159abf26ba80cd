"""``nmdeploy data text|images|hook MODEL ... -o OUT_DIR``: calibration and evaluation sets for your own model, as
the folder of .npz shards that ``--calib`` and ``--data`` take."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.args import HookArgs, ImageArgs, OutputArgs, ReportArgs, ShardArgs, TextArgs, add_groups

OUTPUT = OutputArgs("OUT_DIR", "folder to create (absent or empty) for the shards")
SHARDS, REPORT = ShardArgs(), ReportArgs()
SOURCES = {  # name -> (its group, --help line, description)
    "text": (TextArgs(), "sentences of UTF-8 text, tokenised", "tokenise sentences of UTF-8 text"),
    "images": (ImageArgs(), "a folder of image files", "resize and normalise a folder of images"),
    "hook": (
        HookArgs(),
        "a Python function yielding feed dicts",
        "write what MODULE:FUNCTION() yields (dicts of input name -> numpy array), checked",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sources = parser.add_subparsers(dest="source", metavar="SOURCE")
    sources.required = True
    for name, (group, help, description) in SOURCES.items():
        source = sources.add_parser(name, help=help, description=description)
        source.add_argument("model", metavar="MODEL", help="the ONNX model the data is for (input names, dtypes, dims)")
        add_groups(source, group, OUTPUT, SHARDS, REPORT)


def run(args: argparse.Namespace) -> int:
    build = SOURCES[args.source][0].parse(args)
    report = build(args.model, OUTPUT.parse(args), SHARDS.parse(args))
    if REPORT.parse(args).json:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    for spec in report.inputs:
        dims = ", ".join("?" if d is None else str(d) for d in spec["shape"])
        print(f"{spec['name']}: {spec['dtype']}[{dims}]")
    if report.sequence_lengths is not None:
        low, high = report.sequence_lengths
        print(f"sequence length {low}" if low == high else f"sequence length {low}..{high} (per shard)")
    if report.image_size is not None:
        print(f"image size {report.image_size[0]}x{report.image_size[1]}")
    if report.dropped_rows:
        print(f"{report.dropped_rows} rows left out: the model's fixed batch size takes whole shards only")
    print(f"{report.shards} shards, {report.rows} rows in {report.seconds:.2f} s")
    print(f"PASSED | wrote {report.rows} rows in {report.shards} shards -> {report.output}")
    return 0
