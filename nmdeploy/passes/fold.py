"""Fold weights computed from constants (a Mul, Reshape or Concat of initializers) into initializers.

Only the values feeding a Conv/Gemm/MatMul weight input of the main graph are folded, so the rest of the graph
stays as it was; the nodes and initializers that served nothing else are removed. Exporters that scale or reshape
weights inside the graph (Paddle, TensorFlow, quantisation toolkits) then become prunable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnx
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from nmdeploy.errors import InputError, first_line
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.passes.base import Pass, PassResult, ReportRow


@dataclass
class FoldedWeight(ReportRow):
    folded: str  # the weight now stored as an initializer
    shape: list[int]


class FoldConstantsPass(Pass):
    """Replace each constant-computed GEMM weight of the main graph by an initializer holding its value."""

    name = "fold-constants"
    in_place = True

    def call(self, model: OnnxModel) -> PassResult:
        index = model.index
        targets = sorted({u.foldable for u in find_prunable_weights(model.proto, index).untraced if u.foldable})
        if not targets:
            return PassResult(model, False, [])
        main = index.main
        ancestors = index.backward_slice(targets)  # producers first
        values = _evaluate(model, [main.nodes[i] for i in ancestors], main.initializers, targets)

        # Graph outputs keep their producers; so do values read by kept nodes, their subgraphs included.
        pinned = set(main.outputs)
        removed: set[int] = set()
        for position in reversed(ancestors):
            if all(
                output in targets
                or (output not in pinned and all(use.node in removed for use in main.consumers(output)))
                for output in main.nodes[position].output
                if output
            ):
                removed.add(position)
        inputs_of_removed = {name for position in removed for name in main.reads(position)}
        still_used = {
            name for position in range(len(main.nodes)) if position not in removed for name in main.reads(position)
        }
        unused = [name for name in main.initializers if name in inputs_of_removed and name not in still_used | pinned]
        index.remove_nodes(removed)
        for name in unused:
            index.remove_initializer(name)
        for name in targets:
            index.add_initializer(numpy_helper.from_array(values[name], name))
        return PassResult(model, True, [FoldedWeight(name, list(values[name].shape)) for name in targets])


def _evaluate(
    model: OnnxModel, nodes: list[onnx.NodeProto], initializers: dict[str, onnx.TensorProto], targets: list[str]
) -> dict[str, Any]:
    """Run just the constant nodes with ONNX's reference evaluator (exact, no session or optimiser)."""
    needed = sorted({name for node in nodes for name in model.index.main.reads(node) if name in initializers})
    feeds = [numpy_helper.from_array(model.read(initializers[name]), name) for name in needed]
    outputs = [onnx.helper.make_value_info(name, onnx.TypeProto()) for name in targets]
    graph = onnx.helper.make_graph(nodes, "fold", [], outputs, initializer=feeds)
    sub = onnx.helper.make_model(graph, opset_imports=model.proto.opset_import, ir_version=model.proto.ir_version)
    try:
        return dict(zip(targets, ReferenceEvaluator(sub).run(None, {}), strict=True))
    except Exception as error:  # the reference evaluator raises whatever its op implementations raise
        raise InputError(
            f"the constants computing {', '.join(targets)} cannot be evaluated ({first_line(error, 200)}); "
            f"the model is invalid, check it with onnx.checker"
        ) from None
