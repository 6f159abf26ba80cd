"""Check that every selected weight follows the pattern along its reduction axis; changes nothing."""

from __future__ import annotations

from dataclasses import dataclass

from nmdeploy.errors import ComplianceError, InputError
from nmdeploy.graph.inspection import Inspection, WeightRow, inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.masks import Pattern
from nmdeploy.masks.pattern import PatternLike
from nmdeploy.passes.base import Pass, PassResult, ReportRow
from nmdeploy.passes.prune import selected_by_names


@dataclass
class VerifiedWeight(ReportRow):
    weight: str
    axis: int | None
    compliant: float  # the fraction of groups that follow the pattern (1.0: all)


class VerifyPass(Pass):
    """Raise :class:`ComplianceError` when a selected weight is not N:M (or transposable N:M) along its axis, or is a
    GEMM weight TensorRT could run sparse that cannot be traced to its stored tensor (an op the tracer does not
    follow stands between: TensorRT folds it into one dense constant that nothing checked).

    ``eligible_only`` restricts the check to the weights ``--require`` holds to the pattern: those TensorRT could run
    sparse (as 2:4, its one sparse pattern, so that under 4:8 the check is not empty; see ``WeightRow.required``).
    A step that selects no weight (``include``/``exclude`` matching none, or none eligible) is an :class:`InputError`:
    it would pass whatever the model holds.
    """

    name = "verify"
    in_place = True

    def __init__(
        self,
        *,
        pattern: PatternLike = "2:4",
        transposable: bool = False,
        eligible_only: bool = False,
        include: str | None = None,
        exclude: str | None = None,
    ):
        self.pattern = Pattern.parse(pattern)
        self.transposable = transposable
        self.eligible_only = eligible_only
        self.include, self.exclude = include, exclude

    def call(self, model: OnnxModel) -> PassResult:
        inspection = inspect_model(model, self.pattern)
        rows: list[VerifiedWeight] = []
        failing = []
        for row in inspection.rows:
            if not self._selects(row) or (self.eligible_only and not row.required):
                continue
            compliant = row.transposable if self.transposable else row.compliant
            rows.append(VerifiedWeight(row.weight, row.axis, compliant))
            if compliant != 1.0 and row.dense_on_purpose is None:  # a tied embedding is dense by the graph's rule
                failing.append(row.weight)
        unverified = [
            item
            for item in inspection.failing_untraced
            if selected_by_names([item.value, item.node], self.include, self.exclude)
        ]
        kind = f"transposable {self.pattern}" if self.transposable else str(self.pattern)
        problems = []
        if failing:
            problems.append(
                f"{len(failing)} weights are not {kind} along their reduction axis: "
                f"{', '.join(failing[:5])}{' ...' if len(failing) > 5 else ''}"
            )
        if unverified:
            first = unverified[0]
            problems.append(
                f"{len(unverified)} GEMM weight{'s' if len(unverified) > 1 else ''} not traced, so not verified "
                f"{kind}: {first.node} ({first.reason}){' ...' if len(unverified) > 1 else ''}"
            )
        if problems:
            raise ComplianceError("; ".join(problems))
        if not rows:  # a check of no weight would pass whatever the model holds: nothing to do is not a PASSED
            raise InputError(self._nothing_selected(inspection))
        return PassResult(model, False, rows)

    def _selects(self, row: WeightRow) -> bool:
        """Whether the step's include/exclude select ``row``, by its name or a consumer node's, as prune selects."""
        return selected_by_names([row.weight, *row.nodes], self.include, self.exclude)

    def _nothing_selected(self, inspection: Inspection) -> str:
        """Why the step checked no weight, and what to change."""
        names = [row.weight for row in inspection.rows] + [item.value for item in inspection.unverified]
        if not names:
            return "nothing to verify: the model has no weight of a Conv, Gemm, MatMul or recurrent layer"
        weights = f"{len(names)} weight{'s' if len(names) > 1 else ''} ({', '.join(names[:5])}"
        weights += ", ...)" if len(names) > 5 else ")"
        selected = [row.weight for row in inspection.rows if self._selects(row)] + [
            item.value
            for item in inspection.unverified
            if selected_by_names([item.value, item.node], self.include, self.exclude)
        ]
        if not selected:
            filters = [
                f"{key} {value!r}" for key, value in (("include", self.include), ("exclude", self.exclude)) if value
            ]
            return (
                f"nothing to verify: the verify step's {' and '.join(filters)} leave{'s' if len(filters) == 1 else ''} "
                f"none of the model's {weights}; change its include/exclude"
            )
        if self.eligible_only:
            return (
                f"nothing to verify: eligible_only keeps the weights TensorRT could run sparse, and none of the "
                f"{len(selected)} selected of the model's {weights} is one; drop eligible_only to check them"
            )
        return f"nothing to verify: the {len(selected)} selected of the model's {weights} are dense on purpose"
