"""Activation statistics for calibrated conversion: per prunable weight, H = X^T X of its GEMM input along K.

The dense model runs in ONNX Runtime with each weight's activation input exposed as an extra output; H is
accumulated batch by batch in float64, so memory is bounded by the statistics (K x K per weight), never by the
calibration set. Fully connected uses: MatMul and Gemm with the weight on either side, any batch or token
dimensions. Convolutions (1-D and 2-D, one group): X holds the im2col patches in channel-fastest order
(r, s, c), so that M consecutive entries of a row are M input channels at one kernel position -- the groups a
TensorRT-style N:M mask uses -- and K = R * S * C.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from nmdeploy.files import private_temporary_folder, temporary_beside
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.weights import PrunableWeight
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner


@dataclass
class InputStatistics:
    """Second moments of one weight's GEMM input: ``hessian`` = X^T X [K, K] over ``samples`` rows of X."""

    weight: PrunableWeight
    activation: str
    hessian: torch.Tensor
    samples: int = 0
    cross: torch.Tensor | None = None  # X^T X_dense [K, K], where the inputs differ from the dense model's


@dataclass(frozen=True)
class _Tap:
    """Where a weight's GEMM input comes from and how to turn one batch of it into rows X [samples, K]."""

    activation: str
    reduce_last: bool = True  # K is the activation's last axis (else its second to last: the weight is the A operand)
    convolution: _ConvGeometry | None = None

    def rows(self, activation: np.ndarray) -> torch.Tensor:
        """The batch as rows [samples, K], in fp32 (fp64 stays fp64): moments are summed per batch in that
        precision and accumulated across batches in fp64, at half the cost of fp64 products."""
        x = torch.from_numpy(np.ascontiguousarray(activation))
        x = x if x.dtype == torch.float64 else x.to(torch.float32)
        if self.convolution is not None:
            return self.convolution.patches(x)
        if not self.reduce_last:
            x = x.transpose(-1, -2)
        return x.reshape(-1, x.shape[-1])


@dataclass(frozen=True)
class _ConvGeometry:
    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilations: tuple[int, int]
    pads: tuple[int, int, int, int]  # left, right, top, bottom, the order torch's F.pad takes for the last two axes

    def patches(self, x: torch.Tensor) -> torch.Tensor:
        """im2col of [B, C, H, W] (or [B, C, L]) to [B * positions, R * S * C], channel fastest."""
        if x.ndim == 3:
            x = x.unsqueeze(2)
        x = torch.nn.functional.pad(x, self.pads)
        columns = torch.nn.functional.unfold(x, self.kernel, dilation=self.dilations, stride=self.strides)
        batch, _, positions = columns.shape
        channels = x.shape[1]
        # unfold orders a column (c, r, s); the masks group channels at one kernel position, so (r, s, c).
        columns = columns.view(batch, channels, -1, positions).permute(0, 3, 2, 1)
        return columns.reshape(batch * positions, -1)


def _conv_geometry(node: onnx.NodeProto, weight: PrunableWeight) -> _ConvGeometry | str:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    spatial = len(weight.shape) - 2
    if spatial not in (1, 2):
        return f"{spatial}-D convolution (statistics cover 1-D and 2-D)"
    if attrs.get("group", 1) != 1:
        return "grouped convolution (per-group statistics are not collected)"
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad not in ("NOTSET", "VALID"):
        return f"auto_pad={auto_pad} (export with explicit pads)"

    def pair(values: list[int], fill: int) -> tuple[int, int]:
        values = list(values) or [fill] * spatial
        return (fill, values[0]) if spatial == 1 else (values[0], values[1])

    kernel = pair(weight.shape[2:], 1)
    pads = list(attrs.get("pads", [])) or [0] * (2 * spatial)
    begin, end = pads[:spatial], pads[spatial:]
    if spatial == 1:
        begin, end = [0, *begin], [0, *end]
    return _ConvGeometry(
        kernel=kernel,
        strides=pair(attrs.get("strides", []), 1),
        dilations=pair(attrs.get("dilations", []), 1),
        pads=(begin[1], end[1], begin[0], end[0]),
    )


def _consumer(weight: PrunableWeight, model: onnx.ModelProto) -> onnx.NodeProto | str:
    """The one main-graph node whose GEMM uses the weight, or why there is not exactly one."""
    if len(weight.uses) != 1:
        return "shared by several consumers"
    use = weight.uses[0]
    if use.graph != "main":
        return f"used inside {use.graph}"
    node = next(
        (
            n
            for n in model.graph.node
            if n.op_type == use.op_type
            and len(n.input) > use.input_index
            and (n.name or f"{n.op_type}({n.input[use.input_index]})") == use.node
        ),
        None,
    )
    return "consumer not found in the main graph" if node is None else node


def _tap(weight: PrunableWeight, model: onnx.ModelProto) -> _Tap | str:
    """Where a weight's activation comes from, or why it cannot be collected."""
    node = _consumer(weight, model)
    if isinstance(node, str):
        return node
    use = weight.uses[0]
    other = node.input[1 - use.input_index] if use.input_index < 2 else ""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if use.op_type == "MatMul":
        return _Tap(other, reduce_last=use.input_index == 1)
    if use.op_type == "Gemm":
        transposed = attrs.get("transA", 0) if use.input_index == 1 else attrs.get("transB", 0)
        # Weight as B: the activation A is [M, K] (or [K, M] with transA); weight as A: B is [K, N] (or [N, K]).
        return _Tap(other, reduce_last=(use.input_index == 1) != bool(transposed))
    if use.op_type == "Conv" and use.input_index == 1:
        geometry = _conv_geometry(node, weight)
        return geometry if isinstance(geometry, str) else _Tap(node.input[0], convolution=geometry)
    return f"{use.op_type} weights are not calibrated (convert covers MatMul, Gemm and Conv)"


def reduction_length(weight: PrunableWeight) -> int:
    """K of the weight's GEMM: the reduction axis, times the kernel positions for a convolution."""
    if weight.uses[0].op_type == "Conv":
        return math.prod(weight.shape[1:])
    return weight.shape[weight.axis]


def collect_statistics(
    model: OnnxModel,
    weights: Iterable[PrunableWeight],
    batches: Iterable[dict[str, np.ndarray]],
    *,
    dense_values: Mapping[str, np.ndarray] | None = None,
) -> tuple[dict[str, InputStatistics], dict[str, str]]:
    """H = X^T X for every weight that can be collected, and the reason for every one that cannot.

    ``dense_values`` (tensor name -> the values before conversion, for every tensor converted so far) also
    collects the cross moments X^T X_dense between each weight's inputs in this model and in the dense model, which
    is this model with those values restored. Both run cut down to the nodes the activations need.
    """
    weights = list(weights)
    taps: dict[str, _Tap] = {}
    skipped: dict[str, str] = {}
    for weight in weights:
        tap = _tap(weight, model.proto)
        if isinstance(tap, str):
            skipped[weight.name] = tap
        else:
            taps[weight.name] = tap
    by_name = {w.name: w for w in weights}
    stats = {}
    for name, tap in taps.items():
        k = reduction_length(by_name[name])
        cross = torch.zeros(k, k, dtype=torch.float64) if dense_values is not None else None
        stats[name] = InputStatistics(by_name[name], tap.activation, torch.zeros(k, k, dtype=torch.float64), 0, cross)
    if not stats:
        return stats, skipped
    activations = sorted({tap.activation for tap in taps.values()})
    with contextlib.ExitStack() as stack:
        runner = stack.enter_context(OnnxRuntimeRunner(stack.enter_context(_exposed_model(model, activations))))
        dense_runner = None
        if dense_values is not None:
            dense_path = stack.enter_context(_exposed_model(model, activations, dense_values))
            dense_runner = stack.enter_context(OnnxRuntimeRunner(dense_path))
        # Weights that read the same input the same way (a transformer's Q, K and V) share one set of products.
        shared: dict[_Tap, list[str]] = {}
        for name, tap in taps.items():
            shared.setdefault(tap, []).append(name)
        for feeds in batches:
            outputs = runner.infer(feeds, activations)
            dense = dense_runner.infer(feeds, activations) if dense_runner is not None else {}
            for tap, names in shared.items():
                x = tap.rows(outputs[tap.activation])
                hessian = (x.T @ x).to(torch.float64)
                cross = (x.T @ tap.rows(dense[tap.activation])).to(torch.float64) if dense_runner is not None else None
                for name in names:
                    stats[name].hessian += hessian
                    stats[name].samples += x.shape[0]
                    if cross is not None:
                        stats[name].cross += cross
    return stats, skipped


def fitting_stages(model: OnnxModel, weights: Sequence[PrunableWeight]) -> list[list[PrunableWeight]]:
    """The weights in stages such that no weight's GEMM input depends on a weight of its own or a later stage.

    Fitting stage by stage, each on statistics from the model converted so far, lets every layer see the inputs
    it will see after conversion; weights side by side (a transformer's Q, K and V) share a stage and one run.
    Weights that cannot be tapped go in the first stage, where collection reports them.
    """
    producer = {output: node for node in model.proto.graph.node for output in node.output}
    consumers = {}
    for weight in weights:
        node = _consumer(weight, model.proto)
        if not isinstance(node, str):
            consumers[id(node)] = weight.name
    level: dict[str, int] = {}
    ancestors_seen: dict[int, int] = {}  # node id -> the deepest stage among the weights at or above it

    def depth(node: onnx.NodeProto) -> int:
        # Iterative post-order over producers: exported transformers are deeper than Python's recursion limit.
        stack = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            key = id(current)
            if key in ancestors_seen:
                continue
            parents = [producer[name] for name in current.input if name in producer]
            if not expanded:
                stack.append((current, True))
                stack.extend((parent, False) for parent in parents if id(parent) not in ancestors_seen)
                continue
            deepest = max((ancestors_seen[id(parent)] for parent in parents), default=-1)
            if key in consumers:
                level[consumers[key]] = deepest + 1
                deepest += 1
            ancestors_seen[key] = deepest
        return ancestors_seen[id(node)]

    for node in model.proto.graph.node:
        if id(node) in consumers:
            depth(node)
    stages: dict[int, list[PrunableWeight]] = {}
    for weight in weights:
        stages.setdefault(level.get(weight.name, 0), []).append(weight)
    return [stages[key] for key in sorted(stages)]


@contextlib.contextmanager
def _exposed_model(
    model: OnnxModel, activations: list[str], replaced: Mapping[str, np.ndarray] | None = None
) -> Iterator[Path]:
    """A temporary copy of the model whose outputs are ``activations``, cut down to the nodes and weights they need.

    Weights the model holds changed in memory, and those named in ``replaced``, are embedded with their values.
    ONNX Runtime only reads external data from the model's own folder, so a copy that still refers to external
    data is written there as a hidden file and removed afterwards; where that folder is read-only, every weight
    is embedded instead.
    """
    # Built field by field rather than copied whole: copying every weight only to drop most of them costs seconds
    # on a 100 MB model, and sequential conversion builds two of these per stage.
    source = model.proto
    proto = onnx.ModelProto(
        ir_version=source.ir_version, producer_name=source.producer_name, producer_version=source.producer_version
    )
    proto.opset_import.extend(source.opset_import)
    proto.functions.extend(source.functions)
    proto.graph.name = source.graph.name
    proto.graph.input.extend(source.graph.input)
    needed = _nodes_needed(source.graph, activations)
    kept = [node for index, node in enumerate(source.graph.node) if index in needed]
    proto.graph.node.extend(kept)
    read = {name for node in kept for name in _reads(node)}
    proto.graph.initializer.extend(tensor for tensor in source.graph.initializer if tensor.name in read)
    proto.graph.sparse_initializer.extend(t for t in source.graph.sparse_initializer if t.values.name in read)
    replaced = dict(replaced or {})
    for tensor in _stored_tensors(proto.graph):
        if tensor.name in replaced:
            tensor.CopyFrom(onnx.numpy_helper.from_array(replaced[tensor.name], tensor.name))
        elif tensor.data_location == onnx.TensorProto.EXTERNAL and model.is_modified(tensor):
            tensor.CopyFrom(onnx.numpy_helper.from_array(model.read(tensor), tensor.name))
    # Untyped outputs: ONNX Runtime infers their types, which saves a shape inference over the whole graph.
    proto.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in activations)
    if not _has_external_data(proto):
        with private_temporary_folder("calib") as folder:
            path = Path(folder) / "exposed.onnx"
            path.write_bytes(proto.SerializeToString())
            yield path
        return
    try:
        path = temporary_beside(model.base_dir / ".calibration.onnx", suffix=".onnx")
    except OSError:
        for tensor in _external_tensors(proto):
            tensor.CopyFrom(onnx.numpy_helper.from_array(model.read(tensor), tensor.name))
        with private_temporary_folder("calib") as folder:
            path = Path(folder) / "exposed.onnx"
            path.write_bytes(proto.SerializeToString())
            yield path
        return
    try:
        path.write_bytes(proto.SerializeToString())
        yield path
    finally:
        path.unlink(missing_ok=True)


def _stored_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Initializers and Constant-node tensors of the main graph, the places converted weights live."""
    yield from graph.initializer
    for node in graph.node:
        if node.op_type == "Constant":
            yield from (attribute.t for attribute in node.attribute if attribute.name == "value")


def _nodes_needed(graph: onnx.GraphProto, outputs: Iterable[str]) -> set[int]:
    """Indices of the nodes that the ``outputs`` depend on (names a subgraph reads from outer scope included)."""
    producer = {name: index for index, node in enumerate(graph.node) for name in node.output}
    needed: set[int] = set()
    pending = [producer[name] for name in outputs if name in producer]
    while pending:
        index = pending.pop()
        if index in needed:
            continue
        needed.add(index)
        pending.extend(producer[name] for name in _reads(graph.node[index]) if name in producer)
    return needed


def _reads(node: onnx.NodeProto) -> list[str]:
    names = list(node.input)
    for attribute in node.attribute:
        for subgraph in [attribute.g, *attribute.graphs]:
            for inner in subgraph.node:
                names += _reads(inner)
    return names


def _external_tensors(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]


def _has_external_data(proto: onnx.ModelProto) -> bool:
    return bool(_external_tensors(proto))
