"""TensorRT backend (10 and 11): build a strongly typed engine from ONNX, and run engines.

The code that touches TensorRT is kept thin: parsing the builder log and the engine inspector's JSON is pure Python
in :mod:`nmdeploy.runtimes.engine_report`, tested without TensorRT. TensorRT is imported lazily; where it (or a GPU) is
missing, a :class:`MissingDependencyError` says what to install.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nmdeploy.errors import Error, InputError, MissingDependencyError
from nmdeploy.files import write_atomically
from nmdeploy.runtimes.base import InputSpec
from nmdeploy.runtimes.shapes import ShapeRange

log = logging.getLogger(__name__)
INSTALL_HINT = "pip install 'nmdeploy[tensorrt]' on a machine with an NVIDIA GPU"

def import_tensorrt() -> Any:
    """The ``tensorrt`` module, or a MissingDependencyError naming what to install."""
    try:
        import tensorrt
    except (ImportError, OSError) as error:  # OSError: bindings present but libnvinfer missing
        raise MissingDependencyError(f"TensorRT is not available ({error}): {INSTALL_HINT}") from error
    major = int(str(tensorrt.__version__).split(".")[0])
    if major < 10:
        raise MissingDependencyError(f"nmdeploy needs TensorRT 10 or newer, found {tensorrt.__version__}")
    return tensorrt


@dataclass
class BuiltEngine:
    path: Path
    tensorrt_version: str
    strongly_typed: bool
    seconds: float
    log_lines: list[str] = field(default_factory=list)
    layer_information: dict[str, Any] = field(default_factory=dict)  # the engine inspector's JSON


def build_engine(
    onnx_path: str | Path,
    engine_path: str | Path,
    *,
    sparse: bool = False,
    shapes: Mapping[str, ShapeRange] | None = None,
    timing_cache: str | Path | None = None,
    workspace_mib: int | None = None,
) -> BuiltEngine:
    """Parse ``onnx_path`` into a strongly typed network, build it (SPARSE_WEIGHTS when ``sparse``), write the
    engine atomically, and return the builder log and the engine inspector's per-layer information."""
    trt = import_tensorrt()
    logger = _collecting_logger(trt)
    builder = _builder(trt, logger)
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    network = builder.create_network(0 if flag is None else 1 << int(flag))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise InputError(f"TensorRT's ONNX parser rejected {onnx_path}: {_parser_error(parser)}")
    config = builder.create_builder_config()
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if sparse:
        config.set_flag(trt.BuilderFlag.SPARSE_WEIGHTS)
    if workspace_mib is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_mib) << 20)
    _add_profile(builder, network, config, dict(shapes or {}))
    cache_path = Path(timing_cache) if timing_cache else None
    if cache_path is not None:
        cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
    start = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    seconds = time.perf_counter() - start
    if serialized is None:
        errors = [line for line in logger.lines if line.startswith("[E]")] or logger.lines[-1:] or ["no message"]
        raise Error(f"TensorRT could not build an engine from {onnx_path}: {errors[-1]}")
    engine_path = write_atomically(Path(engine_path).resolve(), bytes(serialized))
    if cache_path is not None:
        write_atomically(cache_path, bytes(config.get_timing_cache().serialize()))
    engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
    information = engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
    return BuiltEngine(
        engine_path,
        str(trt.__version__),
        flag is not None,
        seconds,
        [line.split("] ", 1)[-1] for line in logger.lines],
        json.loads(information),
    )


def _collecting_logger(trt: Any) -> Any:
    class CollectingLogger(trt.ILogger):
        """Keeps every builder message (the sparsity report is logged at INFO) and forwards problems to logging."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.lines: list[str] = []

        def log(self, severity: Any, message: str) -> None:
            tag = {trt.ILogger.ERROR: "E", trt.ILogger.INTERNAL_ERROR: "E", trt.ILogger.WARNING: "W"}.get(severity, "I")
            self.lines.append(f"[{tag}] {message}")
            if tag != "I":
                log.log(logging.ERROR if tag == "E" else logging.WARNING, "TensorRT: %s", message)

    return CollectingLogger()


def _builder(trt: Any, logger: Any) -> Any:
    try:
        builder = trt.Builder(logger)
    except Exception as error:  # TensorRT raises TypeError/RuntimeError when CUDA cannot start
        builder, reason = None, str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    else:
        reason = next((line for line in logger.lines if line.startswith("[E]")), "")
    if builder is None:
        raise MissingDependencyError(f"TensorRT found no usable NVIDIA GPU ({reason or 'CUDA did not initialise'})")
    return builder


def _parser_error(parser: Any) -> str:
    if not parser.num_errors:
        return "no error message; is the file a valid ONNX model?"
    error = parser.get_error(0)
    node = error.node_name() if hasattr(error, "node_name") else ""
    text = " ".join(str(error.desc()).split())
    more = f" (and {parser.num_errors - 1} more errors)" if parser.num_errors > 1 else ""
    return f"{text}{f' at node {node}' if node else ''}{more}"


def _add_profile(builder: Any, network: Any, config: Any, shapes: dict[str, ShapeRange]) -> None:
    """An optimisation profile from the given shapes; static inputs need none, dynamic ones without shapes fail."""
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    names = [tensor.name for tensor in inputs]
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise InputError(f"--shapes names {', '.join(unknown)}, which the model lacks; its inputs are {names}")
    if not shapes and all(d >= 0 for tensor in inputs for d in tensor.shape):
        return
    profile = builder.create_optimization_profile()
    for tensor in inputs:
        dims = tuple(tensor.shape)
        if tensor.name not in shapes:
            if any(d < 0 for d in dims):
                example = "x".join("1" if d < 0 else str(d) for d in dims)
                raise InputError(
                    f"input '{tensor.name}' has dynamic shape {list(dims)}; give it with --shapes {tensor.name}:"
                    f"{example}, or with --min-shapes, --opt-shapes and --max-shapes"
                )
            profile.set_shape(tensor.name, dims, dims, dims)
            continue
        low, opt, high = shapes[tensor.name]
        if len(low) != len(dims) or any(
            d >= 0 and (a, b, c) != (d, d, d) for d, a, b, c in zip(dims, low, opt, high, strict=True)
        ):
            raise InputError(f"the shapes given for '{tensor.name}' do not fit its shape {list(dims)} (-1 is dynamic)")
        profile.set_shape(tensor.name, low, opt, high)
    config.add_optimization_profile(profile)


class TensorRTRunner:
    """Runs a serialized engine on the GPU, with torch CUDA tensors as device buffers."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._engine: Any = None
        self._context: Any = None

    def __enter__(self) -> TensorRTRunner:
        trt = import_tensorrt()
        try:
            import torch
        except ImportError as error:
            raise MissingDependencyError("running TensorRT engines needs torch with CUDA") from error
        if not torch.cuda.is_available():
            raise MissingDependencyError("running TensorRT engines needs an NVIDIA GPU visible to torch (CUDA)")
        if not self.path.is_file():
            raise InputError(f"{self.path}: no such engine file")
        logger = _collecting_logger(trt)
        self._engine = trt.Runtime(logger).deserialize_cuda_engine(self.path.read_bytes())
        if self._engine is None:
            raise InputError(f"{self.path}: TensorRT cannot load it (built by another TensorRT version or GPU?)")
        self._context = self._engine.create_execution_context()
        self._trt, self._torch = trt, torch
        return self

    def __exit__(self, *exc: object) -> None:
        self._context = self._engine = None

    def _names(self, mode: Any) -> list[str]:
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        return [name for name in names if self._engine.get_tensor_mode(name) == mode]

    @property
    def inputs(self) -> tuple[InputSpec, ...]:
        return tuple(
            InputSpec(
                name,
                np.dtype(self._trt.nptype(self._engine.get_tensor_dtype(name))),
                tuple(d if d >= 0 else None for d in self._engine.get_tensor_shape(name)),
            )
            for name in self._names(self._trt.TensorIOMode.INPUT)
        )

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(self._names(self._trt.TensorIOMode.OUTPUT))

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch, context = self._torch, self._context
        keep_alive = []
        for spec in self.inputs:
            tensor = torch.from_numpy(np.ascontiguousarray(feeds[spec.name], dtype=spec.dtype)).cuda()
            context.set_input_shape(spec.name, tuple(tensor.shape))
            context.set_tensor_address(spec.name, tensor.data_ptr())
            keep_alive.append(tensor)
        outputs = {}
        for name in self.output_names:
            dtype = torch.from_numpy(np.zeros(0, self._trt.nptype(self._engine.get_tensor_dtype(name)))).dtype
            outputs[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=dtype, device="cuda")
            context.set_tensor_address(name, outputs[name].data_ptr())
        stream = torch.cuda.current_stream()
        if not context.execute_async_v3(stream.cuda_stream):
            raise Error(f"{self.path}: TensorRT failed to run the engine")
        stream.synchronize()
        return {name: tensor.cpu().numpy() for name, tensor in outputs.items()}
