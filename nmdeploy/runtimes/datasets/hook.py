"""A user's data-loader function -> shards: ``FUNCTION()`` yields feed dicts (input name -> numpy array), as
Polygraphy's data-loader scripts do; every dict is checked against the model before it is written."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError, first_line
from nmdeploy.imports import import_callable
from nmdeploy.runtimes.base import InputSpec
from nmdeploy.runtimes.batch_axes import model_batch_axes
from nmdeploy.runtimes.data import check_batch, graph_inputs
from nmdeploy.runtimes.datasets.shards import DataSetReport, check_output_folder, rows_per_shard, write_shards


def _failure(hook: str, error: Exception) -> InputError:
    reason = first_line(error, 200)
    return InputError(
        f"hook {hook} failed ({type(error).__name__}: {reason}); it must take no arguments and yield feed dicts "
        "(input name -> numpy array)"
    )


def hook_batches(hook: str, inputs: Sequence[InputSpec]) -> Iterator[dict[str, np.ndarray]]:
    """The checked feed dicts the function ``hook`` (``module:function``) yields."""
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
        yield check_batch(batch, inputs, where)
        number += 1


def build_hook_set(
    model: str | Path,
    hook: str,
    output: str | Path,
    *,
    rows: int = 32,
    batch_axes: dict[str, int | None] | None = None,
) -> DataSetReport:
    """Run the data-loader function ``hook`` and write what it yields for ``model`` as shards into ``output``, rows
    regrouped along each input's batch axis (the graph's, or ``batch_axes``: input name -> axis or None)."""
    from nmdeploy.graph.model import OnnxModel

    check_output_folder(Path(output), [Path(model)])
    proto = OnnxModel.load(model).proto
    inputs, axes = graph_inputs(proto), model_batch_axes(proto, batch_axes)
    per_shard = rows_per_shard(inputs, rows, axes)
    return write_shards(Path(output), f"hook {hook}", inputs, hook_batches(hook, inputs), per_shard, axes)
