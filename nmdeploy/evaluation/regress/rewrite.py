"""Rewriting baseline numbers in place (--update), keeping the rest of the file as it was."""

from __future__ import annotations

import math
from pathlib import Path

from nmdeploy.errors import InputError
from nmdeploy.evaluation.regress.schema import MetricKey, load_baselines
from nmdeploy.files import atomic_output


def _format_number(value: float) -> float:
    """Six significant digits: a baseline records a measurement, not its noise."""
    return float(f"{value:.6g}")


def rewrite_baselines(path: Path, values: dict[tuple[int, MetricKey], float]) -> None:
    """Replace the baseline numbers of ``values`` ((model index, key) -> new value) and write the file atomically.

    tomlkit edits the parsed document and writes it back with every comment, table layout and number format it
    did not touch; the result is re-read to prove every number landed.
    """
    import tomlkit

    document = tomlkit.parse(path.read_text(encoding="utf-8"))
    for (index, (section, group, name)), value in values.items():
        try:
            entry = document["model"][index][section][group][name]  # type: ignore[index]
            entry["baseline"] = _format_number(value)
        except (KeyError, IndexError, TypeError) as error:
            raise InputError(
                f"{path}: cannot rewrite the baseline of {(section, group, name)}: write it as "
                "NAME = { baseline = NUMBER, tolerance = NUMBER } under its [model.accuracy.OUTPUT] or "
                "[model.latency.METRIC] table"
            ) from error
    with atomic_output(path) as temporary:
        temporary.write_text(tomlkit.dumps(document), encoding="utf-8")
        reread = load_baselines(temporary)
        for (index, key), value in values.items():
            if not math.isclose(reread[index].baselines[key].value, _format_number(value)):
                raise InputError(f"{path}: rewriting the baselines went wrong at {key}; the file was left as it was")
