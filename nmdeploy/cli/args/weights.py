"""Which weights a verb touches and how: ``--pattern`` (and ``--transposable``), the weight filters, and the
``--require`` / ``--allow-dense`` check on the model a verb inspected or wrote."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from nmdeploy.cli.args.base import ArgGroup, Parser
from nmdeploy.errors import PatternError

if TYPE_CHECKING:
    from nmdeploy.graph.inspection import Inspection, WeightRow
    from nmdeploy.graph.model import OnnxModel
    from nmdeploy.masks import Pattern


def pattern_type(text: str) -> Pattern:
    # nmdeploy.masks.pattern needs no torch: prune and inspect run on numpy alone.
    from nmdeploy.masks.pattern import Pattern

    try:
        return Pattern.parse(text)
    except PatternError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


class PatternArgs(ArgGroup):
    """``--pattern N:M`` and, where ``transposable`` is asked, ``--transposable`` (``every_weight``: the verb makes
    only shared weights transposable unless asked). ``fixed``: the verb's one pattern (the pipeline's 2:4, which its
    file names and baselines name), so it declares ``--transposable`` alone."""

    def __init__(self, *, transposable: bool = False, every_weight: bool = False, fixed: str | None = None) -> None:
        self.transposable, self.every_weight, self.fixed = transposable, every_weight, fixed

    def add_flags(self, parser: Parser) -> None:
        if self.fixed is None:
            parser.add_argument(
                "--pattern",
                type=pattern_type,
                default="2:4",
                metavar="N:M",
                help="keep N of every M consecutive weights along the reduction axis (default: 2:4)",
            )
        if self.transposable:
            help = (
                "transposable masks (exact solver) for every weight, not only shared ones"
                if self.every_weight
                else "transposable N:M masks (exact solver), so the transposed weight is N:M too"
            )
            parser.add_argument("--transposable", action="store_true", help=help)

    def parse(self, args: argparse.Namespace) -> Masks:
        pattern = pattern_type(self.fixed) if self.fixed is not None else args.pattern
        return Masks(pattern, getattr(args, "transposable", False))


@dataclass(frozen=True)
class Masks:
    pattern: Pattern
    transposable: bool = False

    def as_options(self) -> dict[str, Any]:
        """The keyword arguments ``prune`` and ``ConvertOptions`` take."""
        return {"pattern": self.pattern, "transposable": self.transposable}


@dataclass(frozen=True)
class Selection:
    include: str | None = None
    exclude: str | None = None
    eligible_only: bool = False
    sparse_lm_head: bool = False

    def as_options(self) -> dict[str, Any]:
        """The keyword arguments ``prune``, ``ConvertOptions`` and the pipeline take."""
        return asdict(self)


class SelectionArgs(ArgGroup):
    """``--include`` / ``--exclude`` REGEX on weight or consumer node names, and ``--eligible-only``; with
    ``names_only`` (weight files without a graph), ``--include`` on weight names alone; with ``tied``,
    ``--sparse-lm-head`` (the verbs that make weights N:M)."""

    def __init__(self, *, names_only: bool = False, tied: bool = False) -> None:
        self.names_only, self.tied = names_only, tied

    def add_flags(self, parser: Parser) -> None:
        if self.names_only:
            parser.add_argument(
                "--include", metavar="REGEX", help="only weights whose name matches this regular expression"
            )
            return
        parser.add_argument("--include", metavar="REGEX", help="only weights whose name or consumer node name matches")
        parser.add_argument("--exclude", metavar="REGEX", help="skip weights whose name or consumer node name matches")
        parser.add_argument("--eligible-only", action="store_true", help="only weights TensorRT can run sparse")
        if self.tied:
            parser.add_argument(
                "--sparse-lm-head",
                "--sparse-tied-embedding",
                dest="sparse_lm_head",
                action="store_true",
                help="make the lm_head N:M too (tied to the token embedding or not); it is left dense by default: a "
                "tied one's table is also the token embedding, which its mask would make N:M with no fit to "
                "compensate, and an untied one's error reaches the logits with no layer after it",
            )

    def parse(self, args: argparse.Namespace) -> Selection:
        return Selection(
            args.include,
            getattr(args, "exclude", None),
            getattr(args, "eligible_only", False),
            getattr(args, "sparse_lm_head", False),
        )


NOT_COMPLIANT = 1  # the exit code of a verb whose --require fails


class RequireArgs(ArgGroup):
    """``--require`` and ``--allow-dense``: fail (exit 1) when a TensorRT-eligible weight of ``checked`` (the model
    inspected, or the one just written) is not N:M, unless it is dense on purpose; under another pattern than 2:4,
    when a weight TensorRT could run sparse as 2:4 does not follow that pattern."""

    def __init__(self, checked: str) -> None:
        self.checked = checked

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument(
            "--require",
            action="store_true",
            help=f"exit with code 1 when a TensorRT-eligible weight of {self.checked} is not N:M (under a pattern "
            "other than 2:4: a weight TensorRT could run sparse as 2:4), unless it is dense on purpose: recorded so by "
            "'nmdeploy export' / nmdeploy.train.export_onnx, or matched by --allow-dense (for CI pipelines)",
        )
        parser.add_argument(
            "--allow-dense",
            action="append",
            default=[],
            metavar="REGEX",
            help="weights whose ONNX name, consumer node name or recorded torch layer name matches REGEX may stay "
            "dense (repeatable)",
        )

    def parse(self, args: argparse.Namespace) -> Requirement:
        """Whether to fail, and the ``--allow-dense`` patterns, each checked to compile."""
        from nmdeploy.graph.inspection import allow_dense_patterns

        allow_dense_patterns(args.allow_dense)
        return Requirement(args.require, args.allow_dense)


@dataclass(frozen=True)
class Requirement:
    required: bool  # --require: exit 1 when a weight it holds to the pattern is left dense
    allow_dense: list[str]


@dataclass(frozen=True)
class LeftDense:
    """The check ``--require`` makes on the model a verb wrote: its inspection (``--allow-dense`` applied), why each
    TensorRT-eligible weight was left dense, and whether that fails the verb."""

    inspection: Inspection
    reasons: dict[str, str]
    required: bool

    @property
    def failed(self) -> bool:
        return self.required and self.inspection.required_failed

    @property
    def exit_code(self) -> int:
        """NOT_COMPLIANT when ``--require`` fails, else 0."""
        return NOT_COMPLIANT if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        """``left_dense`` and ``passed`` (None: nothing was judged) for a verb's ``--json`` document."""
        passed = (not self.failed) if self.required else None
        return {"left_dense": left_dense_json(self.inspection, self.reasons), "passed": passed}

    def final_line(self, outcome: str, path: object) -> str:
        """The verb's ``PASSED | ...`` / ``FAILED | ...`` line: ``outcome`` and what was left dense; under a pattern
        other than 2:4, a PASSED ``--require`` also says which weights it held to the pattern (a FAILED one names
        them as left dense)."""
        held = self.required and not self.failed and self.inspection.requirement
        requirement = [self.inspection.requirement] if held else []
        said = "; ".join([outcome, *left_dense_clauses(self.inspection, self.reasons), *requirement])
        return f"FAILED | {said} (--require) -> {path}" if self.failed else f"PASSED | {said} -> {path}"


def left_dense(model: OnnxModel, args: argparse.Namespace, skipped: Mapping[str, str], undone: str) -> LeftDense:
    """What a verb that wrote ``model`` left dense: for every weight ``--require`` holds to the pattern
    (``WeightRow.required``), the verb's ``skipped`` reason, not matching ``--include``/``--exclude``, or else
    ``undone`` (e.g. "not converted")."""
    from nmdeploy.graph.inspection import allow_dense, inspect_model

    inspection = allow_dense(inspect_model(model, args.pattern), model, args.allow_dense)
    filters = [flag for flag, value in (("--include", args.include), ("--exclude", args.exclude)) if value]
    unselected = "not selected by " + " / ".join(filters) if filters else undone
    reasons = {row.weight: skipped.get(row.weight) or unselected for row in inspection.failing}
    return LeftDense(inspection, reasons, args.require)


def left_dense_clauses(inspection: Inspection, reasons: Mapping[str, str], *, shown: int = 3) -> list[str]:
    """What a verb's summary line says of the weights ``--require`` holds to the pattern (TensorRT-eligible ones;
    under another pattern than 2:4, those TensorRT could run sparse as 2:4) that its result left dense, named by
    their consumer node: those that fail ``--require`` with their reason (e.g. ``"2 TensorRT-eligible weights left
    dense: /conv_3 (why), ..."``), then those dense on purpose."""

    def clause(rows: Sequence[WeightRow], what: str, why: Callable[[WeightRow], str]) -> list[str]:
        if not rows:
            return []
        named = [f"{row.node_label} ({why(row)})" for row in rows[:shown]]
        more = f", and {len(rows) - shown} more" if len(rows) > shown else ""
        return [f"{what}: {', '.join(named)}{more}"]

    failing_count, allowed_count = len(inspection.failing), len(inspection.allowed_dense)
    failing = clause(
        inspection.failing, f"{inspection.required_weights(failing_count)} left dense", lambda row: reasons[row.weight]
    )
    allowed = clause(
        inspection.allowed_dense, f"{allowed_count} dense on purpose", lambda row: row.dense_on_purpose or ""
    )
    return failing + untraced_clauses(inspection, shown=shown) + allowed


def untraced_clauses(inspection: Inspection, *, shown: int = 3) -> list[str]:
    """What a verb's summary line says of the weights TensorRT could run sparse that were not traced, so that
    nothing checked them (``Inspection.failing_untraced``): named by their node, each with why it was not traced
    and what to do (e.g. ``"1 GEMM weight not traced, so not verified 2:4: MatMul(w2) (computed from constants by
    Mul 'w2'; fold constants first (...))"``)."""
    items = inspection.failing_untraced
    if not items:
        return []
    named = [f"{item.node} ({item.reason})" for item in items[:shown]]
    more = f", and {len(items) - shown} more" if len(items) > shown else ""
    weights = "GEMM weight" + ("" if len(items) == 1 else "s")
    return [f"{len(items)} {weights} not traced, so not verified {inspection.pattern}: {', '.join(named)}{more}"]


def left_dense_json(inspection: Inspection, reasons: Mapping[str, str]) -> list[dict[str, str | bool]]:
    """The same for ``--json``: every required weight left dense, its node, why, and whether it is allowed."""
    return (
        [
            {"weight": row.weight, "node": row.node_label, "reason": reasons[row.weight], "allowed": False}
            for row in inspection.failing
        ]
        + [
            {"weight": item.value, "node": item.node, "reason": item.reason, "allowed": False}
            for item in inspection.failing_untraced
        ]
        + [
            {"weight": row.weight, "node": row.node_label, "reason": row.dense_on_purpose or "", "allowed": True}
            for row in inspection.allowed_dense
        ]
    )
