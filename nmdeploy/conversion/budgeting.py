"""What both budgets share (:mod:`nmdeploy.conversion.budget`, 2:4 or dense per layer, and
:mod:`nmdeploy.conversion.precision_budget`, 2:4 and precision per layer): the held-out probe that measures a
candidate's fidelity in ONNX Runtime, the ``include`` pattern naming exactly the chosen layers, and the loop that
builds the chosen set, measures it and backs off while it falls short of the floor.

**Why a bound.** A fidelity measured on a few dozen held-out rows is itself an estimate: on a sentence encoder,
0.9797 on 24 held-out rows came out at 0.9666 on other text of the same kind. Each built set is therefore judged by
a lower confidence bound: the ``1 - BOUND_CONFIDENCE`` quantile of the fidelity recomputed on ``BOUND_RESAMPLES``
seeded bootstrap resamples of the held-out rows (rows drawn with replacement, each with its own inputs and outputs,
within each group of batches that can be joined). Recomputing the metric, not averaging per-row scores, serves
every metric alike, the user's and those judged across a batch. Below ``MIN_BOUND_ROWS`` rows no bound is worth
its name: the mean is used and the report says so. A figure that is a share of rows each agreeing or not (label
sequences, decoded strings) gets the exact binomial bound instead where that is lower: when every held-out row
agrees, so does every resample, and the bootstrap would promise 1.0 (on a captcha reader, every one of 10 held-out
strings kept, 12 % of strings changed on other captchas).
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx

from nmdeploy.errors import InputError
from nmdeploy.fidelity import FidelityMetric, Figure, measure, select_outputs
from nmdeploy.graph.batch_axes import graph_batch_axes
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.outputs import classifier_outputs, with_model_blank
from nmdeploy.runtimes.batch_axes import BatchAxes, model_batch_axes

Built = TypeVar("Built")
Triple = tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]  # dense, candidate, feeds

BOUND_CONFIDENCE = 0.95  # one-sided: the fidelity is at least the bound with this confidence
BOUND_RESAMPLES = 200
MIN_BOUND_ROWS = 10  # fewer held-out rows give no bound, only the mean
BOUND_SEED = 0


@dataclass(frozen=True)
class HeldOutEstimate:
    """A fidelity measured on held-out rows: the figure itself and its lower confidence bound (None: too few
    rows, or rows not found in the outputs, with the reason in ``note``)."""

    mean: float
    bound: float | None
    rows: int
    note: str = ""

    @property
    def judged(self) -> float:
        """What a floor is checked against: the bound where there is one."""
        return self.mean if self.bound is None else self.bound

    def describe(self) -> str:
        if self.bound is None:
            return f"{self.mean:.4f} ({self.note})"
        return f"{self.mean:.4f}, lower {BOUND_CONFIDENCE:.0%} bound {self.bound:.4f}"


def _groups(triples: Sequence[Triple], axes: BatchAxes) -> list[Triple]:
    """Consecutive held-out batches joined where their shapes allow (a bootstrap over more rows at once)."""
    groups: list[list[Triple]] = []
    for triple in triples:
        last = groups[-1][-1] if groups else None
        if last is not None and all(axes.joinable([a, b]) for a, b in zip(last, triple, strict=True)):
            groups[-1].append(triple)
        else:
            groups.append([triple])
    return [tuple(axes.join([t[part] for t in group]) for part in range(3)) for group in groups]  # type: ignore[misc]


def bootstrap_estimate(
    triples: Sequence[Triple],
    measure: Callable[[list[Triple]], float],
    axes: BatchAxes,
    *,
    seed: int = BOUND_SEED,
    resamples: int = BOUND_RESAMPLES,
    confidence: float = BOUND_CONFIDENCE,
    min_rows: int = MIN_BOUND_ROWS,
    mean: float | None = None,
) -> HeldOutEstimate:
    """``measure`` of the held-out ``triples`` (dense outputs, candidate outputs, feeds per batch) and its lower
    bound: the ``1 - confidence`` quantile of ``measure`` over seeded resamples of the rows (along ``axes``) with
    replacement, capped at the mean (a bound above the figure it bounds would say nothing); ``mean``, where the
    caller has measured it already."""
    mean = float(measure(list(triples))) if mean is None else mean
    rng = np.random.default_rng(seed)
    groups = _groups(triples, axes)
    try:
        counts = [axes.rows(dense) for dense, _, _ in groups]
        if counts != [axes.rows(feeds) for _, _, feeds in groups]:
            raise InputError("the outputs' rows are not the inputs'")
    except InputError:
        return _batch_bootstrap(triples, measure, rng, resamples, confidence, min_rows, mean)
    rows = sum(counts)
    if rows < min_rows:
        return HeldOutEstimate(mean, None, rows, f"no bound: {rows} held-out rows, fewer than {min_rows}")
    values = []
    for _ in range(resamples):
        sample = []
        for (dense, candidate, feeds), count in zip(groups, counts, strict=True):
            pick = rng.integers(0, count, count)
            sample.append((axes.take(dense, pick), axes.take(candidate, pick), axes.take(feeds, pick)))
        values.append(float(measure(sample)))
    return HeldOutEstimate(mean, min(mean, float(np.quantile(values, 1 - confidence))), rows)


def _batch_bootstrap(
    triples: Sequence[Triple],
    measure: Callable[[list[Triple]], float],
    rng: np.random.Generator,
    resamples: int,
    confidence: float,
    min_rows: int,
    mean: float,
) -> HeldOutEstimate:
    """The bound over whole held-out batches drawn with replacement, where the outputs' rows cannot be told apart
    (an output whose declared shape is not what the model returns, such as a time-major [T, B, C] declared [B, T]):
    a batch keeps its inputs and outputs together whatever their layout, so the resample stays sound, only coarser
    (a batch of one row, the common case for such models, is exactly a row)."""
    if len(triples) < min_rows:
        note = (
            f"no bound: the outputs' rows could not be matched to the inputs' and {len(triples)} held-out batches "
            f"are fewer than {min_rows} (give --batch-axis)"
        )
        return HeldOutEstimate(mean, None, 0, note)
    values = [
        float(measure([triples[i] for i in rng.integers(0, len(triples), len(triples))])) for _ in range(resamples)
    ]
    note = f"bound over {len(triples)} held-out batches: the outputs' rows could not be matched to the inputs'"
    return HeldOutEstimate(mean, min(mean, float(np.quantile(values, 1 - confidence))), len(triples), note)


def agreement_bound(agreeing: int, rows: int, confidence: float = BOUND_CONFIDENCE) -> float:
    """The exact (Clopper-Pearson) one-sided lower confidence bound of a share of ``rows`` that each agree or not,
    ``agreeing`` of them: the share p at which ``agreeing`` or more agreements have probability ``1 - confidence``.
    With every row agreeing it is ``(1 - confidence) ** (1 / rows)``: 0.74 on 10 rows, 0.95 only from 59."""
    if rows <= 0 or agreeing <= 0:
        return 0.0
    if agreeing >= rows:
        return float((1 - confidence) ** (1 / rows))
    terms = np.arange(agreeing, rows + 1)
    log_choose = np.array([math.lgamma(rows + 1) - math.lgamma(k + 1) - math.lgamma(rows - k + 1) for k in terms])

    def tail(share: float) -> float:  # P(at least ``agreeing`` of ``rows`` agree | share)
        return float(np.exp(log_choose + terms * math.log(share) + (rows - terms) * math.log1p(-share)).sum())

    low, high = 0.0, agreeing / rows  # the tail grows with the share: bisect for tail(share) = 1 - confidence
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if tail(middle) < 1 - confidence else (low, middle)
    return low


def with_agreement_bounds(estimate: HeldOutEstimate, figures: Sequence[Figure]) -> HeldOutEstimate:
    """``estimate`` with its bound lowered to the exact bound of every figure that is a share of agreeing rows
    (:func:`agreement_bound`), where the bootstrap gave one."""
    shares = [figure.agreeing for figure in figures if figure.agreeing is not None]
    if estimate.bound is None or not shares:
        return estimate
    exact = min(agreement_bound(agreeing, rows) for agreeing, rows in shares)
    if exact >= estimate.bound:
        return estimate
    agreeing, rows = min(shares, key=lambda share: agreement_bound(*share))
    note = f"the exact bound of {agreeing} of {rows} rows agreeing" + (f"; {estimate.note}" if estimate.note else "")
    return HeldOutEstimate(estimate.mean, exact, estimate.rows, note)


def exact_names(names: Sequence[str]) -> str:
    """The ``include`` regular expression that selects exactly the weights ``names``."""
    return "^(" + "|".join(re.escape(name) for name in names) + ")$"


class HeldOutProbe:
    """ONNX Runtime on one copy of the dense model whose candidate weights ``names`` are overridable inputs: the
    dense outputs on the held-out ``batches`` once, then any candidate's fidelity to them (weights swapped in by
    :meth:`measure`, or a whole model by :meth:`measure_model`)."""

    def __init__(
        self,
        model: OnnxModel,
        names: Sequence[str],
        batches: list[dict[str, np.ndarray]],
        folder: Path,
        outputs: Sequence[str] | None = None,
        user_metric: bool = False,
        axes: BatchAxes | None = None,
    ):
        from nmdeploy.runtimes.backends import open_runner

        probe = copy.deepcopy(model)
        graph = probe.proto.graph
        # Weights held by Constant nodes become initializers of the same name, so that they can be fed too.
        for node in [n for n in graph.node if n.op_type == "Constant" and n.output[0] in names]:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                tensor = onnx.TensorProto()
                tensor.CopyFrom(value)
                tensor.name = node.output[0]
                graph.initializer.append(tensor)
                graph.node.remove(node)
        initializers = {t.name: t for t in graph.initializer}
        listed = {value.name for value in graph.input}
        for name in names:
            if name not in listed:
                tensor = initializers[name]
                graph.input.append(onnx.helper.make_tensor_value_info(name, tensor.data_type, list(tensor.dims)))
        self.batches = batches
        self.runner = open_runner("ort", probe.save(folder / "probe.onnx")).__enter__()
        self.dense = [self.runner.infer(batch) for batch in batches]
        self.selection = select_outputs(self.dense[0], batches[0], outputs, required=not user_metric)
        self.classifiers = classifier_outputs(model.proto)
        self.batch_axes = graph_batch_axes(model.proto).named_output_axes()
        self.model = model.proto
        self.figures: list[Figure] = []  # each judged output's figure in the last measurement
        # The data's axes for the inputs (``--batch-axis`` included), the graph's for the outputs.
        self.axes = BatchAxes({**model_batch_axes(model.proto).axes, **(axes.axes if axes else {})})

    def _fidelity(self, candidates: list[dict[str, np.ndarray]], metric: FidelityMetric) -> float:
        return self._estimate(candidates, metric, bound=False).mean

    def _measure(self, triples: Sequence[Triple], metric: FidelityMetric) -> tuple[float, list[Figure]]:
        meter = measure(triples, metric, self.selection.judged, self.classifiers, self.batch_axes)
        return meter.value(), meter.figures()

    def _estimate(
        self, candidates: list[dict[str, np.ndarray]], metric: FidelityMetric, bound: bool
    ) -> HeldOutEstimate:
        metric = with_model_blank(metric, self.model)
        # Only what is judged is resampled: a user metric sees every output, a built-in one the judged outputs.
        kept = None if callable(metric) else set(self.selection.judged)
        triples = [
            ({k: v for k, v in dense.items() if kept is None or k in kept},
             {k: v for k, v in candidate.items() if kept is None or k in kept}, feeds)
            for dense, candidate, feeds in zip(self.dense, candidates, self.batches, strict=True)
        ]  # fmt: skip
        value, self.figures = self._measure(triples, metric)
        if not bound:
            return HeldOutEstimate(value, None, 0, "no bound asked")
        estimate = bootstrap_estimate(triples, lambda sample: self._measure(sample, metric)[0], self.axes, mean=value)
        return with_agreement_bounds(estimate, self.figures)

    def measure(self, overrides: dict[str, np.ndarray], metric: FidelityMetric) -> float:
        """Fidelity of the dense model with the weights ``overrides`` swapped in."""
        return self._fidelity([self.runner.infer({**batch, **overrides}) for batch in self.batches], metric)

    def measure_model(self, path: Path, metric: FidelityMetric) -> float:
        """Fidelity of the model saved at ``path``."""
        return self.estimate_model(path, metric, bound=False).mean

    def estimate_model(self, path: Path, metric: FidelityMetric, bound: bool = True) -> HeldOutEstimate:
        """Fidelity of the model saved at ``path`` and, with ``bound``, its lower confidence bound
        (:func:`bootstrap_estimate`)."""
        from nmdeploy.runtimes.backends import open_runner

        with open_runner("ort", path) as runner:
            candidates = [runner.infer(batch) for batch in self.batches]
        return self._estimate(candidates, metric, bound)


def verify_and_back_off(
    build: Callable[[], Built],
    measure: Callable[[Built], HeldOutEstimate],
    back_off: Callable[[float], bool],
    describe: Callable[[], dict[str, Any]],
    min_fidelity: float,
) -> tuple[Built, HeldOutEstimate, list[dict[str, Any]]]:
    """Build the chosen set (``build``), measure it, and while its judged figure (the lower bound where there is
    one) falls short of ``min_fidelity`` let ``back_off`` undo upgrades and build again; ``back_off`` gets the
    judged figure and returns False when nothing is left to try. Returns the last build, its estimate and every
    attempt (``describe()`` of the set built, with its ``fidelity`` and ``bound``); the caller judges a last build
    still below the floor."""
    attempts: list[dict[str, Any]] = []
    while True:
        built = build()
        estimate = measure(built)
        attempts.append({**describe(), "fidelity": estimate.mean, "bound": estimate.bound})
        if estimate.judged >= min_fidelity or not back_off(estimate.judged):
            return built, estimate, attempts
