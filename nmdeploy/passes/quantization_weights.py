"""Weights rounded onto their quantization grid with the least output error (GPTQ), before quantize stores them.

Nearest rounding treats every weight alone. GPTQ (Frantar et al. 2022) visits a layer's input columns in turn,
rounds them, and spreads each column's rounding error over the columns not yet visited through the Cholesky factor
of the inverse input statistics H = X^T X, the column sweep SparseGPT uses for pruning
(:func:`nmdeploy.masks.reconstruct.sparsegpt_fit` with ``round_kept``). The 2:4 support is kept: zeros stay zeros
and only kept weights move. Layers go stage by stage on the calibration data (:mod:`nmdeploy.calibration.statistics`),
each on the inputs the already-rounded layers before it give. The grid is the one the Q/DQ pair stores (one
symmetric scale per output channel, from the weight before rounding), and the pass stores the weights with exactly
those scales.

Measured on the 2:4 SmolLM2-135M (FP8 weights alone, floating-point activations; mean next-token KL divergence from
the 2:4 float32 model on text of another source): nearest 0.0189, GPTQ 0.0109; with FP8 inputs as well, 0.0414 and
0.0339; on Qwen2.5-0.5B, FP8 weights and inputs, 0.071 and 0.055 (BENCHMARKS.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from nmdeploy.calibration.activation_statistics import Calibration, calibration_batches
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.prunable import PrunableWeight
from nmdeploy.passes.base import ReportRow, optional
from nmdeploy.passes.quantization_plan import QuantizationPlan
from nmdeploy.passes.quantization_ranges import channel_amax, scales_for

log = logging.getLogger(__name__)

WEIGHT_ROUNDINGS = ("gptq", "nearest")
GPTQ_DAMPING = 0.01
"""The ridge added to H, as a share of its mean diagonal (GPTQ's and llm-compressor's default)."""


@dataclass
class RoundedWeight(ReportRow):
    """How one weight was rounded onto its grid, with the output error of nearest rounding and of the rounding done
    (shares of the layer's output energy on the calibration data), or why it was rounded to nearest."""

    item: str = field(default="weight rounding", init=False)
    weight: str
    rounding: str  # "gptq" or "nearest"
    error_nearest: float | None = optional()
    error_rounded: float | None = optional()
    reason: str | None = optional()


def round_weights(
    model: OnnxModel,
    plan: QuantizationPlan,
    calibration: Calibration,
    precision: str,
    batch_size: int | None = None,
    damping: float = GPTQ_DAMPING,
) -> tuple[dict[str, np.ndarray], list[RoundedWeight]]:
    """Round every quantized weight of ``plan`` that the statistics reach onto its ``precision`` grid by GPTQ,
    writing the rounded values (floating point, on the grid) into ``model``; the per-output-channel scales of those
    weights by name (what the stored Q/DQ must use) and a row per quantized weight."""
    from nmdeploy.calibration.statistics import StageStatistics, fitting_stages
    from nmdeploy.calibration.statistics.taps import as_matrix, from_matrix
    from nmdeploy.masks.blockwise import reconstruction_error_blockwise, sparsegpt_blockwise
    from nmdeploy.masks.rounding import grid_rounding, round_to_grid

    axes: dict[str, int] = {}
    weights: dict[str, PrunableWeight] = {}
    rows: dict[str, RoundedWeight] = {}
    for layer in plan.quantized:
        name = layer.weight.name
        if name in axes and axes[name] != layer.channel_axis:
            rows[name] = RoundedWeight(name, "nearest", reason="layers read it along different channel axes")
        axes.setdefault(name, layer.channel_axis)
        weights.setdefault(name, layer.weight)
    for name, weight in weights.items():
        if name not in rows and len(weight.uses) != 1:
            rows[name] = RoundedWeight(name, "nearest", reason="several layers read it: no one input to fit it on")
    fitted = [weight for name, weight in weights.items() if name not in rows]
    scales: dict[str, np.ndarray] = {}
    stages = fitting_stages(model, fitted) if fitted else []
    batches = calibration_batches(model, calibration, batch_size) if stages else []
    for stage, statistics, skipped in StageStatistics(model, stages, batches, compare_dense=False) if stages else ():
        for weight in stage:
            name = weight.name
            if name not in statistics:
                rows[name] = RoundedWeight(name, "nearest", reason=skipped.get(name, "no input statistics"))
                continue
            stored = model.read(weight.tensor)
            values = np.asarray(stored, dtype=np.float32)
            channel_scales = scales_for(channel_amax(values, axes[name]), precision)
            matrix = as_matrix(weight, torch.from_numpy(values.copy())).to(torch.float64).contiguous()
            if matrix.shape[0] != channel_scales.size:
                rows[name] = RoundedWeight(name, "nearest", reason="its output channels are not its matrix rows")
                continue
            grid = torch.from_numpy(channel_scales)
            hessian = statistics[name].hessian
            # N = M over the current support: every non-zero weight is kept, none is pruned (groups of 4 where K
            # allows: the same sweep, with a quarter of the per-group steps).
            group = 4 if matrix.shape[1] % 4 == 0 else 1
            rounding = grid_rounding(grid, precision)
            fit = sparsegpt_blockwise(matrix, hessian, group, group, damping, allowed=matrix != 0, round_kept=rounding)
            energy = reconstruction_error_blockwise(matrix, torch.zeros_like(matrix), hessian) or 1.0
            nearest = reconstruction_error_blockwise(matrix, round_to_grid(matrix, grid, precision), hessian)
            rounded = reconstruction_error_blockwise(matrix, fit.weight, hessian)
            result = from_matrix(weight, fit.weight.to(torch.float32)).contiguous().numpy()
            model.write(weight.tensor, result.astype(stored.dtype))
            scales[name] = channel_scales
            rows[name] = RoundedWeight(name, "gptq", nearest / energy, rounded / energy)
            log.debug("%s: output error %.3g (nearest %.3g)", name, rounded / energy, nearest / energy)
    return scales, [rows[name] for name in weights]
