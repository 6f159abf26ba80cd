"""Compare a candidate model with its reference on the same inputs: errors, cosine and top-1 agreement per judged
output, and one fidelity figure.

The measures themselves live in :mod:`nmdeploy.fidelity`, which conversion (recovery, the fidelity budget) shares.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.fidelity import (
    FidelityMetric,
    OutputComparison,
    OutputSelection,
    metric_value,
    model_fidelity,
    select_outputs,
)
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.outputs import classifier_outputs
from nmdeploy.runtimes.backends import DEFAULT_BACKEND, backend_named, open_runner
from nmdeploy.runtimes.data import RANDOM, load_batches, random_batches
from nmdeploy.tables import render_table


@dataclass
class Comparison:
    """Per judged output, the candidate's distance from the reference; ``metric``: a user metric's mean."""

    outputs: list[OutputComparison]
    metric: float | None = None
    batches: int = 0
    selection: OutputSelection | None = None
    metric_name: str = "cosine"  # "cosine", "top1", or "custom" for a user metric (then ``metric`` holds its mean)

    @property
    def fidelity(self) -> float:
        """The one figure ``--min-fidelity`` judges: mean cosine (or top-1 agreement) over the judged outputs, or the
        user metric's mean."""
        if self.metric_name == "custom":
            assert self.metric is not None
            return self.metric
        return model_fidelity(self.outputs, self.metric_name)


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
    compare the judged outputs: ``outputs``, or by default every float output that is not a copy of an input
    (:func:`select_outputs`). Top-1 agreement is reported for the reference's class-score outputs only. A user
    ``metric`` sees every output."""
    if backend_named(backend).runs != "onnx":
        raise InputError(f"compare runs .onnx models; --backend {backend} runs built engines, choose another backend")
    reference_proto = OnnxModel.load(reference).proto
    classifiers = classifier_outputs(reference_proto)
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
        selection: OutputSelection | None = None
        compared: dict[str, OutputComparison] = {}
        metric_values: list[float] = []
        count = 0
        for feeds in batches:
            expected, actual = ref_runner.infer(feeds), cand_runner.infer(feeds)
            if selection is None:
                selection = select_outputs(expected, feeds, outputs, required=not callable(metric))
                missing = [name for name in selection.judged if name not in actual]
                if missing:
                    raise InputError(f"the candidate has no output named '{missing[0]}'")
                compared = {name: OutputComparison(name, classifier=name in classifiers) for name in selection.judged}
            for name, comparison in compared.items():
                comparison.add(expected[name], actual[name])
            if callable(metric):
                metric_values.append(metric_value(metric, expected, actual, feeds))
            count += 1
    if selection is None:
        raise InputError(f"{data}: no batches to compare on")
    return Comparison(
        list(compared.values()),
        float(np.mean(metric_values)) if metric_values else None,
        count,
        selection,
        metric if isinstance(metric, str) else "custom" if metric is not None else "cosine",
    )


def comparison_table(outputs: Iterable[OutputComparison], *, samples: bool = True) -> str:
    """One row per compared output: errors, mean cosine and, where an output is class scores, top-1 agreement (the
    column is left out when none is)."""
    outputs = list(outputs)
    top1 = any(output.top1_agreement is not None for output in outputs)
    columns = (
        "output",
        *(("samples",) if samples else ()),
        "max abs",
        "max rel",
        "cosine",
        *(("top-1",) if top1 else ()),
    )
    rows = [
        (
            output.name,
            *((output.samples,) if samples else ()),
            f"{output.max_abs_error:.3g}",
            f"{output.max_rel_error:.3g}",
            f"{output.mean_cosine:.5f}",
            *((None if output.top1_agreement is None else f"{output.top1_agreement:.4f}",) if top1 else ()),
        )
        for output in outputs
    ]
    return render_table(columns, rows, right=columns[1:])
