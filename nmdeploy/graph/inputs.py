"""Which stored tables a graph input indexes: the query behind valid random token ids, embedding recovery and the
token vocabulary (which outputs are a language model's logits, which weight is its lm_head).

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


@dataclass(frozen=True)
class TokenVocabulary:
    """The graph input that carries token ids, the embedding table it indexes and that table's rows."""

    input: str
    table: str
    rows: int


def token_vocabulary(model: onnx.ModelProto | GraphIndex) -> TokenVocabulary | None:
    """The model's token input: ``input_ids`` when it indexes a stored table, else the input whose stored table is
    the largest (a vocabulary has thousands of rows; position and segment tables, the other inputs models index
    tables with, hundreds or two). None when no input indexes a stored table, or two tables tie for the largest.
    Only the token table names a vocabulary: a 2-class head is not one because a segment table has 2 rows, nor are
    hidden states because a position table is as wide as the model."""
    largest: dict[str, TableRead] = {}
    for name, reads in indexed_tables(model).items():
        stored = [read for read in reads if read.rows is not None]
        if stored:
            largest[name] = max(stored, key=lambda read: read.rows)
    if "input_ids" in largest:
        token = "input_ids"
    else:
        ranked = sorted(largest, key=lambda name: largest[name].rows, reverse=True)
        if not ranked or (len(ranked) > 1 and largest[ranked[0]].rows == largest[ranked[1]].rows):
            return None
        token = ranked[0]
    return TokenVocabulary(token, largest[token].table, int(largest[token].rows))


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
