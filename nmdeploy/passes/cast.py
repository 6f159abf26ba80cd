"""Cast a model's weights and compute from fp32 to fp16 or bf16, the precision a strongly typed TensorRT engine runs.

TensorRT 11 takes precision from the ONNX types alone, so an fp32 model built with sparse weights enabled runs dense
fp32. This pass converts every float initializer and Constant feeding converted nodes (Gemm/MatMul/Conv weights and
biases included) and the nodes themselves, and keeps numerically sensitive ops and the model's inputs and outputs
in fp32 with explicit Cast nodes at every boundary.

Kept in fp32 by default (``DEFAULT_KEEP_OPS``): normalisations (LayerNormalization, GroupNormalization, ...),
Softmax/LogSoftmax, accumulating reductions (ReduceMean, ReduceSum, ... and CumSum), Exp, Log, Pow, Sqrt,
Reciprocal and Softplus, plus the whole decomposed LayerNorm of torch's legacy exporter (ReduceMean, Sub, Pow,
ReduceMean, Add, Sqrt, Div), whose Sub/Add/Div would otherwise run in fp16 between fp32 reductions. Converted on
purpose: BatchNormalization (TensorRT folds it into the preceding convolution, which an fp32 island would prevent),
Div and Mul (attention scaling and GELU are well within fp16 range), ReduceMax/ReduceMin (exact in any precision).
Ops the opset's schema does not allow in the target type, ops inside or referenced by subgraphs, ops of other
domains and ops whose output type comes from an attribute (RandomNormal, EyeLike, ...) stay fp32 as well.

Rounding is to nearest; finite values beyond the target's range are clamped to its largest value, and nonzero
values that would round to zero become the smallest subnormal of the same sign, so zeros stay exactly the zeros
there were: a weight pruned to N:M before casting keeps exactly its mask.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.errors import InputError
from nmdeploy.graph import dtypes
from nmdeploy.graph.attributes import node_tensors, subgraphs
from nmdeploy.graph.declared import default_opset, tensor_types
from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.layer_norms import decomposed_layer_norms
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.passes.base import Pass, PassResult, PostconditionError, ReportRow, optional

PRECISIONS: dict[str, int] = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}

DEFAULT_KEEP_OPS: frozenset[str] = frozenset(
    {
        "LayerNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "RMSNormalization",
        "LpNormalization",
        "MeanVarianceNormalization",
        "Softmax",
        "LogSoftmax",
        "ReduceMean",
        "ReduceSum",
        "ReduceSumSquare",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceProd",
        "CumSum",
        "Exp",
        "Log",
        "Pow",
        "Sqrt",
        "Reciprocal",
        "Softplus",
    }
)
# Ops whose float output type is set by an attribute rather than by their inputs.
_TYPE_FROM_ATTRIBUTE = frozenset(
    {"EyeLike", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"}
)
_FP32 = "fp32"


@dataclass
class _NodePlan:
    """How one converted node reads and writes its float32 tensors: the precision each input needs, each output has."""

    needs: dict[int, str] = field(default_factory=dict)
    homes: dict[int, str] = field(default_factory=dict)


@dataclass
class CastNode(ReportRow):
    """A node that reads or writes float32: the precision it computes in, and why it stays fp32 when it does."""

    item: str = field(default="node", init=False)
    name: str
    op_type: str
    precision: str
    reason: str | None = optional()


@dataclass
class CastTensor(ReportRow):
    """A stored tensor converted to the low precision (a copy when fp32 consumers share it)."""

    item: str = field(default="tensor", init=False)
    name: str
    precision: str
    clamped: int  # finite values beyond the range, set to the largest finite value
    raised_from_zero: int  # nonzero values below the smallest subnormal, kept nonzero
    shared_with_fp32: bool


@dataclass
class AddedCast(ReportRow):
    """A Cast node inserted after ``tensor``'s producer for consumers that need ``precision``."""

    item: str = field(default="cast", init=False)
    name: str
    tensor: str
    precision: str


class CastPass(Pass):
    """Convert fp32 weights and compute to ``precision`` (fp16 or bf16), keeping sensitive ops and I/O in fp32.

    ``keep_ops`` replaces :data:`DEFAULT_KEEP_OPS`; ``keep_nodes`` is a regular expression on node names that also
    stay fp32; ``keep_io=False`` gives the model fp16/bf16 inputs and outputs instead of Casts at the boundary.
    """

    name = "cast"
    in_place = True

    def __init__(
        self,
        *,
        precision: str = "fp16",
        keep_ops: Iterable[str] | None = None,
        keep_nodes: str | None = None,
        keep_io: bool = True,
    ):
        if precision not in PRECISIONS:
            raise InputError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
        self.precision = precision
        self.keep_ops = DEFAULT_KEEP_OPS if keep_ops is None else frozenset(keep_ops)
        try:
            self.keep_nodes = re.compile(keep_nodes) if keep_nodes else None
        except re.error as error:
            raise InputError(f"invalid keep_nodes expression {keep_nodes!r}: {error}") from error
        self.keep_io = keep_io

    def call(self, model: OnnxModel) -> PassResult:
        # Weights must be finite; other constants may hold infinities on purpose (attention masks), never NaN.
        model.check_finite(weight.tensor for weight in find_prunable_weights(model.proto, model.index).weights)
        model.check_finite(model.tensors(), allow_infinite=True)
        low = PRECISIONS[self.precision]
        graph = model.proto.graph
        index = model.index
        # Strict inference is the check of the result, but only a model that passed it before can be held to it,
        # and the model after the pass cannot tell: the comparison stays here, where both are at hand.
        types_checked = _types_check(model.proto)
        types = tensor_types(model.proto)
        stored = _stored_float_tensors(index)
        # Names subgraphs read from the main graph must keep their type.
        pinned = {name for node in index.nodes for name in index.main.outer_reads(node)}
        pattern_nodes = decomposed_layer_norms(index)
        opset = default_opset(model.proto)
        if opset < _CAST_OPSET[low]:  # older Cast schemas take `to` as a string, or no bfloat16
            raise InputError(
                f"the model imports opset {opset}; casting to {self.precision} needs opset {_CAST_OPSET[low]} or "
                f"later (convert it with onnx.version_converter first)"
            )

        rows: list[ReportRow] = []
        plans: list[_NodePlan | None] = []
        for position, node in enumerate(index.nodes):
            reason = self._keep_reason(node, position in pattern_nodes, pinned)
            plan = None if reason else _plan_node(node, opset, types, low)
            touches_float = any(types.get(name) == TensorProto.FLOAT for name in [*node.input, *node.output] if name)
            if node.op_type == "Constant" and node.output[0] in stored:
                plan, touches_float = None, False  # a stored tensor: converted below according to its consumers
            elif plan is None and touches_float and not reason:
                reason = f"the {node.op_type} schema at opset {opset} does not take {self.precision} here"
            plans.append(plan)
            if touches_float:
                precision = self.precision if plan else _FP32
                rows.append(CastNode(node.name, node.op_type, precision, reason or None))

        # The precision every consumer needs of each float32 tensor, and the precision each dynamic one is made in.
        homes: dict[str, str] = {}
        for value in graph.input:
            if types.get(value.name) == TensorProto.FLOAT:
                homes[value.name] = _FP32 if self.keep_io or value.name in pinned else self.precision
        needs: dict[str, set[str]] = {}
        for node, plan in zip(index.nodes, plans, strict=True):
            for position, name in enumerate(node.input):
                if name and types.get(name) == TensorProto.FLOAT:
                    needs.setdefault(name, set()).add(plan.needs.get(position, _FP32) if plan else _FP32)
            for position, name in enumerate(node.output):
                if name and types.get(name) == TensorProto.FLOAT:
                    homes[name] = plan.homes.get(position, _FP32) if plan else _FP32
        for name in pinned:
            needs.setdefault(name, set()).add(_FP32)
        output_names = {value.name for value in graph.output}
        for name in output_names:
            if name in homes:
                needs.setdefault(name, set()).add(_FP32 if self.keep_io else homes[name])

        modified = False
        # Stored tensors: converted in place when every consumer wants the low precision, copied when some do.
        stored_names: dict[tuple[str, str], str] = {}
        for name, tensor in stored.items():
            wanted = needs.get(name, set())
            stored_names[(name, _FP32)] = name
            if self.precision not in wanted:
                continue
            values, clamped, raised = round_to_precision(model.read(tensor).astype(np.float32), self.precision)
            if wanted == {self.precision}:
                model.write_as(tensor, values, low)
                stored_names[(name, self.precision)] = name
            else:
                copy = index.add_initializer(_new_tensor(index.fresh_name(f"{name}_{self.precision}"), values, low))
                stored_names[(name, self.precision)] = copy.name
            modified = True
            rows.append(CastTensor(name, self.precision, clamped, raised, shared_with_fp32=len(wanted) > 1))

        # Dynamic tensors: a Cast right after the producer for every precision some consumer needs besides its own.
        renamed_outputs: dict[str, str] = {}
        if self.keep_io:
            for name in output_names:
                if homes.get(name, _FP32) != _FP32:
                    renamed_outputs[name] = index.fresh_name(f"{name}_{homes[name]}")
        casts: dict[tuple[str, str], str] = {}
        casts_after: dict[str, list[onnx.NodeProto]] = {}
        for name, wanted in needs.items():
            if name not in homes:
                continue
            for precision in sorted(wanted - {homes[name]}):
                target = (
                    name if name in renamed_outputs and precision == _FP32 else index.fresh_name(f"{name}_{precision}")
                )
                casts[(name, precision)] = target
                source = renamed_outputs.get(name, name)
                to = TensorProto.FLOAT if precision == _FP32 else low
                cast = helper.make_node("Cast", [source], [target], to=to, name=index.fresh_name(f"{target}/Cast"))
                casts_after.setdefault(name, []).append(cast)
                rows.append(AddedCast(cast.name, name, precision))

        def resolve(name: str, precision: str) -> str:
            if name in stored:
                return stored_names[(name, precision)]
            if name not in homes or homes[name] == precision:
                return renamed_outputs.get(name, name)
            return casts[(name, precision)]

        new_nodes: list[onnx.NodeProto] = []
        for value in graph.input:
            new_nodes.extend(casts_after.get(value.name, []))
        for node, plan in zip(list(index.nodes), plans, strict=True):
            for position, name in enumerate(node.input):
                if name and types.get(name) == TensorProto.FLOAT:
                    index.set_input(node, position, resolve(name, plan.needs.get(position, _FP32) if plan else _FP32))
            produced = list(node.output)
            for position, name in enumerate(produced):
                if name in renamed_outputs:
                    index.set_output(node, position, renamed_outputs[name])
            if plan and plan.homes:
                _retype_attributes(model, node, low)
                modified = True
            new_nodes.append(node)
            for name in produced:
                new_nodes.extend(casts_after.get(name, []))
        for pinned_name in pinned:
            if homes.get(pinned_name, _FP32) != _FP32:
                raise PostconditionError(f"subgraph reference '{pinned_name}' was converted")
        index.set_nodes(new_nodes)
        modified |= bool(casts)

        index.set_elem_types(
            {name: low for name, home in homes.items() if home != _FP32 and name not in renamed_outputs}
        )
        if types_checked and not _types_check(model.proto):
            raise PostconditionError("cast produced a model whose types do not check")
        return PassResult(model, modified, rows)

    def _keep_reason(self, node: onnx.NodeProto, in_pattern: bool, pinned: set[str]) -> str | None:
        if node.op_type in self.keep_ops:
            return "kept op type"
        if in_pattern:
            return "part of a decomposed LayerNorm"
        if self.keep_nodes is not None and self.keep_nodes.search(node.name):
            return "matches keep_nodes"
        if node.domain not in ("", "ai.onnx"):
            return f"op of domain {node.domain!r}"
        if next(subgraphs(node), None) is not None:
            return "has a subgraph"
        if node.op_type in _TYPE_FROM_ATTRIBUTE:
            return "output type set by an attribute"
        if any(name in pinned for name in node.output):
            return "its output is read inside a subgraph"
        return None


def cast(model: OnnxModel, **options: Any) -> PassResult:
    """Python API mirror of ``nmdeploy cast``: run :class:`CastPass` with ``options`` on ``model``."""
    return CastPass(**options)(model)


def round_to_precision(values: np.ndarray, precision: str) -> tuple[np.ndarray, int, int]:
    """fp32 values rounded to nearest in ``precision``; also how many were clamped to the largest finite value and
    how many nonzero values were raised to the smallest subnormal instead of becoming zero."""
    dtype = dtypes.numpy_dtype(PRECISIONS[precision])
    info = ml_dtypes.finfo(dtype)
    values = np.asarray(values, dtype=np.float32)
    finite = np.isfinite(values)
    too_large = finite & (np.abs(values) > float(info.max))
    rounded = np.where(too_large, np.sign(values) * float(info.max), values).astype(dtype)
    lost = finite & (values != 0) & (rounded == 0)
    if lost.any():
        tiny = np.asarray(float(info.smallest_subnormal), dtype=dtype)
        rounded = np.where(lost, np.where(values > 0, tiny, -tiny), rounded).astype(dtype)
    return rounded, int(too_large.sum()), int(lost.sum())


def upcast_for_cpu(proto: onnx.ModelProto, precision: str) -> onnx.ModelProto:
    """A copy of a cast model that computes in fp32 but rounds every ``precision`` value as the cast model would.

    ONNX Runtime has no CPU kernels for most bf16 ops (and lacks some fp16 ones): stored values become fp32 (exact),
    every node output of the low type is rounded through a Cast pair, and low-precision graph inputs and outputs
    become fp32. Each op then computes in fp32 and rounds its result, as GPU kernels with fp32 accumulation do.
    """
    low = PRECISIONS[precision]
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    types = tensor_types(copy)
    graph = copy.graph
    model = OnnxModel(copy, Path.cwd())  # every tensor is inline (the caller loads external data)
    index = model.index
    main_tensors = [*graph.initializer, *(t for node in graph.node for t in node_tensors(node, nested=False))]
    for tensor in main_tensors:
        if tensor.data_type == low:
            model.write_as(tensor, model.read(tensor).astype(np.float32), TensorProto.FLOAT)
    rounded_inputs: dict[str, str] = {}
    new_nodes: list[onnx.NodeProto] = []
    for value in graph.input:
        if value.type.tensor_type.elem_type == low:
            rounded_inputs[value.name] = index.fresh_name(f"{value.name}_rounded")
            new_nodes.extend(_round_trip(value.name, rounded_inputs[value.name], low, index))
    for node in graph.node:
        for position, name in enumerate(node.input):
            if name in rounded_inputs:
                index.set_input(node, position, rounded_inputs[name])
        new_nodes.append(node)
        for position, name in enumerate(list(node.output)):
            if name and types.get(name) == low:
                unrounded = index.fresh_name(f"{name}_unrounded")
                index.set_output(node, position, unrounded)
                new_nodes.extend(_round_trip(unrounded, name, low, index))
    index.set_nodes(new_nodes)
    del graph.value_info[:]
    index.set_elem_types(
        {
            value.name: TensorProto.FLOAT
            for value in [*graph.input, *graph.output]
            if value.type.tensor_type.elem_type == low
        }
    )
    return copy


def _round_trip(source: str, target: str, low: int, index: GraphIndex) -> list[onnx.NodeProto]:
    middle = index.fresh_name(f"{target}_low")
    return [
        helper.make_node("Cast", [source], [middle], to=low, name=index.fresh_name(f"{middle}/Cast")),
        helper.make_node("Cast", [middle], [target], to=TensorProto.FLOAT, name=index.fresh_name(f"{target}/Cast")),
    ]


def _plan_node(node: onnx.NodeProto, opset: int, types: dict[str, int], low: int) -> _NodePlan | None:
    """Which float32 inputs and outputs of ``node`` can take the low type, or None when the node must stay fp32."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    constraints = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    plan = _NodePlan()
    for names, formals, target in ((node.input, schema.inputs, plan.needs), (node.output, schema.outputs, plan.homes)):
        for position, name in enumerate(names):
            if not name:
                continue
            if name not in types or not formals:
                return None  # an unknown type could be float32: converting around it might break the model
            if types[name] != TensorProto.FLOAT:
                continue
            formal = formals[min(position, len(formals) - 1)]
            if formal.type_str not in constraints:
                target[position] = _FP32  # a fixed tensor(float) parameter, such as Resize's scales
            elif f"tensor({dtypes.type_name(low)})" in constraints[formal.type_str]:
                target[position] = _PRECISION_OF[low]
            else:
                return None
    if not any(p != _FP32 for p in [*plan.needs.values(), *plan.homes.values()]):
        return None
    return plan


_PRECISION_OF = {code: name for name, code in PRECISIONS.items()}


def _retype_attributes(model: OnnxModel, node: onnx.NodeProto, low: int) -> None:
    """Make attributes that fix a float output type name the low type instead (Cast's ``to``, ConstantOfShape)."""
    if node.op_type == "Cast":
        for attribute in node.attribute:
            if attribute.name == "to" and attribute.i == TensorProto.FLOAT:
                attribute.i = low
    elif node.op_type == "ConstantOfShape":
        values = [a for a in node.attribute if a.name == "value"]
        if not values:
            node.attribute.append(helper.make_attribute("value", _new_tensor("value", np.zeros(1), low)))
        elif values[0].t.data_type == TensorProto.FLOAT:
            rounded, _, _ = round_to_precision(model.read(values[0].t), _PRECISION_OF[low])
            model.write_as(values[0].t, rounded, low)


def _stored_float_tensors(index: GraphIndex) -> dict[str, TensorProto]:
    """fp32 initializers (not overridable graph inputs) and fp32 Constant node values of the main graph, by name."""
    return {
        stored.name: stored.tensor
        for stored in index.stored_tensors()
        if stored.scope is index.main
        and stored.storage in ("initializer", "constant")
        and not stored.overridable
        and stored.tensor.data_type == TensorProto.FLOAT
    }


_CAST_OPSET = {TensorProto.FLOAT16: 6, TensorProto.BFLOAT16: 13}  # Cast's first schema with an integer `to` / bf16


def _types_check(proto: onnx.ModelProto) -> bool:
    """Whether strict shape and type inference accepts the model."""
    try:
        onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    except Exception:  # onnx raises InferenceError, ValidationError or RuntimeError depending on the fault
        return False
    return True


def _new_tensor(name: str, values: np.ndarray, data_type: int) -> TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=dtypes.numpy_dtype(data_type)), name)
