"""ONNX Runtime backend: the embedded default, on CPU unless other providers are asked for."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError, MissingDependencyError
from nmdeploy.runtimes.base import InputSpec

_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


class OnnxRuntimeRunner:
    """An ONNX Runtime session for one model file."""

    def __init__(self, path: str | Path, providers: Sequence[str] = ("CPUExecutionProvider",)):
        self.path = Path(path)
        self.providers = tuple(providers)
        self._session = None

    def __enter__(self) -> OnnxRuntimeRunner:
        try:
            import onnxruntime
        except ImportError as error:
            raise MissingDependencyError("running models needs onnxruntime: pip install onnxruntime") from error
        if not self.path.is_file():
            raise InputError(f"{self.path}: no such file")
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        try:
            self._session = onnxruntime.InferenceSession(str(self.path), options, providers=list(self.providers))
        except Exception as error:  # ORT raises its own Fail/InvalidGraph/... types for unusable models
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise InputError(f"{self.path}: ONNX Runtime cannot load it ({first_line})") from error
        return self

    def __exit__(self, *exc: object) -> None:
        self._session = None

    @property
    def inputs(self) -> tuple[InputSpec, ...]:
        return tuple(
            InputSpec(
                i.name,
                np.dtype(_TYPES.get(i.type, np.float32)),
                tuple(d if isinstance(d, int) and d > 0 else None for d in i.shape),
            )
            for i in self._session.get_inputs()
        )

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self._session.get_outputs())

    def infer(self, feeds: dict[str, np.ndarray], outputs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run the model; ``outputs`` limits the result (and the work) to those tensors."""
        names = list(outputs) if outputs is not None else list(self.output_names)
        return dict(zip(names, self._session.run(names, feeds), strict=True))
