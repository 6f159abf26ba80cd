"""Check that every selected weight follows the pattern along its reduction axis; changes nothing."""

from __future__ import annotations

from dataclasses import dataclass

from nmdeploy.errors import ComplianceError
from nmdeploy.graph.inspection import inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.masks import Pattern
from nmdeploy.masks.pattern import PatternLike
from nmdeploy.passes.base import Pass, PassResult, ReportRow
from nmdeploy.passes.prune import select_weights_by_name


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
        chosen = set(select_weights_by_name([r.weight for r in inspection.rows], self.include, self.exclude))
        rows: list[VerifiedWeight] = []
        failing = []
        for row in inspection.rows:
            if row.weight not in chosen or (self.eligible_only and not row.required):
                continue
            compliant = row.transposable if self.transposable else row.compliant
            rows.append(VerifiedWeight(row.weight, row.axis, compliant))
            if compliant != 1.0 and row.dense_on_purpose is None:  # a tied embedding is dense by the graph's rule
                failing.append(row.weight)
        unverified = [
            item
            for item in inspection.failing_untraced
            if select_weights_by_name([item.value], self.include, self.exclude)
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
        return PassResult(model, False, rows)
