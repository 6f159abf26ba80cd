"""Compare a candidate model with its reference on the same inputs: errors, cosine, spread and top-1 agreement per
judged output, each output's figure under the measure that judges it, and one fidelity figure.

The measures themselves live in :mod:`nmdeploy.fidelity`, which conversion (recovery, the fidelity budget) shares.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nmdeploy.calibration.batch_probe import run_or_first_row
from nmdeploy.errors import InputError
from nmdeploy.fidelity import FidelityMetric, Figure, Meter, OutputComparison, OutputSelection, model_figure
from nmdeploy.graph.batch_axes import graph_batch_axes
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.outputs import classifier_outputs, with_model_blank
from nmdeploy.runtimes.backends import DEFAULT_BACKEND, backend_named, open_runner
from nmdeploy.runtimes.base import Runner
from nmdeploy.runtimes.batch_axes import BatchAxes, model_batch_axes
from nmdeploy.runtimes.data import RANDOM, load_batches, random_batches
from nmdeploy.tables import render_table

ROW_BY_ROW = (
    "{models} declares a free batch size but runs only one row at a time (shapes inside it were fixed at export, "
    "e.g. traced from a batch-1 example): comparing row by row"
)
BATCH_REGRESSION = "the candidate {candidate} fails at batch {rows}, which the reference runs: {error}"
log = logging.getLogger(__name__)
PairedRun = tuple[dict, dict[str, np.ndarray], dict[str, np.ndarray]]  # the feeds, the reference's, the candidate's


@dataclass
class Comparison:
    """Per judged output, the candidate's distance from the reference and its figure under the measure;
    ``metric``: a user metric's mean."""

    outputs: list[OutputComparison]
    metric: float | None = None
    batches: int = 0
    selection: OutputSelection | None = None
    metric_name: str = "auto"  # the built-in measure's spec, or "custom" for a user metric (``metric`` its mean)
    figures: list[Figure] = field(default_factory=list)  # each judged output's figure under the measure
    batch_failure: str | None = None
    """Where the candidate fails at a batch size the reference runs (compared row by row after it), what failed:
    the candidate has regressed as a deployable model whatever its figures, so no verdict may pass it."""

    @property
    def fidelity(self) -> float:
        """The one figure ``--min-fidelity`` judges: the lowest judged output's figure, or the user metric's mean.
        A figure that cannot judge this data raises :class:`nmdeploy.fidelity.IllConditionedError`."""
        if self.metric_name == "custom":
            assert self.metric is not None
            return self.metric
        return model_figure(self.figures, self.metric_name)

    @property
    def unjudged(self) -> list[Figure]:
        """The figures the data cannot move (never PASSED)."""
        return [figure for figure in self.figures if figure.problem]


def compare_models(
    reference: str | Path,
    candidate: str | Path,
    data: str | Path,
    metric: FidelityMetric | None = None,
    outputs: Sequence[str] | None = None,
    *,
    backend: str = DEFAULT_BACKEND,
    device: str = "auto",
) -> Comparison:
    """Run both models on ``backend`` (ONNX Runtime by default) on every batch of ``data`` (or ``"random"``) and
    compare the judged outputs: ``outputs``, or by default every output that is not a copy of an input
    (:func:`select_outputs`), each by ``metric`` (default ``auto``: the measure that fits it). Top-1 agreement is
    reported for the reference's class-score outputs only; rows are counted along each output's batch axis. A user
    ``metric`` sees every output."""
    if backend_named(backend).runs != "onnx":
        raise InputError(f"compare runs .onnx models; --backend {backend} runs built engines, choose another backend")
    reference_proto = OnnxModel.load(reference).proto
    metric = with_model_blank("auto" if metric is None else metric, reference_proto)
    meter = Meter(
        metric, outputs, classifier_outputs(reference_proto), graph_batch_axes(reference_proto).named_output_axes()
    )
    with open_runner(backend, reference, device) as ref_runner, open_runner(backend, candidate, device) as cand_runner:
        ref_inputs = [spec.describe() for spec in ref_runner.inputs]
        cand_inputs = [spec.describe() for spec in cand_runner.inputs]
        if [(s.name, s.dtype) for s in ref_runner.inputs] != [(s.name, s.dtype) for s in cand_runner.inputs]:
            raise InputError(f"the two models have different inputs: {ref_inputs} vs {cand_inputs}")
        batches: Iterable[dict[str, np.ndarray]] = (
            random_batches(ref_runner.inputs, model=reference_proto)
            if str(data) == RANDOM
            else load_batches(data, ref_runner.inputs)
        )
        pairs = _PairedRuns(ref_runner, cand_runner, model_batch_axes(reference_proto), (reference, candidate))
        for feeds in batches:
            for piece, reference_outputs, candidate_outputs in pairs.run(feeds):
                meter.add(reference_outputs, candidate_outputs, piece)
    if meter.selection is None:
        raise InputError(f"{data}: no batches to compare on")
    return Comparison(
        list(meter.comparisons.values()),
        meter.value() if meter.user else None,
        meter.batches,
        meter.selection,
        "custom" if meter.user else str(metric),
        meter.figures(),
        pairs.batch_failure,
    )


class _PairedRuns:
    """Both models run on each batch, or on each of its rows once a batch of several rows fails where its first row
    runs: an export traced from a batch-1 example declares a free batch axis yet runs one row at a time. Each model is
    tried on the batch alone, so that a candidate failing at a batch the reference runs is told apart
    (``batch_failure``: compared row by row, never passed) from a pair that both run one row at a time."""

    def __init__(self, reference: Runner, candidate: Runner, axes: BatchAxes, paths: tuple[object, object]):
        self.reference, self.candidate, self.axes = reference, candidate, axes
        self.paths = paths
        self.row_by_row = False
        self.batch_failure: str | None = None

    def _both(self, feeds: dict[str, np.ndarray]) -> PairedRun:
        return feeds, self.reference.infer(feeds), self.candidate.infer(feeds)

    def _rows(self, feeds: dict[str, np.ndarray], start: int) -> list[PairedRun]:
        return [self._both(self.axes.take(feeds, slice(r, r + 1))) for r in range(start, self.axes.rows(feeds))]

    def run(self, feeds: dict[str, np.ndarray]) -> list[PairedRun]:
        if self.row_by_row:
            return self._rows(feeds, 0)
        reference = run_or_first_row(self.reference.infer, feeds, self.axes)
        candidate = run_or_first_row(self.candidate.infer, feeds, self.axes)
        if reference.failure is None and candidate.failure is None:
            return [(feeds, reference.result, candidate.result)]
        if reference.failure is None:
            self.batch_failure = BATCH_REGRESSION.format(
                candidate=self.paths[1], rows=self.axes.rows(feeds), error=candidate.failure
            )
            log.warning("%s: comparing row by row", self.batch_failure)
        else:
            roles = zip(("reference", "candidate"), self.paths, (reference, candidate), strict=True)
            failing = [f"the {role} {path}" for role, path, ran in roles if ran.failure is not None]
            models = failing[0] if len(failing) == 1 else f"each model ({' and '.join(failing)})"
            log.warning(ROW_BY_ROW.format(models=models))
        self.row_by_row = True
        return self._rows(feeds, 0)


def comparison_table(
    outputs: Iterable[OutputComparison], *, samples: bool = True, figures: Sequence[Figure] = ()
) -> str:
    """One row per compared output: rows, errors, mean cosine, spread, top-1 agreement where an output is class
    scores (the column is left out when none is), and the figure each output is judged by (``figures``)."""
    outputs = list(outputs)
    judged = {figure.output: figure for figure in figures}
    top1 = any(output.top1_agreement is not None for output in outputs)
    columns = (
        "output",
        *(("rows",) if samples else ()),
        "max abs",
        "max rel",
        "cosine",
        "spread",
        *(("top-1",) if top1 else ()),
        *(("judged by",) if judged else ()),
    )
    rows = [
        (
            output.name,
            *((output.samples,) if samples else ()),
            f"{output.max_abs_error:.3g}",
            *(
                (None, None, None)
                if output.integer
                else (  # labels: judged by agreement alone
                    f"{output.max_rel_error:.3g}",
                    f"{output.mean_cosine:.5f}",
                    f"{output.spread_agreement:.5f}",
                )
            ),
            *((None if output.top1_agreement is None else f"{output.top1_agreement:.4f}",) if top1 else ()),
            *((_judged(judged.get(output.name)),) if judged else ()),
        )
        for output in outputs
    ]
    return render_table(columns, rows, right=columns[1:])


def _judged(figure: Figure | None) -> str | None:
    if figure is None:
        return None
    text = f"{figure.metric} {figure.value:.5f}"
    return text + " (cannot judge)" if figure.problem else text
