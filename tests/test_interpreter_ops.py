"""The ONNX-to-torch interpreter against ONNX Runtime, op by op: every op it claims runs one small graph here.

The table must cover SUPPORTED_OPS exactly, so a new op cannot be claimed without a test. Float ops are also
checked to carry gradients (recovery fine-tunes through them).
"""

import re

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import helper, numpy_helper

from nmdeploy.errors import InputError
from nmdeploy.runtimes.interpreter import SUPPORTED_OPS, GraphProgram, unsupported_nodes

RNG = np.random.default_rng(0)


def floats(*shape, low=None, high=None):
    if low is not None:
        return RNG.uniform(low, high, shape).astype(np.float32)
    return RNG.standard_normal(shape).astype(np.float32)


def ints(*values):
    return np.array(values, dtype=np.int64)


def bools(*shape):
    return RNG.random(shape) < 0.5


X = floats(2, 3, 4)
Y = floats(2, 3, 4)
POSITIVE = floats(2, 3, 4, low=0.1, high=3.0)
IMAGE = floats(2, 4, 7, 6)

EMPTY = np.zeros(0, np.float32)
SMALL_IMAGE = floats(2, 3, 5, 6)


def scales(*values):
    return np.array(values, np.float32)


def resize(mode, coordinates, *given, opset=18, **attrs):
    """A Resize case: X, roi (empty), then scales or sizes (the other omitted)."""
    attrs = {"mode": mode, "coordinate_transformation_mode": coordinates, **attrs}
    return ([SMALL_IMAGE, EMPTY, *given], attrs, opset)


# Every mode x coordinate transformation claimed, upsampling and downsampling by scales, and sizes (whose scale is
# output / input). PP-OCR detectors use the first: nearest, asymmetric, floor, scales [1, 1, 2, 2] at opset 11.
RESIZE_CASES = {
    "Resize#paddle": resize("nearest", "asymmetric", scales(1, 1, 2, 2), opset=11, nearest_mode="floor"),
    "Resize#nearest_default": ([SMALL_IMAGE, EMPTY, scales(1, 1, 2, 3)], {}, 18),
    "Resize#nearest_ceil_down": resize("nearest", "half_pixel", scales(1, 1, 0.6, 0.5), nearest_mode="ceil"),
    "Resize#nearest_prefer_ceil": resize(
        "nearest", "pytorch_half_pixel", scales(1, 1, 1.5, 2.5), nearest_mode="round_prefer_ceil"
    ),
    "Resize#nearest_align_corners": resize("nearest", "align_corners", None, ints(2, 3, 9, 4)),
    "Resize#nearest_symmetric": resize("nearest", "half_pixel_symmetric", scales(1, 1, 1.7, 0.8)),
    "Resize#linear_half_pixel": resize("linear", "half_pixel", scales(1, 1, 2, 3)),
    "Resize#linear_half_pixel_down": resize("linear", "half_pixel", scales(1, 1, 0.6, 0.5)),
    "Resize#linear_pytorch": resize("linear", "pytorch_half_pixel", None, ints(2, 3, 1, 11)),
    "Resize#linear_asymmetric": resize("linear", "asymmetric", scales(1, 1, 2, 1.5)),
    "Resize#linear_align_corners": resize("linear", "align_corners", None, ints(2, 3, 8, 13)),
    "Resize#linear_symmetric": resize("linear", "half_pixel_symmetric", scales(1, 1, 1.7, 0.8)),
    "Resize#axes": ([SMALL_IMAGE, EMPTY, scales(2, 0.5)], {"mode": "linear", "axes": [2, 3]}, 18),
    "Resize#opset10": ([SMALL_IMAGE, scales(1, 1, 2, 1.5)], {"mode": "nearest"}, 10),
    "Resize#opset10_linear": ([SMALL_IMAGE, scales(1, 1, 0.6, 1.5)], {"mode": "linear"}, 10),
    "Resize#cubic": resize("cubic", "half_pixel", scales(1, 1, 2, 1.5)),
    "Resize#cubic_down": resize("cubic", "pytorch_half_pixel", scales(1, 1, 0.6, 0.5), cubic_coeff_a=-0.5),
    "Resize#cubic_exclude_outside": resize("cubic", "asymmetric", scales(1, 1, 1.7, 2), exclude_outside=1),
    "Resize#cubic_align_corners": resize("cubic", "align_corners", None, ints(2, 3, 9, 4)),
    "Resize#crop_linear": (
        [SMALL_IMAGE, scales(0, 0, 0.2, -0.1, 1, 1, 0.9, 1.3), None, ints(2, 3, 4, 5)],
        {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": -2.0},
        18,
    ),
    "Resize#crop_nearest": (
        [SMALL_IMAGE, scales(0.1, 0.4, 0.8, 1.2), None, ints(3, 7)],
        {"coordinate_transformation_mode": "tf_crop_and_resize", "axes": [2, 3]},
        18,
    ),
    "Resize#not_larger": resize(
        "linear", "half_pixel", None, ints(7, 9), axes=[2, 3], keep_aspect_ratio_policy="not_larger"
    ),
    "Resize#not_smaller": resize(
        "nearest", "half_pixel", None, ints(7, 9), axes=[2, 3], keep_aspect_ratio_policy="not_smaller"
    ),
}

# Pad in every mode, pads as an input or (opset 2-10) an attribute, negative pads (crops), axes (opset 18)
PAD_CASES = {
    "Pad": ([IMAGE, ints(0, 0, 1, 2, 0, 0, 2, 1), np.array(1.5, np.float32)], {}, 18),
    "Pad#reflect": ([floats(1, 3, 9), ints(0, 0, 4, 0, 0, 3)], {"mode": "reflect"}, 18),
    "Pad#edge": ([IMAGE, ints(0, 0, 3, 1, 0, 0, 0, 2)], {"mode": "edge"}, 18),
    "Pad#wrap": ([IMAGE, ints(0, 0, 2, 5, 0, 0, 1, 3)], {"mode": "wrap"}, 19),
    "Pad#negative": ([IMAGE, ints(0, 0, -1, 2, 0, 0, 1, -2)], {"mode": "reflect"}, 18),
    "Pad#axes": ([IMAGE, ints(1, 2, 2, 0), None, ints(-1, 1)], {"mode": "edge"}, 18),
    "Pad#attribute": ([IMAGE], {"pads": [0, 1, 0, 2, 0, 0, 1, 0], "value": -1.0}, 10),
}

# op -> (inputs in order (None: omitted), attributes, opset); several cases of one op get a "#tag" suffix
CASES = {
    "Abs": ([X], {}, 18),
    "Add": ([X, floats(4)], {}, 18),
    "And": ([bools(3, 4), bools(3, 4)], {}, 18),
    "AveragePool": ([IMAGE], {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 0]}, 18),
    "AveragePool#include_pad": (
        [IMAGE],
        {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1, "ceil_mode": 1, "strides": [2, 2]},
        18,
    ),
    "BatchNormalization": (
        [IMAGE, floats(4, low=0.5, high=2), floats(4), floats(4), floats(4, low=0.5, high=2)],
        {"epsilon": 1e-3},
        18,
    ),
    "Cast": ([X], {"to": onnx.TensorProto.DOUBLE}, 18),
    "Cast#int": ([ints(3, -2, 7)], {"to": onnx.TensorProto.FLOAT}, 18),
    "Ceil": ([X], {}, 18),
    "Clip": ([X, np.array(-0.5, np.float32), np.array(0.7, np.float32)], {}, 18),
    "Clip#min_only": ([X, np.array(0.1, np.float32)], {}, 18),
    "Concat": ([X, Y], {"axis": 1}, 18),
    "CumSum": ([X, ints(1)], {}, 14),
    "CumSum#exclusive-reverse": ([X, ints(-1)], {"exclusive": 1, "reverse": 1}, 14),
    "CumSum#int": ([np.arange(12, dtype=np.int64).reshape(3, 4), ints(0)], {"reverse": 1}, 14),
    "CumSum#int32": ([np.arange(12, dtype=np.int32).reshape(3, 4), ints(1)], {}, 14),
    "Constant": ([], {"value": numpy_helper.from_array(floats(2, 3))}, 18),
    "Constant#ints": ([], {"value_ints": [4, 5, 6]}, 18),
    "Constant#float": ([], {"value_float": 2.5}, 18),
    "ConstantOfShape": ([ints(2, 3)], {"value": numpy_helper.from_array(np.array([1.5], np.float32))}, 18),
    "Conv": ([IMAGE, floats(6, 4, 3, 2), floats(6)], {"pads": [1, 0, 2, 1], "strides": [2, 1]}, 18),
    "Conv#group_dilation": ([IMAGE, floats(4, 2, 2, 2)], {"group": 2, "dilations": [2, 1], "pads": [1, 1, 1, 1]}, 18),
    "Conv#1d": ([floats(2, 4, 9), floats(3, 4, 3)], {"pads": [1, 1]}, 18),
    # Paddle exports: SAME_UPPER (odd padding at the end), stride 2 on an odd size
    "Conv#same_upper": ([IMAGE, floats(6, 4, 2, 3)], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, 11),
    "Conv#same_lower": ([IMAGE, floats(6, 4, 2, 2)], {"auto_pad": "SAME_LOWER", "strides": [2, 1]}, 18),
    # PP-OCR detectors: kernel 2, stride 2, no padding (opset 11)
    "ConvTranspose": ([IMAGE, floats(4, 3, 2, 2), floats(3)], {"kernel_shape": [2, 2], "strides": [2, 2]}, 11),
    "ConvTranspose#pads_output_padding": (
        [IMAGE, floats(4, 2, 3, 3)],
        {"strides": [2, 3], "pads": [1, 0, 1, 0], "output_padding": [1, 2], "dilations": [1, 1]},
        18,
    ),
    "ConvTranspose#asymmetric_pads": ([IMAGE, floats(4, 3, 3, 2)], {"strides": [2, 1], "pads": [0, 1, 2, 0]}, 18),
    "ConvTranspose#group_dilation": ([IMAGE, floats(4, 1, 2, 2)], {"group": 2, "dilations": [2, 2]}, 18),
    "ConvTranspose#1d": ([floats(2, 4, 9), floats(4, 3, 3)], {"strides": [2], "pads": [1, 1]}, 18),
    "Cos": ([X], {}, 18),
    "Div": ([X, POSITIVE], {}, 18),
    "Div#int": ([ints(7, -7, 9, 3), ints(2, 2, -4, 3)], {}, 18),
    "Dropout": ([X], {}, 18),
    "Equal": ([ints(1, 2, 3, 4), ints(1, 0, 3, 5)], {}, 18),
    "Erf": ([X], {}, 18),
    "Exp": ([X], {}, 18),
    "Expand": ([floats(3, 1), ints(2, 3, 4)], {}, 18),
    "Flatten": ([X], {"axis": 2}, 18),
    "Flatten#zero": ([X], {"axis": 0}, 18),
    "Floor": ([X], {}, 18),
    "Gather": ([floats(5, 3), ints(0, -1, 2, 2).reshape(2, 2)], {"axis": 0}, 18),
    "Gather#axis1": ([X, ints(3, 0)], {"axis": -1}, 18),
    "GatherElements": ([floats(3, 4), np.array([[0, -1, 2, 1], [3, 3, 0, 1]], np.int64)], {"axis": 1}, 18),
    "Gelu": ([X], {}, 20),
    "Gelu#tanh": ([X], {"approximate": "tanh"}, 20),
    "Gemm": ([floats(3, 5), floats(4, 5), floats(4)], {"transB": 1, "alpha": 0.5, "beta": 2.0}, 18),
    "Gemm#transA": ([floats(5, 3), floats(5, 4)], {"transA": 1}, 18),
    "GlobalAveragePool": ([IMAGE], {}, 18),
    "GlobalMaxPool": ([IMAGE], {}, 18),
    "Greater": ([X, Y], {}, 18),
    "HardSigmoid": ([X], {}, 18),
    "HardSigmoid#paddle": ([X * 4], {"alpha": 0.16666670143604279, "beta": 0.5}, 11),
    "HardSwish": ([X * 4], {}, 18),
    "GreaterOrEqual": ([X, np.round(X, 0)], {}, 18),
    "Identity": ([X], {}, 18),
    "IsInf": ([np.array([1.0, np.inf, -np.inf, np.nan], np.float32)], {}, 18),
    "IsNaN": ([np.array([1.0, np.inf, np.nan], np.float32)], {}, 18),
    "LayerNormalization": ([X, floats(4), floats(4)], {"epsilon": 1e-5}, 18),
    "LayerNormalization#axis": ([X, floats(3, 4), floats(3, 4)], {"axis": 1}, 18),
    "LeakyRelu": ([X], {"alpha": 0.2}, 18),
    "Less": ([X, Y], {}, 18),
    "LessOrEqual": ([X, np.round(X, 0)], {}, 18),
    "Log": ([POSITIVE], {}, 18),
    "LogSoftmax": ([X], {"axis": 1}, 18),
    "MatMul": ([X, floats(4, 5)], {}, 18),
    "MatMul#batched": ([X, floats(2, 4, 3)], {}, 18),
    "Max": ([X, Y, floats(4)], {}, 18),
    "MaxPool": ([IMAGE], {"kernel_shape": [2, 3], "strides": [1, 2], "pads": [1, 1, 1, 1]}, 18),
    "MaxPool#same_upper": ([IMAGE], {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER"}, 11),
    "MaxPool#asymmetric": ([-np.abs(IMAGE)], {"kernel_shape": [2, 2], "pads": [0, 1, 1, 0]}, 18),
    "MaxPool#dilation": ([IMAGE], {"kernel_shape": [2, 2], "dilations": [2, 1], "ceil_mode": 1}, 18),
    "Min": ([X, Y], {}, 18),
    "Mul": ([X, Y], {}, 18),
    "Neg": ([X], {}, 18),
    "Not": ([bools(5)], {}, 18),
    "Or": ([bools(5), bools(5)], {}, 18),
    "Pow": ([POSITIVE, floats(4, low=-2, high=2)], {}, 18),
    "Range": ([np.array(1, np.int64), np.array(11, np.int64), np.array(3, np.int64)], {}, 18),
    "Range#float": ([np.array(0.5, np.float32), np.array(2.0, np.float32), np.array(0.25, np.float32)], {}, 18),
    "Reciprocal": ([POSITIVE], {}, 18),
    "ReduceMax": ([X, ints(1)], {"keepdims": 0}, 18),
    "ReduceMean": ([X, ints(-1)], {}, 18),
    "ReduceMean#all": ([X], {"keepdims": 0}, 18),
    "ReduceMean#attribute": ([X], {"axes": [0, 2]}, 17),
    "ReduceMin": ([X, ints(0, 2)], {}, 18),
    "ReduceSum": ([X, ints(1)], {"keepdims": 0}, 18),
    "ReduceSum#noop": ([X, np.zeros(0, np.int64)], {"noop_with_empty_axes": 1}, 18),
    "ReduceL1": ([X, ints(1)], {"keepdims": 0}, 18),
    "ReduceL2": ([X, ints(-1)], {}, 18),
    "ReduceSumSquare": ([X, ints(0, 2)], {}, 18),
    "ReduceLogSumExp": ([X, ints(1)], {"keepdims": 0}, 18),
    "Relu": ([X], {}, 18),
    "Reshape": ([X, ints(0, -1)], {}, 18),
    **RESIZE_CASES,
    "Reshape#explicit": ([X, ints(4, 3, 2)], {}, 18),
    "Shape": ([X], {}, 18),
    "Shape#slice": ([X], {"start": 1, "end": -1}, 18),
    "Sigmoid": ([X], {}, 18),
    "Sin": ([X], {}, 18),
    "Slice": ([X, ints(1, -3), ints(3, 100), ints(1, 2), ints(1, 2)], {}, 18),
    "Slice#defaults": ([X, ints(-1), ints(10)], {}, 18),
    # voice-activity detectors reverse their audio with negative steps
    "Slice#negative_steps": ([X, ints(-1, 100, 3), ints(-100, 0, -5), ints(2, 1, 0), ints(-1, -2, -1)], {}, 18),
    "Softmax": ([X], {"axis": 1}, 18),
    "Sqrt": ([POSITIVE], {}, 18),
    "Squeeze": ([floats(2, 1, 3, 1), ints(1, -1)], {}, 18),
    "Squeeze#all": ([floats(2, 1, 3, 1)], {}, 18),
    "Sub": ([X, Y], {}, 18),
    "Sum": ([X, Y, X], {}, 18),
    "Tanh": ([X], {}, 18),
    "Transpose": ([X], {"perm": [2, 0, 1]}, 18),
    "Transpose#default": ([X], {}, 18),
    "Unsqueeze": ([floats(3, 4), ints(0, -1)], {}, 18),
    "Unsqueeze#attribute": ([floats(3, 4)], {"axes": [1]}, 12),
    "Where": ([bools(3, 4), floats(3, 4), floats(4)], {}, 18),
    "Xor": ([bools(5), bools(5)], {}, 18),
    **PAD_CASES,
    "ArgMax": ([X], {"axis": 1}, 18),
    "ArgMax#last": (
        [
            np.round(X),
        ],
        {"axis": -1, "keepdims": 0, "select_last_index": 1},
        18,
    ),
    "ArgMin": ([X], {"axis": 2, "keepdims": 0}, 18),
    "Einsum": ([X, floats(2, 4, 5)], {"equation": "bij,bjk->bik"}, 18),
    "Einsum#ellipsis": ([X, floats(4)], {"equation": "...j,j->..."}, 18),
    "Einsum#transpose": ([X], {"equation": "abc->cba"}, 18),
    "Elu": ([X], {"alpha": 0.7}, 18),
    "InstanceNormalization": ([IMAGE, floats(4), floats(4)], {"epsilon": 1e-4}, 18),
    "PRelu": ([IMAGE, floats(4, 1, 1)], {}, 18),
    "Sign": ([np.array([-2.0, 0.0, 3.5], np.float32)], {}, 18),
    "Size": ([X], {}, 18),
    "Softplus": ([X], {}, 18),
    "Softsign": ([X], {}, 18),
    "Tile": ([X, ints(1, 2, 3)], {}, 18),
    "Round": ([np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.4, 2.6], np.float32)], {}, 18),
    "Mod": ([ints(7, -7, 9, -9), ints(3, 3, -4, -4)], {}, 18),
    "Mod#fmod": ([X, POSITIVE], {"fmod": 1}, 18),
    "Selu": ([X], {}, 18),
    "Celu": ([X], {"alpha": 0.5}, 18),
    "Mish": ([X], {}, 18),
    "ThresholdedRelu": ([X], {"alpha": 0.3}, 18),
    "ReduceProd": ([X, ints(0, 2)], {}, 18),
    "ReduceProd#all": ([X], {"keepdims": 0}, 18),
    "DepthToSpace": ([floats(2, 8, 3, 4)], {"blocksize": 2}, 18),
    "DepthToSpace#crd": ([floats(2, 8, 3, 4)], {"blocksize": 2, "mode": "CRD"}, 18),
    "SpaceToDepth": ([floats(2, 3, 4, 6)], {"blocksize": 2}, 18),
    "LRN": ([IMAGE], {"size": 3, "alpha": 0.01, "beta": 0.75, "bias": 1.0}, 18),
    "GroupNormalization": ([floats(2, 6, 3, 4), floats(3), floats(3)], {"num_groups": 3}, 18),
    "Upsample": ([SMALL_IMAGE, scales(1, 1, 2, 3)], {"mode": "nearest"}, 9),
    "Upsample#linear": ([SMALL_IMAGE, scales(1, 1, 2, 1.5)], {"mode": "linear"}, 9),
    "GatherND": ([floats(3, 4, 5), np.array([[0, 1], [2, -1]], np.int64)], {}, 18),
    "GatherND#batch": ([floats(2, 4, 5), np.array([[[1], [3]], [[0], [2]]], np.int64)], {"batch_dims": 1}, 18),
    "ScatterND": ([floats(4, 3), np.array([[1], [3]], np.int64), floats(2, 3)], {}, 18),
    "ScatterND#add": ([floats(4, 3), np.array([[1], [1], [-1]], np.int64), floats(3, 3)], {"reduction": "add"}, 18),
    "NonZero": ([np.array([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0]], np.float32)], {}, 18),
    "OneHot": ([ints(1, -1, 3, 0), ints(4), np.array([0.5, 2.0], np.float32)], {"axis": 0}, 18),
    "Trilu": ([X, ints(1)], {"upper": 0}, 14),
    "Trilu#upper": ([floats(4, 5)], {}, 14),
    "Hardmax": ([X], {"axis": 1}, 13),
}


def recurrent_inputs(gates, directions=1, steps=5, batch=3, features=6, hidden=4, *, lengths=None, extra=()):
    """X, W, R, B, sequence_lens, initial_h (and for LSTM initial_c, P through ``extra``) of a recurrent op."""
    x = floats(steps, batch, features)
    state = (directions, batch, hidden)
    inputs = [x, floats(directions, gates * hidden, features), floats(directions, gates * hidden, hidden)]
    inputs += [floats(directions, 2 * gates * hidden), lengths, floats(*state)]
    return inputs + [floats(*state) if isinstance(item, str) else item for item in extra]


LSTM_STATE = ("state",)
# op -> (inputs, attributes, opset, number of outputs): the ops whose nodes have several outputs
MULTI_OUTPUT_CASES = {
    "TopK": ([X, ints(2)], {"axis": 1}, 11, 2),
    "TopK#smallest": ([X, ints(3)], {"largest": 0}, 11, 2),
    "Split#num_outputs": ([floats(2, 3, 7)], {"axis": 2, "num_outputs": 3}, 18, 3),
    "Split#sizes": ([X, ints(1, 3)], {"axis": -1}, 18, 2),
    "Split#equal": ([floats(6, 2)], {}, 11, 3),
    "Split#attribute": ([floats(2, 7)], {"axis": 1, "split": [2, 5]}, 11, 2),
    "LSTM": (recurrent_inputs(4, extra=LSTM_STATE), {"hidden_size": 4}, 14, 3),
    "LSTM#bidirectional": (
        recurrent_inputs(4, 2, extra=LSTM_STATE),
        {"hidden_size": 4, "direction": "bidirectional"},
        14,
        3,
    ),
    "LSTM#reverse_lengths": (
        recurrent_inputs(4, lengths=np.array([5, 2, 3], np.int32), extra=LSTM_STATE),
        {"hidden_size": 4, "direction": "reverse"},
        14,
        3,
    ),
    "LSTM#bidirectional_lengths": (
        recurrent_inputs(4, 2, lengths=np.array([1, 5, 4], np.int32), extra=LSTM_STATE),
        {"hidden_size": 4, "direction": "bidirectional"},
        14,
        3,
    ),
    "LSTM#peephole_clip": (
        recurrent_inputs(4, extra=("state", floats(1, 12))),
        {"hidden_size": 4, "clip": 0.8},
        14,
        3,
    ),
    "LSTM#no_bias_no_state": (recurrent_inputs(4)[:3], {"hidden_size": 4}, 14, 3),
    "LSTM#activations": (
        recurrent_inputs(4, extra=LSTM_STATE),
        {
            "hidden_size": 4,
            "activations": ["HardSigmoid", "Tanh", "Softsign"],
            "activation_alpha": [0.3],
            "activation_beta": [0.4],
        },
        14,
        3,
    ),
    "GRU": (recurrent_inputs(3), {"hidden_size": 4}, 14, 2),
    "GRU#linear_before_reset": (
        recurrent_inputs(3, 2),
        {"hidden_size": 4, "direction": "bidirectional", "linear_before_reset": 1},
        14,
        2,
    ),
    "GRU#lengths": (
        recurrent_inputs(3, lengths=np.array([2, 5, 1], np.int32)),
        {"hidden_size": 4, "linear_before_reset": 1},
        14,
        2,
    ),
    "RNN": (recurrent_inputs(1), {"hidden_size": 4}, 14, 2),
    "RNN#relu_reverse": (
        recurrent_inputs(1),
        {"hidden_size": 4, "activations": ["Relu"], "direction": "reverse"},
        14,
        2,
    ),
    "RNN#leaky_bidirectional": (
        recurrent_inputs(1, 2),
        {
            "hidden_size": 4,
            "direction": "bidirectional",
            "activations": ["LeakyRelu", "Tanh"],
            "activation_alpha": [0.2],
        },
        14,
        2,
    ),
}


def build(op: str, inputs: list, attrs: dict, opset: int, outputs: int = 1) -> onnx.ModelProto:
    names = ["" if array is None else f"in{i}" for i, array in enumerate(inputs)]
    results = ["out"] if outputs == 1 else [f"out{i}" for i in range(outputs)]
    node = helper.make_node(op, names, results, name="node", **attrs)
    graph = helper.make_graph(
        [node],
        "op",
        [
            helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for name, a in zip(names, inputs, strict=True)
            if a is not None
        ],
        [helper.make_empty_tensor_value_info(name) for name in results],
    )
    return helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", opset)])


def test_the_table_covers_every_claimed_op():
    covered = {case.split("#")[0] for case in (*CASES, *MULTI_OUTPUT_CASES)} | {"If"}  # If: its own test below
    assert covered == set(SUPPORTED_OPS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_onnxruntime(case):
    op = case.split("#")[0]
    inputs, attrs, opset = CASES[case]
    model = build(op, inputs, attrs, opset)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {f"in{i}": array for i, array in enumerate(inputs) if array is not None}
    (expected,) = session.run(["out"], feeds)
    tensors = {name: torch.from_numpy(np.array(array)) for name, array in feeds.items()}
    float_inputs = [t for t in tensors.values() if t.dtype.is_floating_point and t.ndim]
    for tensor in float_inputs:
        tensor.requires_grad_(True)
    actual = GraphProgram(model).run(tensors)["out"]
    assert actual.dtype == torch.from_numpy(np.zeros(0, expected.dtype)).dtype, case
    assert tuple(actual.shape) == expected.shape, case
    np.testing.assert_allclose(actual.detach().numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=case)
    if actual.dtype.is_floating_point and actual.requires_grad:
        actual.sum().backward()
        assert any(t.grad is not None and torch.isfinite(t.grad).all() for t in float_inputs), case


@pytest.mark.parametrize("case", sorted(MULTI_OUTPUT_CASES))
def test_multi_output_op_matches_onnxruntime_and_passes_gradients(case):
    op = case.split("#")[0]
    inputs, attrs, opset, count = MULTI_OUTPUT_CASES[case]
    model = build(op, inputs, attrs, opset, count)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {f"in{i}": array for i, array in enumerate(inputs) if array is not None}
    names = [f"out{i}" for i in range(count)]
    expected = session.run(names, feeds)
    tensors = {name: torch.from_numpy(np.array(array)) for name, array in feeds.items()}
    float_inputs = {n: t.requires_grad_(True) for n, t in tensors.items() if t.dtype.is_floating_point and t.ndim}
    actual = GraphProgram(model).run(tensors)
    for name, reference in zip(names, expected, strict=True):
        assert tuple(actual[name].shape) == reference.shape, (case, name)
        np.testing.assert_allclose(actual[name].detach().numpy(), reference, rtol=1e-5, atol=1e-5, err_msg=case)
    sum(actual[name].sum() for name in names).backward()
    # Recovery trains through these ops: every float input (a recurrent op's X, W, R, B, states) gets a gradient.
    for name, tensor in float_inputs.items():
        assert tensor.grad is not None and torch.isfinite(tensor.grad).all(), (case, name)
        assert tensor.grad.abs().sum() > 0, (case, name)


def _if_model(branch_op: str) -> onnx.ModelProto:
    """y = If(flag) then x * w (w a then-branch initializer) else Pad(x) reflect-padded then cut back: branches read
    ``x`` from the enclosing graph, as the voice-activity detectors' branches read their audio."""
    then_graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["then_out"])],
        "then",
        [],
        [helper.make_empty_tensor_value_info("then_out")],
        [numpy_helper.from_array(floats(4), "w")],
    )
    else_graph = helper.make_graph(
        [
            helper.make_node(branch_op, ["x", "pads"], ["padded"], mode="reflect"),
            helper.make_node("Slice", ["padded", "starts", "ends", "axes"], ["else_out"]),
        ],
        "else",
        [],
        [helper.make_empty_tensor_value_info("else_out")],
        [
            numpy_helper.from_array(ints(0, 0, 2, 0, 0, 1), "pads"),
            numpy_helper.from_array(ints(1), "starts"),
            numpy_helper.from_array(ints(5), "ends"),
            numpy_helper.from_array(ints(-1), "axes"),
        ],
    )
    node = helper.make_node("If", ["flag"], ["y"], name="node", then_branch=then_graph, else_branch=else_graph)
    graph = helper.make_graph(
        [node],
        "if",
        [
            helper.make_tensor_value_info("flag", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 4]),
        ],
        [helper.make_empty_tensor_value_info("y")],
    )
    return helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("flag", [True, False])
def test_if_runs_the_branch_its_condition_picks(flag):
    model = _if_model("Pad")
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"flag": np.array(flag), "x": X}
    (expected,) = session.run(["y"], feeds)
    x = torch.from_numpy(X.copy()).requires_grad_(True)
    actual = GraphProgram(model).run({"flag": torch.tensor(flag), "x": x})["y"]
    np.testing.assert_allclose(actual.detach().numpy(), expected, rtol=1e-6, atol=1e-6)
    actual.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_an_unsupported_node_inside_a_branch_is_named():
    model = _if_model("Det")  # not an op the interpreter runs (and not valid here: only the check is asked)
    assert [node.op_type for node, _ in unsupported_nodes(model)] == ["Det"]
    with pytest.raises(InputError, match=r"\(Det\)"):
        GraphProgram(model)


def test_an_op_outside_the_table_is_named():
    model = build("Det", [floats(2, 2)], {}, 18)
    assert [node.op_type for node, _ in unsupported_nodes(model)] == ["Det"]
    with pytest.raises(InputError, match=r"'node' \(Det\)"):
        GraphProgram(model)


@pytest.mark.parametrize(
    ("op", "inputs", "attrs", "opset", "named"),
    [
        ("Resize", [SMALL_IMAGE, EMPTY, scales(1, 1, 0.5, 0.5)], {"mode": "linear", "antialias": 1}, 18, "antialias"),
        (
            "ConvTranspose",
            [IMAGE, floats(4, 3, 2, 2)],
            {"output_shape": [14, 12], "strides": [2, 2]},
            18,
            "output_shape",
        ),
        (
            "ConvTranspose",
            [IMAGE, floats(4, 3, 2, 2)],
            {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
            18,
            "auto_pad='SAME_UPPER'",
        ),
        ("AveragePool", [IMAGE], {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1]}, 18, "asymmetric pads"),
        ("AveragePool", [IMAGE], {"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER"}, 18, "auto_pad='SAME_UPPER'"),
    ],
)
def test_an_attribute_outside_the_implementation_is_refused_by_name(op, inputs, attrs, opset, named):
    model = build(op, inputs, attrs, opset)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.get_outputs()  # a valid model ONNX Runtime runs; the interpreter alone declines it
    ((node, reason),) = unsupported_nodes(model)
    assert node.op_type == op and named in reason
    with pytest.raises(InputError, match=rf"'node' \({op}\) with {re.escape(named)}"):
        GraphProgram(model)


def test_a_batch_first_recurrent_op_is_refused_by_name():
    # ONNX Runtime refuses layout=1 too, so no reference could check the interpreter there.
    model = build("LSTM", recurrent_inputs(4)[:3], {"hidden_size": 4, "layout": 1}, 14, 3)
    ((node, reason),) = unsupported_nodes(model)
    assert node.op_type == "LSTM" and "layout=1" in reason


def _chain_with_branch() -> onnx.ModelProto:
    """a = Relu(x), b = Neg(a), then If(flag): a * b (the branch reads a and b by name) else b + x."""
    then_graph = helper.make_graph(
        [helper.make_node("Mul", ["a", "b"], ["then_out"])],
        "then",
        [],
        [helper.make_empty_tensor_value_info("then_out")],
    )
    else_graph = helper.make_graph(
        [helper.make_node("Add", ["b", "x"], ["else_out"])],
        "else",
        [],
        [helper.make_empty_tensor_value_info("else_out")],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("Neg", ["a"], ["b"]),
        helper.make_node("Split", ["b"], ["half", "unread"], axis=0),  # "unread": an output nothing reads
        helper.make_node("If", ["flag"], ["y"], then_branch=then_graph, else_branch=else_graph),
    ]
    inputs = [
        helper.make_tensor_value_info("flag", onnx.TensorProto.BOOL, []),
        helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3]),
    ]
    graph = helper.make_graph(nodes, "chain", inputs, [helper.make_empty_tensor_value_info("y")])
    return helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("flag", [True, False])
def test_values_are_dropped_after_their_last_reader_branches_included(flag):
    from nmdeploy.runtimes.interpreter import _execute, _last_reads

    model = _chain_with_branch()
    # a and b live until the If, whose branches read them by name; Split's outputs, which nothing reads, go as soon
    # as they are made (the branches' own names are listed too: nothing by those names is ever held)
    plan = [set(names) for names in _last_reads(model.graph, {"y"})]
    assert plan == [set(), set(), {"half", "unread"}, {"flag", "x", "a", "b", "then_out", "else_out"}]
    x = torch.from_numpy(np.arange(-3.0, 3.0, dtype=np.float32).reshape(2, 3))
    program = GraphProgram(model)
    values = {"flag": torch.tensor(flag), "x": x}
    left = _execute(program._steps, dict(values), program._released, frozenset({"a"}))
    assert set(left) == {"y", "a"}  # only the output and what the caller keeps
    relu = torch.relu(x)
    result = program.run(values, keep=("b",))
    torch.testing.assert_close(result["y"], relu * -relu if flag else -relu + x)
    torch.testing.assert_close(result["b"], -relu)
    assert set(values) == {"flag", "x"}  # the caller's mapping is not touched
