"""Prune weights to N:M along the reduction axis found by the graph layer (transposable where asked or needed)."""

from __future__ import annotations

import re
from typing import Any

import torch

from nmdeploy.errors import InputError, PatternError
from nmdeploy.graph.eligibility import tensorrt_verdict
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.tensors import (
    dequantized_magnitude,
    nonzero_positions,
    to_numpy,
    to_torch,
    transposable_axes,
    zero_points,
)
from nmdeploy.graph.weights import PrunableWeight, find_prunable_weights
from nmdeploy.masks import Pattern, is_nm, is_transposable, nm_mask, transposable_mask
from nmdeploy.masks.pattern import PatternLike
from nmdeploy.passes.base import Pass, PassResult

_FLOAT_DTYPES = {"float", "float16", "bfloat16", "double"}
_INTEGER_DTYPES = {"int8", "uint8", "int16", "uint16", "int32"}


def select_weights_by_name(names: list[str], include: str | None, exclude: str | None) -> list[str]:
    """Names that match ``include`` and do not match ``exclude`` (regular expressions; None matches everything)."""
    return [name for name in names if _matches([name], include, exclude)]


def select_weights(
    weights: tuple[PrunableWeight, ...], include: str | None, exclude: str | None
) -> list[PrunableWeight]:
    """Weights whose name or a consumer node's name matches ``include`` and none matches ``exclude``."""
    return [w for w in weights if _matches([w.name, *(use.node for use in w.uses)], include, exclude)]


def _matches(names: list[str], include: str | None, exclude: str | None) -> bool:
    try:
        included = re.compile(include) if include else None
        excluded = re.compile(exclude) if exclude else None
    except re.error as error:
        raise InputError(f"invalid --include/--exclude expression: {error}") from error
    if included is not None and not any(included.search(n) for n in names):
        return False
    return not (excluded is not None and any(excluded.search(n) for n in names))


class PrunePass(Pass):
    """Magnitude N:M pruning of every selected weight along its reduction axis.

    Weights shared by consumers with different reduction axes get a transposable mask (exact solver), as do all
    weights with ``transposable=True``. Weights whose axis length M does not divide are skipped and reported.
    """

    name = "prune"

    def __init__(
        self,
        *,
        pattern: PatternLike = "2:4",
        transposable: bool = False,
        include: str | None = None,
        exclude: str | None = None,
        eligible_only: bool = False,
        method: str = "exact",
    ):
        self.pattern = Pattern.parse(pattern)
        self.transposable = transposable
        self.include, self.exclude = include, exclude
        self.eligible_only = eligible_only
        if method not in ("exact", "greedy"):
            raise PatternError(f"unknown transposable method {method!r}; choose exact or greedy")
        self.method = method
        self._pruned: list[tuple[PrunableWeight, bool]] = []

    def call(self, model: OnnxModel) -> PassResult:
        report = find_prunable_weights(model.proto)
        selected = select_weights(report.weights, self.include, self.exclude)
        if not selected:
            raise InputError(
                "nothing to prune: no weight of a Conv, Gemm or MatMul matched"
                + (" the --include/--exclude filters" if self.include or self.exclude else "")
            )
        modified = False
        rows: list[dict[str, Any]] = []
        self._pruned = []
        for weight in selected:
            row: dict[str, Any] = {"weight": weight.name, "shape": list(weight.shape), "axis": weight.axis}
            rows.append(row)
            reason = self._skip_reason(weight)
            if reason:
                row["skipped"] = reason
                continue
            values = model.read(weight.tensor)
            dense = to_torch(values)
            transposable = self.transposable or weight.needs_transposable
            scores = dequantized_magnitude(model.read, weight, dense)
            if not bool(torch.isfinite(scores).all()):
                raise InputError(f"weight '{weight.name}' contains NaN or infinite values; fix the model first")
            mask = self._mask(weight, scores, transposable)
            # Multiplying by the mask is several times faster than masked_fill; scores are finite, so it is exact.
            dropped = scores * ~mask
            changed = bool(dropped.any())
            if changed:
                zero = zero_points(model.read, weight)
                # An integer weight behind DequantizeLinear is pruned to its zero point, which dequantizes to 0.
                # Adding +0.0 turns the -0.0 of negative pruned floats into +0.0.
                pruned = dense * mask + 0.0 if zero is None else torch.where(mask, dense, zero.to(dense.dtype))
                model.write(weight.tensor, to_numpy(pruned.to(dense.dtype), values))
            modified |= changed
            self._pruned.append((weight, transposable))
            total = float(scores.sum())
            row.update(
                method="transposable " + self.method if transposable else "1-D",
                retained=1.0 - float(dropped.sum()) / total if total else 1.0,
                changed=changed,
            )
        return PassResult(model, modified, rows)

    def _skip_reason(self, weight: PrunableWeight) -> str | None:
        if weight.dtype not in _FLOAT_DTYPES and not (weight.dtype in _INTEGER_DTYPES and weight.dequantization):
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

    def _mask(self, weight: PrunableWeight, scores: torch.Tensor, transposable: bool) -> torch.Tensor:
        if not transposable:
            return nm_mask(scores, self.pattern, weight.axis, score=scores)
        axis, out_axis = transposable_axes(weight)
        return transposable_mask(scores, self.pattern, axis=axis, out_axis=out_axis, method=self.method, score=scores)

    def ensures(self, result: PassResult) -> None:
        for weight, transposable in self._pruned:
            values = nonzero_positions(result.model.read, weight, to_torch(result.model.read(weight.tensor)))
            if transposable:
                axis, out_axis = transposable_axes(weight)
                ok = is_transposable(values, self.pattern, axis=axis, out_axis=out_axis)
            else:
                ok = is_nm(values, self.pattern, weight.axis)
            if not ok:
                raise AssertionError(f"prune left '{weight.name}' not {self.pattern} ({ok.fraction:.3f} compliant)")


def prune(model: OnnxModel, **options: Any) -> PassResult:
    """Python API mirror of ``nmdeploy prune``: run :class:`PrunePass` with ``options`` on ``model``."""
    return PrunePass(**options)(model)
