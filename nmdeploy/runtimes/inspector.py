"""The engine inspector's JSON (``get_engine_information`` at DETAILED verbosity, or trtexec ``--exportLayerInfo``),
as TensorRT 10 and TensorRT 11 write it, parsed without TensorRT.

Both list ``Layers``: names only (built without DETAILED profiling), or objects with ``Name``, ``LayerType``,
``Metadata`` (``[ONNX Layer: node]`` per fused node, separated by \\x1e or \\x1f), ``HasSparseWeights``,
``TacticName`` and the layer's ``Inputs`` and ``Outputs``. The two differ, per TensorRT 11's migration guide for
IEngineInspector, in two places:
- the engine's I/O: TensorRT 10's ``Bindings`` is a list of tensor names; TensorRT 11's ``I/O Tensors`` is a list of
  objects (``Name``, ``IOMode``, ``DataType``, ``Dimensions``, ``Location``, ``IsShapeInferenceIO``, ``ProfileInfo``
  with each profile's shapes and ``Format``);
- each layer tensor's type: TensorRT 10 writes one ``Format/Datatype`` string ("Row major linear FP32",
  "Thirty-two wide channel vectorized row major Int8 format"); TensorRT 11 splits it into ``Format`` (the layout,
  "Row major linear FP32 format (kLINEAR)") and ``DataType`` (TensorRT's type name: "Float", "Half", "Int8", ...).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from nmdeploy.errors import InputError

_ONNX_LAYER = re.compile(r"\[ONNX Layer: ([^\]\x1e\x1f]*)\]")


@dataclass(frozen=True)
class EngineLayer:
    """One layer of a built engine, from the inspector."""

    name: str
    layer_type: str | None
    onnx_nodes: tuple[str, ...]
    has_sparse_weights: bool | None
    tactic: str | None
    input_precision: str | None = None  # of the first input and output
    output_precision: str | None = None

    @property
    def sparse_tactic(self) -> bool | None:
        """Whether the tactic's name marks a sparse kernel (a naming heuristic; None without a tactic name)."""
        if not self.tactic:
            return None
        lowered = self.tactic.lower()
        return "sparse" in lowered or "sptensor" in lowered


@dataclass(frozen=True)
class EngineTensor:
    """One input or output of the engine. TensorRT 10's inspector names them only."""

    name: str
    mode: str | None = None  # "input" or "output"
    precision: str | None = None
    shape: tuple[int, ...] | None = None


def load_document(data: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as error:
            raise InputError(f"engine layer information is not JSON ({error})") from error
    if not isinstance(data, dict) or not isinstance(data.get("Layers"), list):
        raise InputError("engine layer information has no 'Layers' list; is it the inspector's JSON output?")
    return data


def parse_layer_information(data: str | dict[str, Any]) -> tuple[EngineLayer, ...]:
    """The layers of an engine inspector JSON document of TensorRT 10 or 11."""
    parsed = []
    for layer in load_document(data)["Layers"]:
        if isinstance(layer, str):  # built without DETAILED profiling verbosity: names only
            parsed.append(EngineLayer(layer, None, (), None, None))
            continue
        sparse = layer.get("HasSparseWeights")
        parsed.append(
            EngineLayer(
                name=str(layer.get("Name", "")),
                layer_type=layer.get("LayerType"),
                onnx_nodes=tuple(n.strip() for n in _ONNX_LAYER.findall(str(layer.get("Metadata", ""))) if n.strip()),
                has_sparse_weights=None if sparse is None else bool(int(sparse)),
                tactic=layer.get("TacticName"),
                input_precision=_first_precision(layer.get("Inputs")),
                output_precision=_first_precision(layer.get("Outputs")),
            )
        )
    return tuple(parsed)


def parse_io_tensors(data: str | dict[str, Any]) -> tuple[EngineTensor, ...]:
    """The engine's inputs and outputs: TensorRT 11's ``I/O Tensors`` (mode, precision, shape) or TensorRT 10's
    ``Bindings`` (names only); empty where the document has neither."""
    document = load_document(data)
    if isinstance(document.get("I/O Tensors"), list):
        found = []
        for tensor in document["I/O Tensors"]:
            if not isinstance(tensor, dict):
                raise InputError("engine layer information: an 'I/O Tensors' entry is not an object")
            dims = tensor.get("Dimensions")
            found.append(
                EngineTensor(
                    name=str(tensor.get("Name", "")),
                    mode=str(tensor["IOMode"]).lower() if tensor.get("IOMode") else None,
                    precision=tensor_precision(tensor),
                    shape=tuple(int(d) for d in dims) if isinstance(dims, list) else None,
                )
            )
        return tuple(found)
    return tuple(EngineTensor(str(name)) for name in document.get("Bindings") or ())


# TensorRT's DataType names as TensorRT 11's inspector writes them -> precision.
_DATA_TYPES = {"float": "fp32", "half": "fp16", "bfloat16": "bf16", "int8": "int8", "fp8": "fp8"}

# Words of a format string (TensorRT 10's "Format/Datatype", e.g. "Row major linear FP32", "Channel major FP16 format
# where channel % 8 == 0", "Thirty-two wide channel vectorized row major Int8 format") -> precision; first match wins.
_FORMAT_WORDS = (
    ("fp8", re.compile(r"\b(fp8|e4m3)\b", re.IGNORECASE)),
    ("int8", re.compile(r"\bint8\b", re.IGNORECASE)),
    ("bf16", re.compile(r"\bbf16\b", re.IGNORECASE)),
    ("fp16", re.compile(r"\b(fp16|half)\b", re.IGNORECASE)),
    ("fp32", re.compile(r"\b(fp32|float)\b", re.IGNORECASE)),
)


def format_precision(text: str) -> str | None:
    """The precision a format string names (int8, fp8, bf16, fp16, fp32), or None."""
    return next((name for name, words in _FORMAT_WORDS if words.search(text)), None)


def tensor_precision(tensor: dict[str, Any]) -> str | None:
    """A tensor's precision: TensorRT 11's ``DataType`` where given (None for a type without one here, e.g. Int32),
    else the words of TensorRT 10's ``Format/Datatype``."""
    if "DataType" in tensor:
        return _DATA_TYPES.get(str(tensor["DataType"]).lower())
    return format_precision(str(tensor.get("Format/Datatype", "")))


def _first_precision(tensors: Any) -> str | None:
    if not isinstance(tensors, list) or not tensors or not isinstance(tensors[0], dict):
        return None
    return tensor_precision(tensors[0])
