"""ONNX Runtime backend: the embedded default, on CPU unless other providers are asked for."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError, first_line
from nmdeploy.graph import dtypes
from nmdeploy.imports import require
from nmdeploy.runtimes.base import InputSpec

DISABLED_OPTIMIZERS = ("ReluQuantRewrite",)
"""ONNX Runtime rewrites that change results: ReluQuantRewrite drops a Relu before a QuantizeLinear whose zero
point it takes for the type's minimum, which holds for uint8 but not for FP8 E4M3 (ONNX Runtime 1.23 then lets
negative values through: an FP8 Q/DQ model's outputs fall to cosine 0.67). Where the rule is right it only saves
the Relu, so leaving it out costs nothing measurable."""


class OnnxRuntimeRunner:
    """An ONNX Runtime session for one model file.

    ``spinning=False`` stops the intra-op threads from busy-waiting after each run. Timing two models interleaved
    needs it: a spinning pool keeps the cores busy while the other model runs, so the ratio of two identical models
    swung between 0.75 and 1.36 from one session pair to the next on two cores (0.993-1.004 without spinning).
    """

    def __init__(
        self, path: str | Path, providers: Sequence[str] = ("CPUExecutionProvider",), *, spinning: bool = True
    ):
        self.path = Path(path)
        self.providers = tuple(providers)
        self.spinning = spinning
        self._session = None

    def __enter__(self) -> OnnxRuntimeRunner:
        onnxruntime = require("onnxruntime", purpose="running models")
        from nmdeploy.graph.model import OnnxModel

        # The same checks as every other verb (external data inside the model's folder, sizes, no cycles) before
        # ONNX Runtime reads anything.
        OnnxModel.load(self.path)
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        if not self.spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self._session = onnxruntime.InferenceSession(
                str(self.path), options, providers=list(self.providers), disabled_optimizers=list(DISABLED_OPTIMIZERS)
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
