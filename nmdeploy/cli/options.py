"""Flag groups shared by several verbs, so each flag family is spelled and parsed once."""

from __future__ import annotations

import argparse
from pathlib import Path

from nmdeploy.errors import InputError, PatternError
from nmdeploy.files import check_output_path
from nmdeploy.masks import Pattern


def pattern_type(text: str) -> Pattern:
    try:
        return Pattern.parse(text)
    except PatternError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_pattern_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pattern",
        type=pattern_type,
        default=Pattern(2, 4),
        metavar="N:M",
        help="keep N of every M consecutive weights along the reduction axis (default: 2:4)",
    )


def add_json_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")


def add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", required=True, metavar="OUT", help="where to write the resulting model")
    parser.add_argument("--in-place", action="store_true", help="allow OUT to be MODEL itself (overwritten atomically)")


def check_output(model: str, output: str, in_place: bool) -> None:
    """Refuse to overwrite the input unless asked to, so a typo never destroys a model."""
    if Path(output).resolve() == Path(model).resolve() and not in_place:
        raise InputError(f"{output} is the input model; choose another -o OUT or pass --in-place")
    if not in_place or Path(output).resolve() != Path(model).resolve():
        check_output_path(output, inputs=[Path(model)])


def add_filter_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--include", metavar="REGEX", help="only weights whose name or consumer node name matches")
    parser.add_argument("--exclude", metavar="REGEX", help="skip weights whose name or consumer node name matches")
    parser.add_argument("--eligible-only", action="store_true", help="only weights TensorRT can run sparse")
