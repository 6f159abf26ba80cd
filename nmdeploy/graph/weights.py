"""Find every prunable weight of an ONNX model and the axis of the stored tensor that its GEMM reduces over.

The walk goes from each Conv, ConvTranspose, Gemm and MatMul input back to where the tensor is stored (an
initializer or a Constant node, in the main graph, an If/Loop/Scan subgraph or a function), through Transpose
(the axis is remapped), Cast, Identity, QuantizeLinear/DequantizeLinear (the tensor before quantization is what
must be N:M) and Reshapes that provably keep the axis. A consumer whose input comes from graph inputs is an
activation and is not reported. Anything that is constant but cannot be followed (a Reshape that splits the axis,
arithmetic on constants, a weight passed into a function) is reported with the reason instead of being guessed,
and marked foldable when the fold-constants pass can turn it into an initializer.

Only the protobuf is read: nothing is copied or rewritten, so this works the same on models with external data.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import onnx

# Ops that leave the weight's layout as it is: the axis passes through them unchanged.
_PASS_THROUGH = {"Cast", "Identity", "QuantizeLinear", "DequantizeLinear"}


@dataclass(frozen=True)
class WeightUse:
    """One consumer of a weight: which node, which input, and the reduction axis in stored-tensor coordinates."""

    node: str
    op_type: str
    input_index: int
    axis: int
    path: tuple[str, ...]  # ops walked from the stored tensor to the consumer, e.g. ("Transpose", "Cast")
    graph: str


@dataclass(frozen=True)
class Dequantization:
    """The DequantizeLinear right after an integer weight: pruning must set pruned positions to the zero point."""

    scale: onnx.TensorProto
    zero_point: onnx.TensorProto | None
    axis: int  # the per-channel axis of scale and zero point, in stored-tensor coordinates


@dataclass(frozen=True)
class PrunableWeight:
    """A stored weight tensor and every GEMM-like use of it."""

    name: str
    kind: str  # "initializer" or "constant" (the output of a Constant node)
    graph: str  # "main", a subgraph path such as "main/If_0:then_branch", or "function:domain.name"
    shape: tuple[int, ...]
    dtype: str
    uses: tuple[WeightUse, ...]
    tensor: onnx.TensorProto = field(compare=False, repr=False)  # the stored proto itself, for reading and writing
    dequantization: Dequantization | None = field(default=None, compare=False, repr=False)

    @property
    def axes(self) -> tuple[int, ...]:
        """The distinct reduction axes of the uses, in order of first appearance."""
        return tuple(dict.fromkeys(use.axis for use in self.uses))

    @property
    def axis(self) -> int | None:
        """The reduction axis when all uses agree; None when they need different axes (see needs_transposable)."""
        return self.axes[0] if len(self.axes) == 1 else None

    @property
    def needs_transposable(self) -> bool:
        """Shared by consumers that reduce over different axes (tied embeddings, shared projections)."""
        return len(self.axes) > 1


@dataclass(frozen=True)
class UntracedWeight:
    """A constant GEMM operand whose stored tensor or axis could not be determined, and why."""

    node: str
    op_type: str
    input_index: int
    graph: str
    reason: str
    foldable: str | None = None  # the value to fold into an initializer when it is computed from constants only


@dataclass(frozen=True)
class WeightReport:
    weights: tuple[PrunableWeight, ...]
    untraced: tuple[UntracedWeight, ...]


@dataclass
class _Scope:
    """Names visible in one graph: its initializers, the nodes producing each value, and the enclosing scope."""

    name: str
    initializers: dict[str, onnx.TensorProto]
    producers: dict[str, onnx.NodeProto]
    inputs: set[str]
    parent: _Scope | None = None
    constant: dict[str, bool] = field(default_factory=dict)  # memo of is_constant(value) looked up from here

    def is_constant(self, value: str) -> bool:
        """True when ``value`` depends on initializers and Constant nodes only (memoised: graphs revisit a lot)."""
        if value not in self.constant:
            self.constant[value] = _is_constant(value, self, set())
        return self.constant[value]

    def lookup(self, value: str) -> tuple[str, object, _Scope] | None:
        """("initializer", TensorProto) or ("node", NodeProto) or ("input", None) for a name, searching outwards."""
        scope: _Scope | None = self
        while scope is not None:
            if value in scope.producers:
                return "node", scope.producers[value], scope
            if value in scope.inputs:
                # An initializer that is also a graph input is only a default: the caller may override it.
                return "input", None, scope
            if value in scope.initializers:
                return "initializer", scope.initializers[value], scope
            scope = scope.parent
        return None


def find_prunable_weights(model: onnx.ModelProto) -> WeightReport:
    """Every prunable weight of ``model`` with its reduction axis, and the constant operands that cannot be traced."""
    found: dict[tuple[str, str], dict] = {}
    untraced: list[UntracedWeight] = []
    call_sites: dict[tuple[str, str], list[tuple[_Scope, onnx.NodeProto]]] = {}
    for scope, node in _walk_graph(model.graph, "main", None):
        call_sites.setdefault((node.domain, node.op_type), []).append((scope, node))
        _visit(node, scope, found, untraced)
    for function in model.functions:
        name = f"function:{function.domain}.{function.name}" if function.domain else f"function:{function.name}"
        scope = _Scope(name, {}, {}, set(function.input))
        for node in function.node:
            for output in node.output:
                scope.producers[output] = node
        sites = call_sites.get((function.domain, function.name), [])
        constant_inputs = {
            argument
            for position, argument in enumerate(function.input)
            if any(
                position < len(site.input) and site.input[position] and site_scope.is_constant(site.input[position])
                for site_scope, site in sites
            )
        }
        for inner_scope, node in _walk_nodes(function.node, scope):
            _visit(node, inner_scope, found, untraced, constant_inputs)
    weights = tuple(
        PrunableWeight(
            entry["name"],
            entry["kind"],
            entry["graph"],
            entry["shape"],
            entry["dtype"],
            tuple(entry["uses"]),
            entry["tensor"],
            entry["dequantization"],
        )
        for entry in found.values()
    )
    return WeightReport(weights, tuple(untraced))


def _walk_graph(graph: onnx.GraphProto, name: str, parent: _Scope | None) -> Iterator[tuple[_Scope, onnx.NodeProto]]:
    scope = _Scope(name, {t.name: t for t in graph.initializer}, {}, {i.name for i in graph.input}, parent)
    for node in graph.node:
        for output in node.output:
            if output:
                scope.producers[output] = node
    yield from _walk_nodes(graph.node, scope)


def _walk_nodes(nodes, scope: _Scope) -> Iterator[tuple[_Scope, onnx.NodeProto]]:
    for index, node in enumerate(nodes):
        yield scope, node
        for attribute in node.attribute:
            label = node.name or f"{node.op_type}_{index}"
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _walk_graph(attribute.g, f"{scope.name}/{label}:{attribute.name}", scope)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for k, sub in enumerate(attribute.graphs):
                    yield from _walk_graph(sub, f"{scope.name}/{label}:{attribute.name}[{k}]", scope)


def _attribute(node: onnx.NodeProto, name: str, default):
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default


def _weight_inputs(node: onnx.NodeProto) -> list[tuple[int, int]]:
    """(input index, reduction axis in the consumer's coordinates) for each input that may be a weight.

    Negative axes count from the end, so they hold for MatMul operands of any rank (batched MatMul included).
    """
    if node.op_type == "Conv":
        return [(1, 1)]
    if node.op_type == "ConvTranspose":
        return [(1, 0)]
    if node.op_type == "Gemm":
        return [(0, 0 if _attribute(node, "transA", 0) else 1), (1, 1 if _attribute(node, "transB", 0) else 0)]
    if node.op_type == "MatMul":
        return [(0, -1), (1, -2)]
    return []


@dataclass(frozen=True)
class _Reason:
    text: str
    foldable: str | None = None


@dataclass(frozen=True)
class _Stored:
    tensor: onnx.TensorProto
    name: str
    kind: str
    owner: _Scope
    axis: int
    path: tuple[str, ...]
    dequantization: Dequantization | None = None


def _visit(
    node: onnx.NodeProto,
    scope: _Scope,
    found: dict,
    untraced: list[UntracedWeight],
    constant_function_inputs: set[str] = frozenset(),
) -> None:
    if node.domain not in ("", "ai.onnx"):
        return
    for index, axis in _weight_inputs(node):
        if index >= len(node.input) or not node.input[index]:
            continue
        label = node.name or f"{node.op_type}({node.input[index]})"
        result = _trace(node.input[index], axis, scope, constant_function_inputs)
        if result is None:
            continue  # an activation, not a weight
        if isinstance(result, _Reason):
            untraced.append(UntracedWeight(label, node.op_type, index, scope.name, result.text, result.foldable))
            continue
        shape = tuple(int(d) for d in result.tensor.dims)
        if len(shape) < 2:
            continue  # a vector operand of MatMul has no N:M structure
        if node.op_type == "Conv" and shape[1] == 1 and _attribute(node, "group", 1) > 1:
            untraced.append(
                UntracedWeight(
                    label,
                    node.op_type,
                    index,
                    scope.name,
                    "depthwise convolution: one input channel per group, nothing to prune",
                )
            )
            continue
        entry = found.setdefault(
            (result.owner.name, result.name),
            {
                "name": result.name,
                "kind": result.kind,
                "graph": result.owner.name,
                "shape": shape,
                "dtype": _dtype_name(result.tensor.data_type),
                "uses": [],
                "tensor": result.tensor,
                "dequantization": result.dequantization,
            },
        )
        entry["uses"].append(WeightUse(label, node.op_type, index, result.axis % len(shape), result.path, scope.name))


def _dtype_name(data_type: int) -> str:
    return onnx.TensorProto.DataType.Name(data_type).lower()


def _trace(value: str, axis: int, scope: _Scope, constant_function_inputs: set[str]) -> _Stored | _Reason | None:
    """Follow ``value`` back to its storage: None for activations, a reason for untraceable constants."""
    path: list[str] = []
    first_op: tuple[onnx.NodeProto, _Scope] | None = None  # the node right after storage, once storage is reached
    while True:
        hit = scope.lookup(value)
        if hit is None:
            return None
        kind, item, owner = hit
        if kind == "input":
            if value in owner.initializers:
                return _Reason(f"'{value}' is a graph input with a default initializer, so it is not constant")
            if value in constant_function_inputs and owner.name.startswith("function:"):
                return _Reason(f"the weight reaches {owner.name} as its input '{value}'; inline local functions first")
            return None
        if kind == "initializer":
            return _Stored(
                item,
                value,
                "initializer",
                owner,
                axis,
                tuple(reversed(path)),
                _dequantization(first_op, len(item.dims)),
            )
        node: onnx.NodeProto = item
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            tensor = _attribute(node, "value", None)
            if tensor is None:
                return _Reason(f"Constant '{value}' holds no tensor value")
            return _Stored(
                tensor,
                value,
                "constant",
                owner,
                axis,
                tuple(reversed(path)),
                _dequantization(first_op, len(tensor.dims)),
            )
        if node.op_type == "Transpose":
            perm = list(_attribute(node, "perm", []))
            if not perm:
                return _Reason(f"Transpose '{node.name or value}' has no perm, so its rank is unknown here")
            axis = perm[axis % len(perm)]
        elif node.op_type == "Reshape" and node.domain in ("", "ai.onnx") and owner.is_constant(value):
            kept = _axis_through_reshape(node, axis, owner)
            if isinstance(kept, _Reason):
                return kept
            axis = kept
        elif node.op_type not in _PASS_THROUGH or node.domain not in ("", "ai.onnx"):
            if owner.is_constant(value):
                return _Reason(
                    f"computed from constants by {node.op_type} '{node.name or value}'; fold constants "
                    f"first (the fold-constants pass, or polygraphy surgeon sanitize --fold-constants)",
                    value if owner.name == "main" else None,
                )
            return None
        path.append(node.op_type)
        first_op = (node, owner)
        value, scope = node.input[0], owner


def _axis_through_reshape(node: onnx.NodeProto, axis: int, scope: _Scope) -> int | _Reason:
    """The input axis that a Reshape keeps intact as output ``axis``, when provable from constant shapes.

    The axis is kept when it has the same length on both sides and the same number of elements before it, so each
    of its fibres is the same run of elements in memory. The input shape is the stored tensor's, which is only
    known when nothing but Cast/Identity/Q/DQ lies between the storage and the Reshape.
    """
    label = node.name or node.output[0]
    shape_tensor = _stored_tensor(node.input[1], scope) if len(node.input) > 1 else None
    stored = _storage_shape(node.input[0], scope)
    if shape_tensor is None or stored is None:
        return _Reason(
            f"Reshape '{label}' with shapes not known here; fold constants first (the fold-constants pass)",
            node.output[0] if scope.name == "main" else None,
        )
    target = [int(d) for d in onnx.numpy_helper.to_array(shape_tensor).reshape(-1)]
    if not _attribute(node, "allowzero", 0):
        target = [stored[i] if d == 0 and i < len(stored) else d for i, d in enumerate(target)]
    if -1 in target:
        known = 1
        for d in target:
            known *= d if d != -1 else 1
        total = 1
        for d in stored:
            total *= d
        target[target.index(-1)] = total // known if known else 0
    axis %= len(target)
    before = 1
    for d in target[:axis]:
        before *= d
    running = 1
    for index, size in enumerate(stored):
        if running == before and size == target[axis]:
            return index
        running *= size
    return _Reason(
        f"Reshape '{label}' splits or merges the reduction axis ({stored} -> {target}); fold constants "
        f"first, then prune the folded weight",
        node.output[0] if scope.name == "main" else None,
    )


def _storage_shape(value: str, scope: _Scope) -> list[int] | None:
    """Dims of the stored tensor behind ``value`` when only shape-preserving ops (Cast, Identity, Q/DQ) intervene."""
    while True:
        hit = scope.lookup(value)
        if hit is None or hit[0] == "input":
            return None
        kind, item, owner = hit
        if kind == "initializer":
            return [int(d) for d in item.dims]
        if item.op_type == "Constant":
            tensor = _attribute(item, "value", None)
            return [int(d) for d in tensor.dims] if tensor is not None else None
        if item.op_type not in _PASS_THROUGH:
            return None
        value, scope = item.input[0], owner


def _dequantization(first_op: tuple[onnx.NodeProto, _Scope] | None, rank: int) -> Dequantization | None:
    """Scale and zero point of a DequantizeLinear reading the stored tensor directly, when both are stored constants."""
    if first_op is None or first_op[0].op_type != "DequantizeLinear":
        return None
    node, scope = first_op
    stored = [_stored_tensor(name, scope) for name in list(node.input[1:3]) + [""] * (3 - len(node.input))]
    if stored[0] is None or (len(node.input) > 2 and node.input[2] and stored[1] is None):
        return None
    return Dequantization(stored[0], stored[1], _attribute(node, "axis", 1) % max(rank, 1))


def _stored_tensor(name: str, scope: _Scope) -> onnx.TensorProto | None:
    hit = scope.lookup(name) if name else None
    if hit is None or hit[0] == "input":
        return None
    if hit[0] == "initializer":
        return hit[1]
    node = hit[1]
    return _attribute(node, "value", None) if node.op_type == "Constant" else None


def _is_constant(value: str, scope: _Scope, seen: set[str]) -> bool:
    """The walk behind :meth:`_Scope.is_constant`; ``seen`` stops revisits of shared ancestors."""
    if value in seen:
        return True
    seen.add(value)
    hit = scope.lookup(value)
    if hit is None or hit[0] == "input":
        return False
    kind, item, owner = hit
    if kind == "initializer":
        return True
    return all(_is_constant(name, owner, seen) for name in item.input if name)
