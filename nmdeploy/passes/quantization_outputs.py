"""Layer outputs that one per-tensor range cannot hold (a few outlier channels): measured on the calibration data,
divided per channel inside the layer (weight columns and bias) and multiplied back after their DequantizeLinear, or
kept in floating point with the share they would lose, the division undone. Used by
:class:`nmdeploy.passes.quantize.QuantizePass`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.base import ReportRow, optional
from nmdeploy.passes.quantization_plan import PlannedLayer, QuantizationPlan
from nmdeploy.passes.quantization_ranges import relative_error
from nmdeploy.passes.quantization_rewrite import insert_after_producers, numpy_float

OUTPUT_ERROR_LIMIT = 0.05
"""A layer output whose Q/DQ would lose more than this share of its energy on the calibration data is rescaled per
channel (``rescale_outputs``: its outlier channels divided out of the weight's columns and bias, multiplied back
after the DequantizeLinear), or, where that cannot be done, kept in floating point (the layer INT8 in, fp16 out).
On the one-shot 2:4 MiniLM the FFN down-projections' outputs before the residual Add lose 8-76 % to entropy ranges
(max ranges are worse: 3-7 outlier channels per layer, 19-107x the median channel, hold most of the energy; the
outliers Bondarenko et al. 2021 found in BERT's FFN outputs); every other tensor loses under 5 %, most under 0.1 %.
Mean embedding cosine (calibration's kind / another kind; 2:4 fp32 0.9021 / 0.7682): pairs kept 0.8903 / 0.7457,
outputs kept float 0.8993 / 0.7588 (30 of 36 layers INT8 in/out), rescaled 0.8997 / 0.7630 with auto ranges (36 of
36; after rescaling they lose 0.03-0.04 %)."""


def lossy_outputs(
    plan: QuantizationPlan, histograms, amax: dict[str, float], precision: str, limit: float
) -> dict[str, tuple[PlannedLayer, float]]:
    """The layer outputs (that no quantized layer reads) whose pair would lose more than ``limit`` of their energy,
    with their layer and the share lost."""
    inputs = {layer.node.input[0] for layer in plan.quantized}
    found = {}
    for layer in plan.quantized:
        name = layer.output
        if name is None or name in inputs or name not in histograms:
            continue
        lost = relative_error(histograms[name], amax[name], precision)
        if lost > limit:
            found[name] = (layer, lost)
    return found


@dataclass
class RescaledOutput(ReportRow):
    """A layer output whose outlier channels were divided by per-channel factors (folded into the layer's weight
    columns and bias) so that one per-tensor range holds it, and multiplied back after its DequantizeLinear."""

    item: str = field(default="rescaled output", init=False)
    tensor: str
    layer: str
    channels: int  # channels divided by a factor above 1
    largest_factor: float
    lost_before: float
    lost_after: float | None = optional()


@dataclass
class Rescaling:
    """One output's per-channel division: its factors, its report row, and the stored values it replaced (so that
    :meth:`undo` can put them back bit for bit, fp16 included)."""

    factor: np.ndarray
    row: RescaledOutput
    replaced: list[tuple[TensorProto, np.ndarray]]

    def undo(self, model: OnnxModel) -> None:
        for tensor, values in self.replaced:
            model.write(tensor, values)


def rescale_outputs(
    model: OnnxModel, plan: QuantizationPlan, lossy: dict[str, tuple[PlannedLayer, float]], calibration, batch_size
) -> dict[str, Rescaling]:
    """Divide each lossy output's channels above twice the median channel max by their excess (in the layer's
    weight columns and bias: a MatMul/Gemm with at most a bias Add after it), so the Q/DQ after the epilogue stays
    (INT8 out, as sparse integer kernels need); :func:`scale_back` multiplies them back after the DequantizeLinear,
    and a division whose output ends up without its pair must be undone (:meth:`Rescaling.undo`). Only where the
    weight and bias have no other reader."""
    from nmdeploy.calibration.activation_statistics import activation_channel_max

    eligible = {}
    for name, (layer, lost) in lossy.items():
        bias = _bias_only_epilogue(model, layer, name)
        if bias is not False and len(layer.weight.uses) == 1 and layer.channel_axis is not None:
            eligible[name] = (layer, lost, bias)
    if not eligible:
        return {}
    maxima, _ = activation_channel_max(model, eligible, calibration, batch_size=batch_size)
    found = {}
    for name, (layer, lost, bias) in eligible.items():
        channel_max = maxima[name].values
        channels = layer.weight.shape[layer.channel_axis]
        if channel_max is None or channel_max.shape != (channels,):
            continue
        factor = np.maximum(channel_max / max(2.0 * float(np.median(channel_max)), 1e-30), 1.0).astype(np.float32)
        if not (factor > 1.0).any():
            continue
        values = model.read(layer.weight.tensor)
        shape = [-1 if d == layer.channel_axis else 1 for d in range(values.ndim)]
        model.write(layer.weight.tensor, (values.astype(np.float32) / factor.reshape(shape)).astype(values.dtype))
        replaced = [(layer.weight.tensor, values)]
        if bias is not None:
            stored = model.read(bias)
            model.write(bias, (stored.astype(np.float32) / factor).astype(stored.dtype))
            replaced.append((bias, stored))
        label = layer.node.name or layer.node.op_type
        row = RescaledOutput(name, label, int((factor > 1.0).sum()), float(factor.max()), lost)
        found[name] = Rescaling(factor, row, replaced)
    return found


def undo_unpaired(model: OnnxModel, plan: QuantizationPlan, rescaled: Mapping[str, Rescaling]) -> dict[str, Rescaling]:
    """The rescalings whose output keeps its Q/DQ pair in ``plan``; every other one is undone.

    A division of an output's channels is only half of a pair whose other half, the Mul after the output's
    DequantizeLinear (:func:`scale_back`), exists only while that output keeps its Q/DQ. Where the output stays
    floating point after all (:func:`keep_lossy_outputs_float`, or any later step that drops the pair), the stored
    weight and bias are restored exactly as they were, so the float layer computes what the original did: leaving the
    division behind would lose the Mul and change the model's output, and a Mul on a float path would cost a node for
    nothing."""
    kept = {}
    for name, rescaling in rescaled.items():
        if name in plan.activations:
            kept[name] = rescaling
        else:
            rescaling.undo(model)
    return kept


def _bias_only_epilogue(model: OnnxModel, layer: PlannedLayer, end: str):
    """The stored bias tensor when ``end`` is the layer's MatMul/Gemm output plus a stored per-channel bias (None
    when ``end`` is the product itself); False for any other epilogue (an activation function does not commute with
    a per-channel division)."""
    index = model.index
    main = index.main
    node = layer.node
    if node.op_type not in ("MatMul", "Gemm") or len(layer.weight.shape) != 2:
        return False
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        return False  # Gemm's own bias input: not rescaled here
    if end == node.output[0]:
        return None
    add = main.producer(end)
    if add is None or add.op_type != "Add" or node.output[0] not in add.input:
        return False
    if len(main.consumer_nodes(node.output[0])) != 1:
        return False
    other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
    stored = index.stored(other)
    if stored is None or len(main.consumers(other)) != 1:
        return False
    channels = layer.weight.shape[layer.channel_axis]
    return stored.tensor if list(stored.tensor.dims) == [channels] else False


def scale_back(model: OnnxModel, factors: dict[str, np.ndarray], types: dict[str, int]) -> None:
    """After each rescaled output's DequantizeLinear, a Mul by its factors: the readers see the original values."""
    if not factors:
        return
    index = model.index
    main = index.main
    after: dict[str, list[onnx.NodeProto]] = {}
    renamed: dict[str, str] = {}
    for name, factor in factors.items():
        quantizer = next(n for n in main.consumer_nodes(name) if n.op_type == "QuantizeLinear")
        dequantizer = next(n for n in main.consumer_nodes(quantizer.output[0]) if n.op_type == "DequantizeLinear")
        scale = index.add_initializer(
            onnx.numpy_helper.from_array(factor.astype(numpy_float(types[name])), index.fresh_name(f"{name}_rescale"))
        )
        restored = index.fresh_name(f"{name}_restored")
        renamed[dequantizer.output[0]] = restored
        after[dequantizer.output[0]] = [
            helper.make_node(
                "Mul", [dequantizer.output[0], scale.name], [restored], name=index.fresh_name(f"{name}/Rescale")
            )
        ]
    readers = [(node, position) for node in main.nodes for position, value in enumerate(node.input) if value in renamed]
    for node, position in readers:
        node.input[position] = renamed[node.input[position]]
    insert_after_producers(index, after)


def keep_lossy_outputs_float(
    plan: QuantizationPlan,
    histograms,
    amax: dict[str, float],
    precision: str,
    limit: float | None,
    rescaled: Mapping[str, Rescaling],
) -> None:
    """Drop the output pair of every layer whose output would still lose more than ``limit`` of its energy (and that
    no quantized layer reads), so that the layer is INT8 in, floating-point out, with the measured reason (for an
    output in ``rescaled``: the share lost as it was and the share still lost rescaled)."""
    if limit is None:
        return
    for name, (layer, lost) in lossy_outputs(plan, histograms, amax, precision, limit).items():
        del plan.activations[name]
        layer.output = None
        rescaling = rescaled.get(name)
        if rescaling is None:
            share = _share(lost)
        else:
            share = f"{_share(rescaling.row.lost_before)} ({_share(lost)} with its outlier channels rescaled)"
        layer.output_reason = (
            f"its output would lose {share} of its energy to a per-tensor {precision.upper()} range on the "
            f"calibration data (outlier channels), kept in floating point"
        )


def _share(lost: float) -> str:
    """A share of energy as a percentage, with two decimals below 1 % (so a small limit never reads "0%")."""
    return f"{lost:.0%}" if lost >= 0.01 else f"{lost:.2%}"
