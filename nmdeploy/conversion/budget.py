"""A fidelity budget for conversion: as much 2:4 as the accuracy allows.

Each candidate layer's sensitivity is measured on the held-out split of the calibration data: the fidelity lost
when it alone is converted (fitted on the training split, as a whole-model parallel fit does, since a layer alone
sees dense inputs). The layers to convert are chosen to maximise the parameters TensorRT will run sparse, large
layers (both channel counts >= 256, where sparse kernels usually win) counting four times as much as small ones,
while the sum of the chosen sensitivities keeps the predicted fidelity >= the floor. The chosen set is then
converted for real (sequentially and with recovery when asked) and measured; while it falls short, the layers
that buy the least per unit of fidelity are backed off and the conversion repeated. Every fidelity reported is one
measured in ONNX Runtime on the held-out split, and the chosen set is judged by the lower confidence bound of its
fidelity (:mod:`nmdeploy.conversion.budgeting`), not by the figure alone.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from nmdeploy.calibration.data import CalibrationData, CalibrationSplit, SplitSettings
from nmdeploy.conversion.budgeting import BOUND_CONFIDENCE, HeldOutProbe, exact_names, verify_and_back_off
from nmdeploy.conversion.recovery import RecoveryOptions
from nmdeploy.errors import InputError
from nmdeploy.fidelity import Figure, OutputSelection, metric_label
from nmdeploy.files import private_temporary_folder
from nmdeploy.graph.eligibility import WIN_CHANNELS, gemm_channels, tensorrt_verdict
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.prunable import PrunableWeight
from nmdeploy.graph.trainable import stored_tensors
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.masks.pattern import Pattern
from nmdeploy.passes.base import PassResult
from nmdeploy.passes.convert import ConvertOptions, ConvertPass
from nmdeploy.passes.prune import select_weights
from nmdeploy.rows import ReportRow


class BudgetedOptions(Protocol):
    """What the budget needs of the conversion it runs: the fit's options and the budget's (``min_fidelity``,
    ``metric``, ``outputs``, ``recover``, ``include``, ``exclude``), replaceable as a dataclass's."""

    pattern: Pattern
    min_fidelity: float | None
    metric: Any
    outputs: tuple[str, ...] | None
    recover: RecoveryOptions | None
    include: str | None
    exclude: str | None

    def fit_options(self, **changes: Any) -> ConvertOptions: ...


class FitAndRecover(Protocol):
    """How the budget converts a chosen set: fit ``model`` in place on the training rows of ``split`` (and recover,
    when asked)."""

    def __call__(
        self, model: OnnxModel, options: Any, data: CalibrationData, split: CalibrationSplit
    ) -> PassResult: ...


SMALL_WEIGHT = 0.25  # value of a parameter in a layer too narrow for sparse kernels to usually win
TOO_SMALL = 64  # below this many input or output channels a layer is never worth its fidelity


@dataclass
class LayerDecision:
    """One weight's outcome under the budget."""

    weight: str
    parameters: int
    converted: bool
    reason: str  # "converted", "budget", "not eligible: ...", "too small to win: ...", "not convertible: ..."
    sensitivity: float | None = None  # fidelity lost when this layer alone is converted (held-out, measured)
    large: bool = False  # both channel counts >= 256

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BudgetReport(ReportRow):
    """The budget's outcome, the last row of a conversion with ``min_fidelity``: the measured fidelity of exactly the
    converted set and every layer's decision."""

    step: str = field(default="budget", init=False)
    min_fidelity: float = 0.0
    metric: str = "auto"
    fidelity: float = 0.0  # measured on the held-out split for exactly the converted set
    fidelity_bound: float | None = None  # its lower confidence bound, what the floor was checked against
    bound_note: str = ""  # why there is no bound, or what it was drawn over where not rows
    held_out_rows: int = 0
    pattern: str = "2:4"  # the pattern the converted layers were given
    layers: list[LayerDecision] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)  # each verified set: layers, measured fidelity
    outputs: OutputSelection | None = None  # the outputs every figure judged
    judged: list[Figure] = field(default_factory=list)  # each judged output's figure for the converted set

    @property
    def converted_parameters(self) -> int:
        return sum(row.parameters for row in self.layers if row.converted)

    @property
    def eligible_parameters(self) -> int:
        return sum(row.parameters for row in self.layers if not row.reason.startswith(("not eligible", "not conv")))

    def to_json(self) -> dict[str, Any]:
        return {
            "min_fidelity": self.min_fidelity,
            "metric": self.metric,
            "fidelity": self.fidelity,
            "fidelity_bound": self.fidelity_bound,
            "bound_confidence": BOUND_CONFIDENCE,
            "bound_note": self.bound_note,
            "held_out_rows": self.held_out_rows,
            "pattern": self.pattern,
            "outputs": self.outputs.to_json() if self.outputs else None,
            "judged": [figure.to_json() for figure in self.judged],
            "converted_parameters": self.converted_parameters,
            "eligible_parameters": self.eligible_parameters,
            "attempts": self.attempts,
            "layers": [row.to_json() for row in self.layers],
        }


def _parameters(weight: PrunableWeight) -> int:
    return int(np.prod(weight.shape, dtype=np.int64))


def _drop_skipped(
    weights: list[PrunableWeight], report: Sequence[ReportRow], decisions: dict[str, LayerDecision]
) -> list[PrunableWeight]:
    """``weights`` less those the conversion ``report`` skipped, whose decisions then give the reason."""
    skipped = {row.weight: row.skipped for row in report if getattr(row, "step", None) == "convert" and row.skipped}
    for weight in weights:
        if weight.name in skipped:
            decisions[weight.name].reason = f"not convertible: {skipped[weight.name]}"
    return [weight for weight in weights if weight.name not in skipped]


def _last_set(built: list[str], best: str, tried: int) -> str:
    """The last set the budget built, as its refusal names it."""
    named = "it" if built == [best] else f"'{built[0]}'" if len(built) == 1 else f"a set of {len(built)} layers"
    return named + (f" (the last of {tried} sets tried)" if tried > 1 else "")


def _adopt(model: OnnxModel, converted: OnnxModel) -> None:
    """Write into ``model`` every stored tensor of the main graph that ``converted`` (a copy of it) changed."""
    targets = stored_tensors(model.proto)
    for name, tensor in stored_tensors(converted.proto).items():
        values = converted.read(tensor)
        if not np.array_equal(model.read(targets[name]), values):
            model.write(targets[name], np.asarray(values))


def convert_within_budget(
    options: BudgetedOptions, model: OnnxModel, data: CalibrationData, fit_and_recover: FitAndRecover
) -> PassResult:
    """Convert, in place, the layers of ``model`` that keep held-out fidelity >= ``options.min_fidelity``.

    Every fit and measurement reads ``data``'s one fit / held-out split; the probe is the fit alone, the chosen set
    goes through ``fit_and_recover``. The report is the accepted conversion's rows and a :class:`BudgetReport` last.
    """
    fitter = ConvertPass(options.fit_options())  # the fit's skip rule and pattern
    min_fidelity, metric, recover = options.min_fidelity, options.metric, options.recover
    outputs = options.outputs or (recover.outputs if recover is not None else None)
    # Every inner conversion fits on the one split's training rows, with no budget of its own.
    inner = replace(
        options, calibration=data, min_fidelity=None, include=None, exclude=None, recover=None, held_out=None
    )
    decisions: dict[str, LayerDecision] = {}
    candidates: list[PrunableWeight] = []
    for weight in select_weights(find_prunable_weights(model.proto).weights, options.include, options.exclude):
        decision = LayerDecision(weight.name, _parameters(weight), False, "")
        decisions[weight.name] = decision
        skipped = fitter.skip_reason(weight)
        verdict = tensorrt_verdict(weight, fitter.pattern)
        if skipped or weight.uncalibrated:
            decision.reason = f"not convertible: {skipped or weight.uncalibrated}"
            continue
        if not verdict.eligible:
            decision.reason = f"not eligible: {'; '.join(verdict.reasons)}"
            continue
        reduction, channels = gemm_channels(weight)
        decision.large = min(reduction, channels) >= WIN_CHANNELS
        if min(reduction, channels) < TOO_SMALL:
            decision.reason = f"too small to win: reduction {reduction}, outputs {channels}"
            continue
        candidates.append(weight)
    if not candidates:  # each reason whole, with its count: "too small" is not why a weight inside an If stays dense
        reasons = Counter(decision.reason for decision in decisions.values()).most_common()
        said = "; ".join(f"{count} weight{'s' * (count > 1)} {reason}" for reason, count in reasons[:6])
        raise InputError(f"nothing to convert: no weight the budget can convert ({said or 'the model has none'})")

    # The one split every fit and measurement reads: recovery's, when the conversion recovers, else the defaults.
    split = data.split(recover.split if recover is not None else SplitSettings())
    fit_rows = split.train_batches()
    with private_temporary_folder("budget") as folder:
        names = [w.name for w in candidates]
        held_out = HeldOutProbe(model, names, split.held_out, folder, outputs, callable(metric), split.axes)
        if recover is not None:  # recovery trains toward exactly the outputs the budget judges
            recover = replace(recover, outputs=held_out.selection.judged)
        baseline = held_out.measure({}, metric)

        # Each layer alone: one parallel fit of every candidate gives each its dense-input conversion.
        alone = copy.deepcopy(model)
        probe = replace(inner, sequential=False, fit_target="auto", include=exact_names([w.name for w in candidates]))
        probe_report = ConvertPass(probe.fit_options(), batches=fit_rows)(alone).report
        candidates = _drop_skipped(candidates, probe_report, decisions)
        if not candidates:
            raise InputError("nothing to convert: the fit skipped every candidate layer (see the reasons with --json)")
        stored = {w.name: w.tensor for w in find_prunable_weights(alone.proto).weights}
        for weight in candidates:
            score = held_out.measure({weight.name: np.asarray(alone.read(stored[weight.name]))}, metric)
            decisions[weight.name].sensitivity = baseline - score

        def value(weight: PrunableWeight) -> float:
            row = decisions[weight.name]
            return row.parameters * (1.0 if row.large else SMALL_WEIGHT)

        def cost(weight: PrunableWeight) -> float:
            return max(decisions[weight.name].sensitivity or 0.0, 1e-9)

        # Greedy knapsack on the (nearly additive) sensitivities: the best value per unit of fidelity first.
        ranked = sorted(candidates, key=lambda w: value(w) / cost(w), reverse=True)
        allowance = baseline - min_fidelity
        chosen, spent = [], 0.0
        for weight in ranked:
            if spent + max(decisions[weight.name].sensitivity or 0.0, 0.0) <= allowance:
                chosen.append(weight)
                spent += max(decisions[weight.name].sensitivity or 0.0, 0.0)

        built: list[str] = []  # the names of the last set built

        def build() -> tuple[OnnxModel, PassResult]:
            built[:] = [w.name for w in chosen]
            attempt = copy.deepcopy(model)
            result = fit_and_recover(
                attempt, replace(inner, include=exact_names([w.name for w in chosen]), recover=recover), data, split
            )
            # A layer the fit skips stays dense: it leaves the set, and the measurement is of what was converted.
            chosen[:] = _drop_skipped(chosen, result.report, decisions)
            return attempt, result

        def back_off(measured: float) -> bool:
            """Back off the worst buys until their predicted loss covers the shortfall (at least one layer)."""
            nonlocal spent
            shortfall, removed, tried = min_fidelity - measured, 0.0, len(chosen)
            while chosen and (removed == 0.0 or removed < shortfall):
                worst = min(chosen, key=lambda w: value(w) / cost(w))
                chosen.remove(worst)
                loss = max(decisions[worst.name].sensitivity or 0.0, 0.0)
                removed, spent = removed + max(loss, 1e-12), spent - loss
            if not chosen and tried > 1:  # predicted badly (a coarse metric): the most tolerant alone, last
                chosen.append(min(candidates, key=cost))
                spent = max(decisions[chosen[0].name].sensitivity or 0.0, 0.0)
            return bool(chosen)

        measured = None
        if chosen:
            (attempt, result), measured, attempts = verify_and_back_off(
                build,
                lambda built: held_out.estimate_model(built[0].save(folder / "attempt.onnx"), metric),
                back_off,
                lambda: {"layers": len(chosen), "predicted": baseline - spent},
                min_fidelity,
            )
        if not chosen:
            best = min(candidates, key=cost)
            raise InputError(
                f"no layer can be converted with held-out "
                f"{metric_label(metric, held_out.selection, held_out.figures)} >= "
                f"{min_fidelity}: the most tolerant, '{best.name}', alone gives "
                f"{baseline - decisions[best.name].sensitivity:.4f} predicted"
                + ("" if measured is None else f", but built, {_last_set(built, best.name, len(attempts))} measured ")
                + ("" if measured is None else measured.describe())
                + "; lower --min-fidelity"
                + ("" if measured is None or measured.bound is None else " or judge on more held-out rows (--held-out)")
            )
    _adopt(model, attempt)
    names = {w.name for w in chosen}
    for name, decision in decisions.items():
        if name in names:
            decision.converted, decision.reason = True, "converted"
        elif not decision.reason:
            decision.reason = "budget"
    report = BudgetReport(
        min_fidelity=min_fidelity,
        metric=metric_label(metric, held_out.selection, held_out.figures),
        fidelity=measured.mean,
        fidelity_bound=measured.bound,
        bound_note=measured.note,
        held_out_rows=split.held_out_rows,
        pattern=str(fitter.pattern),
        layers=list(decisions.values()),
        attempts=attempts,
        outputs=held_out.selection,
        judged=held_out.figures,
    )
    return PassResult(model, bool(names), [*result.report, report])
