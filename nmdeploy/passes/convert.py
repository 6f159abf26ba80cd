"""Calibrated N:M conversion of fully connected weights: mask by activation-aware saliency, then refit.

Every selected weight's GEMM input second moments H = X^T X come from one run of the dense model over the
calibration data (all layers fitted on dense inputs). The mask keeps the N highest |w| * ||x|| of each group along
the reduction axis; the kept weights of each output row are then refitted by exact damped least squares to the
dense layer's outputs. Existing zeros score 0, so an unstructured-sparse weight keeps its zeros wherever the
pattern allows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nmdeploy.calibration import collect_statistics
from nmdeploy.data import batches_for, graph_inputs
from nmdeploy.errors import InputError
from nmdeploy.graph.eligibility import tensorrt_verdict
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.tensors import to_numpy, to_torch
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.masks import Pattern, is_nm, nm_mask, reconstruction_error, refit, saliency, sparsegpt
from nmdeploy.masks.pattern import PatternLike
from nmdeploy.passes.base import Pass, PassResult
from nmdeploy.passes.prune import select_weights

METHODS = ("magnitude", "saliency", "refit", "sparsegpt")
_FLOAT_DTYPES = {"float", "float16", "bfloat16", "double"}


class ConvertPass(Pass):
    """Convert selected fully connected weights to N:M with calibration data (``calibration``: .npz, folder, random)."""

    name = "convert"

    def __init__(
        self,
        *,
        calibration: str | Path,
        pattern: PatternLike = "2:4",
        method: str = "refit",
        damping: float = 0.01,
        include: str | None = None,
        exclude: str | None = None,
        eligible_only: bool = False,
    ):
        if method not in METHODS:
            raise InputError(f"unknown conversion method {method!r}; choose one of {', '.join(METHODS)}")
        self.calibration = calibration
        self.pattern = Pattern.parse(pattern)
        self.method, self.damping = method, damping
        self.include, self.exclude, self.eligible_only = include, exclude, eligible_only
        self._converted: list[Any] = []

    def call(self, model: OnnxModel) -> PassResult:
        candidates = select_weights(find_prunable_weights(model.proto).weights, self.include, self.exclude)
        rows: list[dict[str, Any]] = []
        chosen = []
        for weight in candidates:
            reason = self._skip_reason(weight)
            if reason:
                rows.append({"weight": weight.name, "skipped": reason})
            else:
                chosen.append(weight)
        if not chosen:
            raise InputError("nothing to convert: no fully connected 2-D float weight matched")
        batches = batches_for(self.calibration, graph_inputs(model.proto))
        stats, skipped = collect_statistics(model, chosen, batches)
        rows += [{"weight": name, "skipped": reason} for name, reason in skipped.items()]
        modified = False
        self._converted = []
        for weight in chosen:
            if weight.name not in stats:
                continue
            values = model.read(weight.tensor)
            stored = to_torch(values)
            # The math works on [out, K]; a [K, out] weight (MatMul B) is transposed there and back.
            matrix = stored.to(torch.float64) if weight.axis == 1 else stored.to(torch.float64).T
            hessian = stats[weight.name].hessian
            scores = matrix.abs() if self.method == "magnitude" else saliency(matrix, hessian)
            if self.method == "sparsegpt":
                converted = sparsegpt(matrix, hessian, self.pattern.n, self.pattern.m, self.damping)
                keep = converted != 0
            else:
                keep = nm_mask(scores, self.pattern, 1, score=scores)
            masked = matrix * keep
            if self.method == "refit":
                # Existing zeros stay zero: the refit only moves weights that are kept and non-zero.
                converted = refit(matrix, keep & (matrix != 0), hessian, self.damping)
            elif self.method != "sparsegpt":
                converted = masked
            result = (converted if weight.axis == 1 else converted.T).to(stored.dtype)
            model.write(weight.tensor, to_numpy(result.contiguous(), values))
            modified = True
            self._converted.append(weight)
            total = float(scores.sum())
            rows.append(
                {
                    "weight": weight.name,
                    "shape": list(weight.shape),
                    "axis": weight.axis,
                    "method": self.method,
                    "retained_saliency": float((scores * keep).sum()) / total if total else 1.0,
                    "error_masked": reconstruction_error(matrix, masked, hessian),
                    "error_converted": reconstruction_error(matrix, converted, hessian),
                    "samples": stats[weight.name].samples,
                }
            )
        return PassResult(model, modified, rows)

    def _skip_reason(self, weight) -> str | None:
        if weight.dtype not in _FLOAT_DTYPES:
            return f"{weight.dtype} weight (calibrated conversion handles float weights)"
        if len(weight.shape) != 2 or weight.axis is None or weight.uses[0].op_type not in ("MatMul", "Gemm"):
            return "not a 2-D MatMul/Gemm weight with one reduction axis (convolutions come later)"
        if weight.shape[weight.axis] % self.pattern.m:
            return f"axis {weight.axis} has length {weight.shape[weight.axis]}, not a multiple of {self.pattern.m}"
        if self.eligible_only and not tensorrt_verdict(weight, self.pattern).eligible:
            return "not TensorRT-eligible"
        return None

    def ensures(self, result: PassResult) -> None:
        for weight in self._converted:
            values = to_torch(result.model.read(weight.tensor))
            if not is_nm(values, self.pattern, weight.axis):
                raise AssertionError(f"convert left '{weight.name}' not {self.pattern}")
