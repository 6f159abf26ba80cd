"""The named element-type sets of nmdeploy.graph.dtypes: the one answer to "which floats" for every module."""

from onnx import TensorProto

from nmdeploy.graph.dtypes import (
    ARITHMETIC_FLOAT_NAMES,
    ARITHMETIC_FLOAT_TYPES,
    QUANTIZABLE_FLOAT_TYPES,
    UnknownDtypeError,
    is_float,
    numpy_dtype,
    type_name,
)


def test_arithmetic_floats_are_the_wide_floats_and_their_names_match_the_codes():
    wide_floats = {code for code in TensorProto.DataType.values() if _is_wide_float(code)}
    assert wide_floats == ARITHMETIC_FLOAT_TYPES
    assert {type_name(code) for code in ARITHMETIC_FLOAT_TYPES} == ARITHMETIC_FLOAT_NAMES
    assert "float8e4m3fn" not in ARITHMETIC_FLOAT_NAMES and is_float(TensorProto.FLOAT8E4M3FN)


def test_quantizable_floats_map_codes_to_names_within_the_arithmetic_floats():
    assert dict(QUANTIZABLE_FLOAT_TYPES) == {TensorProto.FLOAT: "float", TensorProto.FLOAT16: "float16"}
    assert set(QUANTIZABLE_FLOAT_TYPES) <= ARITHMETIC_FLOAT_TYPES


def _is_wide_float(code: int) -> bool:
    try:
        return is_float(code) and numpy_dtype(code).itemsize >= 2
    except UnknownDtypeError:  # UNDEFINED and the types numpy has no dtype for
        return False
