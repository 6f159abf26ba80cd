"""Whether a model runs at the batch sizes its inputs declare, or only one row at a time.

An exporter that traces a batch-1 example can declare the batch axis symbolic and still bake batch 1 into shapes
computed inside the graph (torch.onnx.export with dynamo and ``dynamic_axes`` does this to a decoder's attention
masks: ONNX Runtime then fails at batch 2 with a broadcasting error). :func:`run_or_first_row` tells such a model
from bad data for every verb that feeds several rows per run: calibration probes it once on two rows of the first
calibration batch and calibrates row by row; compare finds it on the first batch that fails and compares row by row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import onnx

from nmdeploy.calibration.data import CalibrationData
from nmdeploy.calibration.statistics.segments import SegmentPlan, SegmentSession
from nmdeploy.errors import InputError, first_line
from nmdeploy.graph.model import OnnxModel
from nmdeploy.runtimes.batch_axes import BatchAxes, FeedDict
from nmdeploy.runtimes.data import graph_inputs

ROW_BY_ROW = (
    "the model declares a free batch size but runs only one row at a time in ONNX Runtime (shapes inside it were "
    "fixed at export, e.g. traced from a batch-1 example): calibrating row by row"
)

PIECE_BYTES = 1 << 28  # weights per probe session: the probe never holds the whole model
log = logging.getLogger(__name__)
Result = TypeVar("Result")


@dataclass(frozen=True)
class RowRun(Generic[Result]):
    """What :func:`run_or_first_row` ran: the whole batch's result, or, where the model runs one row at a time only,
    its first row's, with ``failure``: the first line of the error the whole batch met."""

    result: Result
    failure: str | None = None


def run_or_first_row(run: Callable[[FeedDict], Result], batch: FeedDict, axes: BatchAxes) -> RowRun[Result]:
    """``run`` on the whole ``batch``, or, where that raises an InputError, on the batch's first row alone: a model
    that runs one row but not several runs one row at a time only. Where one row fails too (the data's fault), or the
    batch has no rows to cut, the whole batch's error is raised as it was."""
    try:
        return RowRun(run(batch))
    except InputError as error:
        # Rows are counted only to fall back: a batch that runs whole needs no batch axis of its inputs
        # (a state [2, B, H] whose B the graph leaves unnamed, compared without --batch-axis).
        try:
            rows = axes.rows(batch)
        except InputError:
            raise error from None
        if rows < 2:
            raise
        try:
            first = run(axes.take(batch, slice(0, 1)))
        except InputError:
            raise error from None  # one row fails too: the data's fault, told as the batch's
        return RowRun(first, first_line(error.__cause__ or error, 200))


def rows_that_run(model: OnnxModel, data: CalibrationData) -> CalibrationData:
    """``data`` as ``model`` can be fed it: the same data, or, where the model runs one row at a time only (probed on
    the first batch), the data fed one row per batch (``row_by_row``), said in one line of the log."""
    if data.max_samples == 1:
        return data
    first = next(iter(data.batches()), None)
    failure = runs_one_row_only(model, first) if first is not None else None
    if failure is None:
        return data
    log.warning("%s (at two rows: %s)", ROW_BY_ROW, failure[:120])
    return data.one_row_per_run()


def runs_one_row_only(model: OnnxModel, batch: Mapping[str, np.ndarray]) -> str | None:
    """ONNX Runtime's error at two rows of ``batch`` when the model runs its first row alone but not its first two;
    None when two rows run, when one row fails too (the data's fault, reported where it is fed), or when the batch
    cannot be cut into rows (a fixed batch axis, or fewer than two rows).

    The model runs in pieces of about ``PIECE_BYTES`` of weights, one piece's session at a time, so the probe holds
    one piece of the model at a time, as calibration does.
    """
    inputs = graph_inputs(model.proto)
    if not inputs or any(not spec.shape or spec.shape[0] is not None for spec in inputs):
        return None
    if any(np.ndim(batch.get(spec.name)) == 0 or len(batch[spec.name]) < 2 for spec in inputs):
        return None
    try:
        plan = SegmentPlan(model.index, _cut_values(model), ())
    except InputError:
        return None  # a graph calibration cannot cut: the conversion says why itself
    two_rows = {spec.name: np.asarray(batch[spec.name])[:2] for spec in inputs}
    try:
        return run_or_first_row(lambda feeds: _run_in_pieces(model, plan, feeds), two_rows, BatchAxes({})).failure
    except InputError:
        return None


def _run_in_pieces(model: OnnxModel, plan: SegmentPlan, feeds: FeedDict) -> None:
    """``feeds`` through every piece of ``plan``, each piece's session built, run and dropped before the next."""
    values = dict(feeds)
    for segment in plan.segments:
        if not segment.nodes:
            continue
        session = SegmentSession(model, plan, segment, {}, quiet=True)
        values.update(session.run({name: values[name] for name in segment.inputs}))
        del session  # this piece's weights go before the next piece's are read
        for name in [name for name in values if plan.last_need.get(name, len(plan.segments)) <= segment.index]:
            del values[name]  # values no later piece reads


def _cut_values(model: OnnxModel) -> list[list[str]]:
    """The values crossing cuts of the main graph's node order between pieces of about PIECE_BYTES of stored
    weights, then the graph outputs: the "taps" a SegmentPlan cuts at."""
    index = model.index
    main = index.main
    order = index.topological_order()
    seen: set[str] = set()
    cuts, held = [], 0
    for position, node in enumerate(order):
        added = 0
        for name in main.reads(node):
            tensor = main.initializers.get(name)
            if tensor is not None and name not in seen:
                seen.add(name)
                added += _nbytes(tensor)
        if held and held + added > PIECE_BYTES:
            cuts.append(position)
            held = 0
        held += added
    outputs = [value.name for value in model.proto.graph.output]
    return [index.live_values(cut, order) for cut in cuts] + [outputs]


def _nbytes(tensor: onnx.TensorProto) -> int:
    count = int(np.prod(tensor.dims, dtype=np.int64))
    return count * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
