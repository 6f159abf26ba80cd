"""SmoothQuant-style migration of activation outliers into weights, before Q/DQ pairs are placed.

Each channel of a MatMul/Gemm input is divided by max|x|^alpha / max|w|^(1 - alpha) (a Mul before its Q/DQ) and the
matching rows of the layers' weights multiplied by it: the product is unchanged, the outlier channels of transformer
activations move into the per-channel weight scales, and zeros stay zeros, so a 2:4 weight stays 2:4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from nmdeploy.graph.declared import node_attribute, tensor_types
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.base import ReportRow
from nmdeploy.passes.quantization_plan import PlannedLayer, QuantizationPlan
from nmdeploy.passes.quantization_ranges import channel_amax, smoothing_scales
from nmdeploy.passes.quantization_rewrite import insert_after_producers, numpy_float

DEFAULT_SMOOTH: dict[str, bool] = {"int8": True, "fp8": False}


DEFAULT_SMOOTHING_STRENGTH = 0.85
"""SmoothQuant by precision, and its strength. One-shot 2:4 MiniLM, INT8 entropy, mean embedding cosine to dense
on text of the calibration's kind / another kind: no smoothing 0.847 / 0.712, strength 0.85 0.890 / 0.746, strength 1
0.893 / 0.745 (2:4 fp32: 0.902 / 0.768). FP8 E4M3 without it: 0.900 / 0.766."""


@dataclass
class SmoothedActivation(ReportRow):
    """An activation divided per channel by SmoothQuant factors (a Mul before its Q/DQ), the layers reading it
    given the factors in their weights' rows."""

    item: str = field(default="smoothing", init=False)
    tensor: str
    layers: list[str]
    strength: float
    largest_factor: float
    smallest_factor: float


def smooth_layer_inputs(
    model: OnnxModel, plan: QuantizationPlan, calibration, batch_size: int | None, strength: float
) -> list[SmoothedActivation]:
    """SmoothQuant on the inputs of quantized MatMul/Gemm layers that nothing else reads quantized: each channel of
    the input is divided by s (a Mul before its Q/DQ) and the matching rows (reduction axis) of the layers' weights
    multiplied by s, so the product is unchanged and zeros stay zeros (2:4 is kept)."""
    from nmdeploy.calibration.activation_statistics import activation_channel_max

    index = model.index
    by_input: dict[str, list[PlannedLayer]] = {}
    for layer in plan.quantized:
        by_input.setdefault(layer.node.input[0], []).append(layer)
    candidates = {}
    for name, layers in by_input.items():
        nodes = {id(layer.node) for layer in layers}
        weights = {id(layer.weight): layer.weight for layer in layers}.values()
        row_channels = {w.shape[w.axis] for w in weights if w.axis is not None}
        if (
            all(
                layer.node.op_type in ("MatMul", "Gemm") and not node_attribute(layer.node, "transA", 0)
                for layer in layers
            )
            and all(id(node) in nodes and position == 0 for node, position in plan.activations.get(name, []))
            and all(use.consumer is not None and id(use.consumer) in nodes for w in weights for use in w.uses)
            and not any(w.tied_embedding for w in weights)  # a Gather reads the table unscaled
            and len(row_channels) == 1
        ):
            candidates[name] = (layers, list(weights), row_channels.pop())
    maxima, _ = activation_channel_max(model, candidates, calibration, batch_size=batch_size)
    types = tensor_types(model.proto)
    after: dict[str, list[onnx.NodeProto]] = {}
    rows = []
    for name, (layers, weights, channels) in candidates.items():
        activation = maxima[name].values
        if activation is None or activation.shape != (channels,):
            continue
        weight_max = np.max([channel_amax(model.read(w.tensor), w.axis) for w in weights], axis=0)
        factors = smoothing_scales(activation, weight_max, strength)
        for weight in weights:
            values = model.read(weight.tensor)
            shape = [-1 if d == weight.axis else 1 for d in range(values.ndim)]
            model.write(weight.tensor, (values.astype(np.float32) * factors.reshape(shape)).astype(values.dtype))
        inverse = index.add_initializer(
            onnx.numpy_helper.from_array(
                (1.0 / factors).astype(numpy_float(types[name])), index.fresh_name(f"{name}_smoothing")
            )
        )
        smoothed = index.fresh_name(f"{name}_smoothed")
        after.setdefault(name, []).append(
            helper.make_node("Mul", [name, inverse.name], [smoothed], name=index.fresh_name(f"{name}/Smooth"))
        )
        for layer in layers:
            layer.node.input[0] = smoothed
        rows.append(
            SmoothedActivation(
                name,
                [layer.node.name or layer.node.op_type for layer in layers],
                strength,
                float(factors.max()),
                float(factors.min()),
            )
        )
    insert_after_producers(index, after)
    return rows
