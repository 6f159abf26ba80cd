"""``nmdeploy data text|images|hook MODEL ... -o OUT_DIR``: calibration and evaluation sets for your own model, as
the folder of .npz shards that ``--calib`` and ``--data`` take."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.options import add_json_option
from nmdeploy.errors import InputError


def _size(text: str) -> tuple[int, int]:
    height, _, width = text.lower().partition("x")
    try:
        return int(height), int(width)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW such as 224x224, not {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers such as 0.485,0.456,0.406, not {text!r}"
        ) from None


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the ONNX model the data is for (input names, dtypes, dims)")


def _output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o", "--output", required=True, metavar="OUT_DIR", help="folder to create (absent or empty) for the shards"
    )
    parser.add_argument("--batch", type=int, default=32, metavar="N", help="rows per shard (default: 32)")
    add_json_option(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sources = parser.add_subparsers(dest="source", metavar="SOURCE")
    sources.required = True
    text = sources.add_parser(
        "text", help="sentences of UTF-8 text, tokenised", description="tokenise sentences of UTF-8 text"
    )
    _common(text)
    text.add_argument("text", metavar="FILE|DIR", help="a UTF-8 text file, or a folder of .txt files (name order)")
    text.add_argument(
        "--tokenizer",
        required=True,
        metavar="DIR_OR_PACKAGE",
        help="a folder holding tokenizer.json (or a WordPiece vocab.txt), or an installed package that ships one",
    )
    text.add_argument(
        "--max-length", type=int, default=128, metavar="N", help="longest sequence in tokens (default: 128)"
    )
    text.add_argument("--limit", type=int, metavar="N", help="use at most the first N sentences")
    _output(text)
    images = sources.add_parser(
        "images", help="a folder of image files", description="resize and normalise a folder of images"
    )
    _common(images)
    images.add_argument("images", metavar="DIR", help="folder of image files (.png, .jpg, ...; name order)")
    images.add_argument("--size", type=_size, metavar="HxW", help="image size (default: the model's fixed size)")
    images.add_argument("--layout", choices=("NCHW", "NHWC"), help="default: read from the model's input shape")
    images.add_argument("--mean", type=_floats, metavar="R,G,B", help="subtracted after scaling (default: 0)")
    images.add_argument("--std", type=_floats, metavar="R,G,B", help="divided by after the mean (default: 1)")
    images.add_argument("--scale", type=float, default=255.0, help="pixels are divided by it first (default: 255)")
    _output(images)
    hook = sources.add_parser(
        "hook",
        help="a Python function yielding feed dicts",
        description="write what MODULE:FUNCTION() yields (dicts of input name -> numpy array), checked",
    )
    _common(hook)
    hook.add_argument("hook", metavar="MODULE:FUNCTION", help="a function that takes no arguments and yields feeds")
    _output(hook)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.runtimes.datasets import build_hook_set, build_image_set, build_text_set

    if args.source == "text":
        report = build_text_set(
            args.model,
            args.text,
            args.tokenizer,
            args.output,
            max_length=args.max_length,
            rows=args.batch,
            limit=args.limit,
        )
    elif args.source == "images":
        report = build_image_set(
            args.model,
            args.images,
            args.output,
            size=args.size,
            layout=args.layout,
            mean=args.mean,
            std=args.std,
            scale=args.scale,
            rows=args.batch,
        )
    elif args.source == "hook":
        report = build_hook_set(args.model, args.hook, args.output, rows=args.batch)
    else:  # argparse allows only the sources above
        raise InputError(f"unknown data source {args.source!r}")
    if args.json:
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
