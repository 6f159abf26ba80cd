"""Which stored tables a graph input indexes: the query behind valid random token ids and embedding recovery.

An input indexes a table when it reaches the indices of a Gather, directly or through ops that pass its values on
unchanged (Cast, Identity, Unsqueeze, Squeeze, Reshape, Flatten, Expand: their data input only). Only the main
graph is followed; a subgraph's reads are not.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from nmdeploy.graph.index import GraphIndex

# Ops whose output holds the values of their first input (only the shape or type changes).
VALUE_PRESERVING = frozenset({"Cast", "Identity", "Unsqueeze", "Squeeze", "Reshape", "Flatten", "Expand"})


@dataclass(frozen=True)
class TableRead:
    """One Gather that reads rows of ``table`` at indices derived from an input; ``rows`` is the table's size along
    the gathered axis, None when the data is computed (its size is not known before running)."""

    table: str
    rows: int | None
    node: onnx.NodeProto


def indexed_tables(model: onnx.ModelProto | GraphIndex, names: list[str] | None = None) -> dict[str, list[TableRead]]:
    """Every main-graph input (or each of ``names``) -> the Gathers whose indices it becomes, in graph order."""
    index = model if isinstance(model, GraphIndex) else GraphIndex(model)
    main = index.main
    if names is None:
        initializers = set(main.initializers)
        names = [value.name for value in index.model.graph.input if value.name not in initializers]
    found: dict[str, list[TableRead]] = {}
    for name in names:
        reads: list[TableRead] = []
        pending, seen = [name], {name}
        while pending:
            for use in main.consumers(pending.pop()):
                if use.position < 0:
                    continue
                node = main.nodes[use.node]
                if node.op_type in VALUE_PRESERVING and use.position == 0 and node.output[0] not in seen:
                    seen.add(node.output[0])
                    pending.append(node.output[0])
                elif node.op_type == "Gather" and use.position == 1:
                    reads.append(TableRead(node.input[0], _rows(index, node), node))
        found[name] = sorted(reads, key=lambda read: main.position(read.node))
    return found


def index_bound(reads: list[TableRead]) -> int | None:
    """The number of valid ids for an input with these reads: the fewest rows of the stored tables it indexes (None
    when it indexes no stored table)."""
    sizes = [read.rows for read in reads if read.rows is not None]
    return min(sizes) if sizes else None


def _rows(index: GraphIndex, node: onnx.NodeProto) -> int | None:
    stored = index.stored(node.input[0])
    if stored is None:
        return None
    # A sparse initializer's tensor holds its values; the table's shape is the sparse tensor's own dims.
    dims = list((stored.sparse if stored.sparse is not None else stored.tensor).dims)
    if not dims:
        return None
    axis = next((attribute.i for attribute in node.attribute if attribute.name == "axis"), 0)
    return int(dims[axis % len(dims)]) if -len(dims) <= axis < len(dims) else None
