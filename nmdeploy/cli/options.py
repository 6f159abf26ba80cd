"""Flag groups shared by several verbs, so each flag family is spelled and parsed once.

Nothing heavy is imported here: this module is loaded with every verb, and ``--help`` must stay instant.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from nmdeploy.errors import InputError, PatternError
from nmdeploy.files import check_output_path

if TYPE_CHECKING:
    from nmdeploy.masks import Pattern


def pattern_type(text: str) -> Pattern:
    # nmdeploy.masks imports torch; only verbs that take --pattern parse one, and they need torch anyway.
    from nmdeploy.masks.pattern import Pattern

    try:
        return Pattern.parse(text)
    except PatternError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def add_pattern_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pattern",
        type=pattern_type,
        default="2:4",
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


DATA_FORMS = "an .npz (input name -> batched array), a folder of them, or 'random' (seeded; functional checks only)"


def add_data_option(
    parser: argparse.ArgumentParser,
    flag: str = "--data",
    *,
    purpose: str,
    required: bool = False,
    default: str | None = None,
) -> None:
    """``--data`` (or ``--calib``): model inputs, in the one format every verb reads (nmdeploy.runtimes.data)."""
    parser.add_argument(flag, required=required, default=default, metavar="DATA", help=f"{purpose}: {DATA_FORMS}")


def add_outputs_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--outputs NAME[,NAME]``: the outputs fidelity figures judge, the same in every verb that measures fidelity."""
    parser.add_argument(
        "--outputs",
        type=outputs_type,
        metavar="NAME[,NAME]",
        help="outputs to judge fidelity on (default: every float output that is not a copy of an input, so "
        "integer pass-throughs such as input_ids do not count)",
    )


def outputs_type(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give output names separated by commas, e.g. logits,embeddings")
    return names


def add_shapes_option(parser: argparse.ArgumentParser, *, purpose: str) -> None:
    """``--shapes NAME:DIMS,...`` in trtexec's syntax, where ``B`` stands for each batch size."""
    parser.add_argument("--shapes", metavar="NAME:Bx128,...", help=f"{purpose}; B stands for each batch size")


def parsed_shapes(args: argparse.Namespace) -> dict[str, tuple[int | str, ...]] | None:
    from nmdeploy.runtimes.shapes import parse_shapes

    return parse_shapes(args.shapes, batch=True) if args.shapes else None


_PROFILE_FLAGS = {
    "shapes": "--shapes",
    "min_shapes": "--min-shapes",
    "opt_shapes": "--opt-shapes",
    "max_shapes": "--max-shapes",
}


def add_profile_options(parser: argparse.ArgumentParser) -> None:
    """An optimisation profile as trtexec takes it: fixed ``--shapes``, or ``--min/--opt/--max-shapes``."""
    group = parser.add_argument_group("input shapes (NAME:DIMS, comma-separated, e.g. ids:8x128,mask:8x128)")
    group.add_argument("--shapes", metavar="NAME:DIMS,...", help="fixed shapes of dynamic inputs")
    group.add_argument("--min-shapes", metavar="NAME:DIMS,...", help="smallest shapes of the profile")
    group.add_argument("--opt-shapes", metavar="NAME:DIMS,...", help="shapes TensorRT tunes for")
    group.add_argument("--max-shapes", metavar="NAME:DIMS,...", help="largest shapes of the profile")


def parsed_profile(args: argparse.Namespace) -> dict[str, tuple[tuple[int, ...], ...]]:
    from nmdeploy.runtimes.shapes import parse_shapes, shape_ranges

    given = {
        key: parse_shapes(getattr(args, key), flag=flag) if getattr(args, key) else {}
        for key, flag in _PROFILE_FLAGS.items()
    }
    return shape_ranges(given["shapes"], given["min_shapes"], given["opt_shapes"], given["max_shapes"])
