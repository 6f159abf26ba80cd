"""Fold weights computed from constants (a Mul, Reshape or Concat of initializers) into initializers.

Only the values feeding a Conv/Gemm/MatMul weight input of the main graph are folded, so the rest of the graph
stays as it was; the nodes and initializers that served nothing else are removed. Exporters that scale or reshape
weights inside the graph (Paddle, TensorFlow, quantisation toolkits) then become prunable.
"""

from __future__ import annotations

from typing import Any

import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.passes.base import Pass, PassResult


class FoldConstantsPass(Pass):
    """Replace each constant-computed GEMM weight of the main graph by an initializer holding its value."""

    name = "fold-constants"

    def call(self, model: OnnxModel) -> PassResult:
        targets = sorted({u.foldable for u in find_prunable_weights(model.proto).untraced if u.foldable})
        if not targets:
            return PassResult(model, False, [])
        graph = model.proto.graph
        nodes = list(graph.node)
        producers = {output: index for index, node in enumerate(nodes) for output in node.output}
        initializers = {t.name: t for t in graph.initializer}
        ancestors = _ancestors(targets, producers, nodes)
        values = _evaluate(model, [nodes[i] for i in sorted(ancestors)], initializers, targets)

        consumers: dict[str, list[int]] = {}
        for index, node in enumerate(nodes):
            for name in node.input:
                consumers.setdefault(name, []).append(index)
        # Names read by subgraphs from the outer scope, and graph outputs, must keep their producers.
        pinned = {o.name for o in graph.output} | _subgraph_names(graph)
        removed: set[int] = set()
        for index in sorted(ancestors, reverse=True):  # consumers come after producers in a valid graph
            if all(
                output in targets or (output not in pinned and all(c in removed for c in consumers.get(output, [])))
                for output in nodes[index].output
                if output
            ):
                removed.add(index)
        inputs_of_removed = {name for index in removed for name in nodes[index].input}
        kept = [node for index, node in enumerate(nodes) if index not in removed]
        still_used = {name for node in kept for name in node.input} | pinned
        del graph.node[:]
        graph.node.extend(kept)
        for tensor in list(graph.initializer):
            if tensor.name in inputs_of_removed and tensor.name not in still_used:
                graph.initializer.remove(tensor)
        graph.initializer.extend(numpy_helper.from_array(values[name], name) for name in targets)
        return PassResult(model, True, [{"folded": name, "shape": list(values[name].shape)} for name in targets])


def _ancestors(targets: list[str], producers: dict[str, int], nodes: list[onnx.NodeProto]) -> set[int]:
    """Indices of the nodes that the targets are computed from."""
    found: set[int] = set()
    stack = [producers[t] for t in targets if t in producers]
    while stack:
        index = stack.pop()
        if index not in found:
            found.add(index)
            stack.extend(producers[name] for name in nodes[index].input if name in producers)
    return found


def _evaluate(
    model: OnnxModel, nodes: list[onnx.NodeProto], initializers: dict[str, onnx.TensorProto], targets: list[str]
) -> dict[str, Any]:
    """Run just the constant nodes with ONNX's reference evaluator (exact, no session or optimiser)."""
    needed = sorted({name for node in nodes for name in node.input if name in initializers})
    feeds = [numpy_helper.from_array(model.read(initializers[name]), name) for name in needed]
    outputs = [onnx.helper.make_value_info(name, onnx.TypeProto()) for name in targets]
    graph = onnx.helper.make_graph(nodes, "fold", [], outputs, initializer=feeds)
    sub = onnx.helper.make_model(graph, opset_imports=model.proto.opset_import, ir_version=model.proto.ir_version)
    return dict(zip(targets, ReferenceEvaluator(sub).run(None, {}), strict=True))


def _subgraph_names(graph: onnx.GraphProto) -> set[str]:
    names: set[str] = set()
    for node in graph.node:
        for attribute in node.attribute:
            subgraphs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
            for sub in subgraphs:
                names |= {name for inner in sub.node for name in inner.input} | _subgraph_names(sub)
    return names
