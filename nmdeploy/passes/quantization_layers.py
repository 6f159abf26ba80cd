"""The per-layer rows of a quantization: each weighted layer's precision in and out, its 2:4 pattern behind the
DequantizeLinear, and whether TensorRT can run it on sparse integer (or FP8) kernels, with the reasons when not."""

from __future__ import annotations

from dataclasses import dataclass, field

from nmdeploy.graph.eligibility import tensorrt_verdict
from nmdeploy.graph.inspection import WeightRow
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.quantization import SPARSE_KERNEL_OUTPUTS, sparse_kernel_precision
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.passes.base import ReportRow, optional
from nmdeploy.passes.quantization_plan import QuantizationPlan


@dataclass
class QuantizedLayer(ReportRow):
    """A weighted layer: the precision of its weight, input and output, its pattern, and whether TensorRT can run
    it on sparse integer (or FP8) kernels, with the reasons when not."""

    item: str = field(default="layer", init=False)
    node: str
    op_type: str
    weight: str
    weight_precision: str  # "int8", "fp8", or "float" when left unquantized
    input: str
    output: str
    pattern: str  # "2:4", or the fraction of 2:4 groups, or "dense"
    sparse_integer: bool
    verdict: str
    notes: str | None = optional()


def quantized_layer_rows(
    model: OnnxModel, plan: QuantizationPlan, precision: str, inspection: dict[str, WeightRow]
) -> list[QuantizedLayer]:
    """Each weighted layer's precision, pattern (``inspection``: the quantized model's, by weight) and sparse-kernel
    verdict."""
    weights = {weight.name: weight for weight in find_prunable_weights(model.proto, model.index).weights}
    label = precision.upper()
    rows = []
    for layer in plan.layers:
        name = layer.weight.name
        row = inspection.get(name)
        reasons: list[str] = []
        quantized = layer.skipped is None
        if not quantized:
            reasons.append(f"not quantized: {layer.skipped}")
        elif sparse_kernel_precision(precision, precision if layer.output else None) != precision:
            reasons.append(f"{label} in, floating-point out ({layer.output_reason}): TensorRT falls back to fp16")
        verdict = tensorrt_verdict(weights[name], _pattern_2of4()) if name in weights else None
        if verdict is not None and not verdict.eligible:
            reasons.extend(f"TensorRT: {reason}" for reason in verdict.reasons)
        compliant = row.compliant if row is not None else None
        if compliant is None or compliant < 1.0:
            reasons.append("not 2:4" if not compliant else f"not 2:4 ({compliant:.0%} of groups)")
        pattern = "2:4" if compliant == 1.0 else "dense" if not compliant else f"{compliant:.0%} 2:4"
        eligible = not reasons
        hints = [h for h in (verdict.reasons if verdict and verdict.eligible else ()) if h.startswith("small layer")]
        kernels = "sparse integer kernels" if precision == "int8" else "sparse FP8 kernels"
        rows.append(
            QuantizedLayer(
                node=layer.node.name or layer.node.op_type,
                op_type=layer.node.op_type,
                weight=name,
                weight_precision=precision if quantized else "float",
                input=precision if quantized else "float",
                output=precision if quantized and layer.output else "float",
                pattern=pattern,
                sparse_integer=eligible,
                verdict=f"2:4 + {SPARSE_KERNEL_OUTPUTS[precision]}: eligible for {kernels}"
                if eligible
                else f"not eligible for {kernels}: " + "; ".join(reasons),
                notes="; ".join(hints) or None,
            )
        )
    return rows


def _pattern_2of4():
    from nmdeploy.masks.pattern import Pattern

    return Pattern.parse("2:4")
