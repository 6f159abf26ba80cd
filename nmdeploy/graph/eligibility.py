"""TensorRT's rules for sparse weights, applied to a discovered weight (TensorRT itself is not needed).

The rules come from TensorRT's documentation and issue tracker: 2:4 only; Convolution weights [K, C, R, S] with C
a multiple of 4; fully connected / MatMul weights that are constant, 2-D and on the second input; precision from
the network (fp16, bf16, int8 or fp8; fp32 builds do not get sparse tactics). Sparse kernels usually only win when
both channel counts are 256 or more, where a convolution's C counts R*S times.

Recurrent ops (ONNX LSTM, GRU, RNN) run dense. TensorRT's RNN layer (IRNNv2Layer) was deprecated in TensorRT 8.0 for
the Loop API and announced for removal in 9.0 (TensorRT 7.2 API reference, addRNNv2; 8.5 operator reference, RNN);
the ONNX parser does not use it: in TensorRT 10 and 11 (onnx-tensorrt, onnxOpImporters.cpp, the LSTM/GRU/RNN
importers) it builds an ILoop over the sequence whose gate products are IMatrixMultiplyLayers of X(t) with the
whole 3-D W [directions, gates * hidden, input] and of H(t-1) with R, both transposed. Sparse tactics are for 2-D
constant weights of convolutions and matrix multiplies (trtexec's own sparsifier only handles 2-D MatMul weights);
a batched weight inside a loop body is neither, so no TensorRT engine runs these GEMMs on sparse tensor cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nmdeploy.graph.prunable import RECURRENT_GATES, PrunableWeight, UntracedWeight
from nmdeploy.masks import Pattern

TENSORRT_PATTERN = Pattern(2, 4)
"""The one pattern TensorRT's sparse kernels take."""
_SPARSE_DTYPES = {"float", "float16", "bfloat16", "int8", "float8e4m3fn"}
WIN_CHANNELS = 256


@dataclass(frozen=True)
class TensorRTVerdict:
    eligible: bool
    likely_to_win: bool
    reasons: tuple[str, ...]  # why not eligible, or why it may not pay off


def tensorrt_verdict(weight: PrunableWeight, pattern: Pattern) -> TensorRTVerdict:
    """Whether TensorRT can run this weight's layer(s) on sparse tensor cores, and whether that is likely faster."""
    reasons = []
    if pattern != TENSORRT_PATTERN:
        reasons.append(f"TensorRT supports 2:4 only, not {pattern}")
    if weight.needs_transposable:
        reasons.append("shared by consumers that reduce over different axes")
    ops = {use.op_type for use in weight.uses}
    recurrent = sorted(ops & set(RECURRENT_GATES))
    if recurrent:
        reasons.append(
            f"{'/'.join(recurrent)}: TensorRT runs its gate GEMMs in a loop on the 3-D weight, with no sparse tactics"
        )
    if ops & {"ConvTranspose"}:
        reasons.append("ConvTranspose has no sparse tactics")
    # Judged on the operand each GEMM reads: TensorRT folds a Reshape or Cast of a stored tensor into one constant.
    gemm_uses = [use for use in weight.uses if use.op_type in ("Gemm", "MatMul")]
    if gemm_uses:
        if any(use.input_index != 1 for use in gemm_uses):
            reasons.append("the weight is the first GEMM input; TensorRT needs it second")
        rank = next((len(use.operand_shape) for use in gemm_uses if len(use.operand_shape) != 2), None)
        if rank is not None:
            reasons.append(f"{rank}-D MatMul weight; TensorRT needs a 2-D one")
    dtypes = list(dict.fromkeys(use.operand_dtype for use in weight.uses))
    reasons.extend(f"dtype {dtype} has no sparse tactics" for dtype in dtypes if dtype not in _SPARSE_DTYPES)
    axis = weight.axis
    if axis is not None and weight.shape[axis] % 4:
        reasons.append(f"reduction axis length {weight.shape[axis]} is not a multiple of 4")
    eligible = not reasons
    hints = []
    if eligible:
        reduction, outputs = gemm_channels(weight)
        if reduction < WIN_CHANNELS or outputs < WIN_CHANNELS:
            hints.append(f"small layer (reduction {reduction}, outputs {outputs}; sparse kernels usually win from 256)")
        if "float" in dtypes:
            hints.append("fp32 weights: cast to fp16/bf16 (strongly typed) for TensorRT to pick sparse tactics")
    return TensorRTVerdict(eligible, eligible and not hints, tuple(reasons) + tuple(hints))


def untraced_eligible(untraced: UntracedWeight, dtype: str | None, shape: tuple[int | None, ...] | None) -> bool:
    """Whether an operand that could not be traced to its storage is a weight TensorRT could run sparse as 2:4, by
    the rules of :func:`tensorrt_verdict` that can be checked without it: a stored tensor behind it (TensorRT folds
    whatever computes it into one constant, dense unless that constant is N:M), the second input of a MatMul or Gemm
    or a Conv's weight, and, where known (``dtype``: onnx's lower-case name; ``shape``: None or dims None where not
    known), a sparse dtype, a 2-D GEMM weight and a reduction axis of a multiple of 4. What is not known counts as
    eligible: a weight no one could see is never passed as N:M. The pattern is the caller's to judge: ``--require``
    holds these operands to whichever pattern it checks (:attr:`~nmdeploy.graph.inspection.WeightRow.required`)."""
    if not untraced.weight or untraced.input_index != 1:
        return False
    if untraced.op_type not in ("Conv", "Gemm", "MatMul"):
        return False  # ConvTranspose and recurrent ops run dense (see tensorrt_verdict)
    if dtype is not None and dtype not in _SPARSE_DTYPES:
        return False
    if shape is None:
        return True
    if untraced.op_type in ("Gemm", "MatMul") and len(shape) != 2:
        return False
    if untraced.axis is None or not -len(shape) <= untraced.axis < len(shape):
        return True
    reduction = shape[untraced.axis]
    return reduction is None or reduction % 4 == 0


def gemm_channels(weight: PrunableWeight) -> tuple[int, int]:
    """(effective reduction size, output channels) of the GEMM the weight feeds."""
    shape, axis = weight.shape, weight.axis or 0
    if weight.recurrent:  # [directions, gates * hidden, K]: every direction's gates share the reduction
        return shape[axis], math.prod(shape) // shape[axis]
    if weight.uses[0].op_type == "Conv":
        kernel = 1
        for size in shape[2:]:
            kernel *= size
        return shape[1] * kernel, shape[0]
    other = len(shape) - 1 if axis == len(shape) - 2 else len(shape) - 2
    return shape[axis], shape[other]
