"""Whether a model runs at the batch sizes its inputs declare, or only one row at a time.

An exporter that traces a batch-1 example can declare the batch axis symbolic and still bake batch 1 into shapes
computed inside the graph (torch.onnx.export with dynamo and ``dynamic_axes`` does this to a decoder's attention
masks: ONNX Runtime then fails at batch 2 with a broadcasting error). Calibration feeds many rows per run, so such a
model is probed once on two rows of the first calibration batch, and on one row where two fail: a model that runs
one row but not two is calibrated row by row.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import onnx

from nmdeploy.conversion.data import CalibrationData
from nmdeploy.errors import first_line
from nmdeploy.graph.model import OnnxModel
from nmdeploy.imports import require
from nmdeploy.runtimes.data import graph_inputs

ROW_BY_ROW = (
    "the model declares a free batch size but runs only one row at a time in ONNX Runtime (shapes inside it were "
    "fixed at export, e.g. traced from a batch-1 example): calibrating row by row"
)

log = logging.getLogger(__name__)


def feed_row_by_row(model: OnnxModel, data: CalibrationData) -> bool:
    """Whether ``model`` runs one row at a time only (probed on the first batch of ``data``); ``data`` then feeds
    one row per batch, said in one line of the log."""
    if data.max_samples == 1:
        return False
    first = next(iter(data.batches()), None)
    failure = runs_one_row_only(model, first) if first is not None else None
    if failure is None or not data.one_row_per_batch():
        return False
    log.warning("%s (at two rows: %s)", ROW_BY_ROW, failure[:120])
    return True


def runs_one_row_only(model: OnnxModel, batch: Mapping[str, np.ndarray]) -> str | None:
    """ONNX Runtime's error at two rows of ``batch`` when the model runs its first row alone but not its first two;
    None when two rows run, when one row fails too (the data's fault, reported where it is fed), or when the batch
    cannot be cut into rows (a fixed batch axis, or fewer than two rows)."""
    inputs = graph_inputs(model.proto)
    if not inputs or any(not spec.shape or spec.shape[0] is not None for spec in inputs):
        return None
    if any(np.ndim(batch.get(spec.name)) == 0 or len(batch[spec.name]) < 2 for spec in inputs):
        return None
    opened = _session(model)
    if opened is None:
        return None
    session, fixed = opened
    names = [output.name for output in model.proto.graph.output]
    feeds = {spec.name: np.asarray(batch[spec.name]) for spec in inputs}
    try:
        session.run(names, {**fixed, **{name: value[:2] for name, value in feeds.items()}})
        return None
    except Exception as error:  # ORT raises its own types for shapes the model cannot take
        failure = first_line(error, 200)
    try:
        session.run(names, {**fixed, **{name: value[:1] for name, value in feeds.items()}})
    except Exception:
        return None
    return failure


def _session(model: OnnxModel):
    """A session of the whole model and the external weights it is fed with every run (ONNX Runtime resolves the
    external data of a model given as bytes against the working directory, and values may have changed in memory);
    None where ONNX Runtime cannot load it (the conversion reports that itself)."""
    onnxruntime = require("onnxruntime", purpose="calibration (it runs the model)")
    source = model.proto
    proto = onnx.ModelProto(ir_version=source.ir_version)
    proto.opset_import.extend(source.opset_import)
    proto.functions.extend(source.functions)
    graph = proto.graph
    graph.node.extend(source.graph.node)
    graph.input.extend(source.graph.input)
    graph.output.extend(source.graph.output)
    graph.sparse_initializer.extend(source.graph.sparse_initializer)
    fixed = {}
    declared = {value.name for value in source.graph.input}
    for tensor in source.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            fixed[tensor.name] = model.read(tensor)
            if tensor.name not in declared:
                graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
        else:
            graph.initializer.append(tensor)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4  # the failure at two rows is expected here, not news for the log
    try:
        session = onnxruntime.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:  # ORT raises its own Fail/InvalidGraph/... types for unusable models
        return None
    return session, fixed
