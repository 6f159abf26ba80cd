"""Permute input channels so that N:M pruning keeps more of each weight, without changing the model's function.

For every region the graph layer proves permutable (producers -> per-channel ops -> consumers), the consumers'
scores (|w|, times a per-channel input scale when given) choose a permutation of the channels with
:func:`nmdeploy.masks.search_permutation`; the consumers' reduction axis, the producers' output axis and every
per-channel constant in between are then permuted the same way. Nothing is pruned here: run prune or convert next.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from nmdeploy.errors import InputError, ShapeError
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.permutation import Blocked, PermutationPlan, plan_permutations
from nmdeploy.graph.prunable import PrunableWeight
from nmdeploy.graph.tensors import to_torch
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.masks.pattern import Pattern, PatternLike
from nmdeploy.passes.base import Pass, PassResult, PostconditionError, ReportRow, optional
from nmdeploy.passes.prune import select_weights

if TYPE_CHECKING:
    import torch


@dataclass
class PermutedWeight(ReportRow):
    """One weight of a permutation region: whether its input channels were reordered and the N:M score the best
    mask keeps before and after (fractions of the total), or why its region was skipped."""

    weight: str
    permuted: bool
    skipped: str | None = optional()
    channels: int | None = optional()
    producers: list[str] | None = optional()  # the nodes whose output rows were reordered with it
    retained_before: float | None = optional()
    retained_after: float | None = optional()
    converged: bool | None = optional()
    step: str | None = optional()  # "permute" when convert --permute ran it: printed first

    def to_json(self) -> dict[str, Any]:
        document = super().to_json()
        return {"step": document.pop("step"), **document} if self.step else document


@dataclass
class PermutationOutcome:
    """What :func:`permute_channels` did: the permutation of each permuted weight's reduction axis, and a report.

    ``permutations[name][j]`` is the old index of new channel j. Statistics of a permuted weight's input must follow
    it: a second-moment matrix H becomes ``H[p][:, p]``, a per-channel vector ``v[p]``.
    """

    modified: bool
    permutations: dict[str, torch.Tensor] = field(default_factory=dict)
    rows: list[PermutedWeight] = field(default_factory=list)


def permute_channels(
    model: OnnxModel,
    weights: Sequence[PrunableWeight] | None = None,
    column_scale: Mapping[str, torch.Tensor] | None = None,
    *,
    pattern: PatternLike = "2:4",
    max_iterations: int = 200,
    time_limit: float | None = None,
) -> PermutationOutcome:
    """Permute the input channels of ``weights`` (all prunable weights when None) where that is provably safe.

    ``column_scale`` maps a weight name to a non-negative [K] vector multiplying |w| along the reduction axis (for
    example sqrt(diag(X^T X)) from calibration), so the search keeps what matters for the outputs, not just large
    weights. ``time_limit`` is in seconds per region.
    """
    pattern = Pattern.parse(pattern)
    column_scale = dict(column_scale or {})
    outcome = PermutationOutcome(False)
    for plan in plan_permutations(model.proto, weights, model.index):
        if isinstance(plan, Blocked):
            outcome.rows += [PermutedWeight(name, False, skipped=plan.reason) for name in plan.weights]
            continue
        _permute_region(model, plan, column_scale, pattern, max_iterations, time_limit, outcome)
    return outcome


def _permute_region(
    model: OnnxModel,
    plan: PermutationPlan,
    column_scale: dict[str, torch.Tensor],
    pattern: Pattern,
    max_iterations: int,
    time_limit: float | None,
    outcome: PermutationOutcome,
) -> None:
    # The search is torch code, imported here so that importing the passes (for pruning) does not load torch.
    import torch

    from nmdeploy.masks.permutation import is_permutation, retained_nm_score, search_permutation

    names = [weight.name for weight in plan.consumers]
    if plan.channels % pattern.m or plan.channels < 2 * pattern.m:
        reason = f"{plan.channels} channels: fewer than two groups of {pattern.m}, or not a multiple of {pattern.m}"
        outcome.rows += [PermutedWeight(name, False, skipped=reason) for name in names]
        return
    scores = [_column_scores(model, weight, column_scale.get(weight.name)) for weight in plan.consumers]
    search = search_permutation(torch.cat(scores), pattern, max_iterations=max_iterations, time_limit=time_limit)
    permutation = search.permutation
    if search.improved:
        if not is_permutation(permutation, plan.channels):
            raise PostconditionError(f"the permutation search returned an invalid permutation for {names}")
        order = permutation.numpy()
        for edit in plan.edits:
            model.write(edit.tensor, np.take(model.read(edit.tensor), order, axis=edit.axis))
        outcome.modified = True
        outcome.permutations.update({name: permutation for name in names})
    for name, matrix in zip(names, scores, strict=True):
        total = float(matrix.sum(dtype=torch.float64)) or 1.0
        outcome.rows.append(
            PermutedWeight(
                name,
                search.improved,
                channels=plan.channels,
                producers=list(plan.producers),
                retained_before=retained_nm_score(matrix, pattern) / total,
                retained_after=retained_nm_score(matrix, pattern, permutation) / total,
                converged=search.converged,
            )
        )


def _column_scores(model: OnnxModel, weight: PrunableWeight, scale: torch.Tensor | None) -> torch.Tensor:
    """|w| as [rows, K] with the reduction axis last, times the column scale when given."""
    import torch

    values = to_torch(model.read(weight.tensor))
    dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    channels = weight.shape[weight.axis]
    matrix = values.to(dtype).abs().movedim(weight.axis, -1).reshape(-1, channels)
    if not bool(torch.isfinite(matrix).all()):
        raise InputError(f"weight '{weight.name}' contains NaN or infinite values; fix the model first")
    if scale is None:
        return matrix
    scale = torch.as_tensor(scale).to(dtype).reshape(-1)
    if scale.numel() != channels or not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ShapeError(
            f"column scale of '{weight.name}' must be {channels} finite non-negative values, got {scale.numel()}"
        )
    return matrix * scale


class PermutePass(Pass):
    """Function-preserving channel permutation ahead of N:M pruning (see :func:`permute_channels`)."""

    name = "permute"
    in_place = True

    def __init__(
        self,
        *,
        pattern: PatternLike = "2:4",
        include: str | None = None,
        exclude: str | None = None,
        scores: Mapping[str, torch.Tensor] | None = None,
        max_iterations: int = 200,
        time_limit: float | None = None,
    ):
        self.pattern = Pattern.parse(pattern)
        self.include, self.exclude = include, exclude
        self.scores = scores
        if max_iterations < 1:
            raise InputError(f"max_iterations must be at least 1, got {max_iterations}")
        self.max_iterations, self.time_limit = max_iterations, time_limit

    def call(self, model: OnnxModel) -> PassResult:
        selected = select_weights(find_prunable_weights(model.proto, model.index).weights, self.include, self.exclude)
        if not selected:
            raise InputError(
                "nothing to permute: no weight of a Conv, Gemm or MatMul matched"
                + (" the --include/--exclude filters" if self.include or self.exclude else "")
            )
        outcome = permute_channels(
            model,
            selected,
            self.scores,
            pattern=self.pattern,
            max_iterations=self.max_iterations,
            time_limit=self.time_limit,
        )
        return PassResult(model, outcome.modified, outcome.rows)

    def ensures(self, result: PassResult) -> None:
        """Each permuted weight, as the model now stores it, keeps the N:M score the report promises, and no less
        than it kept before."""
        import torch

        from nmdeploy.masks.permutation import retained_nm_score

        model = result.model
        weights = {weight.name: weight for weight in find_prunable_weights(model.proto, model.index).weights}
        for row in result.report:
            if not row.permuted:
                continue
            if row.retained_after < row.retained_before:
                raise PostconditionError(f"permute lowered the retained score of '{row.weight}'")
            # A given column scale is in the old channel order, which the stored weight no longer shows.
            if self.scores is not None and row.weight in self.scores:
                continue
            matrix = _column_scores(model, weights[row.weight], None)
            kept = retained_nm_score(matrix, self.pattern) / (float(matrix.sum(dtype=torch.float64)) or 1.0)
            if kept < row.retained_before - 1e-6 or abs(kept - row.retained_after) > 1e-4:
                raise PostconditionError(
                    f"permute left '{row.weight}' keeping {kept:.6f} of its N:M score; it reported "
                    f"{row.retained_after:.6f}, up from {row.retained_before:.6f}"
                )


def permute(model: OnnxModel, **options: Any) -> PassResult:
    """Python API mirror of the pass: run :class:`PermutePass` with ``options`` on ``model``."""
    return PermutePass(**options)(model)
