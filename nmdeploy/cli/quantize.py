"""``nmdeploy quantize MODEL -o OUT --precision int8|fp8 --calib DATA``: explicit Q/DQ placed for TensorRT's
sparse integer kernels, with a per-layer verdict."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.options import add_data_option, add_json_option, add_output_options, check_output
from nmdeploy.tables import render_table

PRECISIONS = ("int8", "fp8")  # nmdeploy.passes.quantization_ranges.QUANTIZED_MAX, without importing numpy here
METHODS = ("max", "percentile", "mse", "entropy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the float ONNX model (never modified unless --in-place)")
    add_output_options(parser)
    # Checked by the pass, not by argparse choices: a wrong value is then one line, as every bad input is.
    parser.add_argument(
        "--precision", default="int8", metavar="|".join(PRECISIONS), help="quantized type (default int8)"
    )
    add_data_option(parser, "--calib", required=True, purpose="calibration inputs for the activation ranges")
    parser.add_argument(
        "--method",
        metavar="|".join(METHODS),
        help="activation range from the calibration histogram: max |x|, a percentile of |x| (--percentile), the "
        "range with the least quantization error (mse), or TensorRT's entropy search (int8 only); default entropy "
        "for int8, max for fp8",
    )
    parser.add_argument("--percentile", type=float, default=99.99, metavar="P", help="for --method percentile")
    parser.add_argument(
        "--keep-ops",
        metavar="OP,OP",
        type=lambda text: [op.strip() for op in text.split(",") if op.strip()],
        help="op types whose inputs get no Q/DQ, replacing the default (Softmax, LogSoftmax and the normalisations)",
    )
    parser.add_argument(
        "--quantize-residuals",
        action="store_true",
        help="also quantize the other input of residual Adds after quantized layers, so TensorRT can fuse the Add "
        "(off by default: it quantizes the residual stream, which costs accuracy in transformers)",
    )
    parser.add_argument(
        "--smooth",
        action=argparse.BooleanOptionalAction,
        help="SmoothQuant before quantizing: divide each MatMul/Gemm input channel by max|x|^ALPHA / max|w|^(1-ALPHA) "
        "(a Mul before its Q/DQ) and multiply the weights' matching rows by it, so outlier channels move into the "
        "per-channel weight scales; zeros stay zeros (default: on for int8, off for fp8)",
    )
    parser.add_argument(
        "--smooth-strength", type=float, default=0.85, metavar="ALPHA", help="ALPHA of --smooth (default 0.85)"
    )
    parser.add_argument("--calib-batch", type=int, metavar="N", help="calibration samples per batch")
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.passes.quantize import quantize_model_file

    check_output(args.model, args.output, args.in_place)
    outcome = quantize_model_file(
        args.model,
        args.output,
        calibration=args.calib,
        precision=args.precision,
        method=args.method,
        percentile=args.percentile,
        keep_ops=args.keep_ops,
        quantize_residuals=args.quantize_residuals,
        smooth=args.smooth,
        smoothing_strength=args.smooth_strength,
        batch_size=args.calib_batch,
    )
    summary = outcome.summary
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "output": str(outcome.output),
                    "precision": args.precision,
                    "calibration": args.calib,
                    "report": [row.to_json() for row in outcome.report],
                },
                indent=2,
            )
        )
        return 0
    rows = [
        (layer.node, layer.weight_precision, layer.input, layer.output, layer.pattern, layer.verdict)
        for layer in outcome.layers
    ]
    print(render_table(("layer", "weight", "in", "out", "pattern", "verdict"), rows))
    print(
        f"{summary.activations} activations quantized per tensor ({summary.method}) on "
        f"{summary.calibration_samples} calibration samples"
    )
    print(
        f"written | {args.precision.upper()}: {summary.quantized_layers} of {summary.layers} layers quantized, "
        f"{summary.sparse_integer_layers} eligible for sparse {'integer' if args.precision == 'int8' else 'FP8'} "
        f"kernels (2:4 + {args.precision.upper()} in/out) -> {outcome.output}"
    )
    return 0
