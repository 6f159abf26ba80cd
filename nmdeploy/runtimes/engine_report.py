"""What TensorRT did with each prunable layer: eligible for sparse math, sparse kernel picked, or dense chosen,
joined with nmdeploy's own prediction so a user sees which predicted-eligible layers TensorRT did not take.

Evidence comes from two documented sources, parsed here without TensorRT:
- the builder's INFO lines ``(Sparsity) Layers eligible for sparse math: a, b`` and
  ``(Sparsity) TRT inference plan picked sparse implementation for layers: b`` (TensorRT names layers after
  their ONNX nodes and joins fused ones with `` + ``, e.g. ``Conv_3 + Relu_4``);
- the engine inspector's JSON at DETAILED verbosity, TensorRT 10's or 11's (:mod:`nmdeploy.runtimes.inspector`):
  per layer ``Name``, ``LayerType``, the fused ONNX nodes, ``HasSparseWeights`` and ``TacticName``.
When the log lines are missing, HasSparseWeights and sparse tactic names ("sparse" or "sptensor" in the name, a
heuristic) stand in for them.

Each row also says the precision the layer runs in: from the inspector's type of the layer's first input and output
(TensorRT 10's ``Format/Datatype``, TensorRT 11's ``DataType``; INT8 in and out is what TensorRT's sparse integer
kernels need), or, where the inspector does not say (names only, or a Myelin layer holding many nodes), from the
ONNX graph: the weight's stored or quantized type and whether the layer's input is read from a DequantizeLinear.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from onnx import TensorProto

from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.inspection import Inspection, inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.quantization import (
    QUANTIZED_TYPE_NAMES,
    SPARSE_KERNEL_OUTPUTS,
    layer_quantization,
    quantized_type,
    quantized_type_name,
    sparse_kernel_precision,
)
from nmdeploy.runtimes.inspector import EngineLayer, EngineTensor, parse_io_tensors, parse_layer_information
from nmdeploy.runtimes.shapes import ShapeRange

_ELIGIBLE = "(Sparsity) Layers eligible for sparse math:"
_PICKED = "(Sparsity) TRT inference plan picked sparse implementation for layers:"
_FOREIGN = re.compile(r"^\{ForeignNode\[(.*)\.\.\.(.*)\]\}$")
_WRAPPER = re.compile(r"^[A-Za-z]+\((.*)\)$")  # PWN(...) and similar fusion wrappers


@dataclass(frozen=True)
class SparsityLog:
    """The layer names of the two sparsity lines; None where a line is absent (built without sparsity, or a log
    level above INFO)."""

    eligible: tuple[str, ...] | None
    picked: tuple[str, ...] | None


def parse_builder_log(text: str | Iterable[str]) -> SparsityLog:
    """Find the sparsity lines in a builder log (trtexec's, polygraphy's or a Python logger's; the last build wins)."""
    lines = text.splitlines() if isinstance(text, str) else list(text)
    found: dict[str, tuple[str, ...]] = {}
    for line in lines:
        for key, marker in (("eligible", _ELIGIBLE), ("picked", _PICKED)):
            at = line.find(marker)
            if at >= 0:
                found[key] = tuple(name for name in split_top_level(line[at + len(marker) :], ",") if name)
    return SparsityLog(found.get("eligible"), found.get("picked"))


def split_top_level(text: str, separator: str) -> list[str]:
    """Split on ``separator`` outside brackets, so ``PWN(a, b)`` and ``{ForeignNode[a...b]}`` stay whole."""
    parts, depth, current = [], 0, []
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == separator and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    parts.append("".join(current).strip())
    return parts


def onnx_nodes_of(layer_name: str, node_order: Sequence[str]) -> tuple[str, ...]:
    """The ONNX nodes a TensorRT layer name stands for: fused parts joined by `` + ``, fusion wrappers such as
    ``PWN(a, b)``, and Myelin's ``{ForeignNode[first...last]}`` (every node between the two in graph order)."""
    known = set(node_order)
    if layer_name in known:
        return (layer_name,)
    found: list[str] = []
    for part in split_top_level(layer_name, "+"):
        foreign = _FOREIGN.match(part)
        wrapped = _WRAPPER.match(part)
        if part in known:
            found.append(part)
        elif foreign and foreign.group(1) in known and foreign.group(2) in known:
            first, last = node_order.index(foreign.group(1)), node_order.index(foreign.group(2))
            found.extend(node_order[first : last + 1])
        elif wrapped:
            for inner in split_top_level(wrapped.group(1), ","):
                found.extend(onnx_nodes_of(inner, node_order))
    return tuple(dict.fromkeys(found))


# Row statuses, from best to worst.
SPARSE = "sparse"  # TensorRT picked a sparse kernel
DENSE_CHOSEN = "dense-chosen"  # eligible, but a dense kernel timed faster
MISSED = "missed"  # nmdeploy predicted eligible, TensorRT did not list the layer as eligible
NOT_ELIGIBLE = "not-eligible"  # neither predicted nor found eligible
NOT_IN_ENGINE = "not-in-engine"  # no TensorRT layer maps back to the node
UNKNOWN = "unknown"  # no sparsity evidence at all (no log lines, no inspector fields)


@dataclass(frozen=True)
class LayerRow:
    node: str
    op_type: str
    weight: str
    predicted_eligible: bool
    predicted_reasons: tuple[str, ...]
    trt_layer: str | None
    trt_eligible: bool | None
    picked_sparse: bool | None
    tactic: str | None
    status: str
    precision: str | None = None  # "int8" (in and out), "int8 in, fp16 out", "fp16", ... None: not known
    precision_from: str | None = None  # "engine inspector" or "ONNX graph"

    @property
    def sparse_kernel_precision(self) -> str | None:
        """ "int8" or "fp8" when the layer runs as that precision's sparse kernels need (INT8 in and out, FP8 in)."""
        text = self.precision or ""
        if " in, " in text:  # the inspector's "int8 in, fp16 out"
            given, made = text.split(" in, ", 1)
            return sparse_kernel_precision(given, made.removesuffix(" out"))
        if text.endswith(" in"):  # the ONNX graph's "fp8 in": the output's precision is TensorRT's choice
            return sparse_kernel_precision(text.removesuffix(" in"), None)
        return sparse_kernel_precision(text, text)


QUANTIZED = ("int8", "fp8")
KERNELS = {"int8": "sparse integer kernels", "fp8": "sparse FP8 kernels"}


@dataclass(frozen=True)
class EngineReport:
    rows: tuple[LayerRow, ...]
    unmatched: tuple[str, ...]  # eligible or picked TensorRT layers that map to no known ONNX node
    evidence: str  # "builder log", "engine inspector" or "none"
    engine_io: tuple[EngineTensor, ...] = ()  # the engine's inputs and outputs, as the inspector lists them

    def summary(self) -> dict[str, int]:
        counts = {status: 0 for status in (SPARSE, DENSE_CHOSEN, MISSED, NOT_ELIGIBLE, NOT_IN_ENGINE, UNKNOWN)}
        for row in self.rows:
            counts[row.status] += 1
        return {"layers": len(self.rows), "predicted_eligible": sum(r.predicted_eligible for r in self.rows), **counts}

    def by_precision(self) -> dict[str, dict[str, int]]:
        """Per precision the layers run in: how many, how many of them 2:4 and eligible, how many ran sparse."""
        found: dict[str, dict[str, int]] = {}
        for row in self.rows:
            counts = found.setdefault(row.precision or "unknown", {"layers": 0, "predicted_eligible": 0, SPARSE: 0})
            counts["layers"] += 1
            counts["predicted_eligible"] += row.predicted_eligible
            counts[SPARSE] += row.status == SPARSE
        return found

    def quantized_lines(self) -> list[str]:
        """One line per 8-bit precision present: how many 2:4 layers that run it as its sparse kernels need picked
        them (e.g. "2:4 + INT8 in/out: 3 of 4 layers picked sparse integer kernels")."""
        lines = []
        for precision in QUANTIZED:
            rows = [row for row in self.rows if row.sparse_kernel_precision == precision and row.predicted_eligible]
            if rows:
                picked = sum(row.status == SPARSE for row in rows)
                lines.append(
                    f"2:4 + {SPARSE_KERNEL_OUTPUTS[precision]}: {picked} of {len(rows)} layers picked "
                    f"{KERNELS[precision]}"
                )
        return lines

    def as_dict(self) -> dict[str, Any]:
        return {
            "evidence": self.evidence,
            "summary": self.summary(),
            "by_precision": self.by_precision(),
            "quantized": self.quantized_lines(),
            "layers": [asdict(row) for row in self.rows],
            "unmatched_trt_layers": list(self.unmatched),
            "engine_io": [asdict(tensor) for tensor in self.engine_io],
        }


def join_report(
    inspection: Inspection,
    node_order: Sequence[str],
    log: SparsityLog,
    layers: Sequence[EngineLayer] = (),
    graph_precisions: Mapping[str, str] | None = None,
) -> EngineReport:
    """One row per (ONNX node, weight) of ``inspection``: what TensorRT did with the layer that runs the node, and
    the precision it runs in (the inspector's, else ``graph_precisions``: node -> precision from the ONNX graph)."""
    layer_of: dict[str, EngineLayer] = {}
    for layer in layers:
        if layer.layer_type == "Reformat" or layer.name.startswith("Reformatting CopyNode"):
            continue  # data movement between layers, named after its consumer
        for node in layer.onnx_nodes or onnx_nodes_of(layer.name, node_order):
            layer_of.setdefault(node, layer)
    eligible_nodes = _nodes_of_names(log.eligible or (), node_order)
    picked_nodes = _nodes_of_names(log.picked or (), node_order)
    unmatched = tuple(
        name for name in (*(log.eligible or ()), *(log.picked or ())) if not onnx_nodes_of(name, node_order)
    )
    has_inspector = any(layer.has_sparse_weights is not None or layer.tactic for layer in layers)
    evidence = "builder log" if log.eligible is not None else "engine inspector" if has_inspector else "none"
    rows = []
    for weight in inspection.rows:
        # TensorRT lists a layer as eligible only when its weights already are 2:4.
        predicted = weight.eligible and weight.compliant == 1.0
        reasons = weight.reasons
        if weight.eligible and not predicted:
            reasons = (f"not 2:4 along the reduction axis ({(weight.compliant or 0.0):.0%} of groups)", *reasons)
        for node, op_type in zip(weight.nodes, _op_types(weight), strict=True):
            layer = layer_of.get(node)
            trt_eligible: bool | None
            picked: bool | None
            if log.eligible is not None:
                trt_eligible = node in eligible_nodes
                picked = node in picked_nodes if log.picked is not None else None
            elif layer is not None and (layer.has_sparse_weights is not None or layer.sparse_tactic is not None):
                trt_eligible = layer.has_sparse_weights
                picked = layer.sparse_tactic
            else:
                trt_eligible = picked = None
            status = _status(predicted, layer is not None or node in eligible_nodes, trt_eligible, picked)
            precision, precision_from = _layer_precision(layer), "engine inspector"
            if precision is None and graph_precisions and node in graph_precisions:
                precision, precision_from = graph_precisions[node], "ONNX graph"
            rows.append(
                LayerRow(
                    node=node,
                    op_type=op_type,
                    weight=weight.weight,
                    predicted_eligible=predicted,
                    predicted_reasons=reasons,
                    trt_layer=layer.name if layer else _log_name(node, log, node_order),
                    trt_eligible=trt_eligible,
                    picked_sparse=picked,
                    tactic=layer.tactic if layer else None,
                    status=status,
                    precision=precision,
                    precision_from=precision_from if precision else None,
                )
            )
    return EngineReport(tuple(rows), unmatched, evidence)


def _layer_precision(layer: EngineLayer | None) -> str | None:
    """The precision of a layer that runs one GEMM or convolution (a Myelin layer holds many: its inputs say
    nothing about each one), from its first input's and output's formats."""
    if layer is None or layer.layer_type == "Myelin" or layer.name.startswith("{ForeignNode["):
        return None
    given, made = layer.input_precision, layer.output_precision
    if given is None or made is None:
        return None
    return given if given == made else f"{given} in, {made} out"


def _op_types(weight: Any) -> list[str]:
    """The op type of each use (inspection keeps distinct op types; uses of one weight share their op type)."""
    return [weight.op_types[0] if len(weight.op_types) == 1 else "/".join(weight.op_types)] * len(weight.nodes)


def _nodes_of_names(names: Iterable[str], node_order: Sequence[str]) -> set[str]:
    return {node for name in names for node in onnx_nodes_of(name, node_order)}


def _log_name(node: str, log: SparsityLog, node_order: Sequence[str]) -> str | None:
    for name in (*(log.eligible or ()), *(log.picked or ())):
        if node in onnx_nodes_of(name, node_order):
            return name
    return None


def _status(predicted: bool, in_engine: bool, trt_eligible: bool | None, picked: bool | None) -> str:
    if picked:
        return SPARSE
    if trt_eligible:
        return DENSE_CHOSEN if picked is not None else UNKNOWN
    if trt_eligible is None:
        return UNKNOWN if in_engine or predicted else NOT_IN_ENGINE
    return MISSED if predicted else NOT_ELIGIBLE


@dataclass
class BuildOutcome:
    engine: Path
    tensorrt_version: str
    strongly_typed: bool
    seconds: float
    report: EngineReport
    warnings: list[str]


def fp32_sparse_warning(inspection: Inspection) -> str | None:
    """A warning when TensorRT-eligible weights are fp32 and not read through a DequantizeLinear: a strongly typed
    engine runs them dense."""
    fp32 = [
        row.weight
        for row in inspection.rows
        if row.eligible and row.dtype in ("float", "double") and "DequantizeLinear" not in row.traced.split(" -> ")
    ]
    if not fp32:
        return None
    listed = ", ".join(fp32[:3]) + (" ..." if len(fp32) > 3 else "")
    return (
        f"--sparse on an fp32 model: {len(fp32)} eligible weights ({listed}) are fp32, and a strongly typed "
        "TensorRT engine runs fp32 layers dense; run "
        "`nmdeploy cast MODEL -o MODEL-fp16.onnx --precision fp16` (or `nmdeploy quantize`) first"
    )


_FLOAT_NAMES = {"float": "fp32", "float16": "fp16", "bfloat16": "bf16", "double": "fp64"}


def quantized_types(model: OnnxModel) -> frozenset[str]:
    """The quantized types of the model's QuantizeLinear/DequantizeLinear nodes (int8, fp8, uint8, ...), which
    decide what the build must allow; empty for a model without Q/DQ."""
    index = model.index
    return frozenset(
        quantized_type(index, node)
        for node in index.main.nodes
        if node.op_type in ("QuantizeLinear", "DequantizeLinear")
    )


def graph_precisions(model: OnnxModel, inspection: Inspection) -> dict[str, str]:
    """Per weighted node of ``inspection``, its precision as the ONNX graph states it: "int8 in" (or fp8) when its
    weight and its input are both read from DequantizeLinear nodes of that type (whether its output is quantized
    depends on what TensorRT fuses after it: the inspector says), "int8 weight, float in" for weight-only
    quantization, else the weight's float type."""
    index = model.index
    by_name = {node.name: node for node in index.main.nodes if node.name}
    found = {}
    for row in inspection.rows:
        for name, weight_position in zip(row.nodes, row.inputs, strict=True):
            node = by_name.get(name)
            if node is None or len(node.input) < 2:
                continue
            layer = layer_quantization(index, node, weight_position)
            weight_type = layer.weight or QUANTIZED_TYPE_NAMES.get(
                _stored_type(index, node.input[weight_position]) or -1
            )
            if weight_type is None and row.dtype not in _FLOAT_NAMES:  # quantized, behind a Transpose or Reshape
                weight_type = quantized_type_name(TensorProto.DataType.Value(row.dtype.upper()))
            input_type = layer.input
            if weight_type and input_type == weight_type:
                found[name] = f"{weight_type} in"
            elif weight_type:
                found[name] = f"{weight_type} weight, {input_type or 'float'} in"
            else:
                found[name] = _FLOAT_NAMES.get(row.dtype, row.dtype)
    return found


def _stored_type(index: GraphIndex, value: str) -> int | None:
    stored = index.stored(value)
    return None if stored is None else stored.tensor.data_type


def build_with_report(
    model: str | Path,
    engine: str | Path,
    *,
    sparse: bool = False,
    shapes: Mapping[str, ShapeRange] | None = None,
    timing_cache: str | Path | None = None,
    workspace_mib: int | None = None,
) -> BuildOutcome:
    """Build a TensorRT engine from ``model`` and report, per prunable layer, eligible / picked sparse / dense."""
    from nmdeploy.runtimes.tensorrt import build_engine, import_tensorrt

    import_tensorrt()  # fail fast, before reading a large model, when TensorRT is missing
    loaded = OnnxModel.load(model)
    inspection = inspect_model(loaded, "2:4")
    quantized = quantized_types(loaded)
    warnings = []
    warning = fp32_sparse_warning(inspection) if sparse else None
    if warning:
        warnings.append(warning)
    unsupported = sorted(quantized - set(QUANTIZED))
    if unsupported:
        warnings.append(
            f"the model holds {', '.join(unsupported)} Q/DQ; TensorRT's sparse kernels take symmetric INT8 or FP8 "
            "(zero point 0): quantize the float model with `nmdeploy quantize --precision int8|fp8`"
        )
    built = build_engine(
        Path(model),
        engine,
        sparse=sparse,
        shapes=dict(shapes or {}),
        timing_cache=timing_cache,
        workspace_mib=workspace_mib,
        quantized=quantized,
    )
    if not built.strongly_typed:
        warnings.append(f"TensorRT {built.tensorrt_version} has no strongly typed networks; precision may differ")
    node_order = [node.name for node in loaded.proto.graph.node]
    report = join_report(
        inspection,
        node_order,
        parse_builder_log(built.log_lines),
        parse_layer_information(built.layer_information),
        graph_precisions(loaded, inspection),
    )
    report = replace(report, engine_io=parse_io_tensors(built.layer_information))
    return BuildOutcome(built.path, built.tensorrt_version, built.strongly_typed, built.seconds, report, warnings)
