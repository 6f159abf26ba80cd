"""The Runner protocol every backend implements."""

from __future__ import annotations

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
