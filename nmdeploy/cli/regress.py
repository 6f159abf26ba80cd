"""``nmdeploy regress BASELINES [--update]``: accuracy and latency-ratio regression checks for CI."""

from __future__ import annotations

import argparse
import json

from nmdeploy.cli.options import add_json_option
from nmdeploy.evaluation.regress import format_report, run_regression

REGRESSED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("baselines", metavar="BASELINES", help="a baselines TOML file (see models/mlp/baselines.toml)")
    parser.add_argument(
        "--update",
        action="store_true",
        help="rewrite the file's baseline numbers with the measured ones (tolerances and comments kept)",
    )
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    report = run_regression(args.baselines, update=args.update)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return REGRESSED if report.regressed else 0
