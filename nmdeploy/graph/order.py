"""The order a graph's nodes run in (:func:`topological_order`; a cycle is a :class:`GraphCycleError`) and the span
of each value over an order, from its producer to its last reader (:func:`value_spans`)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from nmdeploy.errors import InputError
from nmdeploy.graph.scope import Scope


class GraphCycleError(InputError):
    """The main graph has a cycle: no order computes every node after its inputs."""


def topological_order(scope: Scope) -> list[int]:
    """The scope's node positions with every node after the producers of what it reads (its subgraphs' outer reads
    included): the stored order where it already is one, otherwise the earliest-first topological order. A cycle
    raises :class:`GraphCycleError`."""
    nodes = scope.nodes
    parents: list[list[int]] = []
    in_order = True
    for index in range(len(nodes)):
        found = []
        for name in scope.reads(index):
            producer = scope.producers.get(name)
            if producer is not None:
                found.append(producer)
                if producer >= index:
                    in_order = False
        parents.append(found)
    if in_order:
        return list(range(len(nodes)))
    waiting = [len(set(found)) for found in parents]
    children: list[list[int]] = [[] for _ in nodes]
    for index, found in enumerate(parents):
        for parent in set(found):
            children[parent].append(index)
    ready = [index for index, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        index = heapq.heappop(ready)
        order.append(index)
        for child in children[index]:
            waiting[child] -= 1
            if waiting[child] == 0:
                heapq.heappush(ready, child)
    if len(order) < len(nodes):
        stuck = next(index for index, count in enumerate(waiting) if count)
        node = nodes[stuck]
        raise GraphCycleError(
            f"the graph has a cycle through {node.op_type} node '{node.name or node.output[0]}' "
            f"({len(nodes) - len(order)} nodes wait on each other); an ONNX graph must be acyclic, re-export the model"
        )
    return order


def value_spans(scope: Scope, order: Sequence[int]) -> tuple[list[int], dict[str, tuple[int, int]]]:
    """(order, value -> (position of its producer, position of its last reader)) over main-graph node values;
    a graph output's last reader is past the end."""
    where = {index: position for position, index in enumerate(order)}
    spans: dict[str, tuple[int, int]] = {}
    for index in order:
        for output in scope.nodes[index].output:
            if output:
                made = where[index]
                last = max((where[use.node] for use in scope.uses.get(output, []) if use.node in where), default=made)
                spans[output] = (made, last)
    end = len(order)
    for output in scope.outputs:
        if output in spans:
            spans[output] = (spans[output][0], end)
    return list(order), spans
