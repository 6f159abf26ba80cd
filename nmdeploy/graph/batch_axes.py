"""Which axis of each model input and output holds a batch's rows, as far as the graph tells.

Most models take their rows along axis 0, but a stateful one need not: a voice-activity detector takes a frame
[B, 512], a scalar sample rate and a state [2, B, 128], and returns the next state [2, B, 128]; a CTC recogniser
returns [time, B, classes]. One rule serves every caller (the runtimes cutting and joining batches, the fidelity
measures counting rows):

- the batch symbol is the symbolic dimension most real inputs start with (ties: the first input's);
- a value whose shape holds that symbol has its rows on the first axis holding it: the graph *names* that axis;
- otherwise the axis is inferred: a free axis 0, else an axis 0 fixed at 1 where the free axes are named as sizes
  (a captcha reader's [1, 1, 64, image_width]: a batch of one), else the one free axis, else 0; a value of
  fixed shape has none where the model's batch is free (a table the model reads whole), and axis 0 in a model of
  fixed shapes, for the inputs whose first dimension is the most common one (the others: none);
- a scalar has no batch axis; an output without a declared shape takes axis 0.

Callers that would rather measure than guess (the fidelity meter: the axis whose length is the batch's) take only
the named axes (:meth:`GraphBatchAxes.named_output_axes`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import onnx

Dim = tuple[str | None, int | None]


@dataclass(frozen=True)
class GraphBatchAxes:
    """Value name -> the axis of its rows (None: it has none), for every real input and every output; ``named``:
    the values whose axis the batch symbol names (the others are inferred from their free dimensions)."""

    inputs: dict[str, int | None]
    outputs: dict[str, int | None]
    named: frozenset[str]
    input_ranks: dict[str, int]

    @property
    def axes(self) -> dict[str, int | None]:
        """Inputs and outputs together (an input passed through as an output keeps its input's axis)."""
        return {**self.outputs, **self.inputs}

    def named_output_axes(self) -> dict[str, int]:
        """Only the output axes the graph names (output name -> axis); the caller decides the others."""
        return {name: axis for name, axis in self.outputs.items() if name in self.named and axis is not None}


def _dims(value: onnx.ValueInfoProto) -> list[Dim]:
    """(symbol, size) per dimension: a free dimension has no size (Paddle writes -1 for it)."""
    dims = value.type.tensor_type.shape.dim
    return [(d.dim_param or None, d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None) for d in dims]


def real_inputs(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a caller feeds (an initializer listed as an input is a stored weight)."""
    initializers = {t.name for t in proto.graph.initializer}
    return [value for value in proto.graph.input if value.name not in initializers]


def batch_symbol(values: Iterable[onnx.ValueInfoProto]) -> str | None:
    """The symbol most of ``values`` start with (ties: the first one's), or None."""
    starts = Counter(dims[0][0] for value in values if (dims := _dims(value)) and dims[0][0])
    return starts.most_common(1)[0][0] if starts else None


def _named_axis(dims: list[Dim], symbol: str | None) -> int | None:
    if symbol is None:
        return None
    return next((index for index, (name, _) in enumerate(dims) if name == symbol), None)


def _inferred_axis(dims: list[Dim], free_batch: bool) -> int | None:
    if not dims:
        return None
    free = [index for index, (_, size) in enumerate(dims) if size is None]
    if not free:
        return None if free_batch else 0
    if 0 in free:
        return 0
    if dims[0][1] == 1 and not any(_batch_like(dims[index][0]) for index in free):
        return 0  # a batch fixed at one row, its free axes named as sizes (an image's width, a sequence's length)
    return free[0] if len(free) == 1 else 0


def _batch_like(symbol: str | None) -> bool:
    """Whether a dimension's symbol may name a batch: unnamed, or named so (batch, batch_size, N, B)."""
    return symbol is None or "batch" in symbol.lower() or symbol in ("N", "B", "n", "b")


def graph_batch_axes(proto: onnx.ModelProto) -> GraphBatchAxes:
    """The batch axis of every real input and every output of ``proto``, by the rules of this module."""
    inputs = real_inputs(proto)
    symbol = batch_symbol(inputs)
    input_dims = {value.name: _dims(value) for value in inputs}
    free_batch = symbol is not None or any(size is None for dims in input_dims.values() for _, size in dims)
    named: set[str] = set()

    def axis_of(name: str, dims: list[Dim]) -> int | None:
        axis = _named_axis(dims, symbol)
        if axis is not None:
            named.add(name)
            return axis
        return _inferred_axis(dims, free_batch)

    if free_batch:
        input_axes = {name: axis_of(name, dims) for name, dims in input_dims.items()}
    else:  # a fixed-shape model: rows on axis 0 where it agrees with the most common first dimension
        firsts = Counter(dims[0][1] for dims in input_dims.values() if dims)
        common = firsts.most_common(1)[0][0] if firsts else None
        input_axes = {name: 0 if dims and dims[0][1] == common else None for name, dims in input_dims.items()}
    output_axes: dict[str, int | None] = {}
    for value in proto.graph.output:
        if value.name in input_axes:  # an input passed through: its input's axis
            output_axes[value.name] = input_axes[value.name]
            continue
        output_axes[value.name] = axis_of(value.name, _dims(value)) if value.type.tensor_type.HasField("shape") else 0
    ranks = {name: len(dims) for name, dims in input_dims.items()}
    return GraphBatchAxes(input_axes, output_axes, frozenset(named), ranks)
