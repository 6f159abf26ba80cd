"""What a model's outputs are: which ones are class scores, so that top-1 agreement is reported only where it means
something (an embedding's largest coordinate is no prediction)."""

from __future__ import annotations

import onnx

from nmdeploy.graph.index import GraphIndex, Scope

# Ops that move or relabel values without computing new ones: an output behind them is what they read.
_PASS_THROUGH = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast"}
# Ops a stored weight passes through on its way to a linear layer (quantized or transposed exports).
_WEIGHT_PATH = {"Identity", "Cast", "Transpose", "DequantizeLinear"}
_LINEAR = {"MatMul", "Gemm"}


def classifier_outputs(model: onnx.ModelProto, index: GraphIndex | None = None) -> frozenset[str]:
    """The graph outputs that are class scores: computed by Softmax / LogSoftmax, or by a final linear layer (a
    MatMul or Gemm with a stored weight, possibly followed by its bias Add). Normalisations, pooling and other
    heads (embeddings, feature and detection maps) are not."""
    scope = (index or GraphIndex(model)).main
    return frozenset(name for name in scope.outputs if _scores(scope, _source(scope, name)))


def _source(scope: Scope, value: str) -> onnx.NodeProto | None:
    """The node that computes ``value``, looking through pass-through ops."""
    node = scope.producer(value)
    while node is not None and node.op_type in _PASS_THROUGH and node.input:
        node = scope.producer(node.input[0])
    return node


def _scores(scope: Scope, node: onnx.NodeProto | None) -> bool:
    if node is None:
        return False
    if node.op_type in ("Softmax", "LogSoftmax"):
        return True
    if node.op_type == "Add" and len(node.input) == 2:
        linear = [_source(scope, name) for name in node.input]
        return any(_is_stored(scope, name) for name in node.input) and any(
            producer is not None and _is_linear_layer(scope, producer) for producer in linear
        )
    return _is_linear_layer(scope, node)


def _is_linear_layer(scope: Scope, node: onnx.NodeProto) -> bool:
    return node.op_type in _LINEAR and any(_is_stored(scope, name) for name in node.input[:2])


def _is_stored(scope: Scope, value: str) -> bool:
    while scope.stored(value) is None:
        node = scope.producer(value)
        if node is None or node.op_type not in _WEIGHT_PATH or not node.input:
            return False
        value = node.input[0]
    return True
