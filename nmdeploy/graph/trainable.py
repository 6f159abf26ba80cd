"""What fine-tuning on a graph trains and matches: stored tensors by the names the graph reads, the trainable ones
(converted weights, layer biases, normalisation scales and shifts), block outputs to match, and the token inputs that
index embedding tables."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

from nmdeploy.graph.dtypes import ARITHMETIC_FLOAT_TYPES
from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.inputs import indexed_tables
from nmdeploy.graph.prunable import PrunableWeight

_INTEGER_TYPES = {
    onnx.TensorProto.INT8,
    onnx.TensorProto.INT16,
    onnx.TensorProto.INT32,
    onnx.TensorProto.INT64,
    onnx.TensorProto.UINT8,
    onnx.TensorProto.UINT16,
    onnx.TensorProto.UINT32,
    onnx.TensorProto.UINT64,
}
_NORMALISATIONS = {"LayerNormalization", "BatchNormalization", "InstanceNormalization", "GroupNormalization"}
_BIAS_INPUTS = {"Conv": 2, "Gemm": 2, "ConvTranspose": 2, "LSTM": 3, "GRU": 3, "RNN": 3}
_LAYERS = {"MatMul", "Gemm", "Conv", "ConvTranspose"}
MAX_BLOCK_TARGETS = 16


def stored_tensors(proto: onnx.ModelProto, index: GraphIndex | None = None) -> dict[str, onnx.TensorProto]:
    """The main graph's stored tensors by the name the graph reads them under: initializers and the values of
    Constant nodes (Paddle and TF exports keep weights there); both are trained and written back alike. ``index``:
    the proto's graph index where the caller holds one already."""
    index = GraphIndex(proto) if index is None else index
    return {
        stored.name: stored.tensor
        for stored in index.stored_tensors()
        if stored.scope is index.main and stored.storage in ("initializer", "constant") and not stored.overridable
    }


def trainable_tensors(proto: onnx.ModelProto, weights: Sequence[str]) -> list[str]:
    """The converted weights plus every stored float tensor used as a layer bias or a normalisation scale/shift."""
    index = GraphIndex(proto)
    initializers = {
        name: t for name, t in stored_tensors(proto, index).items() if t.data_type in ARITHMETIC_FLOAT_TYPES
    }
    names = [name for name in weights if name in initializers]
    for node in proto.graph.node:
        found: list[str] = []
        if node.op_type in _NORMALISATIONS:
            found = list(node.input[1:3])
        elif node.op_type in _BIAS_INPUTS and len(node.input) > _BIAS_INPUTS[node.op_type]:
            found = [node.input[_BIAS_INPUTS[node.op_type]]]
        elif node.op_type == "Add" and len(node.input) == 2:
            # A bias added to a layer's output: the other operand comes straight from a MatMul/Gemm/Conv.
            for mine, other in (node.input, reversed(node.input)):
                producer = index.producer(other)
                if producer is not None and producer.op_type in _LAYERS and mine in initializers:
                    found.append(mine)
        names += [name for name in found if name in initializers and initializers[name].dims]
    return list(dict.fromkeys(names))


def block_targets(proto: onnx.ModelProto, weights: Sequence[PrunableWeight]) -> dict[str, int | None]:
    """Intermediate tensors to match, at most 16, each with its channel axis (None: weighed as a whole).

    Normalisation outputs where the graph has them (the channel axis is the one the normalisation's scale runs
    along), else the converted layers' inputs.
    """
    found: dict[str, int | None] = {}
    for node in proto.graph.node:
        if node.op_type == "LayerNormalization":
            axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
            found[node.output[0]] = -1 if axis == -1 else None  # a scale over several trailing axes: as a whole
        elif node.op_type in _NORMALISATIONS:
            found[node.output[0]] = 1
    if not found:
        consumers = {use.node for weight in weights for use in weight.uses}
        excluded = set(stored_tensors(proto)) | {value.name for value in proto.graph.input}
        for node in proto.graph.node:
            if (node.name or node.output[0]) in consumers:
                found.update((name, None) for name in node.input[:2] if name and name not in excluded)
    names = list(found)
    if len(names) > MAX_BLOCK_TARGETS:
        picks = np.linspace(0, len(names) - 1, MAX_BLOCK_TARGETS).round().astype(int)
        names = [names[i] for i in sorted(set(picks.tolist()))]
    return {name: found[name] for name in names}


def embedding_inputs(proto: onnx.ModelProto) -> dict[str, str]:
    """Integer graph inputs used as the indices of a Gather on a stored table (:func:`indexed_tables`): the input's
    name -> the table's (the one with the fewest rows where several are read, so every id is valid)."""
    stored = {tensor.name for tensor in proto.graph.initializer}
    integer = [
        value.name
        for value in proto.graph.input
        if value.name not in stored and value.type.tensor_type.elem_type in _INTEGER_TYPES
    ]
    trainable = stored_tensors(proto)  # tables recovery can read (not sparse initializers)
    found = {}
    for name, reads in indexed_tables(proto, integer).items():
        stored = [read for read in reads if read.rows is not None and read.table in trainable]
        if stored:
            found[name] = min(stored, key=lambda read: read.rows).table
    return found
