"""ONNX Runtime backend: the embedded default, on CPU unless other providers are asked for. Every ONNX Runtime
session of the package is opened here (:func:`open_session`): model files by :class:`OnnxRuntimeRunner`, pieces of
models held in memory (calibration's segments) by :class:`OnnxRuntimeGraphRunner`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from nmdeploy.errors import InputError, first_line
from nmdeploy.graph import dtypes
from nmdeploy.imports import require
from nmdeploy.runtimes.base import InputSpec

DISABLED_OPTIMIZERS = ("ReluQuantRewrite",)
"""ONNX Runtime rewrites that change results: ReluQuantRewrite drops a Relu before a QuantizeLinear whose zero
point it takes for the type's minimum, which holds for uint8 but not for FP8 E4M3 (ONNX Runtime 1.23 then lets
negative values through: an FP8 Q/DQ model's outputs fall to cosine 0.67). Where the rule is right it only saves
the Relu, so leaving it out costs nothing measurable."""

EXACT_QDQ = ("session.disable_quant_qdq", "1")
"""Q/DQ computed as written (dequantize, then the float op) rather than fused into ONNX Runtime's integer kernels.
What a fused kernel gives depends on the CPU: without VNNI, ONNX Runtime's u8 x s8 kernels round intermediate sums
(10x the output error of the Q/DQ arithmetic on a small correlated layer of tests/test_quantize.py on an AVX2
machine; 2 % of SmolLM2's perplexity), so a verdict would change with the machine. Sessions whose outputs are
judged compute exactly; sessions that are timed run the fused kernels a deployment on this CPU would."""


def open_session(
    model: str | bytes,
    *,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    threads: int = 0,
    spinning: bool = True,
    quiet: bool = False,
    arena: bool = True,
    fused_qdq: bool = False,
    purpose: str = "running models",
) -> Any:
    """An ONNX Runtime InferenceSession of ``model`` (a path, or a serialized ModelProto), with the rewrites that
    change results turned off. ``threads``: intra-op threads (0: ONNX Runtime's default); ``spinning=False``: no
    thread left busy-waiting after a run; ``quiet``: no log line of a failure the caller expects and explains;
    ``arena=False``: tensors allocated and freed one by one rather than from the session's CPU arena (see
    :class:`OnnxRuntimeGraphRunner`); ``fused_qdq``: Q/DQ fused into integer kernels, for timing (else computed as
    written, :data:`EXACT_QDQ`). ONNX Runtime's own exceptions pass through: the caller knows what the model is
    and says what failed."""
    onnxruntime = require("onnxruntime", purpose=purpose)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4 if quiet else 3
    options.intra_op_num_threads = threads
    options.enable_cpu_mem_arena = arena
    if not fused_qdq:
        options.add_session_config_entry(*EXACT_QDQ)
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(
        model, options, providers=list(providers), disabled_optimizers=list(DISABLED_OPTIMIZERS)
    )


class OnnxRuntimeRunner:
    """An ONNX Runtime session for one model file.

    ``spinning=False`` stops the intra-op threads from busy-waiting after each run. Timing two models interleaved
    needs it: a spinning pool keeps the cores busy while the other model runs, so the ratio of two identical models
    swung between 0.75 and 1.36 from one session pair to the next on two cores (0.993-1.004 without spinning).
    """

    def __init__(
        self,
        path: str | Path,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        *,
        spinning: bool = True,
        quiet: bool = False,
        fused_qdq: bool = False,
    ):
        self.path = Path(path)
        self.providers = tuple(providers)
        self.spinning = spinning
        self.fused_qdq = fused_qdq  # timed: Q/DQ in the integer kernels a deployment on this CPU runs
        self.quiet = quiet  # a model that fails to load is expected (a probe): ONNX Runtime logs nothing
        self._session = None

    def __enter__(self) -> OnnxRuntimeRunner:
        require("onnxruntime", purpose="running models")
        from nmdeploy.graph.model import OnnxModel

        # The same checks as every other verb (external data inside the model's folder, sizes, no cycles) before
        # ONNX Runtime reads anything.
        OnnxModel.load(self.path)
        try:
            self._session = open_session(
                str(self.path),
                providers=self.providers,
                spinning=self.spinning,
                quiet=self.quiet,
                fused_qdq=self.fused_qdq,
            )
        except Exception as error:  # ORT raises its own Fail/InvalidGraph/... types for unusable models
            reason = first_line(error)
            raise InputError(f"{self.path}: ONNX Runtime cannot load it ({reason})") from error
        return self

    def __exit__(self, *exc: object) -> None:
        self._session = None

    @property
    def inputs(self) -> tuple[InputSpec, ...]:
        return tuple(
            InputSpec(
                i.name,
                dtypes.numpy_dtype_of_string(i.type),
                tuple(d if isinstance(d, int) and d > 0 else None for d in i.shape),
            )
            for i in self._session.get_inputs()
        )

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self._session.get_outputs())

    @property
    def intra_op_threads(self) -> int:
        """The session's intra-op thread count; 0 is ONNX Runtime's own default (one per physical core)."""
        return self._session.get_session_options().intra_op_num_threads

    def infer(self, feeds: dict[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run the model; ``outputs`` limits the result (and the work) to those tensors."""
        names = list(outputs) if outputs is not None else list(self.output_names)
        try:
            results = self._session.run(names, feeds)
        except Exception as error:  # ORT raises its own types for inputs the model cannot take (ids out of range)
            reason = first_line(error)
            raise InputError(
                f"{self.path}: ONNX Runtime failed on the given inputs ({reason[:200]}); check the data"
            ) from error
        return dict(zip(names, results, strict=True))


class OnnxRuntimeGraphRunner:
    """An ONNX Runtime session of a graph held in memory (a piece of a model), on the CPU; ``fixed`` values are fed
    with every run (weights the graph takes as inputs). Inputs the graph leaves untyped take the types of the first
    values fed: the session opens at the first run. Runs share the CPU with torch's products: ``threads`` as many
    as torch uses, none left spinning after a run. ``label`` names the graph in messages.

    The session has no CPU arena. An output array of ONNX Runtime (1.32) wraps its OrtValue, which holds the
    allocator it came from: one output kept past its session (a calibration cut's values are kept for later segments)
    kept that session's whole arena, its largest run's intermediates, alive. On Qwen2.5-0.5B's block-by-block
    conversion the arenas so kept were most of what the run held besides its cache."""

    def __init__(
        self,
        graph: onnx.ModelProto,
        fixed: Mapping[str, np.ndarray] | None = None,
        *,
        threads: int = 0,
        quiet: bool = False,
        label: str = "the graph",
    ):
        require("onnxruntime", purpose="running models")
        self.label, self.threads, self.quiet = label, threads, quiet
        self.fixed = dict(fixed or {})
        self.output_names = tuple(value.name for value in graph.graph.output)
        self._graph: onnx.ModelProto | None = graph
        self._session = None

    def _open(self, feeds: Mapping[str, np.ndarray]) -> None:
        graph, self._graph = self._graph, None  # the protobuf (and its weights) goes once the session has it
        for value in graph.graph.input:
            if not value.type.HasField("tensor_type") and value.name in feeds:
                elem = onnx.helper.np_dtype_to_tensor_dtype(np.asarray(feeds[value.name]).dtype)
                value.type.tensor_type.elem_type = elem
        try:
            self._session = open_session(
                graph.SerializeToString(), threads=self.threads, spinning=False, quiet=self.quiet, arena=False
            )
        except Exception as error:  # ORT raises its own Fail/InvalidGraph/... types for unusable models
            raise InputError(f"ONNX Runtime cannot run {self.label} ({first_line(error)})") from error

    def to_device(self, values: Mapping[str, object]) -> dict[str, object]:
        return dict(values)

    def run(self, feeds: Mapping[str, object]) -> dict[str, object]:
        if self._session is None:
            self._open(feeds)
        try:
            outputs = self._session.run(list(self.output_names), {**self.fixed, **feeds})
        except Exception as error:  # ORT raises its own types for inputs the model cannot take (ids out of range)
            raise InputError(f"ONNX Runtime failed on {self.label} ({first_line(error)[:200]})") from error
        return dict(zip(self.output_names, outputs, strict=True))
