"""Flag groups shared by several verbs, so each flag family is spelled and parsed once.

Nothing heavy is imported here: this module is loaded with every verb, and ``--help`` must stay instant.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nmdeploy.errors import InputError, PatternError
from nmdeploy.files import check_output_path

if TYPE_CHECKING:
    from nmdeploy.graph.inspection import Inspection, WeightRow
    from nmdeploy.graph.model import OnnxModel
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


def add_require_options(parser: argparse.ArgumentParser, *, checked: str) -> None:
    """``--require`` and ``--allow-dense``: fail (exit 1) when a TensorRT-eligible weight of ``checked`` (the model
    inspected, or the one just written) is not N:M, unless it is dense on purpose."""
    parser.add_argument(
        "--require",
        action="store_true",
        help=f"exit with code 1 when a TensorRT-eligible weight of {checked} is not N:M, unless it is dense on "
        "purpose: recorded so by 'nmdeploy export' / nmdeploy.train.export_onnx, or matched by --allow-dense (for CI "
        "pipelines)",
    )
    parser.add_argument(
        "--allow-dense",
        action="append",
        default=[],
        metavar="REGEX",
        help="weights whose ONNX name, consumer node name or recorded torch layer name matches REGEX may stay dense "
        "(repeatable)",
    )


def left_dense(
    model: OnnxModel, args: argparse.Namespace, skipped: Mapping[str, str], undone: str
) -> tuple[Inspection, dict[str, str]]:
    """The check ``--require`` makes on the model a verb wrote: its inspection (with ``--allow-dense`` applied) and,
    for every TensorRT-eligible weight left dense, why: the verb's ``skipped`` reason, not matching
    ``--include``/``--exclude``, or else ``undone`` (e.g. "not converted")."""
    from nmdeploy.graph.inspection import allow_dense, inspect_model

    inspection = allow_dense(inspect_model(model, args.pattern), model, args.allow_dense)
    filters = [flag for flag, value in (("--include", args.include), ("--exclude", args.exclude)) if value]
    unselected = "not selected by " + " / ".join(filters) if filters else undone
    return inspection, {row.weight: skipped.get(row.weight) or unselected for row in inspection.failing}


def left_dense_clauses(inspection: Inspection, reasons: Mapping[str, str], *, shown: int = 3) -> list[str]:
    """What a verb's summary line says of the TensorRT-eligible weights its result left dense, named by their
    consumer node: those that fail ``--require`` with their reason (e.g. ``"2 TensorRT-eligible weights left dense:
    /conv_3 (why), ..."``), then those dense on purpose."""

    def clause(rows: Sequence[WeightRow], what: str, why: Callable[[WeightRow], str]) -> list[str]:
        if not rows:
            return []
        named = [f"{row.node_label} ({why(row)})" for row in rows[:shown]]
        more = f", and {len(rows) - shown} more" if len(rows) > shown else ""
        return [f"{len(rows)} {what}: {', '.join(named)}{more}"]

    eligible = "TensorRT-eligible weight" + ("" if len(inspection.failing) == 1 else "s")
    failing = clause(inspection.failing, f"{eligible} left dense", lambda row: reasons[row.weight])
    return failing + clause(inspection.allowed_dense, "dense on purpose", lambda row: row.dense_on_purpose or "")


def left_dense_json(inspection: Inspection, reasons: Mapping[str, str]) -> list[dict[str, str | bool]]:
    """The same for ``--json``: every eligible weight left dense, its node, why, and whether it is allowed."""
    return [
        {"weight": row.weight, "node": row.node_label, "reason": reasons[row.weight], "allowed": False}
        for row in inspection.failing
    ] + [
        {"weight": row.weight, "node": row.node_label, "reason": row.dense_on_purpose or "", "allowed": True}
        for row in inspection.allowed_dense
    ]


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


def add_device_option(parser) -> None:
    """``--device``: where conversion's statistics, fit and recovery run (checked by the library, one line)."""
    parser.add_argument(
        "--device",
        default="cpu",
        metavar="{cpu,cuda,cuda:N,auto}",
        help="where conversion runs: statistics through the torch interpreter, the fit and recovery on that device "
        "(recovery's training passes in bfloat16 or float16 autocast on a GPU); auto picks cuda when torch sees a "
        "GPU (default: cpu, statistics in ONNX Runtime)",
    )
