"""``nmdeploy convert MODEL -o OUT --calib DATA``: calibrated N:M conversion (saliency mask, least-squares refit)."""

from __future__ import annotations

import argparse
import json
import logging

from nmdeploy.cli.options import (
    add_filter_options,
    add_json_option,
    add_output_options,
    add_pattern_option,
    check_output,
)
from nmdeploy.data import RANDOM
from nmdeploy.errors import InputError
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.convert import METHODS, ConvertPass

HELP = "convert fully connected weights to N:M with calibration data: saliency mask, then least-squares refit"
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the dense or unstructured-sparse ONNX model")
    add_output_options(parser)
    add_pattern_option(parser)
    parser.add_argument(
        "--calib",
        metavar="DATA",
        help="calibration inputs: an .npz (input name -> batched array) or a folder of them; "
        "'random' only for functional tests",
    )
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="refit",
        help="magnitude, saliency (|w| x input norm), refit (saliency mask + exact least-squares refit; default), "
        "or sparsegpt (OBS column sweep: several times faster on wide layers, slightly higher error)",
    )
    parser.add_argument("--damping", type=float, default=0.01, help="refit damping, relative to mean diag(X^T X)")
    add_filter_options(parser)
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    if not args.calib:
        raise InputError(
            "convert needs calibration data: --calib DATA (an .npz or a folder of them), "
            "or --calib random for a functional test"
        )
    if args.calib == RANDOM:
        log.warning("--calib random: the conversion will run, but accuracy needs real calibration data")
    check_output(args.model, args.output, args.in_place)
    model = OnnxModel.load(args.model)
    result = ConvertPass(
        calibration=args.calib,
        pattern=args.pattern,
        method=args.method,
        damping=args.damping,
        include=args.include,
        exclude=args.exclude,
        eligible_only=args.eligible_only,
    )(model)
    path = model.save(args.output)
    if args.json:
        print(json.dumps({"model": args.model, "output": str(path), "report": result.report}, indent=2))
        return 0
    converted = [row for row in result.report if "skipped" not in row]
    for row in result.report:
        if "skipped" in row:
            print(f"{row['weight']:<48} skipped: {row['skipped']}")
        else:
            print(
                f"{row['weight']:<48} {row['method']:<9} saliency kept {row['retained_saliency']:.3f}  "
                f"error {row['error_masked']:.4g} -> {row['error_converted']:.4g}"
            )
    print(f"PASSED | converted {len(converted)} weights to {args.pattern} -> {path}")
    return 0
