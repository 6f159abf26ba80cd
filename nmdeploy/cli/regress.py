"""``nmdeploy regress BASELINES [--update]``: accuracy and latency-ratio regression checks for CI;
``nmdeploy regress --init BASELINES --reference DENSE --candidate SPARSE --data EVAL``: a new baselines file."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.options import add_data_option, add_json_option, add_outputs_option
from nmdeploy.errors import InputError

REGRESSED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "baselines", nargs="?", metavar="BASELINES", help="a baselines TOML file (see models/mlp/baselines.toml)"
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="rewrite the file's baseline numbers with the measured ones (tolerances and comments kept); latency "
        "is the median of [model.latency] runs (at least 3) benchmarks",
    )
    group = parser.add_argument_group("a new baselines file (--init)")
    group.add_argument(
        "--init",
        metavar="BASELINES",
        help="measure --reference against --candidate on --data once and write a new baselines file, with "
        "tolerances derived from the measurement (never overwrites: refresh an existing file with --update)",
    )
    group.add_argument("--reference", metavar="DENSE", help="the reference (dense) ONNX model")
    group.add_argument("--candidate", metavar="SPARSE", help="the candidate (converted) ONNX model")
    add_data_option(group, purpose="evaluation inputs for --init")
    group.add_argument(
        "--metric", metavar="MODULE:FUNCTION", help="your own figure (higher is better) to check besides cosine"
    )
    add_outputs_option(group)
    group.add_argument("--batch", default="1,8", metavar="1,8", help="batch sizes timed for --init (default 1,8)")
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.evaluation.regress import format_report, run_regression

    given = [
        flag for flag in ("reference", "candidate", "data", "metric", "outputs") if getattr(args, flag) is not None
    ]
    if args.init is None:
        if args.baselines is None:
            raise InputError("regress needs a baselines file (BASELINES), or --init BASELINES to write a new one")
        if given:
            raise InputError(f"--{given[0]} belongs to --init BASELINES; a baselines file names its own models")
        report = run_regression(args.baselines, update=args.update)
    else:
        report = _init(args)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return REGRESSED if report.regressed else 0


def _init(args: argparse.Namespace):
    from pathlib import Path

    from nmdeploy.evaluation.bench import parse_batches
    from nmdeploy.evaluation.regress import LatencySettings, init_baselines
    from nmdeploy.fidelity import load_metric
    from nmdeploy.files import check_output_path

    if args.baselines is not None or args.update:
        raise InputError("--init BASELINES writes a new file: give no other BASELINES and no --update")
    missing = [f"--{flag}" for flag in ("reference", "candidate", "data") if getattr(args, flag) is None]
    if missing:
        raise InputError(f"--init needs {', '.join(missing)}: the two models and the evaluation data to measure")
    check_output_path(args.init, inputs=[Path(args.reference), Path(args.candidate)])
    if args.metric is not None:
        load_metric(args.metric)
    return init_baselines(
        args.init,
        reference=Path(args.reference),
        candidate=Path(args.candidate),
        data=args.data,
        latency=LatencySettings(batch=tuple(parse_batches(args.batch))),
        metric=args.metric,
        outputs=args.outputs,
    )
