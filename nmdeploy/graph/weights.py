"""Find every prunable weight of an ONNX model and the axis of the stored tensor that its GEMM reduces over.

The walk goes from each Conv, ConvTranspose, Gemm and MatMul input, and the W and R inputs of each LSTM, GRU and
RNN, back to where the tensor is stored (an
initializer or a Constant node, in the main graph, an If/Loop/Scan subgraph or a function), through Transpose
(the axis is remapped), Cast, Identity, QuantizeLinear/DequantizeLinear (the tensor before quantization is what
must be N:M) and Reshapes that provably keep the axis. A consumer whose input comes from graph inputs is an
activation and is not reported. Anything that is constant but cannot be followed (a Reshape that splits the axis,
arithmetic on constants, a weight passed into a function) is reported with the reason instead of being guessed,
and marked foldable when the fold-constants pass can turn it into an initializer.

Only the protobuf is read: nothing is copied or rewritten, so this works the same on models with external data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from nmdeploy.graph.declared import node_attribute
from nmdeploy.graph.index import Definition, GraphIndex, Scope, constant_value

# Ops that leave the weight's layout as it is: the axis passes through them unchanged.
_PASS_THROUGH = {"Cast", "Identity", "QuantizeLinear", "DequantizeLinear"}

# ONNX's recurrent ops and their gate count. W is [directions, gates * hidden, input] and R is [directions,
# gates * hidden, hidden]: both reduce over their last axis, each direction's gates stacked along the middle one.
RECURRENT_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
RECURRENT_INPUT, RECURRENT_STATE = 1, 2  # the input positions of W and R
HIDDEN_STATE_REASON = (
    "recurrent weight R multiplies the hidden state, made inside the {op} (no graph value holds it): no calibration "
    "sees its input, so prune and convert both leave it dense"
)

SUBGRAPH_REASON = (
    "used inside {graph}, whose values the calibration run cannot read (it runs the main graph; a branch's values "
    "exist only while ONNX Runtime runs the If): convert and --min-fidelity leave it dense, prune (magnitude, no "
    "calibration) reaches it"
)

SHARED_REASON = (
    "read by {count} GEMMs ({nodes}): its fit would need every reader's input at once, and a later reader's input "
    "can depend on the weight itself (a tied or unrolled layer), which calibration stage by stage cannot order: "
    "convert and --min-fidelity leave it dense, prune (magnitude, no calibration) reaches it"
)


@dataclass(frozen=True)
class WeightUse:
    """One consumer of a weight: which node, which input, and the reduction axis in stored-tensor coordinates."""

    node: str
    op_type: str
    input_index: int
    axis: int
    path: tuple[str, ...]  # ops walked from the stored tensor to the consumer, e.g. ("Transpose", "Cast")
    graph: str
    consumer: onnx.NodeProto | None = field(default=None, compare=False, repr=False)  # the node itself


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
    embedding_lookups: tuple[str, ...] = ()
    """Gather nodes that read the same stored tensor as their table: a token embedding tied to this GEMM weight."""

    @property
    def dense_by_default(self) -> str | None:
        """Why every verb leaves this weight dense unless asked (``--sparse-tied-embedding``), or None.

        A tied lm_head (the logits MatMul reads Transpose(embedding table)) stores the token embeddings too: its N:M
        mask would zero every token's embedding at the same positions, a change no GEMM fit sees or compensates.
        llm-compressor's SparseGPT leaves the lm_head dense by default too.
        """
        tied = self.tied_embedding
        return None if tied is None else f"{tied}: left dense"

    @property
    def tied_embedding(self) -> str | None:
        """Where embedding lookups read this table, the words "tied to the token embedding that Gather ... reads"
        (else None): a change to this weight (a mask, a scale, Q/DQ) changes every token's embedding too."""
        if not self.embedding_lookups:
            return None
        lookups = ", ".join(f"'{name}'" for name in self.embedding_lookups[:2])
        return f"tied to the token embedding that Gather {lookups} reads"

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

    @property
    def recurrent(self) -> str | None:
        """The recurrent op (LSTM, GRU, RNN) reading the weight as its W or R, else None."""
        return next((use.op_type for use in self.uses if use.op_type in RECURRENT_GATES), None)

    @property
    def kept_dense(self) -> str | None:
        """Why every verb leaves this weight dense (prune, convert, the budget and inspect say the same), or None.

        A recurrent op's R reads the hidden state at step t - 1, which exists only inside the op: magnitude pruning
        it would be blind to what it multiplies, and TensorRT runs it dense anyway (see graph/eligibility.py).
        """
        for use in self.uses:
            if use.op_type in RECURRENT_GATES and use.input_index == RECURRENT_STATE:
                return HIDDEN_STATE_REASON.format(op=use.op_type)
        return None

    @property
    def uncalibrated(self) -> str | None:
        """Why the calibrated fit cannot reach this weight (convert, the budgets, prune and inspect say the same), or
        None: a use inside an If, Loop or Scan branch or a function body, or several GEMMs reading it."""
        inside = next((use.graph for use in self.uses if use.graph != "main"), None)
        if inside is None and self.graph != "main":
            inside = self.graph
        if inside is not None:
            return SUBGRAPH_REASON.format(graph=inside)
        if len(self.uses) > 1:
            nodes = list(dict.fromkeys(use.node for use in self.uses))
            named = ", ".join(f"'{node}'" for node in nodes[:3]) + (" ..." if len(nodes) > 3 else "")
            return SHARED_REASON.format(count=len(self.uses), nodes=named)
        return None

    @property
    def node_label(self) -> str:
        """The layer as users know it (the name ``inspect`` shows): the first consumer node's name, with " (+N)"
        for N more consumer nodes; the weight's own name where that node has none."""
        nodes = list(dict.fromkeys(use.node for use in self.uses))
        first = nodes[0] if nodes and nodes[0] else self.name
        return first + (f" (+{len(nodes) - 1})" if len(nodes) > 1 else "")


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


class _Constants:
    """Whether a value depends on stored tensors only, memoised by the scope defining each value (graphs revisit
    shared ancestors a lot, and every value on a walk is settled once)."""

    def __init__(self):
        self.memo: dict[tuple[int, str], bool] = {}

    def __call__(self, value: str, scope: Scope) -> bool:
        key, known, node = self._settle(value, scope)
        if known is not None:
            return known
        # An explicit stack, not recursion: a deep model's chain of producers outgrows Python's recursion limit.
        # A node is constant when everything it reads is (its subgraphs' reads from outside included); a read that
        # loops back to a node still on the walk counts as constant, so cycles in subgraphs end.
        on_walk = {key}
        stack = [(key, node, node.scope.reads(node.item), 0)]
        while stack:
            key, node, reads, position = stack[-1]
            if position == len(reads):
                self.memo[key] = True
                on_walk.discard(key)
                stack.pop()
                continue
            read_key, known, read_node = self._settle(reads[position], node.scope)
            if known is None and read_key in on_walk:
                known = True
            if known is None:
                on_walk.add(read_key)
                stack.append((read_key, read_node, read_node.scope.reads(read_node.item), 0))
                continue
            if not known:  # one read from outside the stored tensors settles every node on the walk
                for walked, *_ in stack:
                    self.memo[walked] = False
                return False
            stack[-1] = (key, node, reads, position + 1)
        return self.memo[self._settle(value, scope)[0]]

    def _settle(self, value: str, scope: Scope) -> tuple[tuple[int, str], bool | None, Definition | None]:
        """``value``'s memo key (by its defining scope), its answer when known, else its producing node."""
        hit = scope.lookup(value)
        if hit is None:
            return (id(scope), value), False, None
        key = (id(hit.scope), value)
        if hit.kind == "input":
            return key, False, None
        if hit.kind in ("initializer", "sparse_initializer"):
            return key, True, None
        return key, self.memo.get(key), hit


def find_prunable_weights(model: onnx.ModelProto, index: GraphIndex | None = None) -> WeightReport:
    """Every prunable weight of ``model`` with its reduction axis, and the constant operands that cannot be traced.

    ``index`` is the model's :class:`GraphIndex` when the caller has one (``OnnxModel.index``); else one is built.
    """
    index = GraphIndex(model) if index is None else index
    index.topological_order()  # a cyclic main graph is the user's error, said in one line before any walk
    constants = _Constants()
    found: dict[tuple[str, str], dict] = {}
    untraced: list[UntracedWeight] = []
    call_sites: dict[tuple[str, str], list[tuple[Scope, onnx.NodeProto]]] = {}
    for scope, _, node in index.main.walk():
        call_sites.setdefault((node.domain, node.op_type), []).append((scope, node))
        _visit(node, scope, found, untraced, constants)
    for function in model.functions:
        scope = index.function(function.domain, function.name)
        sites = call_sites.get((function.domain, function.name), [])
        constant_inputs = {
            argument
            for position, argument in enumerate(function.input)
            if any(
                position < len(site.input) and site.input[position] and constants(site.input[position], site_scope)
                for site_scope, site in sites
            )
        }
        for inner_scope, _, node in scope.walk():
            _visit(node, inner_scope, found, untraced, constants, constant_inputs)
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
            _embedding_lookups(entry["owner"], entry["name"]),
        )
        for entry in found.values()
    )
    return WeightReport(weights, tuple(untraced))


def _embedding_lookups(scope: Scope, name: str) -> tuple[str, ...]:
    """Gather nodes of ``scope`` whose table (input 0) is its stored tensor ``name``, through Cast, Identity, Q/DQ."""
    found, values, seen = [], [name], {name}
    while values:
        value = values.pop()
        for use in scope.consumers(value):
            node = scope.nodes[use.node]
            if node.domain not in ("", "ai.onnx"):
                continue
            if node.op_type == "Gather" and use.position == 0:
                found.append(node.name or f"Gather({node.output[0]})")
            elif node.op_type in _PASS_THROUGH and use.position == 0 and node.output[0] not in seen:
                seen.add(node.output[0])
                values.append(node.output[0])
    return tuple(dict.fromkeys(found))


def _weight_inputs(node: onnx.NodeProto) -> list[tuple[int, int]]:
    """(input index, reduction axis in the consumer's coordinates) for each input that may be a weight.

    Negative axes count from the end, so they hold for MatMul operands of any rank (batched MatMul included).
    """
    if node.op_type == "Conv":
        return [(1, 1)]
    if node.op_type == "ConvTranspose":
        return [(1, 0)]
    if node.op_type == "Gemm":
        return [(0, 0 if node_attribute(node, "transA", 0) else 1), (1, 1 if node_attribute(node, "transB", 0) else 0)]
    if node.op_type == "MatMul":
        return [(0, -1), (1, -2)]
    if node.op_type in RECURRENT_GATES:
        return [(RECURRENT_INPUT, -1), (RECURRENT_STATE, -1)]
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
    owner: Scope
    axis: int
    path: tuple[str, ...]
    dequantization: Dequantization | None = None


def _visit(
    node: onnx.NodeProto,
    scope: Scope,
    found: dict,
    untraced: list[UntracedWeight],
    constants: _Constants,
    constant_function_inputs: set[str] = frozenset(),
) -> None:
    if node.domain not in ("", "ai.onnx"):
        return
    for index, axis in _weight_inputs(node):
        if index >= len(node.input) or not node.input[index]:
            continue
        label = node.name or f"{node.op_type}({node.input[index]})"
        result = _trace(node.input[index], axis, scope, constants, constant_function_inputs)
        if result is None:
            continue  # an activation, not a weight
        if isinstance(result, _Reason):
            untraced.append(UntracedWeight(label, node.op_type, index, scope.name, result.text, result.foldable))
            continue
        shape = tuple(int(d) for d in result.tensor.dims)
        if len(shape) < 2:
            continue  # a vector operand of MatMul has no N:M structure
        if node.op_type == "Conv" and shape[1] == 1 and node_attribute(node, "group", 1) > 1:
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
                "owner": result.owner,
            },
        )
        entry["uses"].append(
            WeightUse(label, node.op_type, index, result.axis % len(shape), result.path, scope.name, node)
        )


def _dtype_name(data_type: int) -> str:
    return onnx.TensorProto.DataType.Name(data_type).lower()


def _trace(
    value: str, axis: int, scope: Scope, constants: _Constants, constant_function_inputs: set[str]
) -> _Stored | _Reason | None:
    """Follow ``value`` back to its storage: None for activations, a reason for untraceable constants."""
    path: list[str] = []
    first_op: tuple[onnx.NodeProto, Scope] | None = None  # the node right after storage, once storage is reached
    seen: set[tuple[int, str]] = set()
    while True:
        if (id(scope), value) in seen:  # a cycle inside a subgraph or function: nothing stored behind it
            return _Reason(f"'{value}' is computed in a cycle; an ONNX graph must be acyclic")
        seen.add((id(scope), value))
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
        if kind == "sparse_initializer":
            return _Reason(f"'{value}' is stored as a sparse initializer; store it dense to prune it")
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
            tensor = constant_value(node)
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
            perm = list(node_attribute(node, "perm", []))
            if not perm:
                return _Reason(f"Transpose '{node.name or value}' has no perm, so its rank is unknown here")
            axis = perm[axis % len(perm)]
        elif node.op_type == "Reshape" and node.domain in ("", "ai.onnx") and constants(value, owner):
            kept = _axis_through_reshape(node, axis, owner)
            if isinstance(kept, _Reason):
                return kept
            axis = kept
        elif (
            node.op_type == "Unsqueeze"
            and node.domain in ("", "ai.onnx")
            and _storage_shape(node.input[0], owner) is not None
        ):
            kept = _axis_through_unsqueeze(node, axis, owner)
            if isinstance(kept, _Reason):
                return kept
            axis = kept
        elif node.op_type not in _PASS_THROUGH or node.domain not in ("", "ai.onnx"):
            if constants(value, owner):
                folding = (
                    "the fold-constants pass, or polygraphy surgeon sanitize --fold-constants"
                    if owner.name == "main"  # the pass folds the main graph; polygraphy also folds subgraphs
                    else f"it is inside {owner.name}: polygraphy surgeon sanitize --fold-constants; folded, it is "
                    f"still {SUBGRAPH_REASON.format(graph=owner.name)}"
                )
                return _Reason(
                    f"computed from constants by {node.op_type} '{node.name or value}'; fold constants first "
                    f"({folding})",
                    value if owner.name == "main" else None,
                )
            return None
        path.append(node.op_type)
        first_op = (node, owner)
        value, scope = node.input[0], owner


def _axis_through_reshape(node: onnx.NodeProto, axis: int, scope: Scope) -> int | _Reason:
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
    if not node_attribute(node, "allowzero", 0):
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


def _axis_through_unsqueeze(node: onnx.NodeProto, axis: int, scope: Scope) -> int | _Reason:
    """The input axis behind output ``axis`` of an Unsqueeze (a 2-D weight made [1, out, K] for an LSTM cell, as
    torch exports ``nn.LSTMCell``), when its axes and the stored tensor's rank are known here."""
    label = node.name or node.output[0]
    axes_tensor = _stored_tensor(node.input[1], scope) if len(node.input) > 1 and node.input[1] else None
    axes = (
        [int(a) for a in onnx.numpy_helper.to_array(axes_tensor).reshape(-1)]
        if axes_tensor is not None
        else list(node_attribute(node, "axes", []))
    )
    stored = _storage_shape(node.input[0], scope)
    if not axes or stored is None:
        return _Reason(f"Unsqueeze '{label}' with axes not known here; fold constants first")
    rank = len(stored) + len(axes)
    inserted = {a % rank for a in axes}
    axis %= rank
    if axis in inserted:
        return _Reason(f"Unsqueeze '{label}' inserts the reduction axis itself, so nothing stored is reduced over")
    return axis - sum(a < axis for a in inserted)


def _storage_shape(value: str, scope: Scope) -> list[int] | None:
    """Dims of the stored tensor behind ``value`` when only shape-preserving ops (Cast, Identity, Q/DQ) intervene."""
    seen: set[tuple[int, str]] = set()
    while (id(scope), value) not in seen:  # a value seen again is a cycle: nothing stored behind it
        seen.add((id(scope), value))
        hit = scope.lookup(value)
        if hit is None or hit.kind in ("input", "sparse_initializer"):
            return None
        kind, item, owner = hit
        if kind == "initializer":
            return [int(d) for d in item.dims]
        if item.op_type == "Constant":
            tensor = constant_value(item)
            return [int(d) for d in tensor.dims] if tensor is not None else None
        if item.op_type not in _PASS_THROUGH:
            return None
        value, scope = item.input[0], owner
    return None


def _dequantization(first_op: tuple[onnx.NodeProto, Scope] | None, rank: int) -> Dequantization | None:
    """Scale and zero point of a DequantizeLinear reading the stored tensor directly, when both are stored constants."""
    if first_op is None or first_op[0].op_type != "DequantizeLinear":
        return None
    node, scope = first_op
    stored = [_stored_tensor(name, scope) for name in list(node.input[1:3]) + [""] * (3 - len(node.input))]
    if stored[0] is None or (len(node.input) > 2 and node.input[2] and stored[1] is None):
        return None
    return Dequantization(stored[0], stored[1], node_attribute(node, "axis", 1) % max(rank, 1))


def _stored_tensor(name: str, scope: Scope) -> onnx.TensorProto | None:
    stored = scope.stored(name) if name else None
    return None if stored is None or stored.storage == "sparse_initializer" else stored.tensor
