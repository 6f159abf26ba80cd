"""Prune weights to N:M along the reduction axis found by the graph layer (transposable where asked or needed)."""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from nmdeploy.errors import InputError, PatternError
from nmdeploy.graph.dtypes import ARITHMETIC_FLOAT_NAMES
from nmdeploy.graph.eligibility import tensorrt_verdict
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.prunable import PrunableWeight
from nmdeploy.graph.tensors import dequantized_magnitude, keep_only_, nonzero_positions, transposable_axes, zero_points
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.masks.arrays import Compliance, nm_compliance, nm_keep, transposable_compliance
from nmdeploy.masks.pattern import Pattern, PatternLike
from nmdeploy.passes.base import Pass, PassResult, PostconditionError, ReportRow, optional

_INTEGER_DTYPES = {"int8", "uint8", "int16", "uint16", "int32"}


def select_weights(
    weights: tuple[PrunableWeight, ...], include: str | None, exclude: str | None
) -> list[PrunableWeight]:
    """Weights whose name or a consumer node's name matches ``include`` and none matches ``exclude``."""
    return [w for w in weights if selected_by_names([w.name, *(use.node for use in w.uses)], include, exclude)]


def selected_by_names(names: list[str], include: str | None, exclude: str | None) -> bool:
    """Whether a weight known by ``names`` (its own, its consumer nodes') is selected: one matches ``include`` and
    none matches ``exclude`` (regular expressions; None matches everything). Every pass selects weights by it."""
    try:
        included = re.compile(include) if include else None
        excluded = re.compile(exclude) if exclude else None
    except re.error as error:
        raise InputError(f"invalid --include/--exclude expression: {error}") from error
    if included is not None and not any(included.search(n) for n in names):
        return False
    return not (excluded is not None and any(excluded.search(n) for n in names))


@dataclass
class PrunedWeight(ReportRow):
    """What prune did to one weight: skipped (and why), or the mask's method and the share of |w| it kept."""

    weight: str
    shape: list[int]
    axis: int | None
    node: str | None = optional()  # the consumer node's name (PrunableWeight.node_label), as tables show it
    skipped: str | None = optional()
    method: str | None = optional()
    retained: float | None = optional()  # the fraction of |w| the mask kept
    changed: bool | None = optional()  # False when the weight already followed the pattern
    uncalibrated: str | None = optional()  # why convert cannot calibrate it (PrunableWeight.uncalibrated)


class PrunePass(Pass):
    """Magnitude N:M pruning of every selected weight along its reduction axis.

    Weights shared by consumers with different reduction axes get a transposable mask (exact solver), as do all
    weights with ``transposable=True``. An lm_head (tied to the token embedding or not) stays dense unless
    ``sparse_lm_head`` (``PrunableWeight.dense_by_default``). Weights whose axis length M does not divide are skipped
    and reported. ``workers`` weights are pruned at a time, in threads. The values stay numpy arrays throughout; only
    the transposable solver runs in torch, so a model without such weights is pruned without importing it.
    """

    name = "prune"
    in_place = True

    def __init__(
        self,
        *,
        pattern: PatternLike = "2:4",
        transposable: bool = False,
        include: str | None = None,
        exclude: str | None = None,
        eligible_only: bool = False,
        method: str = "exact",
        workers: int = 2,
        sparse_lm_head: bool = False,
    ):
        self.pattern = Pattern.parse(pattern)
        self.sparse_lm_head = sparse_lm_head
        self.transposable = transposable
        self.include, self.exclude = include, exclude
        self.eligible_only = eligible_only
        if method not in ("exact", "greedy"):
            raise PatternError(f"unknown transposable method {method!r}; choose exact or greedy")
        self.method = method
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise InputError(f"workers must be a whole number of at least 1, got {workers!r}")
        self.workers = workers

    def call(self, model: OnnxModel) -> PassResult:
        report = find_prunable_weights(model.proto, model.index)
        selected = select_weights(report.weights, self.include, self.exclude)
        if not selected:
            raise InputError(
                "nothing to prune: no weight of a Conv, Gemm, MatMul or recurrent layer matched"
                + (" the --include/--exclude filters" if self.include or self.exclude else "")
            )

        # Weights are independent and the array work releases the GIL, so ``workers`` weights are pruned at a time
        # (two keep a small machine's cores busy). Results come back in order: the report and the first error are
        # the same as one at a time.
        def prune_one(weight: PrunableWeight) -> PrunedWeight:
            return self._prune_one(model, weight)

        if self.workers > 1 and len(selected) > 1:
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                rows = list(pool.map(prune_one, selected))
        else:
            rows = [prune_one(weight) for weight in selected]
        if all(row.skipped for row in rows):
            reasons = sorted({row.skipped for row in rows})
            raise InputError(
                f"nothing to prune: all {len(rows)} weights were skipped ({'; '.join(reasons)[:300]}); "
                f"try another --pattern or check the model"
            )
        return PassResult(model, any(row.changed for row in rows), rows)

    def _prune_one(self, model: OnnxModel, weight: PrunableWeight) -> PrunedWeight:
        """Prune one weight in the model; its report row."""
        row = PrunedWeight(
            weight.name, list(weight.shape), weight.axis, node=weight.node_label, uncalibrated=weight.uncalibrated
        )
        reason = self._skip_reason(weight)
        if reason:
            row.skipped = reason
            return row
        values = model.read(weight.tensor)
        transposable = self.transposable or weight.needs_transposable
        scores = dequantized_magnitude(model.read, weight, values)
        total = float(scores.sum())
        # A finite sum proves every score finite; only a sum that is not (NaN, infinity, or an overflow of huge
        # finite values) needs a second look. max() propagates NaN, so it finds NaN and infinity alike.
        if not math.isfinite(total) and not bool(scores.max() < math.inf):
            raise InputError(f"weight '{weight.name}' contains NaN or infinite values; fix the model first")
        mask = self._mask(weight, scores, transposable)
        # Scores are finite and non-negative, so the pruned ones sum to more than 0 exactly when one is non-zero.
        # The scores are our own copy and not needed any more: zero the kept ones in place.
        dropped = float(keep_only_(scores, ~mask).sum())
        changed = dropped > 0
        if changed:
            zero = zero_points(model.read, weight)
            if zero is None:
                # model.read hands out the model's buffers read-only: those are copied, our own arrays changed in
                # place.
                pruned = keep_only_(values if values.flags.writeable else values.copy(), mask)
            else:
                # An integer weight behind DequantizeLinear is pruned to its zero point, which dequantizes to 0.
                pruned = np.where(mask, values, zero.astype(values.dtype))
            # The model takes over the array (no copy): nothing here touches it again.
            model.write(weight.tensor, pruned, copy=False)
        row.method = "transposable " + self.method if transposable else "1-D"
        row.retained = 1.0 - dropped / total if total else 1.0
        row.changed = changed
        return row

    def _skip_reason(self, weight: PrunableWeight) -> str | None:
        if weight.kept_dense:
            return weight.kept_dense
        if weight.dense_by_default and not self.sparse_lm_head:
            return f"{weight.dense_by_default} (--sparse-lm-head prunes it too)"
        if weight.dtype not in ARITHMETIC_FLOAT_NAMES and not (
            weight.dtype in _INTEGER_DTYPES and weight.dequantization
        ):
            return f"{weight.dtype} weight that is not read by a DequantizeLinear with constant scale and zero point"
        if self.eligible_only:
            verdict = tensorrt_verdict(weight, self.pattern)
            if not verdict.eligible:
                return "not TensorRT-eligible: " + "; ".join(verdict.reasons)
        if len(weight.axes) > 2:
            return f"used with {len(weight.axes)} different reduction axes; no mask can serve them all"
        axes = transposable_axes(weight) if self.transposable or weight.needs_transposable else (weight.axis,)
        for axis in axes:
            if weight.shape[axis] % self.pattern.m:
                return f"axis {axis} has length {weight.shape[axis]}, not a multiple of {self.pattern.m}"
        return None

    def _mask(self, weight: PrunableWeight, scores: np.ndarray, transposable: bool) -> np.ndarray:
        if not transposable:
            return nm_keep(scores, self.pattern, weight.axis)
        # The exact and greedy tile solvers are torch code: the one place pruning needs torch.
        import torch

        from nmdeploy.masks.transposable import transposable_mask

        axis, out_axis = transposable_axes(weight)
        scores_tensor = torch.from_numpy(scores)
        mask = transposable_mask(
            scores_tensor, self.pattern, axis=axis, out_axis=out_axis, method=self.method, score=scores_tensor
        )
        return np.ascontiguousarray(mask.numpy())

    def _compliant(
        self, model: OnnxModel, weight: PrunableWeight, values: np.ndarray, transposable: bool
    ) -> Compliance:
        """How much of ``values`` (the weight as stored) follows the pattern the pass promises for it."""
        nonzero = nonzero_positions(model.read, weight, values)
        if transposable:
            axis, out_axis = transposable_axes(weight)
            return transposable_compliance(nonzero, self.pattern, axis=axis, out_axis=out_axis)
        return nm_compliance(nonzero, self.pattern, weight.axis)

    def ensures(self, result: PassResult) -> None:
        """Every weight the report says was pruned follows the pattern as the model now stores it."""
        model = result.model
        weights = {weight.name: weight for weight in find_prunable_weights(model.proto, model.index).weights}
        for row in result.report:
            if not isinstance(row, PrunedWeight) or row.skipped:
                continue
            weight = weights.get(row.weight)
            if weight is None:
                raise PostconditionError(f"prune reported '{row.weight}', which the model no longer has as a weight")
            transposable = (row.method or "").startswith("transposable")
            compliance = self._compliant(model, weight, model.read(weight.tensor), transposable)
            if not compliance:
                raise PostconditionError(
                    f"prune left '{row.weight}' not {self.pattern} ({compliance.fraction:.3f} compliant)"
                )


def prune(model: OnnxModel, **options: Any) -> PassResult:
    """Python API mirror of ``nmdeploy prune``: run :class:`PrunePass` with ``options`` on ``model``."""
    return PrunePass(**options)(model)
