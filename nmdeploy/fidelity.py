"""How close a candidate model's outputs are to a reference's: per-output errors, cosine and top-1 agreement, one
fidelity figure for a model, and user metrics (``module:function``).

Plain numpy on output arrays, below every layer that runs models, so that comparing models (``nmdeploy compare``),
recovery and the fidelity budget of a conversion all measure fidelity the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.imports import import_callable

Metric = Callable[[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]], float]
"""metric(reference_outputs, candidate_outputs, feeds) -> a number per batch; the report averages it."""


@dataclass
class OutputComparison:
    """How far one output of the candidate is from the reference's, over all compared samples."""

    name: str
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0  # |c - r| / max(|r|, 1e-3 * max|r|): relative, without blowing up near zero
    mean_cosine: float = 0.0  # per sample (first axis), flattened
    top1_agreement: float | None = None  # for classifier-like outputs (float, last axis >= 2)
    samples: int = 0
    _cosine_sum: float = field(default=0.0, repr=False)
    _top1_hits: int = field(default=0, repr=False)
    _top1_total: int = field(default=0, repr=False)

    def add(self, reference: np.ndarray, candidate: np.ndarray) -> None:
        if reference.shape != candidate.shape:
            raise InputError(
                f"output '{self.name}' has shape {list(candidate.shape)} in the candidate but "
                f"{list(reference.shape)} in the reference"
            )
        ref, cand = reference.astype(np.float64), candidate.astype(np.float64)
        for which, values in (("reference", ref), ("candidate", cand)):
            if not np.isfinite(values).all():
                raise InputError(
                    f"the {which} model's output '{self.name}' contains NaN or infinite values, so no error or "
                    f"cosine means anything; check that model's weights and the input data"
                )
        diff = np.abs(cand - ref)
        scale = np.abs(ref)
        floor = max(float(scale.max(initial=0.0)) * 1e-3, np.finfo(np.float32).tiny)
        self.max_abs_error = max(self.max_abs_error, float(diff.max(initial=0.0)))
        self.max_rel_error = max(self.max_rel_error, float((diff / np.maximum(scale, floor)).max(initial=0.0)))
        rows_ref = ref.reshape(len(ref), -1) if ref.ndim else ref.reshape(1, 1)
        rows_cand = cand.reshape(len(cand), -1) if cand.ndim else cand.reshape(1, 1)
        norms = np.linalg.norm(rows_ref, axis=1) * np.linalg.norm(rows_cand, axis=1)
        same = np.all(rows_ref == rows_cand, axis=1)
        cosine = np.where(norms > 0, (rows_ref * rows_cand).sum(axis=1) / np.where(norms > 0, norms, 1), same * 1.0)
        self._cosine_sum += float(cosine.sum())
        self.samples += len(rows_ref)
        self.mean_cosine = self._cosine_sum / self.samples
        if np.issubdtype(reference.dtype, np.floating) and reference.ndim >= 2 and reference.shape[-1] >= 2:
            hits = reference.argmax(axis=-1) == candidate.argmax(axis=-1)
            self._top1_hits += int(hits.sum())
            self._top1_total += hits.size
            self.top1_agreement = self._top1_hits / self._top1_total

    def as_dict(self) -> dict[str, float | int | str | None]:
        return {key: value for key, value in vars(self).items() if not key.startswith("_")}


FIDELITY_METRICS = ("cosine", "top1")
FidelityMetric = str | Metric
"""A model-fidelity measure: "cosine" (mean output cosine), "top1" (top-1 agreement) or a user Metric."""


def resolve_metric(spec: str) -> FidelityMetric:
    """``cosine``, ``top1``, or a ``module:function`` loaded by :func:`load_metric`."""
    return spec if spec in FIDELITY_METRICS else load_metric(spec)


def fidelity(
    batches: Iterable[tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]],
    metric: FidelityMetric = "cosine",
) -> float:
    """One figure for (reference outputs, candidate outputs, feeds) batches: 1.0 means the candidate is the reference.

    ``cosine`` averages :class:`OutputComparison`'s mean cosine over the outputs; ``top1`` its top-1 agreement over
    the classifier-like outputs; a user metric is averaged over the batches.
    """
    outputs: dict[str, OutputComparison] = {}
    values = []
    for expected, actual, feeds in batches:
        if callable(metric):
            values.append(metric_value(metric, expected, actual, feeds))
            continue
        for name, reference in expected.items():
            outputs.setdefault(name, OutputComparison(name)).add(reference, actual[name])
    if callable(metric):
        if not values:
            raise InputError("no batches to measure fidelity on")
        return float(np.mean(values))
    if metric == "cosine":
        return float(np.mean([output.mean_cosine for output in outputs.values()]))
    top1 = [output.top1_agreement for output in outputs.values() if output.top1_agreement is not None]
    if not top1:
        raise InputError("--metric top1 needs a classifier-like output (float, last axis >= 2); use cosine")
    return float(np.mean(top1))


def load_metric(spec: str) -> Metric:
    """Import ``module:function`` (a module importable from the current directory or the environment)."""
    return import_callable(spec, f"--metric {spec!r}", allow_classes=False)


def metric_value(metric: Metric, expected, actual, feeds) -> float:
    """The user's metric on one batch; anything but a finite number is an error naming the metric."""
    name = getattr(metric, "__qualname__", repr(metric))
    try:
        value = float(metric(expected, actual, feeds))
    except Exception as error:  # the metric is the user's code: its failure is their input, not our bug
        reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        raise InputError(
            f"--metric {name} failed ({type(error).__name__}: {reason}); it must take (reference_outputs, "
            f"candidate_outputs, feeds) and return a number"
        ) from error
    if not np.isfinite(value):
        raise InputError(f"--metric {name} returned {value}; it must return a finite number")
    return value
