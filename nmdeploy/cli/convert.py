"""``nmdeploy convert MODEL -o OUT --calib DATA``: calibrated N:M conversion, layer by layer on calibration data."""

from __future__ import annotations

import argparse
import json
import time

from nmdeploy.cli import args as groups
from nmdeploy.cli.args.weights import left_dense
from nmdeploy.cli.precision_budget import show_precision_budget
from nmdeploy.cli.views import conversion_text

NOT_COMPLIANT = 1  # --require: a TensorRT-eligible weight of the result is left dense
MISSING = "convert needs calibration data: --calib DATA (an .npz or a folder of them), or --calib random for a test"
OUTPUT, PATTERN = groups.OutputArgs(in_place=True), groups.PatternArgs(transposable=True)
CALIBRATION, AXES = groups.CalibrationArgs(purpose="calibration inputs", missing=MISSING), groups.BatchAxisArgs()
CONVERSION, DEVICE, SELECTION = groups.ConversionArgs(), groups.DeviceArgs(), groups.SelectionArgs(tied=True)
PRECISION = groups.PrecisionArgs(budgeted=True)
REQUIRE, REPORT = groups.RequireArgs("the converted model"), groups.ReportArgs()
RECOVERY, FIDELITY, OUTPUTS = groups.RecoveryArgs(), groups.FidelityArgs("convert"), groups.OutputsArgs()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="the dense or unstructured-sparse ONNX model")
    groups.add_groups(parser, OUTPUT, PATTERN, CALIBRATION, AXES, CONVERSION, DEVICE, SELECTION, REQUIRE)
    groups.add_groups(parser.add_argument_group("fidelity"), RECOVERY, FIDELITY, OUTPUTS, PRECISION)
    REPORT.add_to(parser)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.calibration.data import CalibrationData
    from nmdeploy.conversion.budget import BudgetReport
    from nmdeploy.conversion.controller import Conversion, ConversionOptions
    from nmdeploy.conversion.precision_budget_report import PrecisionBudgetReport
    from nmdeploy.files import check_output_path
    from nmdeploy.graph.model import OnnxModel
    from nmdeploy.passes.conversion_report import ConversionSummary, conversion_outcome

    started = time.perf_counter()
    calibration, fitting = CALIBRATION.parse(args), CONVERSION.parse(args)
    output, device, _ = OUTPUT.parse(args), DEVICE.parse(args), REQUIRE.parse(args)
    fidelity, outputs = FIDELITY.parse(args), OUTPUTS.parse(args)
    recover = RECOVERY.parse(args, fidelity, outputs)
    quantization = PRECISION.parse(args, fidelity.min_fidelity)
    (model := OnnxModel.load(args.model)).check_save_target(output)
    data = CalibrationData(calibration.source, model.proto, calibration.batch_size, fidelity.held_out, AXES.parse(args))
    check_output_path(output, inputs=data.files)
    options = ConversionOptions(
        calibration=data, batch_size=calibration.batch_size, progress=None, device=device, recover=recover,
        min_fidelity=fidelity.min_fidelity, metric=fidelity.metric, outputs=outputs, **quantization,
        **fitting, **PATTERN.parse(args).as_options(), **SELECTION.parse(args).as_options(),
    )  # fmt: skip
    if (rows := CONVERSION.run(Conversion(options), model, args)) is None:
        return 0  # this process ran its share of the calibration rows; rank 0 writes the result
    chosen = next((row for row in rows if isinstance(row, PrecisionBudgetReport)), None)
    if chosen is not None:
        return show_precision_budget(model, model.save(output), chosen, args, REPORT.parse(args).json)
    budget = next((row for row in rows if isinstance(row, BudgetReport)), None)
    rows = [row for row in rows if not isinstance(row, BudgetReport)]
    summary = next(row for row in rows if isinstance(row, ConversionSummary))
    converted, skipped = conversion_outcome(rows, budgeted=budget is not None)
    path = model.save(output)
    if budget is not None:
        skipped.update({row.weight: f"--min-fidelity: {row.reason}" for row in budget.layers if not row.converted})
    dense = left_dense(model, args, skipped, "not converted")
    total_seconds = time.perf_counter() - started
    if REPORT.parse(args).json:
        timed = summary.to_json() | {"total_seconds": total_seconds}
        document = {"model": args.model, "output": str(path), "summary": timed}
        document |= {"report": [row.to_json() for row in rows], **dense.to_json()}
        print(json.dumps(document | ({"budget": budget.to_json()} if budget else {}), indent=2))
        return NOT_COMPLIANT if dense.failed else 0
    labels = {row.weight: row.node_label for row in dense.inspection.rows}
    print(conversion_text(rows, budget, summary, labels, total_seconds))
    zeros = sum(row.zeros_before for row in converted)
    kept = f", {sum(row.zeros_kept for row in converted)}/{zeros} existing zeros kept" if zeros else ""
    print(dense.final_line(f"converted {len(converted)} weights to {args.pattern}{kept}", path))
    return NOT_COMPLIANT if dense.failed else 0
