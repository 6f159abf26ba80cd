"""Follow one GEMM operand back to the tensor stored behind it, keeping track of the reduction axis.

The walk passes Transpose (the axis is remapped), Unsqueeze (a 2-D weight made 3-D, the axis remapped), Cast,
Identity, QuantizeLinear/DequantizeLinear and Reshapes that provably keep the axis. Behind Q/DQ the stored values are
checked against what the GEMM reads as 0: a DequantizeLinear's zero point (applied when only Identity separates it
from storage), and a QuantizeLinear -> DequantizeLinear pair only when both zero points agree. A value reached from a
graph input is an activation (None); anything constant that cannot be followed, or whose zeros cannot be told here,
comes back as :class:`Untraceable` with the reason, and the value to fold when folding constants would help.

A traced weight also carries the operand as the consumer reads it (shape and element type after the walked ops):
TensorRT folds those ops into one constant, so its rules for sparse weights apply to that, not to the stored tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    operand_shape: tuple[int, ...]
    operand_type: int
    """The operand's shape and ONNX element type at the consumer (see :func:`_operand_at_consumer`)."""
    dequantization: Dequantization | None = None


def trace_weight(
    value: str, axis: int, scope: Scope, constants: ConstantValues, constant_function_inputs: set[str]
) -> TracedWeight | Untraceable | None:
    """Follow ``value`` back to its storage: None for activations, a reason for untraceable constants."""
    path: list[str] = []
    walked: list[tuple[onnx.NodeProto, Scope]] = []  # the nodes walked, the consumer's side first
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
            return _stored_weight(item, value, "initializer", owner, axis, path, walked)
        node: onnx.NodeProto = item
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            tensor = constant_value(node)
            if tensor is None:
                return Untraceable(f"Constant '{value}' holds no tensor value", weight=False)
            return _stored_weight(tensor, value, "constant", owner, axis, path, walked)
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
        walked.append((node, owner))
        value, scope = node.input[0], owner


def _stored_weight(
    tensor: onnx.TensorProto,
    name: str,
    kind: str,
    owner: Scope,
    axis: int,
    path: list[str],
    walked: list[tuple[onnx.NodeProto, Scope]],
) -> TracedWeight | Untraceable:
    """The weight found in storage, unless the Q/DQ walked leave what its zeros become at the GEMM unknown."""
    dequantization = _dequantization(walked, len(tensor.dims))
    if isinstance(dequantization, Untraceable):
        return dequantization
    operand = _operand_at_consumer(tensor, walked)
    if isinstance(operand, Untraceable):
        return operand
    shape, data_type = operand
    return TracedWeight(tensor, name, kind, owner, axis, tuple(reversed(path)), shape, data_type, dequantization)


def _operand_at_consumer(
    tensor: onnx.TensorProto, walked: list[tuple[onnx.NodeProto, Scope]]
) -> tuple[tuple[int, ...], int] | Untraceable:
    """Shape and element type of what the consumer reads: the stored tensor carried through the walked ops (consumer
    first in ``walked``). A Cast sets the type; Q/DQ leave the stored one, the integer or fp8 values TensorRT's
    quantized kernels read."""
    shape = [int(d) for d in tensor.dims]
    data_type = tensor.data_type
    for node, scope in reversed(walked):
        if node.op_type == "Transpose":
            perm = [int(p) for p in node_attribute(node, "perm", [])]
            if sorted(perm) != list(range(len(shape))):
                return Untraceable(f"Transpose '{_label(node)}' has perm {perm}, which does not fit a {shape} weight")
            shape = [shape[p] for p in perm]
        elif node.op_type == "Reshape":
            target = _reshape_target(node, shape, scope)
            if target is None:  # the walk passed this Reshape knowing its target, so this does not happen
                return Untraceable(f"Reshape '{_label(node)}' with shapes not known here; fold constants first")
            shape = target
        elif node.op_type == "Unsqueeze":
            axes = _unsqueeze_axes(node, scope)
            rank = len(shape) + len(axes)
            inserted = {a % rank for a in axes}
            if len(inserted) != len(axes):
                return Untraceable(f"Unsqueeze '{_label(node)}' names an axis twice ({axes})")
            kept = iter(shape)
            shape = [1 if position in inserted else next(kept) for position in range(rank)]
        elif node.op_type == "Cast":
            data_type = node_attribute(node, "to", data_type)
    return tuple(shape), data_type


def _axis_through_reshape(node: onnx.NodeProto, axis: int, scope: Scope) -> int | Untraceable:
    """The input axis that a Reshape keeps intact as output ``axis``, when provable from constant shapes.

    The axis is kept when it has the same length on both sides and the same number of elements before it, so each
    of its fibres is the same run of elements in memory. The input shape is the stored tensor's, which is only
    known when nothing but Cast/Identity/Q/DQ lies between the storage and the Reshape.
    """
    label = node.name or node.output[0]
    stored = _storage_shape(node.input[0], scope)
    target = _reshape_target(node, stored, scope) if stored is not None else None
    if target is None:
        return Untraceable(
            f"Reshape '{label}' with shapes not known here; fold constants first (the fold-constants pass)",
            node.output[0] if scope.name == "main" else None,
        )
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


def _reshape_target(node: onnx.NodeProto, shape: list[int], scope: Scope) -> list[int] | None:
    """The output shape of a Reshape of a ``shape`` input (0 and -1 resolved), or None when its shape input is not a
    stored constant."""
    shape_tensor = _stored_tensor(node.input[1], scope) if len(node.input) > 1 else None
    if shape_tensor is None:
        return None
    target = [int(d) for d in onnx.numpy_helper.to_array(shape_tensor).reshape(-1)]
    if not node_attribute(node, "allowzero", 0):
        target = [shape[i] if d == 0 and i < len(shape) else d for i, d in enumerate(target)]
    if -1 in target:
        known = 1
        for d in target:
            known *= d if d != -1 else 1
        total = 1
        for d in shape:
            total *= d
        target[target.index(-1)] = total // known if known else 0
    return target


def _unsqueeze_axes(node: onnx.NodeProto, scope: Scope) -> list[int]:
    """The axes an Unsqueeze inserts: its stored axes input (opset 13 on) or its attribute; empty when unknown."""
    axes_tensor = _stored_tensor(node.input[1], scope) if len(node.input) > 1 and node.input[1] else None
    if axes_tensor is not None:
        return [int(a) for a in onnx.numpy_helper.to_array(axes_tensor).reshape(-1)]
    return [int(a) for a in node_attribute(node, "axes", [])]


def _axis_through_unsqueeze(node: onnx.NodeProto, axis: int, scope: Scope) -> int | Untraceable:
    """The input axis behind output ``axis`` of an Unsqueeze (a 2-D weight made [1, out, K] for an LSTM cell, as
    torch exports ``nn.LSTMCell``), when its axes and the stored tensor's rank are known here."""
    label = node.name or node.output[0]
    axes = _unsqueeze_axes(node, scope)
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


def _dequantization(walked: list[tuple[onnx.NodeProto, Scope]], rank: int) -> Dequantization | Untraceable | None:
    """What the GEMM reads where the stored tensor holds its zero, from the nodes walked (consumer first).

    None: stored zeros are the weight's zeros (no Q/DQ on the path, or every zero point 0). A
    :class:`Dequantization`: a DequantizeLinear with stored scale and zero point reads the stored tensor, through
    nothing but Identity, so stored values equal to its zero point are the zeros. Untraceable: what a stored zero
    becomes is not known here (a zero point that is not a stored constant; a non-zero one behind another op; a
    QuantizeLinear -> DequantizeLinear pair whose zero points differ), so the weight must not pass as N:M unchecked.
    """
    # The DequantizeLinear nearest the storage so far, its scope and zero point: what it reads is a zero where it
    # equals that zero point.
    pending: tuple[onnx.NodeProto, Scope, onnx.TensorProto | None] | None = None
    only_identity = True  # nothing but Identity between ``pending`` and the node the walk has reached
    for node, scope in walked:
        if node.op_type == "Identity":
            continue
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            zero = _zero_point(node, scope)
            if isinstance(zero, Untraceable):
                return zero
            if node.op_type == "QuantizeLinear":
                # QuantizeLinear turns 0 into its zero point; the DequantizeLinear after it reads that back as 0 only
                # if its own zero point is the same.
                if not _same_zero_point(zero, pending[2] if pending else None, only_identity):
                    reader = f"DequantizeLinear '{_label(pending[0])}'" if pending else "the GEMM"
                    return Untraceable(
                        f"QuantizeLinear '{_label(node)}' turns 0 into a zero point that {reader} does not read "
                        "as 0 (zero points differ, or cannot be compared here), so the stored zeros are not zeros "
                        "at the GEMM"
                    )
                pending = None
                continue
        if pending is not None and not _known_zero(pending[2]):
            return Untraceable(
                f"{node.op_type} '{_label(node)}' lies between the stored tensor and DequantizeLinear "
                f"'{_label(pending[0])}', whose zero point is not known to be 0 and is not applied through it here, "
                "so what a stored zero dequantizes to is not known"
            )
        if node.op_type == "DequantizeLinear":
            pending, only_identity = (node, scope, zero), True
        else:
            only_identity = False
    if pending is None:
        return None
    node, scope, zero = pending
    scale = _stored_tensor(node.input[1], scope)
    if only_identity and scale is not None:
        return Dequantization(scale, zero, node_attribute(node, "axis", 1) % max(rank, 1))
    if _known_zero(zero):
        return None
    return Untraceable(
        f"the scale '{node.input[1]}' of DequantizeLinear '{_label(node)}' is not a stored constant, so its non-zero "
        "zero point cannot be applied here"
    )


def _zero_point(node: onnx.NodeProto, scope: Scope) -> onnx.TensorProto | Untraceable | None:
    """The stored zero point of a QuantizeLinear or DequantizeLinear (None: absent, ONNX's default 0), or the reason
    it is not a stored constant."""
    name = node.input[2] if len(node.input) > 2 else ""
    if not name:
        return None
    stored = _stored_tensor(name, scope)
    if stored is None:
        return Untraceable(
            f"the zero point '{name}' of {node.op_type} '{_label(node)}' is not a stored constant, so what a stored "
            "zero becomes at the GEMM is not known here"
        )
    return stored


def _known_zero(zero: onnx.TensorProto | None) -> bool:
    """Whether a zero point is 0 everywhere (absent, or stored in the model file with every value 0)."""
    values = _inline_values(zero) if zero is not None else np.zeros(())
    return values is not None and not np.any(values)


def _same_zero_point(
    quantize: onnx.TensorProto | None, dequantize: onnx.TensorProto | None, only_identity: bool
) -> bool:
    """Whether a QuantizeLinear's zero point equals the one the DequantizeLinear after it reads: both 0, the same
    stored tensor with nothing but Identity between the two nodes (so the same axis), or one value everywhere."""
    if _known_zero(quantize) and _known_zero(dequantize):
        return True
    if quantize is None or dequantize is None:
        return False
    if quantize is dequantize and only_identity:
        return True
    values = [_inline_values(zero) for zero in (quantize, dequantize)]
    if any(v is None or v.size == 0 for v in values):
        return False
    first = values[0].reshape(-1)[0]
    return all(bool(np.all(v == first)) for v in values)


def _inline_values(tensor: onnx.TensorProto) -> np.ndarray | None:
    """A small tensor's values as float64 when the model file holds them (None for external data, which only the
    model can read)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None
    return onnx.numpy_helper.to_array(tensor).astype(np.float64)


def _label(node: onnx.NodeProto) -> str:
    return node.name or node.output[0]


def _stored_tensor(name: str, scope: Scope) -> onnx.TensorProto | None:
    """The stored tensor behind ``name``, through Identity nodes (exporters alias shared constants with them)."""
    seen: set[tuple[int, str]] = set()
    while name and (id(scope), name) not in seen:
        seen.add((id(scope), name))
        stored = scope.stored(name)
        if stored is not None:
            return None if stored.storage == "sparse_initializer" else stored.tensor
        hit = scope.lookup(name)
        if (
            hit is None
            or hit.kind != "node"
            or hit.item.op_type != "Identity"
            or hit.item.domain not in ("", "ai.onnx")
        ):
            return None
        name, scope = hit.item.input[0], hit.scope
    return None
