"""Streamed statistics of chosen activations over calibration data, for quantization's activation ranges.

One function, :func:`activation_histograms`: the model runs once in ONNX Runtime over the calibration batches
(:func:`nmdeploy.calibration.calibration_batches`, the same bounded batches conversion reads) with the tensors added
as outputs, and each batch only updates one :class:`AbsHistogram` per tensor, so memory is one batch's activations
plus ``bins`` counts per tensor whatever the data set's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import onnx

from nmdeploy.calibration import calibration_batches
from nmdeploy.errors import InputError, MissingDependencyError, first_line
from nmdeploy.graph.index import model_tensors
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.quantization_ranges import DEFAULT_BINS, AbsHistogram
from nmdeploy.runtimes.data import graph_inputs


def activation_histograms(
    model: OnnxModel,
    tensors: Iterable[str],
    calibration: str | Path,
    elem_types: Mapping[str, int],
    *,
    batch_size: int | None = None,
    bins: int = DEFAULT_BINS,
) -> tuple[dict[str, AbsHistogram], int]:
    """|x| histograms of ``tensors`` (main-graph values of the float types ``elem_types`` gives) over every batch of
    ``calibration`` (.npz, folder, or "random"), and the number of samples seen."""
    try:
        import onnxruntime
    except ImportError as error:
        raise MissingDependencyError("calibrating activations needs onnxruntime: pip install onnxruntime") from error
    names = list(dict.fromkeys(tensors))
    if not names:
        return {}, 0
    probe = _with_outputs(model, names, elem_types)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    try:
        session = onnxruntime.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as error:  # ORT raises its own Fail/InvalidGraph types
        raise InputError(f"ONNX Runtime cannot load the model to calibrate it ({first_line(error)[:200]})") from error
    histograms = {name: AbsHistogram(bins) for name in names}
    samples = 0
    inputs = graph_inputs(model.proto)
    for batch in calibration_batches(calibration, inputs, batch_size, model=model.proto):
        try:
            values = session.run(names, batch)
        except Exception as error:  # ids out of range and similar: the data does not fit the model
            raise InputError(
                f"{calibration}: ONNX Runtime failed on the calibration data ({first_line(error)[:200]})"
            ) from error
        for name, array in zip(names, values, strict=True):
            histograms[name].update(array, name)
        first = next(iter(batch.values()))
        samples += int(first.shape[0]) if first.ndim else 1
    if not samples:
        raise InputError(f"{calibration}: no calibration batches")
    return histograms, samples


def _with_outputs(model: OnnxModel, names: list[str], elem_types: Mapping[str, int]) -> onnx.ModelProto:
    """A copy of the model, every tensor inline (read through the model), with ``names`` added as graph outputs."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model.proto)
    for original, tensor in zip(model_tensors(model.proto), model_tensors(copy), strict=True):
        if original.data_location == onnx.TensorProto.EXTERNAL:
            values = model.read(original)
            tensor.ClearField("external_data")
            tensor.data_location = onnx.TensorProto.DEFAULT
            tensor.raw_data = values.astype(values.dtype.newbyteorder("<"), copy=False).tobytes()
    present = {value.name for value in copy.graph.output}
    for name in names:
        if name not in present:
            copy.graph.output.append(onnx.helper.make_tensor_value_info(name, elem_types[name], None))
    return copy
