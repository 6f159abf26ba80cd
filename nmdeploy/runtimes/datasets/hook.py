"""A user's data-loader function -> shards: ``FUNCTION()`` yields feed dicts (input name -> numpy array), as
Polygraphy's data-loader scripts do; every dict is checked against the model before it is written.

A streaming model (a voice-activity detector, a decoder with a recurrent state) is calibrated on the states it
meets in use, not on zeros or noise: with ``carry`` (output -> input, ``--carry stateN:state``) the model runs on
each batch in turn and its output becomes the next batch's input. The hook then leaves that input out (the first
batch starts from zeros), or yields it to start a new stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError, first_line
from nmdeploy.imports import import_callable
from nmdeploy.runtimes.base import InputSpec
from nmdeploy.runtimes.batch_axes import BatchAxes, model_batch_axes
from nmdeploy.runtimes.data import check_batch, graph_inputs
from nmdeploy.runtimes.datasets.shards import DataSetReport, check_output_folder, rows_per_shard, write_shards


def _failure(hook: str, error: Exception) -> InputError:
    reason = first_line(error, 200)
    return InputError(
        f"hook {hook} failed ({type(error).__name__}: {reason}); it must take no arguments and yield feed dicts "
        "(input name -> numpy array)"
    )


def hook_batches(
    hook: str, inputs: Sequence[InputSpec], carried: StateCarrier | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """The checked feed dicts the function ``hook`` (``module:function``) yields (``carried`` inputs filled in)."""
    function = import_callable(hook, f"hook {hook}", allow_classes=False)
    try:
        batches = iter(function())
    except Exception as error:  # the hook is the user's code: its failure is their input, not our bug
        raise _failure(hook, error) from error
    number = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as error:  # as above, while the user's generator runs
            raise _failure(hook, error) from error
        where = f"hook {hook}, batch {number}"
        if not isinstance(batch, dict):
            raise InputError(f"{where}: yielded a {type(batch).__name__}; yield dicts of input name -> numpy array")
        wrong = next((name for name, array in batch.items() if not isinstance(array, np.ndarray)), None)
        if wrong is not None:
            kind = type(batch[wrong]).__name__
            raise InputError(f"{where}: input '{wrong}' is a {kind}; yield numpy arrays")
        if carried is not None:
            batch = carried.fill(batch, where)
        checked = check_batch(batch, inputs, where)
        if carried is not None:
            carried.step(checked)
        yield checked
        number += 1


def parse_carry(text: str | None) -> dict[str, str]:
    """``"stateN:state,hN:h"`` -> {output: input}."""
    pairs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        output, _, name = item.partition(":")
        if not output or not name:
            raise InputError(f"--carry {item!r}: expected OUTPUT:INPUT such as stateN:state, comma-separated")
        if name in pairs.values():
            raise InputError(f"--carry: input {name!r} is given twice")
        pairs[output] = name
    return pairs


class StateCarrier:
    """Runs ``model`` on each batch and keeps the outputs ``carry`` names for the inputs they feed next."""

    def __init__(self, model: Path, carry: Mapping[str, str], inputs: Sequence[InputSpec], axes: BatchAxes):
        from nmdeploy.runtimes.backends import open_runner

        specs = {spec.name: spec for spec in inputs}
        self.runner = open_runner("ort", model).__enter__()
        for output, name in carry.items():
            if output not in self.runner.output_names:
                outputs = ", ".join(repr(n) for n in self.runner.output_names)
                raise InputError(f"--carry {output}:{name}: the model has no output {output!r}; its outputs: {outputs}")
            if name not in specs:
                raise InputError(f"--carry {output}:{name}: the model has no input {name!r}")
        self.carry, self.specs, self.axes = dict(carry), specs, axes
        self.state: dict[str, np.ndarray] = {}

    def fill(self, batch: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
        """``batch`` with every carried input it leaves out: the last output, or zeros at the stream's start or
        where the rows changed."""
        missing = [name for name in self.carry.values() if name not in batch]
        if not missing:
            return batch
        rows = self.axes.rows(batch, where)
        filled = dict(batch)
        for name in missing:
            spec, axis = self.specs[name], self.axes.axis(name)
            last = self.state.get(name)
            if last is not None and (axis is None or last.shape[axis] == rows):
                filled[name] = last
                continue
            shape = [rows if index == axis else size for index, size in enumerate(spec.shape)]
            if any(size is None for size in shape):
                raise InputError(
                    f"{where}: carried input '{name}' ({spec.describe()}) has free dimensions besides its rows; "
                    "yield its first value from the hook"
                )
            filled[name] = np.zeros(shape, dtype=spec.dtype)
        return filled

    def step(self, batch: dict[str, np.ndarray]) -> None:
        outputs = self.runner.infer(batch)
        for output, name in self.carry.items():
            value = np.asarray(outputs[output])
            if value.dtype != self.specs[name].dtype:
                raise InputError(
                    f"--carry {output}:{name}: the output is {value.dtype.name}, the input takes "
                    f"{self.specs[name].dtype.name}"
                )
            self.state[name] = value

    def close(self) -> None:
        self.runner.__exit__(None, None, None)


def build_hook_set(
    model: str | Path,
    hook: str,
    output: str | Path,
    *,
    rows: int = 32,
    batch_axes: dict[str, int | None] | None = None,
    carry: Mapping[str, str] | None = None,
) -> DataSetReport:
    """Run the data-loader function ``hook`` and write what it yields for ``model`` as shards into ``output``, rows
    regrouped along each input's batch axis (the graph's, or ``batch_axes``: input name -> axis or None); ``carry``
    (output -> input) feeds each batch's outputs to the next batch's inputs (streaming calibration)."""
    from nmdeploy.graph.model import OnnxModel

    check_output_folder(Path(output), [Path(model)])
    proto = OnnxModel.load(model).proto
    inputs, axes = graph_inputs(proto), model_batch_axes(proto, batch_axes)
    per_shard = rows_per_shard(inputs, rows, axes)
    carrier = StateCarrier(Path(model), carry, inputs, axes) if carry else None
    try:
        batches = hook_batches(hook, inputs, carrier)
        return write_shards(Path(output), f"hook {hook}", inputs, batches, per_shard, axes)
    finally:
        if carrier is not None:
            carrier.close()
