"""Find every prunable weight of an ONNX model and the axis of the stored tensor that its GEMM reduces over.

Each Conv, ConvTranspose, Gemm and MatMul input, and the W and R inputs of each LSTM, GRU and RNN, in the main
graph, every If/Loop/Scan subgraph and every function, is followed back to where its tensor is stored (an
initializer or a Constant node) by ``graph/weight_trace.py``; the uses of one stored tensor become one
:class:`~nmdeploy.graph.prunable.PrunableWeight`. A consumer whose input comes from graph inputs is an activation and
is not reported. Anything that is constant but cannot be followed (a Reshape that splits the axis, arithmetic on
constants, a weight passed into a function) is reported with the reason instead of being guessed, and marked
foldable when the fold-constants pass can turn it into an initializer.

Only the protobuf is read: nothing is copied or rewritten, so this works the same on models with external data.
"""

from __future__ import annotations

import onnx

from nmdeploy.graph.constant_values import ConstantValues
from nmdeploy.graph.declared import node_attribute
from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.inputs import VALUE_PRESERVING, TokenVocabulary, token_vocabulary
from nmdeploy.graph.prunable import (
    RECURRENT_GATES,
    RECURRENT_INPUT,
    RECURRENT_STATE,
    PrunableWeight,
    UntracedWeight,
    WeightReport,
    WeightUse,
)
from nmdeploy.graph.scope import Scope
from nmdeploy.graph.weight_trace import PASS_THROUGH, Untraceable, trace_weight


def find_prunable_weights(model: onnx.ModelProto, index: GraphIndex | None = None) -> WeightReport:
    """Every prunable weight of ``model`` with its reduction axis, and the constant operands that cannot be traced.

    ``index`` is the model's :class:`GraphIndex` when the caller has one (``OnnxModel.index``); else one is built.
    """
    index = GraphIndex(model) if index is None else index
    index.topological_order()  # a cyclic main graph is the user's error, said in one line before any walk
    constants = ConstantValues()
    found: dict[tuple[str, str], dict] = {}
    untraced: list[UntracedWeight] = []
    call_sites: dict[tuple[str, str], list[tuple[Scope, onnx.NodeProto]]] = {}
    for scope, _, node in index.main.walk():
        call_sites.setdefault((node.domain, node.op_type), []).append((scope, node))
        _visit(node, scope, found, untraced, constants)
    for function in model.functions:
        scope = index.function(function.domain, function.name)
        sites = call_sites.get((function.domain, function.name), [])
        constant_inputs = {
            argument
            for position, argument in enumerate(function.input)
            if any(
                position < len(site.input) and site.input[position] and constants(site.input[position], site_scope)
                for site_scope, site in sites
            )
        }
        for inner_scope, _, node in scope.walk():
            _visit(node, inner_scope, found, untraced, constants, constant_inputs)
    vocabulary = token_vocabulary(index)
    weights = tuple(
        PrunableWeight(
            entry["name"],
            entry["kind"],
            entry["graph"],
            entry["shape"],
            entry["dtype"],
            tuple(entry["uses"]),
            entry["tensor"],
            entry["dequantization"],
            _embedding_lookups(entry["owner"], entry["name"]),
            _vocabulary_scores(index, vocabulary, entry["uses"], entry["shape"]),
        )
        for entry in found.values()
    )
    return WeightReport(weights, tuple(untraced))


# What may stand between an lm_head's GEMM and the logits output: a bias, a soft cap (tanh(x / c) * c), a softmax.
SCORE_OPS = VALUE_PRESERVING | {"Add", "Mul", "Div", "Tanh", "Softmax", "LogSoftmax"}


def _vocabulary_scores(
    index: GraphIndex, vocabulary: TokenVocabulary | None, uses: list[WeightUse], shape: tuple[int, ...]
) -> str | None:
    """The main-graph output that this weight's only GEMM computes, when its output width is a token vocabulary (the
    rows of the token input's table, :func:`token_vocabulary`): an lm_head. Else None."""
    if len(uses) != 1 or len(shape) != 2:
        return None
    use = uses[0]
    if use.graph != "main" or use.op_type not in ("MatMul", "Gemm") or use.input_index != 1 or use.consumer is None:
        return None
    if vocabulary is None or shape[1 - use.axis % 2] != vocabulary.rows:
        return None
    main, outputs = index.main, {value.name for value in index.model.graph.output}
    value = use.consumer.output[0]
    while value not in outputs:
        readers = main.consumer_nodes(value)
        if len(readers) != 1 or readers[0].op_type not in SCORE_OPS or readers[0].domain not in ("", "ai.onnx"):
            return None
        value = readers[0].output[0]
    return value


def _embedding_lookups(scope: Scope, name: str) -> tuple[str, ...]:
    """Gather nodes of ``scope`` whose table (input 0) is its stored tensor ``name``, through Cast, Identity, Q/DQ."""
    found, values, seen = [], [name], {name}
    while values:
        value = values.pop()
        for use in scope.consumers(value):
            node = scope.nodes[use.node]
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type == "Gather" and use.position == 0:
                found.append(node.name or f"Gather({node.output[0]})")
            elif node.op_type in PASS_THROUGH and use.position == 0 and node.output[0] not in seen:
                seen.add(node.output[0])
                values.append(node.output[0])
    return tuple(dict.fromkeys(found))


def _weight_inputs(node: onnx.NodeProto) -> list[tuple[int, int]]:
    """(input index, reduction axis in the consumer's coordinates) for each input that may be a weight.

    Negative axes count from the end, so they hold for MatMul operands of any rank (batched MatMul included).
    """
    if node.op_type == "Conv":
        return [(1, 1)]
    if node.op_type == "ConvTranspose":
        return [(1, 0)]
    if node.op_type == "Gemm":
        return [(0, 0 if node_attribute(node, "transA", 0) else 1), (1, 1 if node_attribute(node, "transB", 0) else 0)]
    if node.op_type == "MatMul":
        return [(0, -1), (1, -2)]
    if node.op_type in RECURRENT_GATES:
        return [(RECURRENT_INPUT, -1), (RECURRENT_STATE, -1)]
    return []


def _visit(
    node: onnx.NodeProto,
    scope: Scope,
    found: dict,
    untraced: list[UntracedWeight],
    constants: ConstantValues,
    constant_function_inputs: set[str] = frozenset(),
) -> None:
    if node.domain not in ("", "ai.onnx"):
        return
    for index, axis in _weight_inputs(node):
        if index >= len(node.input) or not node.input[index]:
            continue
        label = node.name or f"{node.op_type}({node.input[index]})"
        result = trace_weight(node.input[index], axis, scope, constants, constant_function_inputs)
        if result is None:
            continue  # an activation, not a weight
        operand = {"value": node.input[index], "axis": axis}
        if isinstance(result, Untraceable):
            reason, foldable = result.text, result.foldable
            untraced.append(
                UntracedWeight(
                    label, node.op_type, index, scope.name, reason, foldable, **operand, weight=result.weight
                )
            )
            continue
        shape = tuple(int(d) for d in result.tensor.dims)
        if len(shape) < 2:
            continue  # a vector operand of MatMul has no N:M structure
        if node.op_type == "Conv" and shape[1] == 1 and node_attribute(node, "group", 1) > 1:
            reason = "depthwise convolution: one input channel per group, nothing to prune"
            untraced.append(UntracedWeight(label, node.op_type, index, scope.name, reason, **operand))
            continue
        entry = found.setdefault(
            (result.owner.name, result.name),
            {
                "name": result.name,
                "kind": result.kind,
                "graph": result.owner.name,
                "shape": shape,
                "dtype": _dtype_name(result.tensor.data_type),
                "uses": [],
                "tensor": result.tensor,
                "dequantization": result.dequantization,
                "owner": result.owner,
            },
        )
        entry["uses"].append(
            WeightUse(
                label,
                node.op_type,
                index,
                result.axis % len(shape),
                result.path,
                scope.name,
                result.operand_shape,
                _dtype_name(result.operand_type),
                node,
            )
        )


def _dtype_name(data_type: int) -> str:
    return onnx.TensorProto.DataType.Name(data_type).lower()
