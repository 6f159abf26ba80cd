"""``nmdeploy regress BASELINES [--update]``: accuracy and latency-ratio regression checks for CI;
``nmdeploy regress --init BASELINES --reference DENSE --candidate SPARSE --data EVAL``: a new baselines file."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.args import BaselinesArgs, BatchArgs, DataArgs, FidelityArgs, OutputsArgs, ReportArgs, add_groups

REGRESSED = 1
BASELINES, REPORT = BaselinesArgs(), ReportArgs()
DATA, METRIC, OUTPUTS = DataArgs(purpose="evaluation inputs for --init"), FidelityArgs("regress"), OutputsArgs()
BATCH = BatchArgs(help="batch sizes timed for --init (default 1,8, or the model's fixed batch where it has one)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "baselines", nargs="?", metavar="BASELINES", help="a baselines TOML file (see models/mlp/baselines.toml)"
    )
    BASELINES.add_to(parser)
    init = parser.add_argument_group("a new baselines file (--init)")
    BASELINES.add_init_flags(init)
    add_groups(init, DATA, METRIC, OUTPUTS, BATCH)
    REPORT.add_to(parser)


def run(args: argparse.Namespace) -> int:
    from nmdeploy.evaluation.regress import LatencySettings, format_report, init_baselines, run_regression

    regression = BASELINES.parse(args)
    if regression.init is None:
        report = run_regression(regression.baselines, update=regression.update)
    else:
        report = init_baselines(
            regression.init,
            reference=regression.reference,
            candidate=regression.candidate,
            data=DATA.parse(args),
            latency=LatencySettings(batch=tuple(BATCH.parse(args) or _init_batches(regression.reference))),
            metric=METRIC.parse(args).spec,
            outputs=OUTPUTS.parse(args),
        )
    print(json.dumps(report.as_dict(), indent=2) if REPORT.parse(args).json else format_report(report))
    return REGRESSED if report.regressed else 0


def _init_batches(reference: str) -> list[int]:
    """1 and 8, or the model's fixed batch (a reader exported with batch 1 refuses 8 rows)."""
    from nmdeploy.evaluation.bench import batches_within

    return batches_within(reference, 8, budget=float("inf"))
