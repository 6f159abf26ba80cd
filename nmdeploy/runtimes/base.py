"""The Runner protocol every backend implements, and the GraphRunner protocol of backends that also run pieces of
models held in memory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class InputSpec:
    """A model input: its name, numpy dtype, and shape (None for a dynamic dimension)."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]

    def describe(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name}: {self.dtype.name}[{dims}]"


class Runner(Protocol):
    """Runs one model; used as a context manager so backends can free sessions and devices."""

    @property
    def inputs(self) -> tuple[InputSpec, ...]: ...

    @property
    def output_names(self) -> tuple[str, ...]: ...

    def infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def __enter__(self) -> Runner: ...

    def __exit__(self, *exc: object) -> None: ...


class GraphRunner(Protocol):
    """Runs one graph held in memory (a piece of a model), built once and run many times: building it (a session, a
    compiled program) is what costs. Values are named; :meth:`run` returns the graph's outputs by name."""

    def to_device(self, values: Mapping[str, object]) -> dict[str, object]:
        """``values`` as :meth:`run` takes them, moved once where the runner keeps values on a device."""
        ...

    def run(self, feeds: Mapping[str, object]) -> dict[str, object]: ...
