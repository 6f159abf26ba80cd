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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from nmdeploy.errors import InputError, first_line
from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.model import OnnxModel
from nmdeploy.imports import require

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
    """One ONNX Runtime session for one segment; weights that change are fed with every run."""

    def __init__(
        self,
        model: OnnxModel,
        plan: SegmentPlan,
        segment: Segment,
        input_types: Mapping[str, np.dtype],
        weight_protos: Mapping[str, onnx.TensorProto],
        threads: int = 0,
        quiet: bool = False,  # no log line of a failed run: the caller expects failures and says what they mean
    ):
        onnxruntime = require("onnxruntime", purpose="calibration (it runs the model's segments)")
        self.segment = segment
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
                graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
            else:
                graph.initializer.append(tensor)
        graph.sparse_initializer.extend(t for t in source.graph.sparse_initializer if t.values.name in wanted)
        # Untyped outputs: ONNX Runtime infers their types, which saves a shape inference here.
        graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in segment.outputs)
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 4 if quiet else 3
        # Runs alternate with torch's products on the same cores: as many threads as torch uses, and none left
        # spinning after a run returns, where they would compete with the products that follow.
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self._session = onnxruntime.InferenceSession(
                proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
        except Exception as error:  # ORT raises its own Fail/InvalidGraph/... types for unusable models
            reason = first_line(error)
            raise InputError(
                f"ONNX Runtime cannot run the part of the model before calibration stage {segment.index} ({reason})"
            ) from error

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            outputs = self._session.run(self.segment.outputs, {**self.fixed_feeds, **feeds})
        except Exception as error:  # ORT raises its own types for inputs the model cannot take (ids out of range)
            reason = first_line(error)
            raise InputError(
                f"ONNX Runtime failed on the calibration data in stage {self.segment.index} ({reason[:200]}); "
                "check the data against the model's inputs"
            ) from error
        result = {}
        for name, value in zip(self.segment.outputs, outputs, strict=True):
            if not isinstance(value, np.ndarray):
                raise InputError(
                    f"'{name}' crosses a calibration stage boundary but is a {type(value).__name__}, not a tensor; "
                    "calibration cuts the graph only between tensors (try --fit parallel)"
                )
            result[name] = value
        return result


class TorchSegmentSession:
    """One segment run by the torch interpreter on ``device``: the segment's constant weights moved there once, fed
    values moved explicitly (numpy arrays from the data or the spill store; tensors already there stay), outputs
    left on the device for the next segment and the taps."""

    def __init__(self, model: OnnxModel, plan: SegmentPlan, segment: Segment, device: str):
        import torch

        from nmdeploy.graph.tensors import to_torch
        from nmdeploy.runtimes.interpreter import GraphProgram

        self.segment, self.device = segment, torch.device(device)
        main = plan.index.main
        wanted = set(segment.initializers)
        if any(t.values.name in wanted for t in model.proto.graph.sparse_initializer):
            raise InputError("the torch interpreter reads no sparse initializers; use --statistics onnxruntime")
        proto = onnx.ModelProto(ir_version=model.proto.ir_version)
        proto.opset_import.extend(model.proto.opset_import)
        proto.graph.node.extend(main.nodes[position] for position in segment.nodes)
        proto.graph.output.extend(onnx.helper.make_empty_tensor_value_info(name) for name in segment.outputs)
        try:
            self._program = GraphProgram(proto, device=self.device)
        except InputError as error:
            raise InputError(f"{error}; use --statistics onnxruntime") from error
        self._constants = {
            tensor.name: to_torch(model.read(tensor)).reshape(tuple(tensor.dims)).to(self.device)
            for tensor in model.proto.graph.initializer
            if tensor.name in wanted
        }

    def to_device(self, values: Mapping[str, object]) -> dict[str, object]:
        """``values`` as tensors on the session's device (a no-op for those already there)."""
        import torch

        from nmdeploy.graph.tensors import to_torch

        moved = {}
        for name, value in values.items():
            tensor = value if isinstance(value, torch.Tensor) else to_torch(np.asarray(value)).reshape(np.shape(value))
            moved[name] = tensor.to(self.device, non_blocking=True)
        return moved

    def run(self, feeds: Mapping[str, object]) -> dict[str, object]:
        import torch

        values = {**self._constants, **self.to_device(feeds)}
        try:
            # Statistics must match ONNX Runtime's float32 products: no TF32 convolutions (matmuls are not TF32 by
            # default either).
            with torch.inference_mode(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
                return self._program.run(values)
        except (RuntimeError, IndexError, ValueError) as error:
            raise InputError(
                f"the torch interpreter failed on the calibration data in stage {self.segment.index} "
                f"({first_line(error)[:200]}); check the data, or use --statistics onnxruntime"
            ) from error
