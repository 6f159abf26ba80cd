"""How close a candidate model's outputs are to a reference's: which outputs are judged, per-output errors, cosine
and top-1 agreement, one fidelity figure for a model, and user metrics (``module:function``).

Plain numpy on output arrays, below every layer that runs models, so that comparing models (``nmdeploy compare``),
recovery and the fidelity budget of a conversion all measure fidelity the same way.

Per-sample cosine misleads on maps dominated by near-zero values (a text detector's probability map of a photo
without text: a tiny shift of the background is a new direction). Such outputs -- values in [0, 1], at least
:data:`NEAR_ZERO_SHARE` of them below :data:`NEAR_ZERO`, with spatial axes -- are judged by ``auto`` (the
conversion default) through the spread-normalised agreement 1 - MSE / (2 Var(reference)) over all samples, which
is the cosine for centred outputs whose norm is kept; ``mask-iou@T`` judges their thresholded masks instead.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nmdeploy.errors import InputError, first_line
from nmdeploy.imports import import_callable

Metric = Callable[[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]], float]
"""metric(reference_outputs, candidate_outputs, feeds) -> a number per batch; the report averages it."""


@dataclass(frozen=True)
class OutputSelection:
    """The outputs every fidelity figure judges, and why each other output is left out.

    Exports often return pass-throughs beside what the model computes (sentence-transformers: ``input_ids`` and
    ``attention_mask`` beside the embeddings). Such outputs match perfectly whatever the weights, so averaged in
    they make a damaged model look faithful, and an integer output cannot be trained toward.
    """

    judged: tuple[str, ...]
    left_out: dict[str, str] = field(default_factory=dict)  # output name -> why it is not judged
    # judged outputs that look like detection or segmentation maps -> their share of near-zero values (first batch)
    maps: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for reports: the judged outputs, then the others with their reasons, then the probability maps
        (which ``auto`` judges by their spread)."""
        line = "judged output" + ("s " if len(self.judged) > 1 else " ") + ", ".join(f"'{n}'" for n in self.judged)
        if self.left_out:
            line += "; left out: " + ", ".join(f"'{name}' ({why})" for name, why in self.left_out.items())
        if self.maps:
            shares = ", ".join(f"'{name}' ({100 * share:.0f} % below {NEAR_ZERO})" for name, share in self.maps.items())
            line += (
                f"; probability map{'s' if len(self.maps) > 1 else ''} {shares}: --metric auto judges "
                "spread-normalised agreement there (per-sample cosine measures background noise), mask-iou@T the "
                "thresholded masks"
            )
        return line

    def to_json(self) -> dict[str, object]:
        return {"judged": list(self.judged), "left_out": dict(self.left_out), "probability_maps": dict(self.maps)}


def background_share(array: np.ndarray) -> float | None:
    """The share of values below :data:`NEAR_ZERO` where ``array`` is a probability map (values in [0, 1] with
    spatial axes: [batch, ..., H, W]) at least :data:`NEAR_ZERO_SHARE` of whose values are background; else None."""
    array = np.asarray(array)
    if array.ndim < 3 or array.size == 0 or not is_float_array(array):
        return None
    values = array.astype(np.float32, copy=False)
    if values.min() < 0 or values.max() > 1:
        return None
    share = float((values < NEAR_ZERO).mean())
    return share if share >= NEAR_ZERO_SHARE else None


def is_float_array(array: np.ndarray) -> bool:
    """Floating point, bfloat16 and float8 (ml_dtypes) included."""
    return np.issubdtype(array.dtype, np.floating) or array.dtype.name.startswith(("bfloat16", "float8"))


def select_outputs(
    outputs: Mapping[str, np.ndarray],
    feeds: Mapping[str, np.ndarray],
    requested: Sequence[str] | None = None,
    *,
    required: bool = True,
) -> OutputSelection:
    """The outputs to judge, decided on one batch: ``requested`` (checked to exist), else every float output that
    is not an exact copy of an input. Nothing left to judge is an InputError that says how to choose, unless not
    ``required`` (a user metric judges instead, on every output)."""
    if requested:
        unknown = [name for name in requested if name not in outputs]
        if unknown:
            raise InputError(
                f"--outputs: the model has no output '{unknown[0]}'; its outputs are "
                + ", ".join(f"'{name}'" for name in outputs)
            )
        chosen = tuple(dict.fromkeys(requested))
        left_out = {name: "not chosen" for name in outputs if name not in chosen}
        return OutputSelection(chosen, left_out, _maps(outputs, chosen))
    judged, left_out = [], {}
    for name, array in outputs.items():
        array = np.asarray(array)
        copied = next(
            (
                feed
                for feed, values in feeds.items()
                if np.shape(values) == array.shape
                and np.asarray(values).dtype == array.dtype
                and np.array_equal(values, array)
            ),
            None,
        )
        if not is_float_array(array):
            left_out[name] = f"{array.dtype.name}, not a float output"
        elif copied is not None:
            left_out[name] = f"identical to input '{copied}'"
        else:
            judged.append(name)
    if not judged and required:
        reasons = "; ".join(f"'{name}': {why}" for name, why in left_out.items())
        raise InputError(f"no output to judge fidelity on ({reasons}); name the outputs to judge with --outputs")
    return OutputSelection(tuple(judged), left_out, _maps(outputs, judged))


def _maps(outputs: Mapping[str, np.ndarray], judged: Sequence[str]) -> dict[str, float]:
    shares = {name: background_share(outputs[name]) for name in judged}
    return {name: share for name, share in shares.items() if share is not None}


NEAR_ZERO = 0.05  # a probability below this is background
NEAR_ZERO_SHARE = 0.8  # a probability map with at least this share of background values is judged by its spread


@dataclass
class OutputComparison:
    """How far one output of the candidate is from the reference's, over all compared samples."""

    name: str
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0  # |c - r| / max(|r|, 1e-3 * max|r|): relative, without blowing up near zero
    mean_cosine: float = 0.0  # per sample (first axis), flattened
    top1_agreement: float | None = None  # for classifier-like outputs
    samples: int = 0
    # Whether top-1 agreement means anything here; None: any float output whose last axis has >= 2 entries.
    classifier: bool | None = field(default=None, repr=False)
    # Where given, the intersection over union of the masks reference > t and candidate > t is counted too.
    iou_threshold: float | None = field(default=None, repr=False)
    _cosine_sum: float = field(default=0.0, repr=False)
    _top1_hits: int = field(default=0, repr=False)
    _top1_total: int = field(default=0, repr=False)
    # Sums over every value of every sample: squared error, reference, reference squared; count, background count.
    _squared_error: float = field(default=0.0, repr=False)
    _reference_sum: float = field(default=0.0, repr=False)
    _reference_squares: float = field(default=0.0, repr=False)
    _values: int = field(default=0, repr=False)
    _background: int = field(default=0, repr=False)
    _unit_interval: bool = field(default=True, repr=False)
    _spatial: bool = field(default=True, repr=False)
    _intersection: int = field(default=0, repr=False)
    _union: int = field(default=0, repr=False)

    @property
    def spread_agreement(self) -> float:
        """1 - MSE / (2 Var(reference)) over all values: the cosine's scale, normalised by the dense output's spread
        across samples rather than by each sample's norm (1.0 for identical outputs, 0 for a constant reference that
        the candidate does not match)."""
        if not self._values:
            return 1.0
        mean = self._reference_sum / self._values
        variance = max(self._reference_squares / self._values - mean * mean, 0.0)
        error = self._squared_error / self._values
        if variance == 0.0:
            return 1.0 if error == 0.0 else 0.0
        return 1.0 - error / (2.0 * variance)

    @property
    def probability_map(self) -> bool:
        """Whether the reference looks like a detection or segmentation map: values in [0, 1] with spatial axes, at
        least :data:`NEAR_ZERO_SHARE` of them below :data:`NEAR_ZERO`."""
        return (
            self._values > 0
            and self._unit_interval
            and self._spatial
            and self._background >= NEAR_ZERO_SHARE * self._values
        )

    @property
    def background_share(self) -> float:
        return self._background / self._values if self._values else 0.0

    @property
    def mask_iou(self) -> float | None:
        """Intersection over union of the thresholded masks over all samples (1.0 when both are empty)."""
        if self.iou_threshold is None:
            return None
        return self._intersection / self._union if self._union else 1.0

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
        self._squared_error += float(np.square(cand - ref).sum())
        self._reference_sum += float(ref.sum())
        self._reference_squares += float(np.square(ref).sum())
        self._values += ref.size
        self._background += int((ref < NEAR_ZERO).sum())
        self._unit_interval &= bool(ref.size == 0 or (ref.min() >= 0 and ref.max() <= 1))
        self._spatial &= ref.ndim >= 3
        if self.iou_threshold is not None:
            dense, converted = ref > self.iou_threshold, cand > self.iou_threshold
            self._intersection += int(np.logical_and(dense, converted).sum())
            self._union += int(np.logical_or(dense, converted).sum())
        scores = is_float_array(reference) and reference.ndim >= 2 and reference.shape[-1] >= 2
        if scores and self.classifier is not False:
            hits = reference.argmax(axis=-1) == candidate.argmax(axis=-1)
            self._top1_hits += int(hits.sum())
            self._top1_total += hits.size
            self.top1_agreement = self._top1_hits / self._top1_total

    def as_dict(self) -> dict[str, float | int | str | None]:
        hidden = ("classifier", "iou_threshold")
        return {key: value for key, value in vars(self).items() if not key.startswith("_") and key not in hidden}


FIDELITY_METRICS = ("auto", "cosine", "spread", "top1", "mask-iou")
FidelityMetric = str | Metric
"""A model-fidelity measure: "auto" (cosine, and the spread-normalised agreement of probability maps), "cosine"
(mean output cosine), "spread" (the spread-normalised agreement of every output), "top1" (top-1 agreement),
"mask-iou@T" (IoU of the outputs thresholded at T; "mask-iou": T = 0.5) or a user Metric."""
DEFAULT_IOU_THRESHOLD = 0.5


def metric_threshold(metric: FidelityMetric) -> float | None:
    """The threshold of a ``mask-iou[@T]`` metric, None for any other."""
    if not isinstance(metric, str) or not metric.startswith("mask-iou"):
        return None
    if metric == "mask-iou":
        return DEFAULT_IOU_THRESHOLD
    return float(metric.removeprefix("mask-iou@"))


def is_builtin_metric(spec: str) -> bool:
    """Whether ``spec`` names a built-in measure (``mask-iou@T`` included) rather than a ``module:function``."""
    if spec in FIDELITY_METRICS:
        return True
    if not spec.startswith("mask-iou@"):
        return False
    try:
        value = float(spec.removeprefix("mask-iou@"))
    except ValueError:
        return False
    return bool(np.isfinite(value))


def check_min_fidelity(value: float, flag: str = "--min-fidelity") -> float:
    if not 0 < value <= 1:
        raise InputError(f"{flag} {value}: must be in (0, 1], e.g. 0.95")
    return value


def resolve_metric(spec: str) -> FidelityMetric:
    """A built-in measure (:data:`FIDELITY_METRICS`, ``mask-iou@T``), or a ``module:function`` loaded by
    :func:`load_metric`."""
    if spec.startswith("mask-iou@") and not is_builtin_metric(spec):
        raise InputError(f"--metric {spec}: the threshold after '@' must be a number, e.g. mask-iou@0.3")
    return spec if is_builtin_metric(spec) else load_metric(spec)


def output_figure(output: OutputComparison, metric: str = "auto") -> float:
    """One output's figure under a built-in ``metric`` other than ``top1``."""
    if metric == "auto":
        return output.spread_agreement if output.probability_map else output.mean_cosine
    if metric == "cosine":
        return output.mean_cosine
    if metric == "spread":
        return output.spread_agreement
    if output.mask_iou is None:
        raise InputError(f"output '{output.name}' was not compared with a mask threshold; use --metric mask-iou@T")
    return output.mask_iou


def measure_note(outputs: Sequence[OutputComparison], metric: FidelityMetric = "auto") -> str | None:
    """A line for reports where ``auto`` judged an output other than by its cosine, or ``cosine`` judged a
    probability map (whose per-sample cosine measures its background noise); None where there is nothing to say."""
    maps = [output for output in outputs if output.probability_map]
    if not maps or metric not in ("auto", "cosine"):
        return None
    names = ", ".join(f"'{output.name}' ({100 * output.background_share:.0f} % below {NEAR_ZERO})" for output in maps)
    if metric == "auto":
        return (
            f"probability map{'s' if len(maps) > 1 else ''} {names} judged by spread-normalised agreement, not "
            "per-sample cosine; --metric mask-iou@T judges the thresholded masks"
        )
    return (
        f"probability map{'s' if len(maps) > 1 else ''} {names}: per-sample cosine measures background noise; "
        "--metric auto (spread) or mask-iou@T judges them better"
    )


def metric_label(metric: FidelityMetric, selection: OutputSelection | None = None) -> str:
    """The measure's name for reports: ``auto`` is named by what it judged with (cosine where no judged output is a
    probability map, spread where all are), a user metric "custom"."""
    if not isinstance(metric, str):
        return "custom"
    if metric != "auto" or selection is None:
        return metric
    if not selection.maps:
        return "cosine"
    return "spread" if set(selection.maps) == set(selection.judged) else "auto"


def model_fidelity(outputs: Sequence[OutputComparison], metric: str = "cosine") -> float:
    """One figure over the judged outputs' comparisons: the mean of their figures under ``metric``
    (:func:`output_figure`), or for ``top1`` the mean top-1 agreement of those that are class scores."""
    if not outputs:
        raise InputError("no output was judged, so there is no fidelity figure; name the outputs with --outputs")
    if metric != "top1":
        return float(np.mean([output_figure(output, metric) for output in outputs]))
    top1 = [output.top1_agreement for output in outputs if output.top1_agreement is not None]
    if not top1:
        raise InputError("--metric top1 needs a class-score output (Softmax, or a final linear layer); use cosine")
    return float(np.mean(top1))


def fidelity(
    batches: Iterable[tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]],
    metric: FidelityMetric = "cosine",
    outputs: Sequence[str] | None = None,
    classifiers: Collection[str] | None = None,
) -> float:
    """One figure for (reference outputs, candidate outputs, feeds) batches: 1.0 means the candidate is the reference.

    Built-in measures are :func:`model_fidelity` over the judged ``outputs`` (None: those :func:`select_outputs`
    picks on the first batch), top-1 counted on the ``classifiers`` (the model's class-score outputs; None: any
    float output whose last axis has two or more entries); a user metric sees every output and is averaged over the
    batches.
    """
    compared: dict[str, OutputComparison] = {}
    values = []
    threshold = metric_threshold(metric)
    for expected, actual, feeds in batches:
        if callable(metric):
            values.append(metric_value(metric, expected, actual, feeds))
            continue
        if outputs is None:
            outputs = select_outputs(expected, feeds).judged
        for name in outputs:
            classifier = None if classifiers is None else name in classifiers
            comparison = compared.setdefault(
                name, OutputComparison(name, classifier=classifier, iou_threshold=threshold)
            )
            comparison.add(expected[name], actual[name])
    if callable(metric):
        if not values:
            raise InputError("no batches to measure fidelity on")
        return float(np.mean(values))
    return model_fidelity(list(compared.values()), metric)


def load_metric(spec: str) -> Metric:
    """Import ``module:function`` (a module importable from the current directory or the environment)."""
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
            f"candidate_outputs, feeds) and return a number"
        ) from error
    if not np.isfinite(value):
        raise InputError(f"--metric {name} returned {value}; it must return a finite number")
    return value
