"""Judging measured figures against their baselines, with each figure's direction and tolerance."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmdeploy.errors import InputError
from nmdeploy.evaluation.regress.schema import USER_METRIC, MetricKey, ModelBaselines, higher_is_better


@dataclass(frozen=True)
class Check:
    """One judged figure: its baseline, tolerance, the measured value and the verdict."""

    model: str
    key: MetricKey
    baseline: float
    tolerance: float
    measured: float | None
    higher_is_better: bool
    runs: tuple[float, ...] = ()  # the repeated measurements ``measured`` is the median of, if any
    failure: str | None = None  # why the pair fails whatever the figure (a candidate crashing where the reference runs)

    @property
    def label(self) -> str:
        section, group, metric = self.key
        return f"{group}.{metric}" if section == "accuracy" else f"{group}@batch{metric}"

    @property
    def status(self) -> str:
        """``regressed`` when worse than baseline by more than the tolerance (or not measured at all), ``improved``
        when better by more than it (a hint to --update), else ``ok``; always ``regressed`` with a ``failure``."""
        if self.failure is not None or self.measured is None or math.isnan(self.measured):
            return "regressed"
        gain = self.measured - self.baseline if self.higher_is_better else self.baseline - self.measured
        # A value exactly on the boundary as written in decimal passes, whatever binary rounding makes of it.
        slack = 1e-9 * max(1.0, abs(self.baseline))
        if gain < -self.tolerance - slack:
            return "regressed"
        return "improved" if gain > self.tolerance + slack else "ok"

    @property
    def description(self) -> str:
        """The judgement in one line, as a failure summary shows it: "m: mean_cosine of output 'logits' 0.91 <
        baseline 0.95 - 0.02" (the bound it crossed, or for a passing check the bound it kept)."""
        section, group, metric = self.key
        if self.key == USER_METRIC:
            figure = "accuracy metric.value (the model's metric)"
        elif section == "accuracy":
            figure = f"{metric} of output '{group}'"
            note = getattr(self.measured, "note", None)
            figure += f" ({note})" if note else ""
        else:
            figure = f"{group} at batch {metric}"
        if self.failure is not None:
            return f"{self.model}: {self.failure}"
        bound = f"baseline {self.baseline:.4g} {'-' if self.higher_is_better else '+'} {self.tolerance:.3g}"
        if self.measured is None or math.isnan(self.measured):
            return f"{self.model}: {figure} not measured ({bound})"
        if self.status == "regressed":
            relation = "<" if self.higher_is_better else ">"
        else:
            relation = ">=" if self.higher_is_better else "<="
        return f"{self.model}: {figure} {self.measured:.4g} {relation} {bound}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "check": f"{self.key[0]} {self.label}",
            "baseline": self.baseline,
            "tolerance": self.tolerance,
            "measured": self.measured,
            "better": "higher" if self.higher_is_better else "lower",
            "status": self.status,
            "runs": list(self.runs),
            "failure": self.failure,
        }


@dataclass
class RegressionReport:
    path: Path
    checks: list[Check]
    updated: bool = False
    created: bool = False  # a new file written from these measurements (regress --init, a pipeline's first run)

    @property
    def regressed(self) -> list[Check]:
        return [check for check in self.checks if check.status == "regressed"]

    @property
    def failure_summary(self) -> str:
        """Every regressed figure against its bound, in one line (a failure that regressed several figures, once)."""
        return "; ".join(dict.fromkeys(check.description for check in self.regressed))

    def as_dict(self) -> dict[str, Any]:
        return {
            "baselines": str(self.path),
            "updated": self.updated,
            "created": self.created,
            "regressed": len(self.regressed),
            "checks": [check.as_dict() for check in self.checks],
        }


def judge(model: ModelBaselines, measured: dict[MetricKey, float | None], source: Path | None = None) -> list[Check]:
    """One check per baseline of ``model``; an accuracy output the candidate does not produce, or one that compare
    judges and the file has no baseline for, is an input error (``source``: the file, named in it)."""
    outputs = list(dict.fromkeys(key[1] for key in measured if key[0] == "accuracy" and key != USER_METRIC))
    where = f"{source}: " if source is not None else ""
    checks = []
    for key, baseline in model.baselines.items():
        if key[0] == "accuracy" and key != USER_METRIC and key[1] not in outputs:
            raise InputError(
                f"{where}model '{model.name}': the model has no output '{key[1]}' that compare judges (it judges "
                f"{', '.join(repr(name) for name in outputs) or 'none'}); name the outputs to judge with "
                f"outputs = [...] in the entry"
            )
        figure = measured.get(key)
        failure = getattr(figure, "failure", None)
        problem = getattr(figure, "problem", None)
        if problem and failure is None:
            better = "spread_agreement" if key[2] == "mean_cosine" else "another figure"
            raise InputError(
                f"{where}model '{model.name}': accuracy.{key[1]}.{key[2]} cannot judge this output on this data: "
                f"{problem}; check {better} in the baselines file instead"
            )
        runs = getattr(figure, "runs", ())
        checks.append(
            Check(model.name, key, baseline.value, baseline.tolerance, figure, higher_is_better(key), runs, failure)
        )
    covered = {key[1] for key in model.baselines if key[0] == "accuracy" and key != USER_METRIC}
    uncovered = [name for name in outputs if name not in covered]
    if covered and uncovered:
        # Judging only the outputs the file lists would pass a candidate whose other judged outputs are garbage.
        raise InputError(
            f"{where}no baseline for output '{uncovered[0]}' of model '{model.name}', which compare judges: add "
            f'[model.accuracy."{uncovered[0]}"] (regress --init NEW.toml records every judged output), or '
            f"name the outputs to judge with outputs = [...] in the entry"
        )
    return checks
