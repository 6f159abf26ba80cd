"""Flag groups shared by several verbs, so each flag family is spelled and parsed once."""

from __future__ import annotations

import argparse

from nmdeploy.errors import PatternError
from nmdeploy.masks import Pattern


def pattern_type(text: str) -> Pattern:
    try:
        return Pattern.parse(text)
    except PatternError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_pattern_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pattern", type=pattern_type, default=Pattern(2, 4), metavar="N:M",
        help="keep N of every M consecutive weights along the reduction axis (default: 2:4)",
    )


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")
