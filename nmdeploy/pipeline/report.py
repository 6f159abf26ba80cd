"""What the pipeline measured, as typed reports, and their JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nmdeploy.evaluation.compare import Comparison
from nmdeploy.evaluation.regress import RegressionReport
from nmdeploy.fidelity import metric_label
from nmdeploy.files import write_atomically


@dataclass
class ModelReport:
    """What the pipeline measured for one model; ``regression`` decides whether it passed."""

    name: str
    folder: Path
    weights: int
    converted: int
    compliant: int  # prunable weights that are 2:4 after conversion
    parameters_compliant: int
    parameters: int
    comparison: dict[str, Any]  # converted vs dense over the judged outputs (judged_figures)
    cast_comparison: dict[str, Any]  # fp16 vs fp32 converted, the same figures
    cast_note: str | None
    latency_ratios: dict[int, float]  # batch size -> p50 latency converted / dense on ONNX Runtime
    task_accuracy: dict[str, float] | None  # dense / converted / cast top-1 on held-out labels, where there are labels
    regression: RegressionReport
    engine: dict[str, Any]  # {"skipped": reason} or the engine report summary
    seconds: dict[str, float] = field(default_factory=dict)
    quantization: dict[str, Any] | None = None  # --precision int8/fp8: the quantize step's summary and comparison

    @property
    def passed(self) -> bool:
        return not self.regression.regressed

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "folder": str(self.folder),
            "passed": self.passed,
            "weights": self.weights,
            "converted": self.converted,
            "compliant": self.compliant,
            "parameters_compliant": self.parameters_compliant,
            "parameters": self.parameters,
            "comparison": self.comparison,
            "cast_comparison": self.cast_comparison,
            "cast_note": self.cast_note,
            "ort_p50_ratio": {str(batch): ratio for batch, ratio in self.latency_ratios.items()},
            "task_accuracy": self.task_accuracy,
            "regression": self.regression.as_dict(),
            "engine": self.engine,
            "seconds": self.seconds,
            "quantization": self.quantization,
        }


@dataclass
class PipelineReport:
    out_dir: Path
    models: list[ModelReport]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(model.passed for model in self.models)

    def as_dict(self) -> dict[str, Any]:
        return {
            "out_dir": str(self.out_dir),
            "passed": self.passed,
            "seconds": self.seconds,
            "models": [model.as_dict() for model in self.models],
        }


def comparison_dict(comparison: Comparison) -> dict[str, Any]:
    return {
        "batches": comparison.batches,
        "metric": comparison.metric,
        "outputs_judged": comparison.selection.to_json() if comparison.selection else None,
        "outputs": [output.as_dict() for output in comparison.outputs],
    }


def judged_figures(comparison: Comparison | None) -> dict[str, Any]:
    """One row's figures over the judged outputs: each output's figure under the measure that fits it (``auto``)
    and the lowest of them (``fidelity``; None where one cannot judge the data), mean cosine, the lowest top-1
    agreement of the class-score outputs (None where there are none), the largest absolute error, and which
    outputs they cover."""
    if comparison is None or not comparison.outputs:
        return {}
    top1 = [output.top1_agreement for output in comparison.outputs if output.top1_agreement is not None]
    figures = [output.auto_figure() for output in comparison.outputs]
    judged = not any(figure.problem for figure in figures)
    return {
        "outputs": [output.name for output in comparison.outputs],
        "judged": [figure.to_json() for figure in figures],
        "fidelity": min(figure.value for figure in figures) if judged else None,
        "fidelity_metric": metric_label("auto", comparison.selection, figures),
        "mean_cosine": _mean([output.mean_cosine for output in comparison.outputs if not output.integer]),
        "top1_agreement": min(top1) if top1 else None,
        "max_abs_error": max(output.max_abs_error for output in comparison.outputs),
    }


def write_json(path: Path, document: Any) -> Path:
    return write_atomically(path, json.dumps(document, indent=2, default=json_value) + "\n")


def json_value(value: Any) -> Any:
    """JSON for what reports hold besides plain types: paths, numpy scalars and arrays, tuples of them."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    return str(value)


def _mean(values: list[float]) -> float | None:
    """The mean, None where there is nothing to average (every judged output integer)."""
    return float(np.mean(values)) if values else None
