"""What an ONNX node holds in its attributes (a Constant's tensor, subgraphs, tensors), and every tensor of a graph
or model found through them; read from the protobuf alone, no index needed."""

from __future__ import annotations

from collections.abc import Iterator

import onnx
from onnx import AttributeProto, NodeProto, TensorProto

_DEFAULT_DOMAINS = ("", "ai.onnx")


def constant_value(node: NodeProto) -> TensorProto | None:
    """The tensor of a default-domain Constant node's ``value`` attribute (None for other nodes and attributes)."""
    if node.op_type != "Constant" or node.domain not in _DEFAULT_DOMAINS:
        return None
    for attribute in node.attribute:
        if attribute.name == "value" and attribute.type == AttributeProto.TENSOR:
            return attribute.t
    return None


def subgraphs(node: NodeProto) -> Iterator[tuple[str, onnx.GraphProto]]:
    """(label, graph) of each subgraph attribute of ``node``: "then_branch", "body", "branches[1]" ..."""
    for attribute in node.attribute:
        if attribute.type == AttributeProto.GRAPH:
            yield attribute.name, attribute.g
        elif attribute.type == AttributeProto.GRAPHS:
            for k, graph in enumerate(attribute.graphs):
                yield f"{attribute.name}[{k}]", graph


def node_tensors(node: NodeProto, *, nested: bool = True) -> Iterator[TensorProto]:
    """Every TensorProto held in ``node``'s attributes, its subgraphs' initializers and nodes included unless
    ``nested`` is False."""
    for attribute in node.attribute:
        if attribute.type == AttributeProto.TENSOR:
            yield attribute.t
        elif attribute.type == AttributeProto.TENSORS:
            yield from attribute.tensors
        elif attribute.type == AttributeProto.SPARSE_TENSOR:
            yield attribute.sparse_tensor.values
            yield attribute.sparse_tensor.indices
        elif not nested:
            continue
        elif attribute.type == AttributeProto.GRAPH:
            yield from graph_tensors(attribute.g)
        elif attribute.type == AttributeProto.GRAPHS:
            for graph in attribute.graphs:
                yield from graph_tensors(graph)


def graph_tensors(graph: onnx.GraphProto) -> Iterator[TensorProto]:
    """Every TensorProto of a graph: initializers, sparse initializers, and node attributes (recursively)."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        yield from node_tensors(node)


def model_tensors(model: onnx.ModelProto) -> Iterator[TensorProto]:
    """Every TensorProto of a model, in the main graph, its subgraphs and its local functions."""
    yield from graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from node_tensors(node)
