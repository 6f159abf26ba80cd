"""``nmdeploy quantize MODEL -o OUT --precision int8|fp8 --calib DATA``: explicit Q/DQ placed for TensorRT's
sparse integer kernels, with a per-layer verdict."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.args import CalibrationArgs, OutputArgs, PrecisionArgs, ReportArgs, add_groups

OUTPUT, PRECISION, REPORT = OutputArgs(in_place=True), PrecisionArgs(quantized=True), ReportArgs()
CALIBRATION = CalibrationArgs(required=True, purpose="calibration inputs for the activation ranges")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the float ONNX model (never modified unless --in-place)")
    add_groups(parser, OUTPUT, PRECISION, CALIBRATION, REPORT)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.graph.quantization import SPARSE_KERNEL_OUTPUTS
    from nmdeploy.passes.quantize import quantize_model_file
    from nmdeploy.tables import render_table

    output, calibration, options = OUTPUT.parse(args), CALIBRATION.parse(args), PRECISION.parse(args)
    outcome = quantize_model_file(
        args.model, output, calibration=calibration.source, batch_size=calibration.batch_size, **options
    )
    summary, precision = outcome.summary, options["precision"]
    if REPORT.parse(args).json:
        document = {"model": args.model, "output": str(outcome.output), "precision": precision}
        document |= {"calibration": calibration.source, "report": [row.to_json() for row in outcome.report]}
        print(json.dumps(document, indent=2))
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
        f"written | {precision.upper()}: {summary.quantized_layers} of {summary.layers} layers quantized, "
        f"{summary.sparse_integer_layers} eligible for sparse {'integer' if precision == 'int8' else 'FP8'} "
        f"kernels (2:4 + {SPARSE_KERNEL_OUTPUTS[precision]}) -> {outcome.output}"
    )
    return 0
