"""The model cut at the fitting stages: segments that run one after another on cached boundary values.

Segment k holds the nodes that stage k's GEMM inputs need and no earlier segment computed. Its inputs are the
values that cross the cut before it (graph inputs, residual streams, attention masks, shape tensors: whatever it
reads that an earlier segment made); its outputs are the values it makes that a later segment reads, and stage k's
GEMM inputs. Weights that conversion changes are segment inputs rather than initializers, so one session per
segment serves both the dense and the converted model, and no session is rebuilt when a weight changes. Sessions
come from the backend registry (:meth:`~nmdeploy.runtimes.backends.Backend.open_graph`: ONNX Runtime on the CPU, the
torch interpreter on a device). Initializers stored in the protobuf are copied into the segment that reads them;
those in external data files are mapped from their files when their segment's session is built and fed, so a
segment of a model over 2 GB is a small protobuf, only the weights of the running segment are in memory at once,
and of those only the pages the runs touch (:meth:`~nmdeploy.graph.model.OnnxModel.mapped`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from nmdeploy.errors import InputError
from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.model import OnnxModel
from nmdeploy.runtimes import backends
from nmdeploy.runtimes.backends import Backend

INPUTS = -1  # the "segment" that makes the graph inputs


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

    Node order, slices, producers and subgraphs' outer-scope reads all come from the model's :class:`GraphIndex`.
    ``fed`` names the weights fed as inputs (initializers, or Constant-node outputs whose node is then left out).
    ``last_need[v]`` is the last segment that reads value ``v`` (or whose stage taps it); ``made_in[v]`` the segment
    that makes it (INPUTS for graph inputs); ``tainted`` the values that depend on a fed weight, the only ones that
    differ between the dense and the converted model.
    """

    def __init__(self, index: GraphIndex, stage_taps: Sequence[Iterable[str]], fed: Iterable[str]):
        self.index = index
        main = index.main
        self.fed = set(fed)
        self.stage_taps = [list(dict.fromkeys(taps)) for taps in stage_taps]
        made_so_far = set(self.fed)
        self.made_in: dict[str, int] = {name: INPUTS for name in main.inputs if name not in main.initializers}
        self.segments = []
        for k, taps in enumerate(self.stage_taps):
            # Values earlier segments made are given: the slice stops there, so every node lands in one segment.
            segment = Segment(k, index.backward_slice(taps, stop=made_so_far))
            for position in segment.nodes:
                for name in main.nodes[position].output:
                    if name:
                        self.made_in[name] = k
                        made_so_far.add(name)
            self.segments.append(segment)
        self.last_need: dict[str, int] = {}
        for segment in self.segments:
            made_here = {name for position in segment.nodes for name in main.nodes[position].output}
            for name in index.segment_inputs(segment.nodes):
                if name in self.fed:
                    segment.weights.append(name)
                elif name in self.made_in and name not in made_here:
                    segment.inputs.append(name)
                    self.last_need[name] = max(self.last_need.get(name, segment.index), segment.index)
                elif name in main.initializers or name in main.sparse_initializers:
                    segment.initializers.append(name)
                else:
                    raise InputError(f"'{name}' is read but neither a graph input, an initializer nor a node output")
            for name in self.stage_taps[segment.index]:
                if name not in self.made_in:
                    raise InputError(f"GEMM input '{name}' is not made by any node of the main graph")
                self.last_need[name] = max(self.last_need.get(name, segment.index), segment.index)
        for segment in self.segments:
            made_here = [name for position in segment.nodes for name in main.nodes[position].output if name]
            taps = set(self.stage_taps[segment.index])
            segment.outputs = [
                name for name in made_here if self.last_need.get(name, -2) > segment.index or name in taps
            ]
        self.tainted = self._tainted()

    def _tainted(self) -> set[str]:
        main = self.index.main
        tainted = set(self.fed)
        for position in self.index.topological_order():
            if any(name in tainted for name in main.reads(position)):
                tainted.update(name for name in main.nodes[position].output if name)
        return tainted

    def live_after(self, k: int) -> list[str]:
        """The values that cross the cut after segment ``k`` (made at or before it, needed after it)."""
        return [name for name, need in self.last_need.items() if self.made_in[name] <= k < need]


class SegmentSession:
    """One segment run by a backend of the registry (:meth:`~nmdeploy.runtimes.backends.Backend.open_graph`): built
    once per stage, run once per batch and stream; weights that change are fed with every run.

    The segment's graph takes its cut values as untyped inputs (typed by the first values fed: no shape inference
    here), the changing weights as typed inputs, its constant weights stored in the protobuf as initializers and those
    in external data files as values fed with every run (ONNX Runtime resolves external data of a model given as
    bytes against the working directory in places, and the values may have changed in memory: a permutation). Its
    outputs are untyped: the engine infers their types, which saves a shape inference here.
    """

    def __init__(
        self,
        model: OnnxModel,
        plan: SegmentPlan,
        segment: Segment,
        weight_protos: Mapping[str, onnx.TensorProto],
        *,
        backend: Backend | None = None,
        device: str = "cpu",
        threads: int = 0,
        quiet: bool = False,  # no log line of a failed run: the caller expects failures and says what they mean
    ):
        backend = backend or backends.backend_named(backends.DEFAULT_BACKEND)
        self.segment = segment
        # Where a backend other than the default one fails, the default is the way out.
        default = backends.backend_named(backends.DEFAULT_BACKEND).graph_engine
        self._advice = f"; or use --statistics {default}" if backend.graph_engine != default else ""
        main = plan.index.main
        source = model.proto
        proto = onnx.ModelProto(
            ir_version=source.ir_version, producer_name=source.producer_name, producer_version=source.producer_version
        )
        proto.opset_import.extend(source.opset_import)
        proto.functions.extend(source.functions)
        graph = proto.graph
        graph.name = f"{source.graph.name}-segment-{segment.index}"
        graph.node.extend(main.nodes[position] for position in segment.nodes)
        graph.input.extend(onnx.helper.make_empty_tensor_value_info(name) for name in segment.inputs)
        for name in segment.weights:
            tensor = weight_protos[name]
            graph.input.append(onnx.helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))
        wanted = set(segment.initializers)
        fixed: dict[str, np.ndarray] = {}
        for tensor in source.graph.initializer:
            if tensor.name not in wanted:
                continue
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                fixed[tensor.name] = model.mapped(tensor)  # only the pages the runs touch become resident
                graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
            else:
                graph.initializer.append(tensor)
        graph.sparse_initializer.extend(t for t in source.graph.sparse_initializer if t.values.name in wanted)
        graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in segment.outputs)
        label = f"the part of the model before calibration stage {segment.index}"
        try:
            self._runner = backend.open_graph(proto, fixed, device=device, threads=threads, quiet=quiet, label=label)
        except InputError as error:
            raise InputError(f"{error}{self._advice}") from error

    def to_device(self, values: Mapping[str, object]) -> dict[str, object]:
        """``values`` as :meth:`run` takes them (moved once to the backend's device, where it keeps values there)."""
        return self._runner.to_device(values)

    def run(self, feeds: Mapping[str, object]) -> dict[str, object]:
        try:
            outputs = self._runner.run(feeds)
        except InputError as error:  # chained to the engine's own error, which the batch probe quotes
            message = f"{error}; check the data against the model's inputs{self._advice}"
            raise InputError(message) from error.__cause__ or error
        for name, value in outputs.items():
            if not (hasattr(value, "shape") and hasattr(value, "dtype")):
                raise InputError(
                    f"'{name}' crosses a calibration stage boundary but is a {type(value).__name__}, not a tensor; "
                    "calibration cuts the graph only between tensors (try --fit parallel)"
                )
        return outputs
