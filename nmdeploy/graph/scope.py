"""The index of one graph of an ONNX model (:class:`Scope`): who produces and who reads each value, where a name is
defined, searching outwards, and which stored tensor stands behind a value; :func:`build_scope` makes one per
graph, its subgraphs' scopes inside it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import onnx
from onnx import NodeProto, TensorProto

from nmdeploy.graph.attributes import constant_value, subgraphs

SUBGRAPH = -1
"""Input position of a :class:`Use` by a node whose subgraph (If/Loop/Scan body) reads the value."""


class Use(NamedTuple):
    """One read of a value: the reading node's index in its scope and the input position (SUBGRAPH: a subgraph)."""

    node: int
    position: int


class Definition(NamedTuple):
    """Where a name is defined: ``kind`` is "node", "input", "initializer" or "sparse_initializer"; ``item`` is the
    NodeProto, None, the TensorProto or the SparseTensorProto; ``scope`` the graph that defines it."""

    kind: str
    item: object
    scope: Scope


@dataclass(frozen=True, eq=False)
class StoredTensor:
    """A tensor whose values are stored in the model, and where.

    ``storage`` is "initializer", "constant" (the ``value`` attribute of a Constant node, ``node``) or
    "sparse_initializer" (``tensor`` is then the values of ``sparse``). ``overridable``: an initializer that is also
    a graph input, only a default the caller may replace.
    """

    name: str
    tensor: TensorProto
    storage: str
    scope: Scope
    node: NodeProto | None = None
    sparse: onnx.SparseTensorProto | None = None
    overridable: bool = False


@dataclass(eq=False)
class Scope:
    """The index of one graph (main graph, subgraph or function body).

    ``name`` is "main", a subgraph path such as "main/If_0:then_branch" (the node's name, or op type and index,
    then the attribute), or "function:domain.name". ``owner`` is the node holding a subgraph.
    """

    name: str
    nodes: Sequence[NodeProto]
    parent: Scope | None = None
    owner: NodeProto | None = None
    graph: onnx.GraphProto | None = None
    function: onnx.FunctionProto | None = None
    inputs: frozenset[str] = frozenset()
    outputs: tuple[str, ...] = ()
    initializers: dict[str, TensorProto] = field(default_factory=dict)
    sparse_initializers: dict[str, onnx.SparseTensorProto] = field(default_factory=dict)
    producers: dict[str, int] = field(default_factory=dict)
    uses: dict[str, list[Use]] = field(default_factory=dict)
    children: list[Scope] = field(default_factory=list)
    # Position of each node, by object identity.
    positions: dict[int, int] = field(default_factory=dict)
    # Subgraph scopes by the position of the node holding them.
    subscopes: dict[int, list[Scope]] = field(default_factory=dict)
    # Per node: names its subgraphs read from this scope or further out.
    _outer: list[frozenset[str]] = field(default_factory=list)
    # Names this graph reads that it does not define (read from enclosing scopes).
    free_names: frozenset[str] = frozenset()

    def producer(self, value: str) -> NodeProto | None:
        """The node of this graph that computes ``value``."""
        index = self.producers.get(value)
        return None if index is None else self.nodes[index]

    def consumers(self, value: str) -> list[Use]:
        """Every read of ``value`` in this graph, subgraph reads (position SUBGRAPH) included, in node order."""
        return self.uses.get(value, [])

    def consumer_nodes(self, value: str) -> list[NodeProto]:
        return [self.nodes[use.node] for use in dict.fromkeys(self.uses.get(value, []))]

    def outer_reads(self, node: NodeProto | int) -> frozenset[str]:
        """Names the subgraphs of ``node`` read from enclosing scopes (this graph or further out)."""
        return self._outer[node if isinstance(node, int) else self.position(node)]

    def reads(self, node: NodeProto | int) -> list[str]:
        """Every name ``node`` depends on: its non-empty inputs, then what its subgraphs read from outside."""
        index = node if isinstance(node, int) else self.position(node)
        names = [name for name in self.nodes[index].input if name]
        return names + sorted(self._outer[index] - set(names))

    def walk(self) -> Iterator[tuple[Scope, int, NodeProto]]:
        """(scope, position, node) of every node of this graph, each followed by the nodes of its subgraphs."""
        for index, node in enumerate(self.nodes):
            yield self, index, node
            for child in self.subscopes.get(index, ()):
                yield from child.walk()

    def lookup(self, value: str) -> Definition | None:
        """Where ``value`` is defined, searching this graph then its enclosing ones (None: nowhere)."""
        scope: Scope | None = self
        while scope is not None:
            if value in scope.producers:
                return Definition("node", scope.nodes[scope.producers[value]], scope)
            if value in scope.inputs:
                return Definition("input", None, scope)
            if value in scope.initializers:
                return Definition("initializer", scope.initializers[value], scope)
            if value in scope.sparse_initializers:
                return Definition("sparse_initializer", scope.sparse_initializers[value], scope)
            scope = scope.parent
        return None

    def stored(self, value: str) -> StoredTensor | None:
        """The stored tensor behind ``value`` seen from this graph, or None (computed, a graph input, or an
        initializer that is also a graph input and so may be overridden)."""
        found = self.lookup(value)
        if found is None:
            return None
        if found.kind == "initializer":
            return StoredTensor(value, found.item, "initializer", found.scope)
        if found.kind == "sparse_initializer":
            return StoredTensor(value, found.item.values, "sparse_initializer", found.scope, sparse=found.item)
        if found.kind == "node":
            tensor = constant_value(found.item)
            if tensor is not None:
                return StoredTensor(value, tensor, "constant", found.scope, node=found.item)
        return None

    def position(self, node: NodeProto) -> int:
        """The position of a node object of this graph (KeyError for a node that is not in it)."""
        try:
            return self.positions[id(node)]
        except KeyError:
            raise KeyError(f"node {node.name or node.op_type!r} is not in graph {self.name}") from None


def _label(node: NodeProto, index: int) -> str:
    return node.name or f"{node.op_type}_{index}"


def build_scope(
    nodes: Sequence[NodeProto],
    name: str,
    parent: Scope | None,
    *,
    graph: onnx.GraphProto | None = None,
    function: onnx.FunctionProto | None = None,
    owner: NodeProto | None = None,
    registry: dict[int, tuple[Scope, int]],
    scopes: list[Scope],
) -> Scope:
    """The scope of one graph (``graph``) or function body (``function``) over ``nodes``, its subgraphs' scopes
    built recursively; each node is entered in ``registry`` (by object identity) and each scope in ``scopes``."""
    if graph is not None:
        inputs = frozenset(value.name for value in graph.input)
        outputs = tuple(value.name for value in graph.output)
        initializers = {tensor.name: tensor for tensor in graph.initializer}
        sparse = {tensor.values.name: tensor for tensor in graph.sparse_initializer}
    else:
        inputs = frozenset(function.input) if function is not None else frozenset()
        outputs = tuple(function.output) if function is not None else ()
        initializers, sparse = {}, {}
    # A list holds the node objects alive: protobuf hands out one Python object per message only while one is
    # referenced, and identity (positions, locate) depends on it.
    nodes = list(nodes)
    scope = Scope(name, nodes, parent, owner, graph, function, inputs, outputs, initializers, sparse)
    scopes.append(scope)
    producers = scope.producers
    uses = scope.uses
    outer: list[frozenset[str]] = []
    for index, node in enumerate(nodes):
        registry[id(node)] = (scope, index)
        scope.positions[id(node)] = index
        for output in node.output:
            if output:
                producers[output] = index
        for position, value in enumerate(node.input):
            if value:
                uses.setdefault(value, []).append(Use(index, position))
        read_inside: set[str] = set()
        if len(node.attribute):
            for label, sub in subgraphs(node):
                child = build_scope(
                    sub.node,
                    f"{name}/{_label(node, index)}:{label}",
                    scope,
                    graph=sub,
                    owner=node,
                    registry=registry,
                    scopes=scopes,
                )
                scope.children.append(child)
                scope.subscopes.setdefault(index, []).append(child)
                read_inside |= child.free_names
        outer.append(frozenset(read_inside))
        for value in read_inside:
            uses.setdefault(value, []).append(Use(index, SUBGRAPH))
    scope._outer = outer
    if parent is not None or function is not None:
        read = {value for node in nodes for value in node.input if value}
        for names in outer:
            read |= names
        scope.free_names = frozenset(read - set(producers) - inputs - set(initializers) - set(sparse))
    return scope
