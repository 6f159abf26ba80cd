"""Compare a candidate model with its reference on the same inputs: errors, cosine and top-1 agreement per output.

The measures themselves live in :mod:`nmdeploy.fidelity`, which conversion (recovery, the fidelity budget) shares.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.fidelity import Metric, OutputComparison, metric_value
from nmdeploy.runtimes.data import RANDOM, load_batches, random_batches
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner
from nmdeploy.tables import render_table


@dataclass
class Comparison:
    outputs: list[OutputComparison]
    metric: float | None = None
    batches: int = 0


def compare_models(
    reference: str | Path, candidate: str | Path, data: str | Path, metric: Metric | None = None
) -> Comparison:
    """Run both models with ONNX Runtime on every batch of ``data`` (or ``"random"``) and compare their outputs."""
    with OnnxRuntimeRunner(reference) as ref_runner, OnnxRuntimeRunner(candidate) as cand_runner:
        ref_inputs = [spec.describe() for spec in ref_runner.inputs]
        cand_inputs = [spec.describe() for spec in cand_runner.inputs]
        if [(s.name, s.dtype) for s in ref_runner.inputs] != [(s.name, s.dtype) for s in cand_runner.inputs]:
            raise InputError(f"the two models have different inputs: {ref_inputs} vs {cand_inputs}")
        batches: Iterable[dict[str, np.ndarray]] = (
            random_batches(ref_runner.inputs) if str(data) == RANDOM else load_batches(data, ref_runner.inputs)
        )
        outputs = {name: OutputComparison(name) for name in ref_runner.output_names}
        metric_values: list[float] = []
        count = 0
        for feeds in batches:
            expected, actual = ref_runner.infer(feeds), cand_runner.infer(feeds)
            for name, comparison in outputs.items():
                if name not in actual:
                    raise InputError(f"the candidate has no output named '{name}'")
                comparison.add(expected[name], actual[name])
            if metric is not None:
                metric_values.append(metric_value(metric, expected, actual, feeds))
            count += 1
    return Comparison(list(outputs.values()), float(np.mean(metric_values)) if metric_values else None, count)


def comparison_table(outputs: Iterable[OutputComparison], *, samples: bool = True) -> str:
    """One row per compared output: errors, mean cosine and top-1 agreement (``-`` where not a classifier)."""
    columns = ("output", *(("samples",) if samples else ()), "max abs", "max rel", "cosine", "top-1")
    rows = [
        (
            output.name,
            *((output.samples,) if samples else ()),
            f"{output.max_abs_error:.3g}",
            f"{output.max_rel_error:.3g}",
            f"{output.mean_cosine:.5f}",
            None if output.top1_agreement is None else f"{output.top1_agreement:.4f}",
        )
        for output in outputs
    ]
    return render_table(columns, rows, right=columns[1:])
