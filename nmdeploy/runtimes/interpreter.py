"""The ONNX -> torch interpreter: a model's graph as one torch call per node, differentiable and device-agnostic.

It covers the ONNX ops of the models we run (MLPs, CNNs, BERT-style encoders from torch's exporters, PaddleOCR's
CNNs and recognisers, CRNN text readers with LSTMs, voice-activity detectors with If branches; the coverage table
is in docs/interpreter-coverage.md); the ops live in :mod:`nmdeploy.runtimes.interpreter_ops`, and attribute values
an op's implementation does not cover are refused by name when the program is built. If runs the branch its
condition picks, each branch compiled once like the main graph. onnx2torch was the alternative; 1.5.15 needs
torchvision and has no converter for opset-20 Gelu, so it cannot run our exports with torch 2.13. The torch backend
(:mod:`nmdeploy.runtimes.torch`) runs models through :class:`GraphProgram`; conversion statistics on a device,
reconstruction and recovery reach it through that backend's graph runner, opened from the backend registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper

from nmdeploy.errors import InputError
from nmdeploy.graph.declared import opset_version
from nmdeploy.runtimes.interpreter_ops import CHECKS, OPS, OUTPUTS, SUPPORTED_OPS, as_tensor, node_attributes
from nmdeploy.runtimes.interpreter_ops.basic import constant_value

_OPS = OPS  # the one table, by the name tests patch

__all__ = ["SUPPORTED_OPS", "GraphProgram", "as_tensor", "describe_node", "node_attributes", "unsupported_nodes"]


def _opset(model: onnx.ModelProto) -> int:
    version = opset_version(model)
    return 1 if version is None else version


def _nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph`` and, inside If nodes, of their branches at any depth."""
    for node in graph.node:
        yield node
        if node.op_type == "If" and node.domain in ("", "ai.onnx"):
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    yield from _nodes(attribute.g)


def unsupported_nodes(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, str]]:
    """The nodes of the main graph and of If branches that the interpreter cannot run, each with the reason: other
    domains, ops not in SUPPORTED_OPS, or an attribute value outside what the op's implementation covers."""
    opset, found = _opset(model), []
    for node in _nodes(model.graph):
        if node.domain not in ("", "ai.onnx") or node.op_type not in SUPPORTED_OPS:
            found.append((node, f"{describe_node(node)} (supported ops: {', '.join(SUPPORTED_OPS)})"))
        elif node.op_type in CHECKS:
            reason = CHECKS[node.op_type](node_attributes(node), opset)
            if reason:
                found.append((node, f"{describe_node(node)} with {reason}"))
    return found


def describe_node(node: onnx.NodeProto) -> str:
    """``'name' (domain.Op)``: how messages name a node."""
    return f"'{node.name or node.output[0]}' ({node.domain + '.' if node.domain else ''}{node.op_type})"


class GraphProgram:
    """The main graph compiled once into one torch call per node, attributes parsed up front.

    :meth:`run` executes it on a mapping of named tensors (initializers and inputs). Every op is a plain torch
    function, so the result is differentiable in any float tensor given to it: the backend runs it under
    ``inference_mode``, recovery fine-tuning runs it with gradients. A value given by name replaces the Constant node
    that would produce it, so weights stored in Constant nodes can be trained like initializers.
    ``linear_overrides`` replaces the weight of named MatMul/Gemm nodes by a prepared one (the semi-structured copies
    of the torch backend). Constant nodes' values are made on ``device``, where the values given to :meth:`run` are:
    torch mixes devices only for 0-d tensors, and exporters write 1-element constants.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        linear_overrides: dict[str, torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
    ):
        missing = unsupported_nodes(model)
        if missing:
            raise InputError(f"the torch interpreter cannot run node {missing[0][1]}")
        self.output_names = tuple(output.name for output in model.graph.output)
        self._steps = _compile(model.graph, linear_overrides or {}, device)
        self._released = _last_reads(model.graph, set(self.output_names))

    def run(self, values: dict[str, torch.Tensor], keep: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """The graph outputs, and the intermediate tensors named in ``keep``, computed from ``values``. Each other
        value is dropped after the last node that reads it (a decoder's activations are gigabytes: only what the
        backward pass saved, and what is still to be read, stays alive)."""
        values = _execute(self._steps, dict(values), self._released, frozenset(keep))
        return {name: values[name] for name in (*self.output_names, *keep)}


_Step = tuple[tuple[str, ...], tuple[str, ...], Callable[[list], Any]]


def _compile(graph: onnx.GraphProto, overrides: dict[str, torch.Tensor], device: torch.device | str) -> list[_Step]:
    return [
        (tuple(node.input), tuple(node.output), _step(node, overrides.get(node.name or node.output[0]), device))
        for node in graph.node
    ]


def _reads(node: onnx.NodeProto) -> set[str]:
    """The names ``node`` reads: its inputs and, for an If node, every name its branches read (a branch reads the
    enclosing values by name; names made inside a branch are among them, which only keeps a namesake longer)."""
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            for inner in attribute.g.node:
                names |= _reads(inner)
            names |= {output.name for output in attribute.g.output}
    return names


def _last_reads(graph: onnx.GraphProto, kept: set[str]) -> list[tuple[str, ...]]:
    """For each node of ``graph``, the names no later node reads (values to drop once it has run, among them its own
    outputs that nothing reads), outside ``kept``."""
    last: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for name in _reads(node):
            last[name] = index
        for name in node.output:
            last.setdefault(name, index)
    released: list[list[str]] = [[] for _ in graph.node]
    for name, index in last.items():
        if name not in kept:
            released[index].append(name)
    return [tuple(names) for names in released]


def _execute(
    steps: list[_Step],
    values: dict[str, torch.Tensor],
    released: list[tuple[str, ...]] | None = None,
    keep: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Run ``steps`` on ``values`` (changed in place: every output is added), which it returns; with ``released``
    (:func:`_last_reads`), each step's dead values are removed from ``values`` once it has run, except ``keep``."""
    for index, (inputs, outputs, step) in enumerate(steps):
        if isinstance(step, _ConstantStep) and outputs[0] in values:
            continue  # a value given by name replaces the Constant node's (recovery trains stored constants)
        if isinstance(step, _IfStep):
            result = step.run(values)
        else:
            result = step([values[name] if name else None for name in inputs])
        for name, value in zip(outputs, result if isinstance(result, tuple) else (result,), strict=False):
            if name:
                values[name] = value
        if released is not None:
            for name in released[index]:
                if name not in keep:
                    values.pop(name, None)
    return values


class _ConstantStep:
    """A Constant node's step: its value, parsed once; recognised by :func:`_execute`."""

    def __init__(self, attrs: dict, device: torch.device | str):
        self.value = constant_value(attrs).to(device)

    def __call__(self, inputs: list) -> torch.Tensor:
        return self.value


class _IfStep:
    """An If node: both branches compiled once, with their initializers on ``device``; the branch the condition
    picks runs on the enclosing values (a branch reads them by name), and its outputs are the node's."""

    def __init__(self, node: onnx.NodeProto, device: torch.device | str):
        self.condition = node.input[0]
        self.branches = {}
        for attribute in node.attribute:
            if attribute.name in ("then_branch", "else_branch"):
                graph = attribute.g
                stored = {t.name: as_tensor(numpy_helper.to_array(t)).to(device) for t in graph.initializer}
                outputs = tuple(output.name for output in graph.output)
                self.branches[attribute.name] = (_compile(graph, {}, device), stored, outputs)

    def run(self, values: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        chosen = "then_branch" if bool(values[self.condition].reshape(-1)[0]) else "else_branch"
        steps, stored, outputs = self.branches[chosen]
        scope = _execute(steps, {**values, **stored})
        return tuple(scope[name] for name in outputs)


def _step(
    node: onnx.NodeProto, sparse_weight: torch.Tensor | None, device: torch.device | str
) -> Callable[[list], Any]:
    """The node's computation with its attributes parsed once, not on every inference."""
    attrs = node_attributes(node)
    if node.op_type == "Constant":
        return _ConstantStep(attrs, device)
    if node.op_type == "If":
        return _IfStep(node, device)
    if sparse_weight is not None:
        return lambda inputs: _prepared_linear(node.op_type, attrs, inputs, sparse_weight)
    attrs[OUTPUTS] = len(node.output)
    op = _OPS[node.op_type]
    return lambda inputs: op(inputs, attrs)


def _prepared_linear(op_type: str, attrs: dict, inputs: list, weight: torch.Tensor) -> torch.Tensor:
    """MatMul/Gemm through a prepared [out, in] weight (semi-structured): F.linear on the input as a matrix."""
    x = inputs[0]
    result = F.linear(x.reshape(-1, x.shape[-1]).contiguous(), weight).reshape(*x.shape[:-1], -1)
    if op_type == "Gemm":
        result = attrs.get("alpha", 1.0) * result
        if len(inputs) > 2 and inputs[2] is not None:
            result = result + attrs.get("beta", 1.0) * inputs[2]
    return result
