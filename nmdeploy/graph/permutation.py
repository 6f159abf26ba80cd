"""Which channels of an ONNX graph can be permuted without changing what the model computes, and how.

Permuting the reduction-axis channels of a prunable weight changes its N:M groups. The function stays the same
when the activation feeding it is permuted the same way, which means permuting the output channels of every layer
producing that activation and every per-channel constant in between (biases, BatchNormalization parameters, PReLU
slopes). This module finds that closed region of the graph: starting from the consumer's activation it walks up to
the producing Conv/Gemm/MatMul layers and down to every reader, through elementwise and per-channel ops only.
Anything it cannot prove safe (reshapes, normalisation over the channel axis, a residual Add with an activation
that comes from elsewhere, a graph output, a tensor shared with other nodes) blocks the region, with the reason.
Only the main graph is handled; a region that reaches into a subgraph is blocked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import onnx

from nmdeploy.graph.declared import node_attribute
from nmdeploy.graph.dtypes import ARITHMETIC_FLOAT_NAMES
from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.prunable import PrunableWeight
from nmdeploy.graph.scope import SUBGRAPH
from nmdeploy.graph.weights import find_prunable_weights

# Ops applied to each element on its own: any channel order gives the same result.
_UNARY = {
    "Abs", "Acos", "Asin", "Atan", "Cast", "Ceil", "Celu", "Cos", "Elu", "Erf", "Exp", "Floor", "Gelu",
    "HardSigmoid", "HardSwish", "Identity", "LeakyRelu", "Log", "Mish", "Neg", "Reciprocal", "Relu", "Round",
    "Selu", "Sigmoid", "Sign", "Sin", "Softplus", "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu",
}  # fmt: skip
# Elementwise ops of two operands (numpy broadcasting): a constant operand is permuted along the channel axis.
_BINARY = {"Add", "Sub", "Mul", "Div", "Pow", "PRelu", "Max", "Min"}
# Ops over the spatial axes of an NCHW tensor, channel by channel.
_POOLS = {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool", "GlobalLpPool"}
_GEMMS = {"Conv", "Gemm", "MatMul"}
_WHY = {
    "Reshape": "may mix the channel axis with other axes",
    "Flatten": "mixes the channel axis with the spatial axes (Conv -> Flatten -> Gemm is not permuted)",
    "LayerNormalization": "normalises over the channel axis",
    "Softmax": "normalises over an axis that may be the channel axis",
    "Transpose": "moves the channel axis",
    "Concat": "joins tensors whose channels would need separate permutations",
}


@dataclass(frozen=True)
class ChannelEdit:
    """A stored tensor to permute along ``axis`` (``role``: reduction, output, or per-channel constant)."""

    tensor: onnx.TensorProto
    name: str
    axis: int
    role: str


@dataclass(frozen=True)
class PermutationPlan:
    """A closed region of the graph whose channels (``channels`` of them) can be permuted together.

    ``consumers`` are the weights whose reduction axis is permuted (the ones to prune), ``producers`` the weights
    whose output channels are, and ``constants`` the per-channel tensors in between.
    """

    channels: int
    consumers: tuple[PrunableWeight, ...]
    edits: tuple[ChannelEdit, ...]

    @property
    def producers(self) -> tuple[str, ...]:
        return tuple(edit.name for edit in self.edits if edit.role == "output")


@dataclass(frozen=True)
class Blocked:
    """The region around a weight that cannot be permuted, and why."""

    weights: tuple[str, ...]
    reason: str


class _Stop(Exception):
    """Raised inside the walk to block the region with a reason."""


class _Graph:
    """The main graph as the walk sees it: the index's producers and readers, plus weights by consumer node."""

    def __init__(self, model: onnx.ModelProto, index: GraphIndex, weights: tuple[PrunableWeight, ...]):
        self.index = index
        main = index.main
        self.main = main
        self.nodes = main.nodes
        self.outputs = set(main.outputs)
        self.producer = main.producers
        self.readers = main.uses  # (node, position); position SUBGRAPH: read inside one of its subgraphs
        self.references = {name: len(readers) for name, readers in self.readers.items()}
        # The weight read by each (node position, input index) of the main graph.
        self.weight_at: dict[tuple[int, int], PrunableWeight] = {}
        for weight in weights:
            for use in weight.uses:
                if use.graph == "main" and use.consumer is not None:
                    self.weight_at[(main.position(use.consumer), use.input_index)] = weight
        self.ranks = _inferred_ranks(model)

    def describe(self, index: int) -> str:
        node = self.nodes[index]
        return f"{node.op_type} '{node.name or node.output[0]}'"

    def constant(self, name: str) -> tuple[onnx.TensorProto | None, tuple[int, ...]] | None:
        """(stored tensor or None for attribute scalars/lists, shape) when ``name`` is a plain constant."""
        stored = self.main.stored(name)  # None for an initializer that is also an input: the caller may override it
        if stored is not None and stored.storage != "sparse_initializer":
            return stored.tensor, tuple(int(d) for d in stored.tensor.dims)
        node = self.main.producer(name)
        if node is None or node.op_type != "Constant" or name in self.main.inputs:
            return None
        attribute = node.attribute[0]
        if attribute.type in (onnx.AttributeProto.FLOATS, onnx.AttributeProto.INTS):
            return None, (len(onnx.helper.get_attribute_value(attribute)),)
        return None, ()


def plan_permutations(
    model: onnx.ModelProto, weights: Sequence[PrunableWeight] | None = None, index: GraphIndex | None = None
) -> list[PermutationPlan | Blocked]:
    """One plan (or the reason it is blocked) per region that has one of ``weights`` as a consumer.

    ``weights`` (from find_prunable_weights; all prunable weights when None) are where the walks start; a region
    may also contain other weights, and every region is reported once, whichever of its weights led to it.
    ``index`` is the model's GraphIndex when the caller has one.
    """
    index = GraphIndex(model) if index is None else index
    everything = find_prunable_weights(model, index).weights
    graph = _Graph(model, index, everything)
    if weights is None:
        weights = everything
    results: list[PermutationPlan | Blocked] = []
    covered: set[str] = set()
    for weight in weights:
        if weight.name in covered:
            continue
        result = _plan(graph, weight)
        names = (
            tuple(consumer.name for consumer in result.consumers)
            if isinstance(result, PermutationPlan)
            else result.weights
        )
        covered.update(names)
        results.append(result)
    return results


def _plan(graph: _Graph, weight: PrunableWeight) -> PermutationPlan | Blocked:
    walk = _Walk(graph)
    try:
        if len(weight.uses) != 1 or weight.uses[0].graph != "main":
            raise _Stop("used by several nodes or inside a subgraph; only a weight with one GEMM use is permuted")
        use = weight.uses[0]
        try:
            index = graph.main.position(use.consumer)
        except KeyError:
            raise _Stop(f"consumer node '{use.node}' not found in the main graph") from None
        walk.add_consumer(index, use.input_index, weight)
        walk.run()
        return walk.plan()
    except _Stop as stop:
        names = tuple(dict.fromkeys([weight.name, *(w.name for w in walk.consumers)]))
        return Blocked(names, str(stop))


class _Walk:
    """The closure of one region: values whose channel axis is permuted, and the tensors to edit."""

    def __init__(self, graph: _Graph):
        self.graph = graph
        self.axis: dict[str, int] = {}  # value -> channel axis, counted from the end (-1 for [..., C])
        self.rank: dict[str, int | None] = {}
        self.queue: list[str] = []
        self.visited: set[int] = set()  # elementwise and per-channel nodes already taken in
        self.consumer_nodes: set[int] = set()
        self.producer_nodes: set[int] = set()
        self.consumers: list[PrunableWeight] = []
        self.edits: dict[int, ChannelEdit] = {}  # keyed by id of the TensorProto
        self.channels: int | None = None

    # -- entry points --------------------------------------------------------------------------------------------
    def add_consumer(self, index: int, position: int, weight: PrunableWeight) -> None:
        """A GEMM reading a region value: its weight is permuted along its reduction axis."""
        node = self.graph.nodes[index]
        self.consumer_nodes.add(index)
        data_position, axis, rank = self._consumer_layout(index, position, weight)
        self._check_weight(weight)
        self._set_channels(weight.shape[weight.axis], weight.name)
        self.consumers.append(weight)
        self._edit(weight.tensor, weight.name, weight.axis, "reduction")
        self._join(node.input[data_position], axis, rank)

    def run(self) -> None:
        while self.queue:
            value = self.queue.pop()
            if value in self.graph.outputs:
                raise _Stop(f"'{value}' is a graph output, so its channel order is visible to the caller")
            producer = self.graph.producer.get(value)
            if producer is None:
                raise _Stop(
                    f"'{value}' comes from a graph input or a constant, not from a layer that can be permuted "
                    "(a residual connection?)"
                )
            self._visit(producer, value, upstream=True)
            for index, position in self.graph.readers.get(value, []):
                if position == SUBGRAPH:
                    raise _Stop(f"'{value}' is read inside a subgraph of {self.graph.describe(index)}")
                self._visit(index, value, upstream=False, position=position)

    def plan(self) -> PermutationPlan:
        members = self.visited | self.consumer_nodes | self.producer_nodes
        for edit in self.edits.values():
            users = self.graph.references.get(edit.name, 0)
            inside = sum(1 for index in members for name in self.graph.nodes[index].input if name == edit.name)
            if edit.role != "reduction" and users > inside:
                raise _Stop(f"'{edit.name}' is shared with nodes outside the region")
        if not any(edit.role == "output" for edit in self.edits.values()):
            raise _Stop("no layer producing the channels was found")
        return PermutationPlan(self.channels or 0, tuple(self.consumers), tuple(self.edits.values()))

    # -- walking -------------------------------------------------------------------------------------------------
    def _visit(self, index: int, value: str, *, upstream: bool, position: int = 0) -> None:
        node = self.graph.nodes[index]
        op = node.op_type
        if node.domain not in ("", "ai.onnx"):
            raise _Stop(f"{self.graph.describe(index)} is a custom op; its channel behaviour is unknown")
        if op in _GEMMS:
            mine, other = (
                (self.producer_nodes, self.consumer_nodes) if upstream else (self.consumer_nodes, self.producer_nodes)
            )
            if index in other:
                raise _Stop(f"{self.graph.describe(index)} both reads and writes the permuted channels")
            if index in mine:
                return
            if upstream:
                self._add_producer(index)
            else:
                self._add_reader_gemm(index, position)
            return
        if index in self.visited:
            return
        self.visited.add(index)
        axis, rank = self.axis[value], self.rank[value]
        if op in _UNARY or op == "Clip" or op == "Dropout":
            self._extra_inputs_scalar(index, first=1)
            self._join(node.input[0], axis, rank)
            self._single_output(index, node.output[0], axis, rank)
        elif op in _BINARY:
            if len(node.input) != 2:
                raise _Stop(f"{self.graph.describe(index)} has {len(node.input)} operands; only two are handled")
            out_rank = rank
            for name in node.input:
                found = self.graph.constant(name)
                if found is None:
                    self._join(name, axis, rank)
                else:
                    self._constant_operand(name, found, axis, index)
                    out_rank = None if rank is None else max(rank, len(found[1]))
            self._single_output(index, node.output[0], axis, out_rank)
        elif op == "BatchNormalization":
            self._require_channel_first(index, axis, rank)
            self._join(node.input[0], axis, rank)
            for name in node.input[1:5]:
                found = self.graph.constant(name)
                if found is None or found[0] is None or found[1] != (self.channels,):
                    raise _Stop(f"{self.graph.describe(index)} has a non-constant or oddly shaped '{name}'")
                self._edit(found[0], name, 0, "constant")
            self._single_output(index, node.output[0], axis, rank)
        elif op in _POOLS:
            self._require_channel_first(index, axis, rank)
            self._join(node.input[0], axis, rank)
            self._single_output(index, node.output[0], axis, rank)
        else:
            why = _WHY.get(op, "is not known to treat channels independently")
            raise _Stop(f"{self.graph.describe(index)} {why}")

    def _single_output(self, index: int, output: str, axis: int, rank: int | None) -> None:
        node = self.graph.nodes[index]
        for extra in node.output[1:]:
            if extra and self.graph.readers.get(extra) or extra in self.graph.outputs:
                raise _Stop(f"the second output of {self.graph.describe(index)} is used (pooling indices, masks)")
        self._join(output, axis, rank)

    def _join(self, value: str, axis: int, rank: int | None) -> None:
        rank = rank if rank is not None else self.graph.ranks.get(value)
        if value in self.axis:
            if self.axis[value] != axis:
                raise _Stop(f"'{value}' is reached with its channels on two different axes")
            return
        self.axis[value], self.rank[value] = axis, rank
        self.queue.append(value)

    def _extra_inputs_scalar(self, index: int, first: int) -> None:
        node = self.graph.nodes[index]
        for name in node.input[first:]:
            if not name:
                continue
            found = self.graph.constant(name)
            if found is None or _numel(found[1]) != 1:
                raise _Stop(f"{self.graph.describe(index)} takes '{name}', which is not a constant scalar")

    def _constant_operand(
        self, name: str, found: tuple[onnx.TensorProto | None, tuple[int, ...]], axis: int, index: int
    ) -> None:
        tensor, shape = found
        aligned = len(shape) + axis  # numpy broadcasting aligns the trailing axes
        if aligned < 0 or shape[aligned] == 1:
            return  # the same value for every channel
        if shape[aligned] != self.channels:
            raise _Stop(f"{self.graph.describe(index)}: '{name}' has {shape[aligned]} entries on the channel axis")
        if tensor is None:
            raise _Stop(f"{self.graph.describe(index)}: per-channel '{name}' is not stored as a tensor")
        self._edit(tensor, name, aligned, "constant")

    def _require_channel_first(self, index: int, axis: int, rank: int | None) -> None:
        if rank is None or rank + axis != 1:
            raise _Stop(f"{self.graph.describe(index)} works on axis 1, which is not known to be the channel axis")

    # -- layers at the boundary ----------------------------------------------------------------------------------
    def _consumer_layout(self, index: int, position: int, weight: PrunableWeight) -> tuple[int, int, int | None]:
        """(input index of the activation, its channel axis from the end, its rank) for a GEMM reading a weight."""
        node = self.graph.nodes[index]
        op = node.op_type
        if op == "Conv" and position == 1:
            if node_attribute(node, "group", 1) != 1:
                raise _Stop(f"{self.graph.describe(index)} is a grouped convolution")
            rank = len(weight.shape)
            return 0, -(rank - 1), rank
        if op == "Gemm" and position == 1 and not node_attribute(node, "transA", 0):
            return 0, -1, 2
        if op == "MatMul" and position == 1 and len(weight.shape) == 2:
            return 0, -1, None
        raise _Stop(f"{self.graph.describe(index)} reads the weight in a layout that is not handled")

    def _add_reader_gemm(self, index: int, position: int) -> None:
        node = self.graph.nodes[index]
        weight_position = 1
        weight = self.graph.weight_at.get((index, weight_position))
        if position != 0 or weight is None:
            raise _Stop(f"{self.graph.describe(index)} reads the permuted channels but not against a constant weight")
        data, axis, _ = self._consumer_layout(index, weight_position, weight)
        if self.axis[node.input[data]] != axis:
            raise _Stop(f"{self.graph.describe(index)} reduces over an axis other than the permuted channels")
        self.add_consumer(index, weight_position, weight)

    def _add_producer(self, index: int) -> None:
        node = self.graph.nodes[index]
        op = node.op_type
        weight = self.graph.weight_at.get((index, 1))
        if weight is None:
            raise _Stop(f"{self.graph.describe(index)} does not produce the channels from a constant weight")
        self.producer_nodes.add(index)
        self._check_weight(weight)
        if op == "Conv":
            if node_attribute(node, "group", 1) != 1:
                raise _Stop(f"{self.graph.describe(index)} is a grouped convolution")
            if any(step == "Transpose" for step in weight.uses[0].path):
                raise _Stop(f"the weight of {self.graph.describe(index)} is transposed on its way")
            out_axis, axis, rank = 0, -(len(weight.shape) - 1), len(weight.shape)
        elif len(weight.shape) == 2 and (op == "MatMul" or not node_attribute(node, "transA", 0)):
            out_axis, axis, rank = 1 - weight.axis, -1, 2 if op == "Gemm" else None
        else:
            raise _Stop(f"{self.graph.describe(index)} produces the channels in a layout that is not handled")
        self._set_channels(weight.shape[out_axis], weight.name)
        self._edit(weight.tensor, weight.name, out_axis, "output")
        if op in ("Conv", "Gemm") and len(node.input) > 2 and node.input[2]:
            bias = node.input[2]
            found = self.graph.constant(bias)
            if found is None:
                raise _Stop(f"{self.graph.describe(index)} adds a bias that is not a constant")
            if op == "Gemm":
                self._constant_operand(bias, found, -1, index)  # C broadcasts to the [M, N] output
            elif found[0] is None or found[1] != (self.channels,):
                raise _Stop(f"{self.graph.describe(index)} has a bias that is not a [{self.channels}] tensor")
            else:
                self._edit(found[0], bias, 0, "constant")
        output = node.output[0]
        if output in self.axis and self.axis[output] != axis:
            raise _Stop(f"'{output}' is reached with its channels on two different axes")
        self._join(output, axis, rank)

    def _check_weight(self, weight: PrunableWeight) -> None:
        if weight.dtype not in ARITHMETIC_FLOAT_NAMES or weight.dequantization is not None:
            raise _Stop(f"'{weight.name}' is a {weight.dtype} weight; permute before quantizing")
        if len(weight.uses) != 1 or weight.uses[0].graph != "main":
            raise _Stop(f"'{weight.name}' is shared by several layers")
        if self.graph.references.get(weight.name, 0) > 1:
            raise _Stop(f"'{weight.name}' is read by other nodes too")

    def _set_channels(self, count: int, name: str) -> None:
        if self.channels is None:
            self.channels = count
        elif self.channels != count:
            raise _Stop(f"'{name}' has {count} channels where the region has {self.channels}")

    def _edit(self, tensor: onnx.TensorProto, name: str, axis: int, role: str) -> None:
        key = id(tensor)
        if key in self.edits and (self.edits[key].axis != axis or self.edits[key].role != role):
            raise _Stop(f"'{name}' would be permuted along two axes in one region")
        self.edits[key] = ChannelEdit(tensor, name, axis, role)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _inferred_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """Ranks of the values that shape inference can tell (empty when it fails: ranks are then unknown)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is a best-effort hint here; unknown ranks only make the walk stricter
        return {}
    ranks = {}
    for info in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            ranks[info.name] = len(info.type.tensor_type.shape.dim)
    return ranks
