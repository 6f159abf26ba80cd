"""TensorRT backend (10 and 11): build a strongly typed engine from ONNX, and run engines.

TensorRT 11 builds only strongly typed networks: its precision flags (FP16, BF16, INT8, FP8, ...) and INT8
calibrators are gone, and the STRONGLY_TYPED network flag is kept only to be ignored. nmdeploy never needed them: a
network is strongly typed on both (each layer runs in its ONNX type, Q/DQ scales come from the graph), and the weakly
typed fallback below serves only a TensorRT 10 build without the flag.

Engines are built through polygraphy's TensorRT loaders (``NetworkFromOnnxPath``, ``CreateConfig``, ``Profile``,
``EngineBytesFromNetwork``, ``EngineFromBytes``), which follow TensorRT's API from release to release; what we hand
them comes from small functions (:func:`optimisation_profile`, :func:`builder_config`) tested without TensorRT.
Parsing the builder log and the engine inspector's JSON, which polygraphy does not offer, is pure Python in
:mod:`nmdeploy.runtimes.engine_report`. TensorRT and polygraphy are imported lazily; where either (or a GPU) is
missing, a :class:`MissingDependencyError` says what to install.
"""

from __future__ import annotations

import glob
import io
import json
import logging
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nmdeploy.errors import Error, InputError, MissingDependencyError
from nmdeploy.files import write_atomically
from nmdeploy.runtimes.base import InputSpec
from nmdeploy.runtimes.shapes import ShapeRange

log = logging.getLogger(__name__)
# TensorRT's PyPI packages are stubs that build by downloading from NVIDIA's index: install from it, wheels only.
INSTALL_HINT = (
    "pip install --only-binary :all: --extra-index-url https://pypi.nvidia.com 'nmdeploy[tensorrt]' "
    "on a machine with an NVIDIA GPU ('nmdeploy[tensorrt-cu12]' for CUDA 12 drivers)"
)
SUPPORTED_MAJORS = (10, 11)  # what the engine report's inspector parsing and the build configuration know


def import_tensorrt() -> Any:
    """The ``tensorrt`` module, or a MissingDependencyError naming what to install (also when polygraphy, through
    which engines are built and loaded, is missing)."""
    try:
        import tensorrt
    except (ImportError, OSError) as error:  # OSError: bindings present but libnvinfer missing
        raise MissingDependencyError(f"TensorRT is not available ({error}): {INSTALL_HINT}") from error
    if tensorrt_major(tensorrt) not in SUPPORTED_MAJORS:
        raise MissingDependencyError(
            f"nmdeploy supports TensorRT 10 and 11, found {tensorrt.__version__}: {INSTALL_HINT} (it installs 11)"
        )
    import_loaders()
    return tensorrt


def tensorrt_major(trt: Any) -> int:
    return int(str(trt.__version__).split(".")[0])


def network_typing(trt: Any) -> tuple[bool, bool]:
    """(ask for the STRONGLY_TYPED network flag, the network is strongly typed). TensorRT 11 networks are always
    strongly typed, whether or not it still has the (ignored) flag; TensorRT 10 networks are when the flag is set."""
    has_flag = hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
    return has_flag, has_flag or tensorrt_major(trt) >= 11


def import_loaders() -> Any:
    """polygraphy's TensorRT loaders (``polygraphy.backend.trt``; TensorRT itself is imported when one runs)."""
    try:
        from polygraphy.backend import trt as loaders
    except ImportError as error:
        raise MissingDependencyError(f"polygraphy is not available ({error}): {INSTALL_HINT}") from error
    return loaders


@dataclass
class BuiltEngine:
    path: Path
    tensorrt_version: str
    strongly_typed: bool
    seconds: float
    log_lines: list[str] = field(default_factory=list)
    layer_information: dict[str, Any] = field(default_factory=dict)  # the engine inspector's JSON


def optimisation_profile(inputs: Sequence[tuple[str, Sequence[int]]], shapes: Mapping[str, ShapeRange]) -> Any:
    """The polygraphy ``Profile`` for a network with ``inputs`` (name, dims; -1 is dynamic): each input's given
    (min, opt, max), or its own shape where static. Unknown names, dynamic inputs without shapes and shapes that do
    not fit are one-line InputErrors (polygraphy would silently fill dynamic dimensions with a default). polygraphy
    reads profile keys as shell patterns, so names are escaped: an input named ``x[0]`` is no pattern for ``x0``."""
    profile = import_loaders().Profile()
    names = [name for name, _ in inputs]
    unknown = sorted(set(shapes) - set(names))
    if unknown:
        raise InputError(f"--shapes names {', '.join(unknown)}, which the model lacks; its inputs are {names}")
    for name, dims in inputs:
        dims = tuple(int(d) for d in dims)
        if name not in shapes:
            if any(d < 0 for d in dims):
                example = "x".join("1" if d < 0 else str(d) for d in dims)
                raise InputError(
                    f"input '{name}' has dynamic shape {list(dims)}; give it with --shapes {name}:{example}, or "
                    "with --min-shapes, --opt-shapes and --max-shapes"
                )
            profile.add(glob.escape(name), dims, dims, dims)
            continue
        low, opt, high = (tuple(shape) for shape in shapes[name])
        if len(low) != len(dims) or any(
            d >= 0 and (a, b, c) != (d, d, d) for d, a, b, c in zip(dims, low, opt, high, strict=True)
        ):
            raise InputError(f"the shapes given for '{name}' do not fit its shape {list(dims)} (-1 is dynamic)")
        profile.add(glob.escape(name), low, opt, high)
    return profile


def builder_config(
    trt: Any,
    *,
    profile: Any,
    strongly_typed: bool,
    sparse: bool = False,
    timing_cache: bytes | None = None,
    workspace_mib: int | None = None,
    quantized: Collection[str] = (),
) -> Any:
    """The polygraphy ``CreateConfig`` for one build: SPARSE_WEIGHTS when ``sparse``; no precision flag at all for a
    strongly typed network (each layer runs in its ONNX type, Q/DQ included: TensorRT 10's explicit quantization
    guide says precision flags are not needed with strong typing and should not be set, TensorRT 11 removed them,
    and no INT8 calibrator either: the scales are in the graph); a weakly typed network (TensorRT 10 without the
    flag) gets fp16 and bf16 kernels, and the INT8 flag when the model's Q/DQ (``quantized``: "int8", "fp8", ...)
    are INT8, without which TensorRT would not honour them. TF32
    left on, as TensorRT has it by default; DETAILED profiling so the engine inspector names every fused ONNX node
    and the format of each layer's inputs and outputs; the timing cache's bytes (None: start empty)."""
    weak = not strongly_typed
    return import_loaders().CreateConfig(
        sparse_weights=sparse,
        tf32=True,
        fp16=weak,
        bf16=weak,
        int8=weak and "int8" in quantized,
        profiles=[profile],
        load_timing_cache=None if timing_cache is None else _TimingCacheBytes(timing_cache),
        memory_pool_limits=None if workspace_mib is None else {trt.MemoryPoolType.WORKSPACE: int(workspace_mib) << 20},
        profiling_verbosity=trt.ProfilingVerbosity.DETAILED,
    )


class _TimingCacheBytes(io.BytesIO):
    """The timing cache as the read-only binary file-like object polygraphy loads (it checks ``mode``); a path would
    make it create a ``.lock`` file beside the cache, and the cache is written back through nmdeploy.files."""

    mode = "rb"


def build_engine(
    onnx_path: str | Path,
    engine_path: str | Path,
    *,
    sparse: bool = False,
    shapes: Mapping[str, ShapeRange] | None = None,
    timing_cache: str | Path | None = None,
    workspace_mib: int | None = None,
    quantized: Collection[str] = (),
) -> BuiltEngine:
    """Parse ``onnx_path`` into a strongly typed network, build it (SPARSE_WEIGHTS when ``sparse``), write the
    engine atomically, and return the builder log and the engine inspector's per-layer information.
    ``quantized`` names the model's Q/DQ types: FP8 Q/DQ need a strongly typed network."""
    trt, loaders = import_tensorrt(), import_loaders()
    from polygraphy.exception import PolygraphyException

    ask_strongly_typed, strongly_typed = network_typing(trt)
    if not strongly_typed and "fp8" in quantized:
        raise MissingDependencyError(
            f"{onnx_path} holds FP8 Q/DQ, which TensorRT builds only as a strongly typed network, and TensorRT "
            f"{trt.__version__} has none: {INSTALL_HINT} (TensorRT 10 or newer)"
        )
    cache_path = Path(timing_cache) if timing_cache else None
    with polygraphy_log() as lines:
        try:
            builder, network, parser = loaders.NetworkFromOnnxPath(str(onnx_path), strongly_typed=ask_strongly_typed)()
        except PolygraphyException as error:
            raise InputError(f"TensorRT's ONNX parser rejected {onnx_path}: {_first_error(lines, error)}") from None
        except (TypeError, RuntimeError) as error:  # what TensorRT raises when its builder cannot start CUDA
            reason = _first_error(lines, error)
            raise MissingDependencyError(f"TensorRT found no usable NVIDIA GPU ({reason})") from None
        inputs = [(tensor.name, tuple(tensor.shape)) for tensor in map(network.get_input, range(network.num_inputs))]
        create = builder_config(
            trt,
            profile=optimisation_profile(inputs, dict(shapes or {})),
            strongly_typed=strongly_typed,
            sparse=sparse,
            timing_cache=cache_path.read_bytes() if cache_path is not None and cache_path.is_file() else None,
            workspace_mib=workspace_mib,
            quantized=quantized,
        )
        start = time.perf_counter()
        try:
            config = create(builder, network)
            serialized = loaders.EngineBytesFromNetwork((builder, network, parser), config=config)()
            seconds = time.perf_counter() - start
            engine = loaders.EngineFromBytes(serialized)()
        except PolygraphyException as error:
            raise Error(f"TensorRT could not build an engine from {onnx_path}: {_last_error(lines, error)}") from None
        engine_path = write_atomically(Path(engine_path).resolve(), bytes(serialized))
        if cache_path is not None:
            write_atomically(cache_path, bytes(config.get_timing_cache().serialize()))
        information = engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
    for line in lines:
        if line.startswith("[E]"):  # errors TensorRT logged yet built past
            log.warning("TensorRT: %s", line[4:])
    return BuiltEngine(
        engine_path,
        str(trt.__version__),
        strongly_typed,
        seconds,
        [line.split("] ", 1)[-1] for line in lines],
        json.loads(information),
    )


@contextmanager
def polygraphy_log() -> Iterator[list[str]]:
    """Collect polygraphy's log, which TensorRT's messages pass through (its INFO as polygraphy's VERBOSE: the
    sparsity report is logged at INFO), as ``[E]``/``[W]``/``[I]`` lines instead of printing it on stdout, where it
    would mix with ``--json``. Warnings go on to logging; errors are only collected, since a failure ends in one
    exception naming TensorRT's error (and a user error in one line). polygraphy's logger settings are put back."""
    from polygraphy.logger import G_LOGGER

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            tag = "E" if record.levelno >= G_LOGGER.ERROR else "W" if record.levelno >= G_LOGGER.WARNING else "I"
            message = record.getMessage().strip()
            lines.append(f"[{tag}] {message}")
            if tag == "W":
                log.warning("TensorRT: %s", message)

    target = logging.getLogger("Polygraphy")  # where polygraphy sends its messages when told to use logging
    saved = (G_LOGGER.use_python_logging_system, G_LOGGER.letter, G_LOGGER.colors, target.level, target.propagate)
    handler = Collect(level=1)
    G_LOGGER.use_python_logging_system, G_LOGGER.letter, G_LOGGER.colors = True, False, False
    target.setLevel(1)
    target.propagate = False
    target.addHandler(handler)
    try:
        with G_LOGGER.verbosity(G_LOGGER.VERBOSE):
            yield lines
    finally:
        target.removeHandler(handler)
        G_LOGGER.use_python_logging_system, G_LOGGER.letter, G_LOGGER.colors = saved[:3]
        target.setLevel(saved[3])
        target.propagate = saved[4]


def _errors(lines: Sequence[str], error: BaseException) -> list[str]:
    """TensorRT's error lines, one line each, before polygraphy's own summary (the exception's message) and without
    the stack traces polygraphy logs as errors."""
    found = [" ".join(line[4:].split()) for line in lines if line.startswith("[E]")]
    summary = " ".join(str(error).split())
    found = [line for line in found if line and line != summary and not line.startswith('File "')]
    return found or [summary or type(error).__name__]


def _first_error(lines: Sequence[str], error: BaseException) -> str:
    return _errors(lines, error)[0]


def _last_error(lines: Sequence[str], error: BaseException) -> str:
    return _errors(lines, error)[-1]


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
        from polygraphy.exception import PolygraphyException

        with polygraphy_log():
            try:
                self._engine = import_loaders().EngineFromBytes(self.path.read_bytes())()
            except PolygraphyException:
                raise InputError(
                    f"{self.path}: TensorRT cannot load it (built by another TensorRT version or GPU?)"
                ) from None
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
