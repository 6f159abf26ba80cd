"""Activation statistics for calibrated conversion: per prunable weight, H = X^T X of its GEMM input along K.

The dense model runs in ONNX Runtime with each weight's activation input exposed as an extra output; H is
accumulated batch by batch in float64, so memory is bounded by the statistics (K x K per weight), never by the
calibration set. Fully connected uses are covered (MatMul and Gemm with the weight on either side, any batch or
token dimensions); convolutions need an im2col in the channel-fastest order and are reported as not supported yet.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from nmdeploy.files import temporary_beside
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.weights import PrunableWeight
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner


@dataclass
class InputStatistics:
    """Second moments of one weight's GEMM input: ``hessian`` [K, K] over ``samples`` rows of X [samples, K]."""

    weight: PrunableWeight
    activation: str
    hessian: torch.Tensor
    samples: int = 0


@dataclass(frozen=True)
class _Tap:
    activation: str
    reduce_last: bool  # K is the activation's last axis (else its second to last: the weight is the A operand)


def _tap(weight: PrunableWeight, model: onnx.ModelProto) -> _Tap | str:
    """Where a weight's activation comes from, or why it cannot be collected."""
    if len(weight.uses) != 1:
        return "shared by several consumers"
    use = weight.uses[0]
    if use.graph != "main":
        return f"used inside {use.graph}"
    node = next(
        (
            n
            for n in model.graph.node
            if n.op_type == use.op_type
            and len(n.input) > use.input_index
            and (n.name or f"{n.op_type}({n.input[use.input_index]})") == use.node
        ),
        None,
    )
    if node is None:
        return "consumer not found in the main graph"
    other = node.input[1 - use.input_index]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if use.op_type == "MatMul":
        return _Tap(other, reduce_last=use.input_index == 1)
    if use.op_type == "Gemm":
        transposed = attrs.get("transA", 0) if use.input_index == 1 else attrs.get("transB", 0)
        # Weight as B: the activation A is [M, K] (or [K, M] with transA); weight as A: B is [K, N] (or [N, K]).
        return _Tap(other, reduce_last=(use.input_index == 1) != bool(transposed))
    return f"{use.op_type} statistics need im2col (not supported yet)"


def collect_statistics(
    model: OnnxModel, weights: Iterable[PrunableWeight], batches: Iterable[dict[str, np.ndarray]]
) -> tuple[dict[str, InputStatistics], dict[str, str]]:
    """H = X^T X for every weight that can be collected, and the reason for every one that cannot."""
    taps: dict[str, _Tap] = {}
    skipped: dict[str, str] = {}
    for weight in weights:
        tap = _tap(weight, model.proto)
        if isinstance(tap, str):
            skipped[weight.name] = tap
        else:
            taps[weight.name] = tap
    by_name = {w.name: w for w in weights}
    stats = {
        name: InputStatistics(
            by_name[name],
            tap.activation,
            torch.zeros(
                by_name[name].shape[by_name[name].axis], by_name[name].shape[by_name[name].axis], dtype=torch.float64
            ),
        )
        for name, tap in taps.items()
    }
    if not stats:
        return stats, skipped
    activations = sorted({tap.activation for tap in taps.values()})
    with _exposed_model(model, activations) as path, OnnxRuntimeRunner(path) as runner:
        for feeds in batches:
            outputs = runner.infer(feeds)
            for name, tap in taps.items():
                x = torch.from_numpy(np.ascontiguousarray(outputs[tap.activation])).to(torch.float64)
                if not tap.reduce_last:
                    x = x.transpose(-1, -2)
                x = x.reshape(-1, x.shape[-1])
                stats[name].hessian += x.T @ x
                stats[name].samples += x.shape[0]
    return stats, skipped


@contextlib.contextmanager
def _exposed_model(model: OnnxModel, activations: list[str]) -> Iterator[Path]:
    """A temporary copy of the model whose extra outputs are ``activations``.

    ONNX Runtime only reads external data from the model's own folder, so the copy is written there as a hidden
    file and removed afterwards; where that folder is read-only, the copy embeds the weights instead.
    """
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(proto).graph.value_info}
    existing = {o.name for o in proto.graph.output}
    for name in activations:
        if name not in existing:
            proto.graph.output.append(
                inferred.get(name) or onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
            )
    data = proto.SerializeToString() if not _has_external_data(proto) else None
    if data is not None:
        with tempfile.TemporaryDirectory(prefix="nmdeploy-calib-") as folder:
            path = Path(folder) / "exposed.onnx"
            path.write_bytes(data)
            yield path
        return
    try:
        path = temporary_beside(model.base_dir / ".calibration.onnx", suffix=".onnx")
    except OSError:
        for tensor in _external_tensors(proto):
            tensor.CopyFrom(onnx.numpy_helper.from_array(model.read(tensor), tensor.name))
        with tempfile.TemporaryDirectory(prefix="nmdeploy-calib-") as folder:
            path = Path(folder) / "exposed.onnx"
            path.write_bytes(proto.SerializeToString())
            yield path
        return
    try:
        path.write_bytes(proto.SerializeToString())
        yield path
    finally:
        path.unlink(missing_ok=True)


def _external_tensors(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]


def _has_external_data(proto: onnx.ModelProto) -> bool:
    return bool(_external_tensors(proto))
