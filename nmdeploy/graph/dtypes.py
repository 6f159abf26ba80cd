"""The one table of ONNX element types: ONNX code <-> numpy (ml_dtypes for bfloat16, float8, int4 ...) <-> torch.

Built on onnx's own mapping (``onnx.helper.tensor_dtype_to_np_dtype`` and its inverse), which already returns the
ml_dtypes types for the formats numpy lacks; torch types are derived from the numpy ones and imported only when
asked for. An element type nmdeploy cannot represent is an :class:`UnknownDtypeError`, never a silent float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import TensorProto

from nmdeploy.errors import InputError

if TYPE_CHECKING:
    import torch


class UnknownDtypeError(InputError):
    """An ONNX element type (or numpy/torch/runtime type) that has no counterpart where it is needed."""


def _code_name(code: int) -> str:
    try:
        return TensorProto.DataType.Name(code)
    except ValueError:
        return f"#{code}"


def numpy_dtype(code: int) -> np.dtype:
    """numpy dtype of ONNX element type ``code`` (an ml_dtypes type for bfloat16, float8, int4, ...)."""
    if code == TensorProto.UNDEFINED:
        raise UnknownDtypeError("a tensor has no element type (UNDEFINED); the model is incomplete, re-export it")
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(code))
    except (KeyError, ValueError, TypeError) as error:
        raise UnknownDtypeError(f"ONNX element type {_code_name(code)} is not supported here") from error


def onnx_type(dtype: Any) -> int:
    """ONNX element type code of a numpy (or ml_dtypes) dtype."""
    try:
        return int(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
    except (KeyError, ValueError, TypeError) as error:
        raise UnknownDtypeError(f"numpy dtype {dtype} has no ONNX element type") from error


def type_name(code: int) -> str:
    """Lower-case ONNX name of an element type: "float", "float16", "bfloat16", "int64" ..."""
    if code == TensorProto.UNDEFINED or code not in TensorProto.DataType.values():
        raise UnknownDtypeError(f"ONNX element type {_code_name(code)} is not a known type")
    return TensorProto.DataType.Name(code).lower()


def from_type_string(text: str) -> int:
    """ONNX element type of a runtime type string such as ONNX Runtime's "tensor(float16)"."""
    inner = text[len("tensor(") : -1] if text.startswith("tensor(") and text.endswith(")") else text
    code = TensorProto.DataType.Value(inner.upper()) if inner.upper() in TensorProto.DataType.keys() else None  # noqa: SIM118
    if code is None or code == TensorProto.UNDEFINED:
        raise UnknownDtypeError(f"runtime type {text!r} is not an ONNX tensor type nmdeploy can feed")
    return code


def numpy_dtype_of_string(text: str) -> np.dtype:
    """numpy dtype of a runtime type string ("tensor(float)" -> float32)."""
    return numpy_dtype(from_type_string(text))


_TORCH_BY_NUMPY_NAME = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float64": "float64",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "bool": "bool",
    "complex64": "complex64",
    "complex128": "complex128",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e4m3fnuz": "float8_e4m3fnuz",
    "float8_e5m2": "float8_e5m2",
    "float8_e5m2fnuz": "float8_e5m2fnuz",
}


def torch_dtype(code: int) -> torch.dtype:
    """torch dtype of ONNX element type ``code`` (imports torch)."""
    import torch

    name = _TORCH_BY_NUMPY_NAME.get(numpy_dtype(code).name)
    dtype = getattr(torch, name, None) if name else None
    if not isinstance(dtype, torch.dtype):
        raise UnknownDtypeError(f"ONNX element type {_code_name(code)} has no torch dtype")
    return dtype


def is_float(code: int) -> bool:
    """Whether ``code`` is a floating-point element type (float8 and bfloat16 included)."""
    return is_float_dtype(numpy_dtype(code))


def is_float_dtype(dtype: Any) -> bool:
    """Whether a numpy dtype is floating point, the ml_dtypes formats (bfloat16, float8, ...) included."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name.startswith(("bfloat", "float"))


# The float types that hold real values to compute on: what pruning ranks, conversion fits, permutation moves,
# recovery trains and a load checks for NaN. float8/float4 are quantized storage, read through a scale, so not here.
ARITHMETIC_FLOAT_TYPES: frozenset[int] = frozenset(
    {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
)
ARITHMETIC_FLOAT_NAMES: frozenset[str] = frozenset(type_name(code) for code in ARITHMETIC_FLOAT_TYPES)
# The float types Q/DQ pairs are placed on (QuantizeLinear's float inputs that TensorRT's INT8/FP8 paths take),
# code -> name.
QUANTIZABLE_FLOAT_TYPES: Mapping[int, str] = MappingProxyType(
    {code: type_name(code) for code in (TensorProto.FLOAT, TensorProto.FLOAT16)}
)
