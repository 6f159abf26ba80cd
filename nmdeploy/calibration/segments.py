"""The model cut at the fitting stages: segments that run one after another on cached boundary values.

Segment k holds the nodes that stage k's GEMM inputs need and no earlier segment computed. Its inputs are the
values that cross the cut before it (graph inputs, residual streams, attention masks, shape tensors: whatever it
reads that an earlier segment made); its outputs are the values it makes that a later segment reads, and stage k's
GEMM inputs. Weights that conversion changes are segment inputs rather than initializers, so one ONNX Runtime
session per segment serves both the dense and the converted model, and no session is rebuilt when a weight changes.
Initializers stored in the protobuf are copied into the segment that reads them; those in external data files are
read when their segment runs and fed too, so a segment of a model over 2 GB is a small protobuf and only the
weights of the running segment are in memory at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from nmdeploy.errors import InputError, MissingDependencyError
from nmdeploy.graph.model import OnnxModel

INPUTS = -1  # the "segment" that makes the graph inputs


class GraphView:
    """Producers, readers (subgraphs' outer-scope reads included) and a topological order of the main graph."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.nodes = list(graph.node)
        self.initializers = {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}
        self.inputs = [value.name for value in graph.input if value.name not in self.initializers]
        self.producer = {name: index for index, node in enumerate(self.nodes) for name in node.output if name}
        self.reads = [_reads(node) for node in self.nodes]
        self.order = self._topological_order()

    def _topological_order(self) -> list[int]:
        waiting = [0] * len(self.nodes)
        readers: dict[int, list[int]] = {}
        for index, names in enumerate(self.reads):
            parents = {self.producer[name] for name in names if name in self.producer}
            parents.discard(index)
            waiting[index] = len(parents)
            for parent in parents:
                readers.setdefault(parent, []).append(index)
        # A heap of node indices: ties keep file order, so an already sorted graph keeps its order.
        ready = [index for index, count in enumerate(waiting) if count == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            index = heapq.heappop(ready)
            order.append(index)
            for reader in readers.get(index, ()):
                waiting[reader] -= 1
                if waiting[reader] == 0:
                    heapq.heappush(ready, reader)
        if len(order) != len(self.nodes):
            stuck = next(node for index, node in enumerate(self.nodes) if waiting[index])
            raise InputError(
                f"the graph has a cycle through node '{stuck.name or stuck.op_type}'; an ONNX graph must be acyclic"
            )
        return order


def _reads(node: onnx.NodeProto) -> list[str]:
    """The node's inputs and every name its subgraphs read from outer scope."""
    names = [name for name in node.input if name]
    for attribute in node.attribute:
        for subgraph in [attribute.g, *attribute.graphs] if attribute.type in (5, 10) else []:
            local = {value.name for value in subgraph.input} | {t.name for t in subgraph.initializer}
            local |= {name for inner in subgraph.node for name in inner.output}
            names += [name for inner in subgraph.node for name in _reads(inner) if name not in local]
    return names


@dataclass
class Segment:
    index: int
    nodes: list[int] = field(default_factory=list)  # in topological order
    inputs: list[str] = field(default_factory=list)  # values made before this segment
    outputs: list[str] = field(default_factory=list)  # values made here that later segments or this stage's taps need
    weights: list[str] = field(default_factory=list)  # changing weights read here, fed as inputs
    initializers: list[str] = field(default_factory=list)  # constant weights read here


class SegmentPlan:
    """Segments for ``stage_taps`` (the GEMM input names of each stage, in stage order).

    ``fed`` names the weights fed as inputs (initializers, or Constant-node outputs whose node is then left out).
    ``last_need[v]`` is the last segment that reads value ``v`` (or whose stage taps it); ``made_in[v]`` the segment
    that makes it (INPUTS for graph inputs); ``tainted`` the values that depend on a fed weight, the only ones that
    differ between the dense and the converted model.
    """

    def __init__(self, view: GraphView, stage_taps: Sequence[Iterable[str]], fed: Iterable[str]):
        self.view = view
        self.fed = set(fed)
        self.stage_taps = [list(dict.fromkeys(taps)) for taps in stage_taps]
        rank = {index: position for position, index in enumerate(view.order)}
        assigned: dict[int, int] = {}
        self.segments = []
        for k, taps in enumerate(self.stage_taps):
            segment = Segment(k)
            pending = [view.producer[name] for name in taps if name in view.producer and name not in self.fed]
            while pending:
                index = pending.pop()
                if index in assigned:
                    continue
                assigned[index] = k
                segment.nodes.append(index)
                pending += [
                    view.producer[name] for name in view.reads[index] if name in view.producer and name not in self.fed
                ]
            segment.nodes.sort(key=rank.__getitem__)
            self.segments.append(segment)
        self.made_in: dict[str, int] = dict.fromkeys(view.inputs, INPUTS)
        for index, k in assigned.items():
            for name in view.nodes[index].output:
                if name:
                    self.made_in[name] = k
        self.last_need: dict[str, int] = {}
        for segment in self.segments:
            made_here = {name for index in segment.nodes for name in view.nodes[index].output}
            read = dict.fromkeys(name for index in segment.nodes for name in view.reads[index])
            for name in read:
                if name in self.fed:
                    segment.weights.append(name)
                elif name in made_here:
                    self.last_need[name] = max(self.last_need.get(name, segment.index), segment.index)
                elif name in self.made_in:
                    segment.inputs.append(name)
                    self.last_need[name] = max(self.last_need.get(name, segment.index), segment.index)
                elif name in view.initializers:
                    segment.initializers.append(name)
                else:
                    raise InputError(f"'{name}' is read but neither a graph input, an initializer nor a node output")
            for name in self.stage_taps[segment.index]:
                if name not in self.made_in:
                    raise InputError(f"GEMM input '{name}' is not made by any node of the main graph")
                self.last_need[name] = max(self.last_need.get(name, segment.index), segment.index)
        for segment in self.segments:
            made_here = [name for index in segment.nodes for name in view.nodes[index].output if name]
            taps = set(self.stage_taps[segment.index])
            segment.outputs = [name for name in made_here if self.last_need.get(name, -2) > segment.index or name in taps]
        self.tainted = self._tainted()

    def _tainted(self) -> set[str]:
        tainted = set(self.fed)
        for index in self.view.order:
            if any(name in tainted for name in self.view.reads[index]):
                tainted.update(name for name in self.view.nodes[index].output if name)
        return tainted

    def live_after(self, k: int) -> list[str]:
        """The values that cross the cut after segment ``k`` (made at or before it, needed after it)."""
        return [name for name, need in self.last_need.items() if self.made_in[name] <= k < need]


class SegmentSession:
    """One ONNX Runtime session for one segment; weights that change are fed with every run."""

    def __init__(
        self,
        model: OnnxModel,
        plan: SegmentPlan,
        segment: Segment,
        input_types: Mapping[str, np.dtype],
        weight_protos: Mapping[str, onnx.TensorProto],
    ):
        try:
            import onnxruntime
        except ImportError as error:
            raise MissingDependencyError("calibration runs models in onnxruntime: pip install onnxruntime") from error
        self.segment = segment
        view = plan.view
        source = model.proto
        proto = onnx.ModelProto(
            ir_version=source.ir_version, producer_name=source.producer_name, producer_version=source.producer_version
        )
        proto.opset_import.extend(source.opset_import)
        proto.functions.extend(source.functions)
        graph = proto.graph
        graph.name = f"{source.graph.name}-segment-{segment.index}"
        graph.node.extend(view.nodes[index] for index in segment.nodes)
        for name in segment.inputs:
            elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(input_types[name]))
            graph.input.append(onnx.helper.make_tensor_value_info(name, elem, None))
        for name in segment.weights:
            tensor = weight_protos[name]
            graph.input.append(onnx.helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))
        wanted = set(segment.initializers)
        self.fixed_feeds: dict[str, np.ndarray] = {}
        for tensor in source.graph.initializer:
            if tensor.name not in wanted:
                continue
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                # Fed rather than referenced: ONNX Runtime resolves external data of a model given as bytes against
                # the working directory in places, and the values may have changed in memory (a permutation).
                self.fixed_feeds[tensor.name] = model.read(tensor)
                graph.input.append(
                    onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))
                )
            else:
                graph.initializer.append(tensor)
        graph.sparse_initializer.extend(t for t in source.graph.sparse_initializer if t.values.name in wanted)
        # Untyped outputs: ONNX Runtime infers their types, which saves a shape inference here.
        graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in segment.outputs)
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        try:
            self._session = onnxruntime.InferenceSession(
                proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
        except Exception as error:  # ORT raises its own Fail/InvalidGraph/... types for unusable models
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise InputError(
                f"ONNX Runtime cannot run the part of the model before calibration stage {segment.index} "
                f"({first_line})"
            ) from error

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self._session.run(self.segment.outputs, {**self.fixed_feeds, **feeds})
        result = {}
        for name, value in zip(self.segment.outputs, outputs, strict=True):
            if not isinstance(value, np.ndarray):
                raise InputError(
                    f"'{name}' crosses a calibration stage boundary but is a {type(value).__name__}, not a tensor; "
                    "calibration cuts the graph only between tensors (try --fit parallel)"
                )
            result[name] = value
        return result
