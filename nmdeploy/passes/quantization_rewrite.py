"""The graph edits of quantization: weights stored quantized per output channel behind a DequantizeLinear, a
QuantizeLinear/DequantizeLinear pair after each planned activation, new nodes placed right after their value's
producer."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.prunable import PrunableWeight
from nmdeploy.passes.quantization_plan import QuantizationPlan
from nmdeploy.passes.quantization_ranges import channel_amax, quantize, scales_for

QUANTIZED_TYPES: dict[str, int] = {"int8": TensorProto.INT8, "fp8": TensorProto.FLOAT8E4M3FN}


def insert_after_producers(index: GraphIndex, after: dict[str, list[onnx.NodeProto]]) -> None:
    """Put each list of new nodes right after the producer of its value (graph inputs and stored values: first),
    replacing the node list once."""
    main = index.main
    produced = {output for node in main.nodes for output in node.output}
    nodes = [new for name, added in after.items() if name not in produced for new in added]
    for node in list(main.nodes):
        nodes.append(node)
        for output in node.output:
            nodes.extend(after.get(output, []))
    index.set_nodes(nodes)


def insert_pairs(
    model: OnnxModel,
    plan: QuantizationPlan,
    amax: dict[str, float],
    types: dict[str, int],
    precision: str,
    weight_scales: dict[str, np.ndarray] | None = None,
) -> None:
    """Store each planned weight quantized (with its ``weight_scales`` where given: the grid it was rounded onto,
    else scales from its largest values), read through a DequantizeLinear, and put a QuantizeLinear/
    DequantizeLinear pair after each planned activation's producer; the node list is replaced once, at the end,
    because node objects taken from the plan belong to the graph as it was."""
    index = model.index
    after: dict[str, list[onnx.NodeProto]] = {}  # new nodes to place after the producer of each value
    seen: set[int] = set()
    for layer in plan.quantized:
        if id(layer.weight) not in seen:
            seen.add(id(layer.weight))
            after.setdefault(layer.weight.name, []).append(
                _quantize_weight(
                    model, layer.weight, layer.channel_axis, precision, (weight_scales or {}).get(layer.weight.name)
                )
            )
    for name, reads in plan.activations.items():
        scale = index.add_initializer(
            onnx.numpy_helper.from_array(
                np.asarray(scales_for(amax[name], precision), dtype=numpy_float(types[name])),
                index.fresh_name(f"{name}_scale"),
            )
        )
        zero = index.add_initializer(_zero_point(index.fresh_name(f"{name}_zero_point"), precision, None))
        quantized = index.fresh_name(f"{name}_quantized")
        dequantized = index.fresh_name(f"{name}_dequantized")
        after.setdefault(name, []).extend(
            [
                helper.make_node(
                    "QuantizeLinear",
                    [name, scale.name, zero.name],
                    [quantized],
                    name=index.fresh_name(f"{name}/QuantizeLinear"),
                ),
                helper.make_node(
                    "DequantizeLinear",
                    [quantized, scale.name, zero.name],
                    [dequantized],
                    name=index.fresh_name(f"{name}/DequantizeLinear"),
                ),
            ]
        )
        for node, position in reads:
            node.input[position] = dequantized
    insert_after_producers(index, after)


def _quantize_weight(
    model: OnnxModel, weight: PrunableWeight, axis: int, precision: str, scales: np.ndarray | None = None
) -> onnx.NodeProto:
    """Store the weight quantized per output channel (``axis``; ``scales``, or scales from each channel's largest
    value); its readers now read the returned DequantizeLinear's output."""
    index = model.index
    main = index.main
    values = model.read(weight.tensor).astype(np.float32)
    if scales is None:
        scales = scales_for(channel_amax(values, axis), precision)
    quantized = quantize(values, scales.reshape([-1 if d == axis else 1 for d in range(values.ndim)]), precision)
    float_type = weight.tensor.data_type
    name = weight.name
    readers = [(main.nodes[use.node], use.position) for use in main.consumers(name)]
    model.write_as(weight.tensor, quantized, QUANTIZED_TYPES[precision])
    scale = index.add_initializer(
        onnx.numpy_helper.from_array(scales.astype(numpy_float(float_type)), index.fresh_name(f"{name}_scale"))
    )
    zero = index.add_initializer(_zero_point(index.fresh_name(f"{name}_zero_point"), precision, scales.size))
    dequantized = index.fresh_name(f"{name}_dequantized")
    for reader, position in readers:
        reader.input[position] = dequantized
    return helper.make_node(
        "DequantizeLinear",
        [name, scale.name, zero.name],
        [dequantized],
        name=index.fresh_name(f"{name}/DequantizeLinear"),
        axis=axis,
    )


def numpy_float(data_type: int) -> np.dtype:
    return np.dtype(np.float16) if data_type == TensorProto.FLOAT16 else np.dtype(np.float32)


def _zero_point(name: str, precision: str, channels: int | None) -> TensorProto:
    shape = () if channels is None else (channels,)
    if precision == "int8":
        return onnx.numpy_helper.from_array(np.zeros(shape, dtype=np.int8), name)
    return helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, list(shape), [0.0] * (channels or 1))
