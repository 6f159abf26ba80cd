"""``nmdeploy pipeline [-o OUT_DIR] [--models digits,minilm]``: the deployment pipeline on the reference models;
``nmdeploy pipeline MODEL --calib DATA --data EVAL``: the same steps on the user's own model."""

from __future__ import annotations

import argparse
import json
import sys

from nmdeploy.cli import args as groups
from nmdeploy.reference import MODELS_FOLDER

REGRESSED = 1
OUTPUT = groups.OutputArgs(
    "OUT_DIR", "artefact folder (default: ./nmdeploy-out)", required=False, default="nmdeploy-out"
)
RECOVERY, FIDELITY, DEVICE = groups.RecoveryArgs("pipeline"), groups.FidelityArgs("pipeline"), groups.DeviceArgs()
CALIBRATION = groups.CalibrationArgs(purpose="calibration inputs of MODEL")
DATA = groups.DataArgs(purpose="held-out evaluation inputs of MODEL (compare, bench, regress)")
CONVERSION, OUTPUTS, AXES = groups.ConversionArgs(distributed=False), groups.OutputsArgs(), groups.BatchAxisArgs()
MASKS, SELECTION = groups.PatternArgs(transposable=True, fixed="2:4"), groups.SelectionArgs(tied=True)
BATCH = groups.BatchArgs(help="batch sizes timed (default: 1 and the largest to the evaluation batch run in 50 ms)")
REPORT, PRECISION = groups.ReportArgs(), groups.PrecisionArgs(deployed=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="your dense ONNX model (needs --calib and --data); without it, the bundled reference models run",
    )
    groups.add_groups(parser, OUTPUT, groups.PipelineArgs(MODELS_FOLDER), RECOVERY, FIDELITY, DEVICE, PRECISION)
    yours = parser.add_argument_group("your model (MODEL)")
    groups.add_groups(yours, CALIBRATION, DATA, AXES, CONVERSION, MASKS, OUTPUTS, SELECTION, BATCH)
    REPORT.add_to(parser)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.pipeline import (
        ConvertSettings,
        engine_lines,
        run_pipeline,
        run_user_pipeline,
        summary_line,
        summary_table,
    )

    job = groups.PipelineArgs(MODELS_FOLDER).parse(args)  # the folder read now: tests point it at a copy
    fidelity, fitting, selection = FIDELITY.parse(args), CONVERSION.parse(args), SELECTION.parse(args)
    recover = RECOVERY.parse(args, fidelity, OUTPUTS.parse(args))
    masks = {"transposable": MASKS.parse(args).transposable, "sparse_lm_head": selection.sparse_lm_head}
    fitting["batch_size"] = args.calib_batch  # --calib DATA itself is read by the pipeline's own group
    settings = ConvertSettings(
        recover=recover, min_fidelity=fidelity.min_fidelity, metric=fidelity.spec, outputs=OUTPUTS.parse(args),
        device=DEVICE.parse(args), eligible_only=selection.eligible_only, method=fitting.pop("method"),
        fitting=fitting | masks, batch_axes=AXES.parse(args), held_out=fidelity.held_out,
    )  # fmt: skip
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if job.model is None:
        report = run_pipeline(fidelity=settings, progress=progress, **job.options, **PRECISION.parse(args))
    else:
        report = run_user_pipeline(
            job.model, settings=settings, progress=progress, **job.options, **PRECISION.parse(args)
        )
    if REPORT.parse(args).json:
        print(json.dumps(report.as_dict(), indent=2, default=str))
        return 0 if report.passed else REGRESSED
    print(summary_table(report))
    print("\n".join(engine_lines(report)))
    for model in report.models:
        for check in model.regression.regressed:
            print(f"regressed: {check.description}")
        if model.regression.created:
            print(f"baselines written to {model.regression.path} from these figures; "
                  f"check the model again with: nmdeploy regress {model.regression.path}")  # fmt: skip
    print(f"artefacts and summary.md in {report.out_dir}")
    print(summary_line(report))
    return 0 if report.passed else REGRESSED
