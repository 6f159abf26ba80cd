"""One index over an ONNX model's graphs: who produces and who reads each value, in which order, and where the
stored tensors live.

The ModelProto stays the model (it is what is loaded and saved byte for byte); :class:`GraphIndex` is a view of
it, built once per model and refreshed after structural edits. It answers every graph query nmdeploy makes:

========================================  ==================================================================
``index.main``, ``index.scopes``           one :class:`Scope` per graph: the main graph, every If/Loop/Scan
                                           body (recursively) and every local function
``scope.producer(value)``                  the node computing a value in that graph (None: input/initializer)
``scope.consumers(value)``                 every :class:`Use` of a value: ``(node index, input position)``,
                                           position :data:`SUBGRAPH` when a node's subgraph reads it
``scope.outer_reads(node)``                names a node's subgraphs read from the enclosing scopes (the one
                                           answer, used everywhere)
``scope.reads(node)``                      its inputs plus its outer reads: everything it depends on
``scope.lookup(value)``                    the :class:`Definition` of a name, searching outwards
``index.topological_order()``              main-graph node indices, producers first; a cycle is a
                                           :class:`GraphCycleError`
``index.backward_slice(values, stop)``     the nodes needed to compute ``values`` (stopping at ``stop``)
``index.live_values(cut, order)``          values made before position ``cut`` of an order and read from it on
                                           (or graph outputs): what crosses a cut when running segment by segment
``index.segment_inputs(nodes)``            what a set of main-graph nodes reads from outside itself
``index.stored(value)``                    the :class:`StoredTensor` behind a value (initializer, Constant
                                           node, sparse initializer), joined to its node by object
``index.stored_tensors()``                 every stored tensor in every graph and function
``index.locate(node)``                     (scope, index) of a node object
``scope.walk()``                           every node of a graph, each followed by its subgraphs' nodes
========================================  ==================================================================

Edits go through the index (``insert_nodes``, ``remove_nodes``, ``set_nodes``, ``set_input``, ``set_output``,
``add_initializer``, ``remove_initializer``, ``set_elem_types``, ``fresh_name``): each changes the proto and marks
the index stale, and the next query rebuilds it, so no caller ever reads a map that no longer matches the graph.
Edits that reorder or remove nodes store copies of the node messages (protobuf's rule), so node objects taken
before such an edit belong to the old graph: look them up again afterwards. Changes made to the proto behind the
index's back need :meth:`GraphIndex.mark_stale`.

Node positions are indices into the proto's repeated ``node`` field of their graph; nodes are joined by object
identity (the index holds each node's Python object, which protobuf then hands out for that message), never by
names rebuilt from op types. Stored tensors are returned as the proto's own objects, to read and write in place.

One graph's index (:class:`Scope`, :class:`Use`, :class:`Definition`, :class:`StoredTensor`, :data:`SUBGRAPH`) is
in ``graph/scope.py``, the node order and value spans (:class:`GraphCycleError`) in ``graph/order.py``, and what a
node's attributes hold in ``graph/attributes.py``; this module ties them into the model's view and its edits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx
from onnx import NodeProto, TensorProto

from nmdeploy.graph.attributes import constant_value, subgraphs
from nmdeploy.graph.order import topological_order, value_spans
from nmdeploy.graph.scope import Scope, StoredTensor, Use, build_scope


class GraphIndex:
    """The index of one ModelProto (see the module docstring for the queries it answers)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self._stale = True
        self._order: list[int] | None = None
        self._spans: tuple[list[int], dict[str, tuple[int, int]]] | None = None
        self._names: set[str] | None = None
        self._build()

    # -- building --------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        self._registry: dict[int, tuple[Scope, int]] = {}
        self._scopes: list[Scope] = []
        self._main = build_scope(
            self.model.graph.node,
            "main",
            None,
            graph=self.model.graph,
            registry=self._registry,
            scopes=self._scopes,
        )
        self._functions: dict[tuple[str, str], Scope] = {}
        for function in self.model.functions:
            label = f"function:{function.domain}.{function.name}" if function.domain else f"function:{function.name}"
            self._functions[(function.domain, function.name)] = build_scope(
                function.node, label, None, function=function, registry=self._registry, scopes=self._scopes
            )
        self._order = None
        self._spans = None
        self._stale = False

    def refresh(self) -> GraphIndex:
        """Rebuild now (queries rebuild by themselves after edits made through the index)."""
        self._build()
        return self

    def mark_stale(self) -> None:
        """Declare that the proto was changed outside the index: the next query rebuilds."""
        self._stale = True
        self._names = None

    def _fresh(self) -> None:
        if self._stale:
            self._build()

    # -- scopes and nodes ------------------------------------------------------------------------------------------
    @property
    def main(self) -> Scope:
        """The main graph's scope."""
        self._fresh()
        return self._main

    @property
    def scopes(self) -> list[Scope]:
        """Every scope: the main graph first, then its subgraphs depth first, then each function and its subgraphs."""
        self._fresh()
        return self._scopes

    def function(self, domain: str, name: str) -> Scope | None:
        """The scope of local function ``domain.name``."""
        self._fresh()
        return self._functions.get((domain, name))

    @property
    def nodes(self) -> Sequence[NodeProto]:
        """The main graph's nodes, the same objects as the proto's (positions are indices into its node field)."""
        return self.main.nodes

    def locate(self, node: NodeProto) -> tuple[Scope, int]:
        """(scope, position) of a node object of this model; KeyError for a node that is not in it."""
        self._fresh()
        return self._registry[id(node)]

    def producer(self, value: str) -> NodeProto | None:
        """The main-graph node computing ``value``."""
        return self.main.producer(value)

    def consumers(self, value: str) -> list[Use]:
        """Reads of a main-graph value, subgraph reads included (see :meth:`Scope.consumers`)."""
        return self.main.consumers(value)

    def outer_reads(self, node: NodeProto) -> frozenset[str]:
        """Names the subgraphs of ``node`` (in any graph of the model) read from enclosing scopes."""
        scope, index = self.locate(node)
        return scope.outer_reads(index)

    @property
    def graph_outputs(self) -> tuple[str, ...]:
        return self.main.outputs

    # -- order, slices and cuts ------------------------------------------------------------------------------------
    def topological_order(self) -> list[int]:
        """Main-graph node indices with every node after the producers of what it reads (its subgraphs' outer
        reads included); the stored order where it already is one, otherwise the earliest-first topological order.
        A cycle raises :class:`GraphCycleError`."""
        self._fresh()
        if self._order is None:
            self._order = topological_order(self._main)
        return list(self._order)

    def backward_slice(self, values: Iterable[str], stop: Iterable[str] = ()) -> list[int]:
        """Indices, in topological order, of the main-graph nodes needed to compute ``values``; the walk does not go
        past ``stop`` values (they are taken as given)."""
        main = self.main
        stop = set(stop)
        needed: set[int] = set()
        pending = [main.producers[value] for value in values if value not in stop and value in main.producers]
        while pending:
            index = pending.pop()
            if index in needed:
                continue
            needed.add(index)
            for name in main.reads(index):
                if name not in stop:
                    producer = main.producers.get(name)
                    if producer is not None and producer not in needed:
                        pending.append(producer)
        return [index for index in self.topological_order() if index in needed]

    def live_values(self, cut: int, order: Sequence[int] | None = None) -> list[str]:
        """Values produced by the nodes at ``order[:cut]`` and read by a node at ``order[cut:]`` or by a graph
        output: what must be carried across the cut when the graph runs segment by segment.

        ``order`` defaults to :meth:`topological_order`; the answer lists values in the order they are produced.
        """
        main = self.main
        if order is None:
            if self._spans is None:
                self._spans = value_spans(main, self.topological_order())
            order, spans = self._spans
        else:
            order, spans = list(order), value_spans(main, order)[1]
        return [value for value, (made, last) in spans.items() if made < cut <= last]

    def segment_inputs(self, indices: Iterable[int]) -> list[str]:
        """Names the main-graph nodes at ``indices`` read but do not produce themselves (their subgraphs' outer
        reads included), in first-read order."""
        main = self.main
        chosen = sorted(set(indices))
        produced = {output for index in chosen for output in main.nodes[index].output if output}
        return list(dict.fromkeys(name for index in chosen for name in main.reads(index) if name not in produced))

    # -- stored tensors --------------------------------------------------------------------------------------------
    def stored(self, value: str, scope: Scope | None = None) -> StoredTensor | None:
        """The stored tensor behind ``value`` as seen from ``scope`` (the main graph by default)."""
        return (scope or self.main).stored(value)

    def stored_tensors(self) -> list[StoredTensor]:
        """Every stored tensor: initializers (overridable ones flagged), sparse initializers and Constant values,
        in every graph and function, in scope then storage order."""
        found: list[StoredTensor] = []
        for scope in self.scopes:
            for name, tensor in scope.initializers.items():
                found.append(StoredTensor(name, tensor, "initializer", scope, overridable=name in scope.inputs))
            for name, sparse in scope.sparse_initializers.items():
                found.append(StoredTensor(name, sparse.values, "sparse_initializer", scope, sparse=sparse))
            for node in scope.nodes:
                tensor = constant_value(node)
                if tensor is not None and node.output and node.output[0]:
                    found.append(StoredTensor(node.output[0], tensor, "constant", scope, node=node))
        return found

    # -- edits (main graph) ----------------------------------------------------------------------------------------
    def _edited(self) -> None:
        self._stale = True

    def insert_nodes(self, position: int, nodes: Iterable[NodeProto]) -> None:
        """Insert ``nodes`` into the main graph before position ``position`` (len(nodes) appends)."""
        graph = self.model.graph
        kept = list(graph.node)
        new = list(nodes)
        self._claim(new)
        self.set_nodes([*kept[:position], *new, *kept[position:]])

    def remove_nodes(self, indices: Iterable[int]) -> None:
        """Remove the main-graph nodes at ``indices``."""
        dropped = set(indices)
        self.set_nodes([node for index, node in enumerate(self.model.graph.node) if index not in dropped])

    def set_nodes(self, nodes: Iterable[NodeProto]) -> None:
        """Make ``nodes`` the main graph's node list (existing nodes and new ones, in the order given)."""
        nodes = list(nodes)
        self._claim(nodes)
        graph = self.model.graph
        del graph.node[:]
        graph.node.extend(nodes)
        self._edited()

    def set_input(self, node: NodeProto, position: int, name: str) -> None:
        """Make input ``position`` of ``node`` read ``name``."""
        node.input[position] = name
        self._claim_names([name])
        self._edited()

    def set_output(self, node: NodeProto, position: int, name: str) -> None:
        """Rename output ``position`` of ``node`` (readers are not renamed)."""
        node.output[position] = name
        self._claim_names([name])
        self._edited()

    def add_initializer(self, tensor: TensorProto) -> TensorProto:
        """Append ``tensor`` to the main graph's initializers; returns the stored copy."""
        self.model.graph.initializer.append(tensor)
        self._claim_names([tensor.name])
        self._edited()
        return self.model.graph.initializer[-1]

    def remove_initializer(self, name: str) -> None:
        """Remove the main graph's initializer ``name`` (nothing happens when there is none)."""
        for tensor in self.model.graph.initializer:
            if tensor.name == name:
                self.model.graph.initializer.remove(tensor)
                self._edited()
                return

    def set_elem_types(self, types: dict[str, int]) -> None:
        """Declare the element type of main-graph values (name -> ONNX type) wherever their type is written
        (inputs, outputs, value_info)."""
        graph = self.model.graph
        for value in [*graph.value_info, *graph.input, *graph.output]:
            if value.name in types and value.type.HasField("tensor_type"):
                value.type.tensor_type.elem_type = types[value.name]

    def fresh_name(self, base: str) -> str:
        """A value or node name that no graph of the model uses yet (``base``, else ``base_1``, ``base_2`` ...)."""
        if self._names is None:
            self._names = _used_names(self.model)
        name, count = base, 1
        while name in self._names:
            name, count = f"{base}_{count}", count + 1
        self._names.add(name)
        return name

    def _claim(self, nodes: Iterable[NodeProto]) -> None:
        if self._names is not None:
            for node in nodes:
                self._names.update([*node.input, *node.output, node.name])

    def _claim_names(self, names: Iterable[str]) -> None:
        if self._names is not None:
            self._names.update(names)


def _used_names(model: onnx.ModelProto) -> set[str]:
    used: set[str] = set()
    pending: list[onnx.GraphProto] = [model.graph]
    while pending:
        graph = pending.pop()
        used.update(value.name for value in [*graph.input, *graph.output, *graph.value_info])
        used.update(tensor.name for tensor in graph.initializer)
        used.update(tensor.values.name for tensor in graph.sparse_initializer)
        for node in graph.node:
            used.update([*node.input, *node.output, node.name])
            pending.extend(sub for _, sub in subgraphs(node))
    for function in model.functions:
        used.update([*function.input, *function.output])
        for node in function.node:
            used.update([*node.input, *node.output, node.name])
    return used
