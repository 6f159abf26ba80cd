"""The table of built-in measures, each registered by a decorator with its name, help and option (``NAME@OPTION``),
and users' ``module:function`` metrics.

A built-in measure is either an output measure (a function of one output's :class:`OutputComparison` and the
option, giving its :class:`Figure`) or a task measure (a class that sees each batch's reference outputs, candidate
outputs and feeds, and gives one figure per output it judges).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nmdeploy.errors import InputError, first_line
from nmdeploy.fidelity.comparison import Figure
from nmdeploy.imports import import_callable
from nmdeploy.registry import Registry

Metric = Callable[[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]], float]
"""metric(reference_outputs, candidate_outputs, feeds) -> a number per batch; the report averages it. Each argument
is a dict of output (or input) name -> numpy array, one batch of rows."""

FidelityMetric = str | Metric
"""A built-in measure's spec (``"auto"``, ``"mask-iou@0.3"``, ``"ctc@0"``: see :data:`METRICS`) or a user Metric."""


class TaskMetric:
    """A measure that judges whole outputs of a task (decoded strings, next-token predictions): it sees every batch
    with its feeds and gives one :class:`Figure` per output it judges."""

    def __init__(self, outputs: Sequence[str], option: Any) -> None:
        self.outputs = tuple(outputs)
        self.option = option

    def add(
        self,
        reference: Mapping[str, np.ndarray],
        candidate: Mapping[str, np.ndarray],
        feeds: Mapping[str, np.ndarray],
        axes: Mapping[str, int],
    ) -> None:
        raise NotImplementedError

    def figures(self) -> list[Figure]:
        raise NotImplementedError


@dataclass(frozen=True)
class MetricEntry:
    """One registered measure: ``option`` names what may follow ``@`` (None: nothing), ``parse`` checks it."""

    name: str
    help: str
    judge: Any  # an output measure's function, or a TaskMetric class
    option: str | None = None
    default: Any = None
    parse: Callable[[str], Any] | None = None

    @property
    def task(self) -> bool:
        return isinstance(self.judge, type)

    def usage(self) -> str:
        return f"{self.name}[@{self.option}]" if self.option else self.name


METRICS: Registry[MetricEntry] = Registry("metric")
"""Name -> the entry of each built-in measure (:mod:`nmdeploy.registry`; the member is its :class:`MetricEntry`)."""


def metric(name: str, *, help: str, option: str | None = None, default: Any = None, parse=None):
    """Register a measure under ``name`` (the one registry style: name, help, options): an output measure
    ``(comparison, option) -> Figure`` or a :class:`TaskMetric` subclass; ``option`` names what may follow ``@``."""

    def register(target):
        entry = MetricEntry(name, help, target, option, default, parse)
        METRICS.register(name, help=help, option=option, default=default, parse=parse)(entry)
        return target

    return register


def parse_spec(spec: str) -> tuple[MetricEntry, Any] | None:
    """The registered measure ``spec`` names and its parsed option; None where ``spec`` names none (a
    ``module:function`` then). A bad option is an InputError."""
    name, at, text = spec.partition("@")
    entry = METRICS.get(name)
    if entry is None:
        return None
    if not at:
        return entry, entry.default
    if entry.option is None:
        raise InputError(f"--metric {spec}: {name} takes no option after '@'")
    try:
        return entry, entry.parse(text) if entry.parse else text
    except ValueError as error:
        raise InputError(f"--metric {spec}: {error}") from None


def is_builtin_metric(spec: str) -> bool:
    """Whether ``spec`` names a built-in measure (with a valid option) rather than a ``module:function``."""
    try:
        return parse_spec(spec) is not None
    except InputError:
        return False


def resolve_metric(spec: str) -> FidelityMetric:
    """A built-in measure's spec (checked), or a ``module:function`` loaded by :func:`load_metric`."""
    return spec if parse_spec(spec) is not None else load_metric(spec)


def load_metric(spec: str) -> Metric:
    """Import ``module:function`` (a module importable from the current directory or the environment)."""
    if ":" not in spec:
        known = ", ".join(entry.usage() for entry in METRICS.values())
        raise InputError(
            f"--metric {spec!r} must look like 'package.module:function' or be a built-in measure ({known})"
        )
    return import_callable(spec, f"--metric {spec!r}", allow_classes=False)


def metric_value(metric: Metric, expected, actual, feeds) -> float:
    """The user's metric on one batch; anything but a finite number is an error naming the metric."""
    name = getattr(metric, "__qualname__", repr(metric))
    try:
        value = float(metric(expected, actual, feeds))
    except Exception as error:  # the metric is the user's code: its failure is their input, not our bug
        reason = first_line(error, 200)
        raise InputError(
            f"--metric {name} failed ({type(error).__name__}: {reason}); it must take (reference_outputs, "
            f"candidate_outputs, feeds), each a dict of name -> numpy array, and return a number"
        ) from error
    if not np.isfinite(value):
        raise InputError(f"--metric {name} returned {value}; it must return a finite number")
    return value


def check_min_fidelity(value: float, flag: str = "--min-fidelity") -> float:
    if not 0 < value <= 1:
        raise InputError(f"{flag} {value}: must be in (0, 1], e.g. 0.95")
    return value


def metrics_help() -> str:
    """Every built-in measure with its help, for ``--metric``'s help."""
    return "; ".join(f"{entry.usage()}: {entry.help}" for entry in METRICS.values())
