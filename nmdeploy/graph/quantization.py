"""Where a model's Conv/Gemm/MatMul layers meet Q/DQ: what TensorRT fuses into a GEMM's epilogue, which
quantized type a QuantizeLinear or DequantizeLinear works in, and whether a layer's weight and input are read from
DequantizeLinear nodes and its output reaches QuantizeLinear nodes only. The quantize pass places its pairs by these
rules and the engine report reads a quantized model (ours or another tool's) with them."""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.model import OnnxModel

# Ops TensorRT fuses into a GEMM's or convolution's epilogue when their other inputs are constants.
EPILOGUE_OPS = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Relu",
        "LeakyRelu",
        "Clip",
        "Sigmoid",
        "Tanh",
        "Erf",
        "Pow",
        "Gelu",
        "HardSigmoid",
        "HardSwish",
        "Elu",
        "Selu",
        "BatchNormalization",
    }
)
# Ops that move data without computing on it: Q/DQ propagates through them, so quantized values pass unchanged.
DATA_MOVEMENT_OPS = frozenset({"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity", "MaxPool"})
WEIGHTED_OPS = ("Conv", "Gemm", "MatMul")
_EPILOGUE_LIMIT = 16  # nodes: an erf GELU is 5, bias + BatchNormalization + activation 3

QUANTIZED_TYPE_NAMES: dict[int, str] = {
    TensorProto.INT8: "int8",
    TensorProto.UINT8: "uint8",
    TensorProto.FLOAT8E4M3FN: "fp8",
    TensorProto.INT4: "int4",
    TensorProto.FLOAT4E2M1: "fp4",
}


def quantized_type_name(data_type: int) -> str:
    """int8, uint8, fp8, int4, fp4, or the ONNX name in lower case."""
    return QUANTIZED_TYPE_NAMES.get(data_type) or TensorProto.DataType.Name(data_type).lower()


def quantized_type(index: GraphIndex, node: onnx.NodeProto) -> str:
    """The quantized element type a QuantizeLinear or DequantizeLinear works in: a DequantizeLinear's stored input
    (a quantized weight) or its QuantizeLinear's type, else the zero point's type, else ``output_dtype``, else
    ONNX's default, uint8."""
    if node.op_type == "DequantizeLinear":
        stored = index.stored(node.input[0])
        if stored is not None:
            return quantized_type_name(stored.tensor.data_type)
        producer = index.producer(node.input[0])
        if producer is not None and producer.op_type == "QuantizeLinear":
            return quantized_type(index, producer)
    if len(node.input) > 2 and node.input[2]:
        zero_point = index.stored(node.input[2])
        if zero_point is not None:
            return quantized_type_name(zero_point.tensor.data_type)
    for attribute in node.attribute:
        if attribute.name == "output_dtype" and helper.get_attribute_value(attribute):
            return quantized_type_name(helper.get_attribute_value(attribute))
    return "uint8"


def dequantized_type(index: GraphIndex, value: str) -> str | None:
    """The quantized type ``value`` is dequantized from when a DequantizeLinear computes it; None otherwise."""
    producer = index.producer(value)
    if producer is None or producer.op_type != "DequantizeLinear":
        return None
    return quantized_type(index, producer)


@dataclass(frozen=True)
class LayerQuantization:
    """How a weighted layer reads and leaves Q/DQ: the quantized type its weight and its input are dequantized from,
    and that of the QuantizeLinear nodes reading the end of its epilogue (followed through data-movement ops, or
    not) when they are its only readers; None where it stays floating point."""

    weight: str | None
    input: str | None
    output: str | None


# What a 2:4 layer's input and output must be for TensorRT's sparse 8-bit kernels, per precision: sparse INT8 kernels
# are picked only for a GEMM that is INT8 in and out (ModelOpt PR 1664); sparse FP8 GEMMs read E4M3 operands and
# write fp16, bf16 or fp32 (cuSPARSELt's type table on sm90; hipSPARSELt lists float8 as an input type only), so an
# FP8 layer needs its input quantized and may leave its output in floating point.
SPARSE_KERNEL_OUTPUTS: dict[str, str] = {"int8": "INT8 in/out", "fp8": "FP8 in"}


def sparse_kernel_precision(input_type: str | None, output_type: str | None) -> str | None:
    """The 8-bit precision ("int8", "fp8") whose sparse kernels a layer reading ``input_type`` and writing
    ``output_type`` (quantized type names; None: floating point) can run, per SPARSE_KERNEL_OUTPUTS; None if none."""
    if input_type == "int8" and output_type == "int8":
        return "int8"
    if input_type == "fp8":
        return "fp8"
    return None


def layer_quantization(index: GraphIndex, node: onnx.NodeProto, weight_position: int = 1) -> LayerQuantization:
    """:class:`LayerQuantization` of a Conv/Gemm/MatMul ``node`` whose weight is its input ``weight_position`` (0 or
    1) and whose activation the other of the two."""
    main = index.main
    outputs = set(index.graph_outputs)
    end = epilogue_end(index, node.output[0], outputs)
    output = None
    for readers in (main.consumer_nodes(through_data_movement(index, end, outputs)), main.consumer_nodes(end)):
        if readers and all(reader.op_type == "QuantizeLinear" for reader in readers):
            output = quantized_type(index, readers[0])
            break
    return LayerQuantization(
        dequantized_type(index, node.input[weight_position]),
        dequantized_type(index, node.input[1 - weight_position]),
        output,
    )


def quantized_io(model: OnnxModel) -> dict[str, tuple[bool, bool]]:
    """For every Conv/Gemm/MatMul whose second input comes from a DequantizeLinear (a model quantized by any tool):
    (input quantized, output quantized) by :func:`layer_quantization`, the rules the quantize pass places pairs by."""
    index = model.index
    found = {}
    for node in index.main.nodes:
        if node.op_type not in WEIGHTED_OPS or len(node.input) < 2:
            continue
        layer = layer_quantization(index, node)
        if layer.weight is not None:
            found[node.name or node.output[0]] = (layer.input is not None, layer.output is not None)
    return found


def epilogue_end(index: GraphIndex, start: str, outputs: set[str]) -> str:
    """The value at the end of what TensorRT fuses after a GEMM producing ``start``: the last value that is the
    only one leaving a growing region of epilogue ops reading only the region, ``start`` and stored constants."""
    main = index.main
    region: list[onnx.NodeProto] = []
    made = {start}
    end = start
    while len(region) < _EPILOGUE_LIMIT:
        candidates = [
            node
            for value in made
            for node in main.consumer_nodes(value)
            if node.op_type in EPILOGUE_OPS
            and node.domain in ("", "ai.onnx")
            and all(node is not r for r in region)
            and all(name in made or index.stored(name) is not None for name in node.input if name)
        ]
        if not candidates:
            break
        node = candidates[0]
        region.append(node)
        made.update(name for name in node.output if name)
        leaving = [
            value
            for value in made
            if value in outputs or any(all(r is not n for n in region) for r in main.consumer_nodes(value))
        ]
        if len(leaving) == 1 and leaving[0] != start:
            end = leaving[0]
    return end


def through_data_movement(index: GraphIndex, value: str, outputs: set[str]) -> str:
    """Follow ``value`` through a chain of single-reader data-movement ops (Reshape, Transpose, MaxPool, ...)."""
    main = index.main
    while value not in outputs:
        readers = main.consumer_nodes(value)
        if len(readers) != 1 or readers[0].op_type not in DATA_MOVEMENT_OPS or readers[0].input[0] != value:
            break
        value = readers[0].output[0]
    return value
