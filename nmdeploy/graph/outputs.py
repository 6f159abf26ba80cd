"""What a model's outputs are: which ones are class scores, so that top-1 agreement is reported only where it means
something (an embedding's largest coordinate, a box's largest coordinate are no prediction); the blank class a CTC
model declares. The axis each output's rows lie along: :mod:`nmdeploy.graph.batch_axes`."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import onnx

from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.inputs import VALUE_PRESERVING, token_vocabulary
from nmdeploy.graph.scope import Scope
from nmdeploy.graph.weights import find_prunable_weights


def classifier_outputs(model: onnx.ModelProto, index: GraphIndex | None = None) -> frozenset[str]:
    """The graph outputs that are class scores: computed by Softmax / LogSoftmax, or by a final linear layer (a
    MatMul or Gemm that reads a stored weight, as :func:`find_prunable_weights` traces it, possibly followed by its
    bias Add). Normalisations, pooling and other heads (embeddings, feature and detection maps) are not."""
    index = index or GraphIndex(model)
    linear = {
        id(use.consumer)
        for weight in find_prunable_weights(model, index).weights
        for use in weight.uses
        if use.op_type in ("MatMul", "Gemm") and use.consumer is not None
    }
    scope = index.main
    return frozenset(
        name
        for name in scope.outputs
        if _scores(scope, _source(scope, name), linear) and not REGRESSION_NAME.search(name)
    )


# A final linear layer also computes regression heads: their names say so (detectors' boxes, landmarks, keypoints).
REGRESSION_NAME = re.compile(r"box|landmark|lmk|keypoint|coord|regress|offset|delta|pose", re.IGNORECASE)


def vocabulary_outputs(
    model: onnx.ModelProto,
    index: GraphIndex | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> frozenset[str]:
    """The graph outputs that score the token vocabulary (a language model's logits): their last axis is as long as
    the token input's embedding table (:func:`token_vocabulary`), tied to the lm_head or not. ``shapes``: the
    outputs' shapes as a run produced them, in place of the declared ones (a symbolic vocabulary axis, or only the
    outputs a caller judges)."""
    vocabulary = token_vocabulary(index or GraphIndex(model))
    if vocabulary is None:
        return frozenset()
    if shapes is None:
        shapes = {}
        for output in model.graph.output:
            dims = output.type.tensor_type.shape.dim
            shapes[output.name] = [dim.dim_value if dim.HasField("dim_value") else -1 for dim in dims]
    return frozenset(name for name, shape in shapes.items() if tuple(shape)[-1:] == (vocabulary.rows,))


BLANK_KEYS = ("ctc_blank", "blank_index", "blank_id", "blank")


def ctc_blank(model: onnx.ModelProto) -> int | None:
    """The blank class a CTC model names in its metadata (``ctc_blank``, ``blank_index``, ``blank_id`` or
    ``blank``), or None."""
    properties = {prop.key.lower(): prop.value.strip() for prop in model.metadata_props}
    for key in BLANK_KEYS:
        if properties.get(key, "").isdigit():
            return int(properties[key])
    return None


def _source(scope: Scope, value: str) -> onnx.NodeProto | None:
    """The node that computes ``value``, looking through ops that only move or relabel values."""
    node = scope.producer(value)
    while node is not None and node.op_type in VALUE_PRESERVING and node.input:
        node = scope.producer(node.input[0])
    return node


def _scores(scope: Scope, node: onnx.NodeProto | None, linear: set[int]) -> bool:
    if node is None:
        return False
    if node.op_type in ("Softmax", "LogSoftmax") or id(node) in linear:
        return True
    if node.op_type == "Add" and len(node.input) == 2:  # a bias after the linear layer
        producers = [_source(scope, name) for name in node.input]
        bias = any(scope.stored(name) is not None for name in node.input)
        return bias and any(producer is not None and id(producer) in linear for producer in producers)
    return False


def with_model_blank(metric, model: onnx.ModelProto):
    """``metric`` with the CTC blank the model declares filled in: ``"ctc"`` becomes ``"ctc@N"`` where the model's
    metadata names blank N (:func:`ctc_blank`); any other metric as it is."""
    if metric == "ctc":
        blank = ctc_blank(model)
        return metric if blank is None else f"ctc@{blank}"
    return metric
