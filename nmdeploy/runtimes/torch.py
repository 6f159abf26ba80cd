"""torch backend: runs an ONNX model through the torch interpreter, and on CUDA runs its 2:4 Linear weights sparse.

A fully 2:4 fp16/bf16 MatMul/Gemm weight is stored as ``torch.sparse.to_sparse_semi_structured`` of its [out, in]
layout and applied with ``F.linear``, so a GPU without TensorRT still shows the sparse speed-up. Which weights
qualify is decided by :func:`plan_sparse_layers` on the protobuf alone (testable without a GPU), from torch's own
shape and dtype constraints for the kernel it will pick. On CPU every layer runs densely and the plan says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from nmdeploy.errors import InputError, MissingDependencyError, first_line
from nmdeploy.files import check_input_file
from nmdeploy.masks import is_nm
from nmdeploy.runtimes.base import InputSpec
from nmdeploy.runtimes.data import graph_inputs
from nmdeploy.runtimes.interpreter import GraphProgram, as_tensor, node_attributes, unsupported_nodes

log = logging.getLogger(__name__)

_SPARSE_DTYPES = (torch.float16, torch.bfloat16)
_DEVICES = ("auto", "cpu", "cuda")
GRAPH_PRECISIONS: dict[str, torch.dtype | None] = {
    "float32": None,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""A graph runner's precision -> the dtype of its products under autocast (None: float32, no autocast)."""


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (torch's own probe; False where torch lacks it)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    try:
        return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    except RuntimeError:
        return False


def training_precision(precision: str, device: torch.device | str = "cpu") -> str:
    """The precision ``precision`` ("auto" or one of GRAPH_PRECISIONS) resolves to on ``device``: on a GPU "auto" is
    bfloat16 where it has bfloat16 units, float16 elsewhere; on the CPU bfloat16 where it multiplies it natively, else
    float32."""
    device = torch.device(device)
    if device.type == "cpu":
        if precision == "float16":
            raise InputError("precision float16 is for CUDA devices; on the CPU use bfloat16 or float32")
        if precision == "auto":
            return "bfloat16" if native_bfloat16() else "float32"
        return precision
    if precision == "auto":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return precision


# ---------------------------------------------------------------------------------------------------------------
# Which weights run through the semi-structured kernels


@dataclass(frozen=True)
class SparseLayer:
    """The sparse verdict for one MatMul/Gemm with a stored weight: converted, or the reason it runs densely."""

    node: str
    op_type: str
    weight: str
    shape: tuple[int, ...]  # the [out, in] layout F.linear uses
    dtype: str
    compliant: bool  # 2:4 along the reduction axis in every group
    converted: bool
    reason: str  # why not converted ("" when converted)

    def as_dict(self) -> dict[str, Any]:
        return {**vars(self), "shape": list(self.shape)}


def kernel_constraints(dtype: torch.dtype) -> tuple[int, int] | None:
    """(row multiple, column multiple) of the sparse [out, in] operand for the kernel torch will pick, or None."""
    from torch.sparse import SparseSemiStructuredTensor
    from torch.sparse.semi_structured import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    kernel = (
        SparseSemiStructuredTensorCUTLASS
        if SparseSemiStructuredTensor._FORCE_CUTLASS
        else SparseSemiStructuredTensorCUSPARSELT
    )
    config = kernel._DTYPE_SHAPE_CONSTRAINTS.get(dtype)
    return None if config is None else (config.sparse_min_rows, config.sparse_min_cols)


def _linear_weight(node: onnx.NodeProto, weights: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | str:
    """The node's stored weight in [out, in] layout, or why it has none that F.linear could take."""
    if len(node.input) < 2 or node.input[1] not in weights:
        return "its second operand is not a stored weight"
    name, stored = node.input[1], weights[node.input[1]]
    if stored.ndim != 2:
        return f"weight has rank {stored.ndim}; the sparse kernels take matrices only"
    if node.op_type == "MatMul":
        return name, stored.t()
    attrs = node_attributes(node)
    if attrs.get("transA", 0):
        return "Gemm with transA=1"
    return name, stored if attrs.get("transB", 0) else stored.t()


def plan_sparse_layers(
    model: onnx.ModelProto, weights: dict[str, torch.Tensor], capability: tuple[int, int] | None
) -> list[SparseLayer]:
    """Decide, per MatMul/Gemm with a stored weight, whether its weight goes through torch's 2:4 kernels.

    A weight qualifies when it is 2:4 along its reduction axis everywhere, is fp16 or bf16, and its [out, in] shape
    is a multiple of the kernel's minimum tile; ``capability`` is the CUDA device's compute capability (8.0 or
    newer needed), None on CPU.
    """
    device_reason = _device_reason(capability)
    layers = []
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        found = _linear_weight(node, weights)
        if isinstance(found, str):
            continue
        name, linear = found
        out_features, in_features = linear.shape
        compliant = in_features % 4 == 0 and bool(is_nm(linear, "2:4", axis=1))
        constraints = kernel_constraints(linear.dtype) if linear.dtype in _SPARSE_DTYPES else None
        if not compliant:
            reason = "not 2:4 along its reduction axis"
        elif constraints is None:
            reason = f"{str(linear.dtype).removeprefix('torch.')}: the 2:4 kernels need fp16 or bf16 (nmdeploy cast)"
        elif out_features % constraints[0] or in_features % constraints[1]:
            reason = f"[out, in] = {list(linear.shape)} is not a multiple of the kernel's {list(constraints)}"
        else:
            reason = device_reason
        layers.append(
            SparseLayer(
                node.name or node.output[0],
                node.op_type,
                name,
                (out_features, in_features),
                str(linear.dtype).removeprefix("torch."),
                compliant,
                not reason,
                reason,
            )
        )
    return layers


def _device_reason(capability: tuple[int, int] | None) -> str:
    if capability is None:
        return "runs densely on CPU: torch's semi-structured kernels are CUDA-only"
    major, minor = capability
    if major < 8:
        return f"compute capability {major}.{minor}: the 2:4 kernels need 8.0 or newer"
    return ""


# ---------------------------------------------------------------------------------------------------------------
# The runner


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` without one is a MissingDependencyError."""
    if device not in _DEVICES:
        raise InputError(f"device {device!r}: choose one of {', '.join(_DEVICES)}")
    available = torch.cuda.is_available()
    if device == "cuda" and not available:
        raise MissingDependencyError(
            f"the torch backend's 2:4 kernels need CUDA, and torch {torch.__version__} sees no CUDA device; "
            "install a CUDA build of torch on an NVIDIA GPU (sm80+), or use --device cpu to run densely"
        )
    if device == "auto":
        return "cuda" if available else "cpu"
    return device


class TorchRunner:
    """Runs an ONNX model with torch on CPU (dense) or CUDA (2:4 weights through semi-structured kernels)."""

    def __init__(self, path: str | Path, device: str = "auto", sparse: bool = True):
        self.path = Path(path)
        self.requested_device = device
        self.sparse = sparse
        self.device = "cpu"
        self.sparse_layers: tuple[SparseLayer, ...] = ()
        self._model: onnx.ModelProto | None = None
        self._values: dict[str, torch.Tensor] = {}
        self._program: GraphProgram | None = None

    def __enter__(self) -> TorchRunner:
        self.device = resolve_device(self.requested_device)
        check_input_file(self.path, "an ONNX model")
        try:
            model = onnx.load(str(self.path))
        except Exception as error:  # protobuf and external-data failures have many types
            raise InputError(f"{self.path}: not a readable ONNX model ({type(error).__name__}: {error})") from error
        _check_supported(model, self.path)
        self._model = model
        self._values = {
            tensor.name: as_tensor(numpy_helper.to_array(tensor)).to(self.device) for tensor in model.graph.initializer
        }
        capability = torch.cuda.get_device_capability(self.device) if self.device.startswith("cuda") else None
        self.sparse_layers = tuple(plan_sparse_layers(model, self._values, capability)) if self.sparse else ()
        self._program = GraphProgram(model, self._convert(model), self.device)
        if self.sparse and self.device == "cpu":
            log.warning("torch backend on CPU: every layer runs densely (torch's 2:4 kernels are CUDA-only)")
        return self

    def _convert(self, model: onnx.ModelProto) -> dict[str, torch.Tensor]:
        """Semi-structured copies of the qualifying weights, keyed by node name."""
        converted = {}
        nodes = {node.name or node.output[0]: node for node in model.graph.node}
        for index, layer in enumerate(self.sparse_layers):
            if not layer.converted:
                continue
            found = _linear_weight(nodes[layer.node], self._values)
            assert not isinstance(found, str)  # the plan only converts layers that have a linear weight
            try:
                converted[layer.node] = torch.sparse.to_sparse_semi_structured(found[1].contiguous())
            except RuntimeError as error:  # e.g. a kernel missing from this torch build or GPU
                reason = f"torch refused: {str(error).splitlines()[0]}"
                self.sparse_layers = (
                    *self.sparse_layers[:index],
                    SparseLayer(**{**vars(layer), "converted": False, "reason": reason}),
                    *self.sparse_layers[index + 1 :],
                )
        return converted

    def __exit__(self, *exc: object) -> None:
        self._values, self._program, self._model = {}, None, None

    @property
    def inputs(self) -> tuple[InputSpec, ...]:
        return graph_inputs(self._model)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(output.name for output in self._model.graph.output)

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Execute the graph on device-resident torch inputs; no host copies."""
        with torch.inference_mode():
            return self._program.run({**self._values, **feeds})

    def to_device(self, feeds: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {name: as_tensor(array).to(self.device) for name, array in feeds.items()}

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.run(self.to_device(feeds))
        return {name: _to_numpy(value) for name, value in outputs.items()}

    def prepare(self, feeds: dict[str, np.ndarray]) -> Callable[[], None]:
        """One timed inference with inputs already on the device, waiting for the GPU to finish."""
        resident = self.to_device(feeds)
        synchronize = torch.cuda.synchronize if self.device.startswith("cuda") else (lambda: None)

        def run_once() -> None:
            self.run(resident)
            synchronize()

        return run_once


class TorchGraphRunner:
    """A graph held in memory (a piece of a model) run by the torch interpreter on ``device``: its initializers and
    the ``fixed`` values moved there once, fed values moved explicitly (numpy arrays; tensors already there stay),
    outputs left there for whatever runs next. Products are exact float32, as ONNX Runtime's are: no TF32 (matmuls
    are not TF32 by default either). ``differentiable``: runs keep autograd as the caller's context has it
    (gradients flow to the tensors fed, with torch's default products), for training through the graph; the caller's
    ``torch.no_grad()`` gives values that later losses may still read. ``outputs``: intermediate tensors returned
    beside the graph's outputs (what a loss matches inside the graph). ``precision`` (:data:`GRAPH_PRECISIONS`):
    bfloat16 or float16 runs the products under autocast and hands what came out in it back as float32.
    ``label`` names the graph in messages."""

    def __init__(
        self,
        graph: onnx.ModelProto,
        fixed: Mapping[str, np.ndarray] | None = None,
        *,
        device: str | torch.device = "cpu",
        label: str = "the graph",
        differentiable: bool = False,
        outputs: Sequence[str] = (),
        precision: str = "float32",
    ):
        from nmdeploy.graph.tensors import to_torch

        if precision not in GRAPH_PRECISIONS:
            raise ValueError(f"graph precision {precision!r}: one of {', '.join(GRAPH_PRECISIONS)}")
        self.label, self.device, self.differentiable = label, torch.device(device), differentiable
        self.extra_outputs, self._autocast = tuple(outputs), GRAPH_PRECISIONS[precision]
        if len(graph.graph.sparse_initializer):
            raise InputError(f"the torch interpreter reads no sparse initializers, and {label} has some")
        # The program is compiled from the nodes alone: what it keeps of them must not keep the protobuf holding
        # the initializers alive (a message's parts share its memory) beside their tensors on the device.
        nodes = onnx.ModelProto(ir_version=graph.ir_version)
        nodes.opset_import.extend(graph.opset_import)
        nodes.graph.node.extend(graph.graph.node)
        nodes.graph.output.extend(graph.graph.output)
        try:
            self._program = GraphProgram(nodes, device=self.device)
        except InputError as error:
            raise InputError(f"{error}, in {label}") from error
        self._constants = {
            tensor.name: to_torch(numpy_helper.to_array(tensor)).reshape(tuple(tensor.dims)).to(self.device)
            for tensor in graph.graph.initializer
        }
        self._constants.update(self.to_device(fixed or {}))

    def to_device(self, values: Mapping[str, object]) -> dict[str, object]:
        """``values`` as tensors on the runner's device (a no-op for those already there)."""
        from nmdeploy.graph.tensors import to_torch

        moved = {}
        for name, value in values.items():
            tensor = value if isinstance(value, torch.Tensor) else to_torch(np.asarray(value)).reshape(np.shape(value))
            moved[name] = tensor.to(self.device, non_blocking=True)
        return moved

    def run(self, feeds: Mapping[str, object]) -> dict[str, object]:
        values = {**self._constants, **self.to_device(feeds)}
        try:
            if self.differentiable:
                return self._run(values)
            with torch.inference_mode(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
                return self._run(values)
        except (RuntimeError, IndexError, ValueError) as error:
            raise InputError(f"the torch interpreter failed on {self.label} ({first_line(error)[:200]})") from error

    def _run(self, values: dict[str, object]) -> dict[str, object]:
        low = self._autocast
        if low is None:
            return self._program.run(values, self.extra_outputs)
        with torch.autocast(self.device.type, dtype=low):
            result = self._program.run(values, self.extra_outputs)
        return {name: value.float() if value.dtype == low else value for name, value in result.items()}


def _to_numpy(value: torch.Tensor) -> np.ndarray:
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        import ml_dtypes

        return value.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return value.numpy()


def _check_supported(model: onnx.ModelProto, path: Path) -> None:
    for _, reason in unsupported_nodes(model):
        raise InputError(f"{path}: the torch backend cannot run node {reason}; use --backend ort")
