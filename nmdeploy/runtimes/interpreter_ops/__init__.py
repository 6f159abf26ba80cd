"""The torch interpreter's ops, by ONNX op type: each takes the node's inputs (None for omitted optional ones) and
its attributes parsed once, and returns a tensor or a tuple of tensors (one per output).

``CHECKS`` names, per op, the attribute values its implementation does not cover: such a node is refused when a
program is built, rather than computed differently from ONNX Runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nmdeploy.runtimes.interpreter_ops import basic, indexing, recurrent, resize, spatial
from nmdeploy.runtimes.interpreter_ops.common import OUTPUTS, as_tensor, node_attributes

OPS: dict[str, Callable[[list, dict], Any]] = {
    **basic.OPS,
    **spatial.OPS,
    **recurrent.OPS,
    **indexing.OPS,
    "Resize": resize.resize,
}
CHECKS: dict[str, Callable[[dict, int], str]] = {
    **spatial.CHECKS,
    **recurrent.CHECKS,
    **indexing.CHECKS,
    "Resize": resize.check_resize,
}
SUPPORTED_OPS = tuple(sorted({*OPS, "If"}))  # If runs its branches in the interpreter itself

__all__ = ["CHECKS", "OPS", "OUTPUTS", "SUPPORTED_OPS", "as_tensor", "node_attributes"]
