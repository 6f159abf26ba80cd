"""Where quantization's Q/DQ pairs go, decided from the graph alone: which Conv/Gemm/MatMul layers are quantized
(and why the others are not), which layer outputs are quantized at the end of their epilogue (and why the others stay
floating point), and which reads of each activation take its dequantized value. :mod:`nmdeploy.passes.quantize`
places the pairs; the rules are in its docstring."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import onnx

from nmdeploy.graph.declared import tensor_types
from nmdeploy.graph.dtypes import QUANTIZABLE_FLOAT_TYPES as _FLOAT_TYPES
from nmdeploy.graph.layer_norms import decomposed_layer_norms
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.prunable import PrunableWeight
from nmdeploy.graph.quantization import WEIGHTED_OPS, epilogue_end, through_data_movement
from nmdeploy.graph.scope import SUBGRAPH
from nmdeploy.graph.tensors import transposable_axes
from nmdeploy.graph.weights import find_prunable_weights

DEFAULT_KEEP_OPS: frozenset[str] = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "RMSNormalization",
        "SkipLayerNormalization",
    }
)
"""Ops whose inputs get no Q/DQ: TensorRT runs them (and their fused neighbours) better in floating point."""


RAW_INPUT_CHANNELS = 4
"""A layer reading a graph input with this many channels or fewer stays in floating point unless asked: measured on
the 2:4 digits CNN (one-channel images), FP8 with the first convolution quantized 98.67 % top-1, kept 98.89 % (2:4
fp32 99.11 %); INT8 99.11 % either way."""


@dataclass
class PlannedLayer:
    node: onnx.NodeProto
    weight: PrunableWeight
    channel_axis: int | None  # the weight's output-channel axis in stored coordinates; None when not quantized
    skipped: str | None = None  # why the layer is not quantized
    output: str | None = None  # the quantized value standing for the layer's output (end of its epilogue)
    output_reason: str | None = None  # why the output stays in floating point


@dataclass
class QuantizationPlan:
    """Where the Q/DQ pairs go: the weighted layers (quantized or not, and why) and, per activation tensor to
    quantize, the (node, input position) reads that take the dequantized value."""

    layers: list[PlannedLayer]
    activations: dict[str, list[tuple[onnx.NodeProto, int]]]

    @property
    def quantized(self) -> list[PlannedLayer]:
        return [layer for layer in self.layers if layer.skipped is None]


def plan_quantization(
    model: OnnxModel,
    *,
    keep_ops: Iterable[str] = DEFAULT_KEEP_OPS,
    quantize_residuals: bool = False,
    layers: Collection[str] | None = None,
    float_outputs: Mapping[str, str] | None = None,
    quantize_raw_input: bool = False,
    quantize_outputs: bool = True,
) -> QuantizationPlan:
    """Decide, from the graph alone, which weights and activations get Q/DQ pairs (see the module docstring).

    ``layers``: quantize only the layers named (weight or node names; None: every one that can be). ``float_outputs``:
    layers (weight or node names) whose output stays in floating point, each with the reason the report gives.
    ``quantize_raw_input``: quantize a first layer reading the model's few-channel input too (RAW_INPUT_CHANNELS).
    ``quantize_outputs``: False places no pair for a layer's output alone (an output read only by quantized layers
    is still quantized by their input pairs)."""
    index = model.index
    keep = frozenset(keep_ops)
    types = tensor_types(model.proto)
    layers = _weighted_layers(model, types, layers, quantize_raw_input)
    float_outputs = dict(float_outputs or {})
    main = index.main
    activations: dict[str, list[tuple[onnx.NodeProto, int]]] = {}

    def add(tensor: str, node: onnx.NodeProto, position: int) -> None:
        reads = activations.setdefault(tensor, [])
        if not any(known is node and known_position == position for known, known_position in reads):
            reads.append((node, position))

    for layer in layers:
        if layer.skipped is None:
            add(layer.node.input[0], layer.node, 0)
    layer_inputs = {id(layer.node) for layer in layers if layer.skipped is None}
    layer_norms = {id(main.nodes[position]) for position in decomposed_layer_norms(index)}
    outputs = set(index.graph_outputs)
    for layer in layers:
        if layer.skipped is not None:
            continue
        kept_float = float_outputs.get(layer.weight.name, float_outputs.get(layer.node.name))
        if kept_float is not None:
            layer.output_reason = kept_float
            continue
        end = epilogue_end(index, layer.node.output[0], outputs)
        onward = through_data_movement(index, end, outputs)
        onward_readers = main.consumer_nodes(onward)
        if (
            onward not in outputs
            and onward_readers
            and all(id(r) in layer_inputs and r.input[0] == onward for r in onward_readers)
        ):
            layer.output = onward  # the next layers' input Q/DQ quantizes it
            continue
        if not quantize_outputs:
            layer.output_reason = "layer outputs are left in floating point"
            continue
        kept = [r for r in main.consumer_nodes(end) if r.op_type in keep or id(r) in layer_norms]
        if end in outputs:
            layer.output_reason = "its output is a graph output, kept in floating point"
        elif kept:
            what = "a decomposed LayerNorm" if id(kept[0]) in layer_norms else kept[0].op_type
            layer.output_reason = f"its output feeds {what}, kept off Q/DQ"
        elif any(use.position == SUBGRAPH for use in main.consumers(end)):
            layer.output_reason = "its output is read inside a subgraph"
        elif types.get(end) not in _FLOAT_TYPES:
            layer.output_reason = "the type of its output is not known to be fp32 or fp16"
        else:
            layer.output = end
            for use in main.consumers(end):
                add(end, main.nodes[use.node], use.position)
    if quantize_residuals:
        layer_outputs = {layer.output for layer in layers if layer.output}
        for node in main.nodes:
            if node.op_type != "Add" or len(node.input) != 2 or not any(name in layer_outputs for name in node.input):
                continue
            for position, name in enumerate(node.input):
                if name in activations or (index.stored(name) is None and types.get(name) in _FLOAT_TYPES):
                    add(name, node, position)
    return QuantizationPlan(layers, activations)


def _weighted_layers(
    model: OnnxModel, types: dict[str, int], selected: Collection[str] | None, quantize_raw_input: bool
) -> list[PlannedLayer]:
    """Every Conv/Gemm/MatMul reading a stored weight on its second input, and why it is not quantized if so (it
    cannot be, or it is not among the ``selected`` weight or node names)."""
    index = model.index
    main = index.main
    outputs = set(index.graph_outputs)
    inputs = {value.name for value in model.proto.graph.input}
    layers = []
    for weight in find_prunable_weights(model.proto, index).weights:
        reason = _weight_reason(weight, main, outputs)
        axes = transposable_axes(weight) if reason is None else (None, None)
        for use in weight.uses:
            if use.op_type not in WEIGHTED_OPS or use.input_index != 1 or use.consumer is None:
                continue
            layer_reason = reason
            if layer_reason is None and (index.stored(use.consumer.input[0]) is not None):
                layer_reason = "its input is a stored constant, not an activation"
            if layer_reason is None and types.get(use.consumer.input[0]) not in _FLOAT_TYPES:
                layer_reason = "its input is not known to be fp32 or fp16"
            if layer_reason is None and not quantize_raw_input and _reads_raw_input(use.consumer, weight, inputs):
                channels = weight.shape[weight.axis]
                layer_reason = (
                    f"it reads the model's input directly with {channels} channel(s) (raw data such as pixels), kept "
                    "in floating point as TensorRT deployments keep the first layer (quantize_raw_input quantizes it)"
                )
            if layer_reason is None and selected is not None and not {weight.name, use.consumer.name} & set(selected):
                layer_reason = "kept in floating point: not among the layers chosen to quantize"
            layers.append(PlannedLayer(use.consumer, weight, axes[1], layer_reason))
    return layers


def _reads_raw_input(node: onnx.NodeProto, weight: PrunableWeight, inputs: set[str]) -> bool:
    """A layer reading a graph input with at most ``RAW_INPUT_CHANNELS`` channels: the first convolution of an image
    model, where quantizing the pixels costs fidelity and TensorRT gains little on so few channels."""
    return node.input[0] in inputs and weight.axis is not None and weight.shape[weight.axis] <= RAW_INPUT_CHANNELS


def _weight_reason(weight: PrunableWeight, main, outputs: set[str]) -> str | None:
    if weight.graph != "main":
        return f"the weight is stored in {weight.graph}"
    if weight.dtype not in _FLOAT_TYPES.values():
        return f"weight dtype {weight.dtype} (fp32 or fp16 weights are quantized)"
    if weight.needs_transposable:
        return "the weight is shared by layers that reduce over different axes"
    if any(use.op_type not in WEIGHTED_OPS or use.input_index != 1 for use in weight.uses):
        return "the weight is also read as a first GEMM input or by a ConvTranspose"
    if weight.name in outputs or any(use.position == SUBGRAPH for use in main.consumers(weight.name)):
        return "the weight is a graph output or read inside a subgraph"
    if weight.tied_embedding:
        # Its Q/DQ would feed the embedding lookups too: every token's embedding quantized, a change no range sees.
        return f"{weight.tied_embedding}: kept in floating point"
    if weight.vocabulary_scores:
        # Nothing after it absorbs its error, and llm-compressor's and ModelOpt's LLM recipes leave it unquantized too.
        return f"the lm_head, scoring the vocabulary in '{weight.vocabulary_scores}': kept in floating point"
    return None
