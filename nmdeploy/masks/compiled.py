"""``torch.compile`` for kernels made of many short elementwise passes.

Eager PyTorch runs every operation as its own pass over memory. MVUE's closed form makes some fifty of them over a
tensor as large as a layer's output gradient, on every backward pass; inductor fuses them into one loop, about ten
times faster on a CPU. Compiling costs seconds per new shape, so only tensors of at least :data:`MIN_ELEMENTS` take
the compiled path. ``NMDEPLOY_COMPILE=0`` turns it off; where compiling fails (no C++ compiler, no Triton on a GPU)
the kernel runs eagerly from then on, after one warning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from nmdeploy.errors import first_line

logger = logging.getLogger(__name__)

MIN_ELEMENTS = 1 << 16
"""Smaller tensors run eagerly: a compiled call has fixed costs, and compiling for every small shape is not worth it."""

SWITCH = "NMDEPLOY_COMPILE"
"""Environment variable: ``0`` runs every kernel eagerly."""


class CompiledKernel:
    """``kernel`` (tensor operations only, no data-dependent Python) with a compiled twin for large inputs."""

    def __init__(self, kernel: Callable[..., Any]) -> None:
        self.kernel = kernel
        self.compiled: Callable[..., Any] | None = None
        self.failed = False

    def applies(self, tensor: torch.Tensor) -> bool:
        """Whether a call on ``tensor`` should take the compiled path."""
        return (
            not self.failed
            and tensor.numel() >= MIN_ELEMENTS
            and os.environ.get(SWITCH, "1") != "0"
            and not torch.compiler.is_compiling()  # inside a caller's compiled graph, dynamo traces the kernel anyway
        )

    def __call__(self, *args: Any) -> Any:
        """Run the compiled kernel (compiling it on first use), or the eager one if compiling fails."""
        if self.compiled is None:
            self.compiled = torch.compile(self.kernel)
        try:
            return self.compiled(*args)
        except Exception as error:  # any compiler failure: the eager kernel computes the same result
            self.failed = True
            reason = first_line(error)
            logger.warning(
                "torch.compile of %s failed (%s); running it eagerly from now on (set %s=0 to skip compiling)",
                self.kernel.__name__,
                reason,
                SWITCH,
            )
            return self.kernel(*args)
