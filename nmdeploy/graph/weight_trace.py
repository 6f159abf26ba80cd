"""Follow one GEMM operand back to the tensor stored behind it, keeping track of the reduction axis.

The walk passes Transpose (the axis is remapped), Unsqueeze (a 2-D weight made 3-D, the axis remapped), Cast,
Identity, QuantizeLinear/DequantizeLinear (the tensor before quantization is what must be N:M) and Reshapes that
provably keep the axis. A value reached from a graph input is an activation (None); anything constant that cannot be
followed comes back as :class:`Untraceable` with the reason, and the value to fold when folding constants would help.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from nmdeploy.graph.attributes import constant_value
from nmdeploy.graph.constant_values import ConstantValues
from nmdeploy.graph.declared import node_attribute
from nmdeploy.graph.prunable import SUBGRAPH_REASON, Dequantization
from nmdeploy.graph.scope import Scope

# Ops that leave the weight's layout as it is: the axis passes through them unchanged.
PASS_THROUGH = {"Cast", "Identity", "QuantizeLinear", "DequantizeLinear"}


@dataclass(frozen=True)
class Untraceable:
    """A constant operand that cannot be followed to its storage: why, and the value to fold when folding would
    make it traceable."""

    text: str
    foldable: str | None = None
    weight: bool = True
    """Whether a stored tensor stands behind the operand as the GEMM's weight (TensorRT folds what computes it into
    one constant weight); False where none does (a value computed in a cycle, a Constant of no tensor, an Unsqueeze
    inserting the reduction axis itself)."""


@dataclass(frozen=True)
class TracedWeight:
    """The stored tensor behind a GEMM operand, the reduction axis in its coordinates, and the ops walked to reach
    the consumer."""

    tensor: onnx.TensorProto
    name: str
    kind: str
    owner: Scope
    axis: int
    path: tuple[str, ...]
    dequantization: Dequantization | None = None


def trace_weight(
    value: str, axis: int, scope: Scope, constants: ConstantValues, constant_function_inputs: set[str]
) -> TracedWeight | Untraceable | None:
    """Follow ``value`` back to its storage: None for activations, a reason for untraceable constants."""
    path: list[str] = []
    first_op: tuple[onnx.NodeProto, Scope] | None = None  # the node right after storage, once storage is reached
    seen: set[tuple[int, str]] = set()
    while True:
        if (id(scope), value) in seen:  # a cycle inside a subgraph or function: nothing stored behind it
            return Untraceable(f"'{value}' is computed in a cycle; an ONNX graph must be acyclic", weight=False)
        seen.add((id(scope), value))
        hit = scope.lookup(value)
        if hit is None:
            return None
        kind, item, owner = hit
        if kind == "input":
            if value in owner.initializers:
                return Untraceable(
                    f"'{value}' is a graph input with a default initializer, so it is not constant; remove it from the "
                    "graph inputs (torch.onnx.export(..., keep_initializers_as_inputs=False)) to prune it"
                )
            if value in constant_function_inputs and owner.name.startswith("function:"):
                return Untraceable(
                    f"the weight reaches {owner.name} as its input '{value}'; inline local functions first"
                )
            return None
        if kind == "sparse_initializer":
            return Untraceable(f"'{value}' is stored as a sparse initializer; store it dense to prune it")
        if kind == "initializer":
            return TracedWeight(
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
                return Untraceable(f"Constant '{value}' holds no tensor value", weight=False)
            return TracedWeight(
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
                return Untraceable(f"Transpose '{node.name or value}' has no perm, so its rank is unknown here")
            axis = perm[axis % len(perm)]
        elif node.op_type == "Reshape" and node.domain in ("", "ai.onnx") and constants(value, owner):
            kept = _axis_through_reshape(node, axis, owner)
            if isinstance(kept, Untraceable):
                return kept
            axis = kept
        elif (
            node.op_type == "Unsqueeze"
            and node.domain in ("", "ai.onnx")
            and _storage_shape(node.input[0], owner) is not None
        ):
            kept = _axis_through_unsqueeze(node, axis, owner)
            if isinstance(kept, Untraceable):
                return kept
            axis = kept
        elif node.op_type not in PASS_THROUGH or node.domain not in ("", "ai.onnx"):
            if constants(value, owner):
                folding = (
                    "the fold-constants pass, or polygraphy surgeon sanitize --fold-constants"
                    if owner.name == "main"  # the pass folds the main graph; polygraphy also folds subgraphs
                    else f"it is inside {owner.name}: polygraphy surgeon sanitize --fold-constants; folded, it is "
                    f"still {SUBGRAPH_REASON.format(graph=owner.name)}"
                )
                return Untraceable(
                    f"computed from constants by {node.op_type} '{node.name or value}'; fold constants first "
                    f"({folding})",
                    value if owner.name == "main" else None,
                )
            return None
        path.append(node.op_type)
        first_op = (node, owner)
        value, scope = node.input[0], owner


def _axis_through_reshape(node: onnx.NodeProto, axis: int, scope: Scope) -> int | Untraceable:
    """The input axis that a Reshape keeps intact as output ``axis``, when provable from constant shapes.

    The axis is kept when it has the same length on both sides and the same number of elements before it, so each
    of its fibres is the same run of elements in memory. The input shape is the stored tensor's, which is only
    known when nothing but Cast/Identity/Q/DQ lies between the storage and the Reshape.
    """
    label = node.name or node.output[0]
    shape_tensor = _stored_tensor(node.input[1], scope) if len(node.input) > 1 else None
    stored = _storage_shape(node.input[0], scope)
    if shape_tensor is None or stored is None:
        return Untraceable(
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
    return Untraceable(
        f"Reshape '{label}' splits or merges the reduction axis ({stored} -> {target}); fold constants "
        f"first, then prune the folded weight",
        node.output[0] if scope.name == "main" else None,
    )


def _axis_through_unsqueeze(node: onnx.NodeProto, axis: int, scope: Scope) -> int | Untraceable:
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
        return Untraceable(f"Unsqueeze '{label}' with axes not known here; fold constants first")
    rank = len(stored) + len(axes)
    inserted = {a % rank for a in axes}
    axis %= rank
    if axis in inserted:
        return Untraceable(
            f"Unsqueeze '{label}' inserts the reduction axis itself, so nothing stored is reduced over", weight=False
        )
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
        if item.op_type not in PASS_THROUGH:
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
