"""Which axis of each model input (and output) holds a batch's rows, and the row operations every verb shares.

Most models take their rows along axis 0, but a stateful one need not: a voice-activity detector takes a frame
[B, 512], a scalar sample rate and a state [2, B, 128], and returns the next state [2, B, 128]. The axis of each value
is read from the graph (:mod:`nmdeploy.graph.batch_axes`: the symbolic dimension most inputs start with, such
as ``batch``, wherever it sits; else a free axis 0; else the one free axis). ``--batch-axis NAME:AXIS`` (AXIS a
number, or ``none``) decides where the graph cannot. Arrays without a batch axis go whole into every piece of a
batch that is cut, and batches are joined only where they hold the same such arrays.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from nmdeploy.errors import InputError
from nmdeploy.graph.batch_axes import graph_batch_axes
from nmdeploy.runtimes.base import InputSpec

FeedDict = dict[str, np.ndarray]
NONE = "none"


@dataclass(frozen=True)
class BatchAxes:
    """Value name -> the axis of its rows (None: the value has none, such as a scalar). A name not listed takes
    axis 0 when it has one."""

    axes: Mapping[str, int | None]

    def axis(self, name: str, array: np.ndarray | None = None) -> int | None:
        axis = self.axes.get(name, 0)
        if array is not None and (axis is None or array.ndim <= axis):
            return None
        return axis

    def rows(self, batch: Mapping[str, np.ndarray], where: str = "batch") -> int:
        """The rows of ``batch``: one count shared by every array with a batch axis (1 where none has one)."""
        counts = {
            name: array.shape[axis] for name, array in batch.items() if (axis := self.axis(name, array)) is not None
        }
        if len(set(counts.values())) > 1:
            described = ", ".join(f"'{name}' {count} along axis {self.axis(name)}" for name, count in counts.items())
            raise InputError(
                f"{where}: the inputs disagree on the number of rows ({described}); give each input's batch axis "
                "with --batch-axis NAME:AXIS (AXIS a number, or none for an input without rows)"
            )
        return next(iter(counts.values()), 1)

    def cuttable(self, inputs: Sequence[InputSpec], shapes: Mapping[str, tuple[int, ...]]) -> bool:
        """Whether a batch of these ``shapes`` can be cut into rows for a model of these ``inputs``: some input has
        rows, each on an axis the model leaves free, and they agree on their count."""
        rowed = [(spec, axis) for spec in inputs if (axis := self.axes.get(spec.name, 0)) is not None]
        if not rowed or any(axis >= len(spec.shape) or spec.shape[axis] is not None for spec, axis in rowed):
            return False
        return len({shapes[spec.name][axis] for spec, axis in rowed}) == 1

    def take(self, batch: Mapping[str, np.ndarray], rows: np.ndarray | slice) -> FeedDict:
        """The ``rows`` (indices or a slice) of every array with a batch axis; the others as they are."""
        taken = {}
        for name, array in batch.items():
            axis = self.axis(name, array)
            if axis is None:
                taken[name] = array
            elif isinstance(rows, slice):
                taken[name] = array[(slice(None),) * axis + (rows,)]
            else:
                taken[name] = np.take(array, rows, axis=axis)
        return taken

    def pieces(self, batch: Mapping[str, np.ndarray], size: int, where: str = "batch") -> list[FeedDict]:
        """``batch`` cut into pieces of at most ``size`` rows, in order."""
        total = self.rows(batch, where)
        return [self.take(batch, slice(start, start + size)) for start in range(0, max(total, 1), size)]

    def joinable(self, batches: Sequence[Mapping[str, np.ndarray]]) -> bool:
        """Whether ``batches`` can be one batch: the same names, and equal arrays wherever there is no batch axis."""
        first = batches[0]
        for batch in batches[1:]:
            if batch.keys() != first.keys():
                return False
            for name, array in batch.items():
                if self.axis(name, array) is None and not np.array_equal(array, first[name]):
                    return False
                if self.axis(name, array) is not None and _rest(array, self.axis(name)) != _rest(
                    first[name], self.axis(name)
                ):
                    return False
        return True

    def join(self, batches: Sequence[Mapping[str, np.ndarray]]) -> FeedDict:
        """One batch of ``batches``' rows in order (they must be :meth:`joinable`)."""
        if len(batches) == 1:
            return dict(batches[0])
        first = batches[0]
        joined = {}
        for name, array in first.items():
            axis = self.axis(name, array)
            joined[name] = array if axis is None else np.concatenate([b[name] for b in batches], axis=axis)
        return joined


def _rest(array: np.ndarray, axis: int) -> tuple[int, ...]:
    return array.shape[:axis] + array.shape[axis + 1 :]


def parse_batch_axes(text: str | None, flag: str = "--batch-axis") -> dict[str, int | None]:
    """``"state:1,sr:none"`` -> {"state": 1, "sr": None}."""
    given: dict[str, int | None] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        name, _, axis = item.rpartition(":")
        if not name or not (axis.isdigit() or axis.lower() == NONE):
            raise InputError(f"{flag} {item!r}: expected NAME:AXIS such as state:1 (or NAME:none), comma-separated")
        if name in given:
            raise InputError(f"{flag}: input {name!r} is given twice")
        given[name] = None if axis.lower() == NONE else int(axis)
    return given


def model_batch_axes(proto: onnx.ModelProto | None, given: Mapping[str, int | None] | None = None) -> BatchAxes:
    """The batch axis of every real input and every output of ``proto`` as the graph gives it
    (:func:`nmdeploy.graph.batch_axes.graph_batch_axes`; None: every value on axis 0), ``given`` (input name -> axis
    or None) taking precedence."""
    if proto is None:
        return BatchAxes(dict(given or {}))
    found = graph_batch_axes(proto)
    axes = found.axes
    for name, axis in (given or {}).items():
        if name not in found.inputs:
            known = ", ".join(repr(n) for n in found.inputs)
            raise InputError(f"--batch-axis: the model has no input {name!r}; its inputs are {known}")
        rank = found.input_ranks[name]
        if axis is not None and axis >= rank:
            raise InputError(f"--batch-axis {name}:{axis}: input {name!r} has {rank} dimensions (axes 0..{rank - 1})")
        axes[name] = axis
    return BatchAxes(axes)
