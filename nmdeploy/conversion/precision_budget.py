"""A per-layer precision-and-sparsity budget: each weighted layer becomes 2:4 + INT8, dense INT8, 2:4 fp16 or stays
dense fp16, chosen by measured sensitivity and expected speed gain, with held-out fidelity >= a floor.

Built as the fidelity budget of :mod:`nmdeploy.conversion.budget` is (the same held-out rows of the calibration
data's one split, the same metric handling, the probe and back-off loop of :mod:`nmdeploy.conversion.budgeting`).
Each layer's sensitivity to each option is measured alone on the held-out rows: 2:4 from one parallel fit of every
sparse candidate (each weight swapped in alone), INT8 (or FP8) from the model with that layer alone quantized;
2:4 + INT8 is predicted as the sum of the two. A greedy multiple-choice knapsack then upgrades layers, best expected
time saved per unit of fidelity first, while the predicted losses fit the allowance. The chosen mix is built for
real (convert the 2:4 layers, then quantize the INT8 ones, calibrated on the fit rows) and measured; while it falls
short, the worst upgrade is undone and the build repeated. The result is one Q/DQ model; every fidelity reported is
measured in ONNX Runtime on the held-out rows.

With recovery, each built mix is fitted, recovered in floating point (masks fixed, on the one split) and then
quantized. The layers are chosen before recovery, not on a model recovered with every candidate 2:4: recovery tunes
biases and normalisations for the set it recovers, so a layer put back dense afterwards would sit among tensors tuned
for another mix. The sensitivities are the one-shot fit's; the floor judges the recovered, quantized mix as measured.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import onnx

from nmdeploy.calibration.data import CalibrationData, CalibrationSplit, SplitSettings
from nmdeploy.conversion.budgeting import HeldOutProbe, exact_names, verify_and_back_off
from nmdeploy.conversion.precision_budget_report import (
    LayerChoice,
    PrecisionBudgetReport,
    PrecisionBudgetResult,
    option_label,
)
from nmdeploy.errors import InputError
from nmdeploy.fidelity import FidelityMetric, metric_label
from nmdeploy.files import private_temporary_folder
from nmdeploy.graph.eligibility import WIN_CHANNELS, gemm_channels, tensorrt_verdict
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.passes.base import ReportRow
from nmdeploy.passes.convert import ConvertOptions, ConvertPass
from nmdeploy.passes.prune import select_weights
from nmdeploy.passes.quantize import QuantizePass, plan_quantization

if TYPE_CHECKING:
    from nmdeploy.conversion.budget import FitAndRecover
    from nmdeploy.conversion.recovery import RecoveryOptions

# Expected speed-up of one GEMM or convolution over dense fp16 in a TensorRT engine, by (sparse, quantized) and by
# whether both channel counts reach WIN_CHANNELS (256). Sources, and what is assumed:
# - 2:4 fp16: BENCHMARKS.md "GPU check" (torch cuSPARSELt on an H200): wide layers gain 1.04-1.20 (MPNet's FFN,
#   VGG16's 512-channel convs), every layer of MiniLM, the digits CNN and the PP-OCR detector runs 0.3-0.8x, and
#   TensorRT keeps the dense tactic where it is faster (TensorRT #1403, #2169), so a small layer gains nothing;
#   TensorRT 10.3 on a pruned ViT-B MLP: 1.20-1.27 (research notes, "Updates of 2026-11-26").
# - dense INT8: twice fp16's peak tensor-core throughput on A100 and H100 (NVIDIA's data sheets); 1.6 and 1.3 are
#   our assumption for the memory traffic that does not halve; not measured here (no TensorRT on these machines).
# - 2:4 + INT8: dense INT8 times the measured 2:4 INT8 gain over dense INT8 (GPU check: 1.1-1.5 on wide layers,
#   1.03-1.05 on MiniLM's 384x1536; TensorRT's demo/BERT: sparse INT8 Megatron-Large 1.64x dense INT8 BERT-Large).
SPEED_UPS: dict[tuple[bool, bool], tuple[float, float]] = {  # (sparse, quantized) -> (small layer, large layer)
    (False, False): (1.0, 1.0),
    (True, False): (1.0, 1.2),
    (False, True): (1.3, 1.6),
    (True, True): (1.35, 2.0),
}


class PrecisionBudgetOptions(Protocol):
    """What the precision budget reads of the conversion options: the floor, the 8-bit type, the judged outputs
    and metric, the quantization's keywords, recovery and the fit's options (:class:`~nmdeploy.conversion.
    controller.ConversionOptions`, checked there), replaceable as a dataclass's."""

    calibration: Any
    min_fidelity: float | None
    precision: str | None
    metric: FidelityMetric
    outputs: tuple[str, ...] | None
    quantize: Mapping[str, Any] | None
    recover: RecoveryOptions | None
    include: str | None
    exclude: str | None

    def fit_options(self, **changes: Any) -> ConvertOptions: ...


def check_quantize_options(calibration: Any, precision: str, quantize: Mapping[str, Any] | None) -> dict[str, Any]:
    """The quantization keywords the precision budget passes to each :class:`QuantizePass` it runs, refused up
    front when bad (the budget sets calibration, precision and the layers itself)."""
    found = dict(quantize or {})
    clash = {"calibration", "precision", "layers"} & set(found)
    if clash:
        raise InputError(f"the precision budget sets {', '.join(sorted(clash))} of the quantization itself")
    QuantizePass(calibration=calibration, precision=precision, **found)
    return found


def choose_within_precision_budget(
    options: PrecisionBudgetOptions, model: OnnxModel, data: CalibrationData, fit_and_recover: FitAndRecover
) -> PrecisionBudgetResult:
    """Choose, per weighted layer, among 2:4 + INT8 (FP8), dense INT8, 2:4 fp16 and dense fp16 so that held-out
    fidelity stays >= ``options.min_fidelity`` and the expected speed-up is largest; write the chosen mix into
    ``model`` as one Q/DQ model. The 2:4 layers are fitted as ``options.fit_options()`` say and recovered when
    ``options.recover`` asks (both by ``fit_and_recover``), the 8-bit ones then quantized with ``options.quantize``
    (range method, smoothing, ...); every step reads ``data``'s one split (recovery's settings when it recovers)."""
    return _PrecisionBudget(options, fit_and_recover).call(model, data)


class _PrecisionBudget:
    """One run of the precision budget (made per call, never kept): the options it reads and its steps."""

    def __init__(self, options: PrecisionBudgetOptions, fit_and_recover: FitAndRecover):
        self.calibration = options.calibration
        self.min_fidelity = options.min_fidelity
        self.precision = options.precision
        self.metric = options.metric
        self.recover = options.recover
        self.outputs = options.outputs or (options.recover.outputs if options.recover is not None else None)
        self.convert = options
        self.fit_and_recover = fit_and_recover
        self.quantize = dict(options.quantize or {})
        # The one split every fit, recovery and measurement reads: recovery's when it recovers, else the defaults.
        self.split = options.recover.split if options.recover is not None else SplitSettings()

    def call(self, model: OnnxModel, data: CalibrationData) -> PrecisionBudgetResult:
        split = data.split(self.split)
        units = self._units(model)
        layers = {layer.weight: layer for unit in units for layer in unit.members}
        with private_temporary_folder("precision-budget") as folder:
            sparse = [name for name, layer in layers.items() if layer.sparse_reason is None]
            held_out = HeldOutProbe(
                model, sparse, split.held_out, folder, self.outputs, callable(self.metric), split.axes
            )
            if self.recover is not None:  # recovery trains toward exactly the outputs the budget judges
                self.recover = replace(self.recover, outputs=held_out.selection.judged)
            baseline = held_out.measure({}, self.metric)
            self._measure_sparse(model, data, split, held_out, layers, sparse, baseline)
            self._measure_quantized(model, split, held_out, units, folder, baseline)
            chosen, spent = _choose(units, baseline - self.min_fidelity)

            def back_off(measured: float) -> bool:
                """Undo the upgrade that buys the least time per fidelity (none left: the dense mix was built)."""
                nonlocal spent
                if not chosen:
                    return False
                worst = min(chosen, key=lambda index: units[index].ratio(chosen[index]))
                spent -= max(units[worst].losses[chosen.pop(worst)], 0.0)
                units[worst].backed_off = measured
                return True

            (built, unquantized, rows), measured, attempts = verify_and_back_off(
                lambda: self._build(model, data, split, units, chosen),
                lambda built: held_out.estimate_model(built[0].save(folder / "attempt.onnx"), self.metric),
                back_off,
                lambda: {"upgraded": len(chosen), "predicted": baseline - spent},
                self.min_fidelity,
            )
        if measured.judged < self.min_fidelity:
            raise InputError(
                f"held-out {metric_label(self.metric, held_out.selection, held_out.figures)} is "
                f"{measured.describe()} with every layer dense fp16, below --min-fidelity {self.min_fidelity}"
            )
        model.proto.CopyFrom(built.proto)
        model.index.mark_stale()
        report = PrecisionBudgetReport(
            min_fidelity=self.min_fidelity,
            metric=metric_label(self.metric, held_out.selection, held_out.figures),
            precision=self.precision,
            fidelity=measured.mean,
            fidelity_bound=measured.bound,
            bound_note=measured.note,
            predicted=baseline - spent,
            held_out_rows=split.held_out_rows,
            expected_speed_up=_expected_speed_up(units, chosen),
            layers=sorted(
                (row for i, unit in enumerate(units) for row in unit.choice_rows(chosen.get(i), self.precision)),
                key=lambda row: list(layers).index(row.weight),
            ),
            attempts=attempts,
            judged=held_out.figures,
            recovery=next((row for row in rows if getattr(row, "step", None) == "recover"), None),
        )
        return PrecisionBudgetResult(model, bool(chosen), [*rows, report], unquantized)

    def _units(self, model: OnnxModel) -> list[_Unit]:
        """Every quantizable or 2:4-convertible weighted layer, grouped: quantizable layers reading one input are
        one unit (one Q/DQ pair and one smoothing serve them), every other layer its own."""
        plan = plan_quantization(model, **_plan_options(self.quantize))
        quantizable = {layer.weight.name: layer for layer in plan.layers}
        convert = ConvertPass(self.convert.fit_options(calibration=self.calibration))
        shares = _multiply_adds(model)
        weights = find_prunable_weights(model.proto, model.index).weights
        selected = {w.name for w in select_weights(weights, self.convert.include, self.convert.exclude)}
        groups: dict[str, list[_Candidate]] = {}
        for weight in weights:
            if weight.name not in quantizable:
                continue
            layer = quantizable[weight.name]
            verdict = tensorrt_verdict(weight, convert.pattern)
            sparse_reason = convert.skip_reason(weight) or (
                None if verdict.eligible else "not TensorRT-eligible: " + "; ".join(verdict.reasons)
            )
            if sparse_reason is None and weight.name not in selected:
                sparse_reason = "not selected by the conversion's include/exclude"
            if sparse_reason is None and weight.uncalibrated:
                sparse_reason = weight.uncalibrated
            reduction, channels = gemm_channels(weight)
            candidate = _Candidate(
                weight.name,
                weight.node_label,
                shares.get(weight.name, float(np.prod(weight.shape))),
                min(reduction, channels) >= WIN_CHANNELS,
                sparse_reason,
                layer.skipped,
            )
            key = f"input {layer.node.input[0]}" if layer.skipped is None else f"weight {weight.name}"
            groups.setdefault(key, []).append(candidate)
        if not any(c.sparse_reason is None or c.quantize_reason is None for g in groups.values() for c in g):
            raise InputError("nothing to budget: no Conv, Gemm or MatMul weight can be converted to 2:4 or quantized")
        total = sum(c.share for g in groups.values() for c in g) or 1.0
        for group in groups.values():
            for candidate in group:
                candidate.share /= total
        return [_Unit(members) for members in groups.values()]

    def _measure_sparse(
        self, model, data, split, held_out, layers: Mapping[str, _Candidate], sparse: list[str], baseline: float
    ) -> None:
        """Each 2:4 candidate's loss alone: one parallel fit of all of them on the dense model, each put in alone."""
        if not sparse:
            return
        alone = copy.deepcopy(model)
        options = self.convert.fit_options(
            calibration=data, sequential=False, fit_target="auto", include=exact_names(sparse), exclude=None
        )
        report = ConvertPass(options, batches=split.train_batches())(alone).report
        skipped = {row.weight: row.skipped for row in report if getattr(row, "step", None) == "convert" and row.skipped}
        stored = {w.name: w.tensor for w in find_prunable_weights(alone.proto).weights}
        for name in sparse:
            if name in skipped:
                layers[name].sparse_reason = f"the fit skipped it: {skipped[name]}"
                continue
            score = held_out.measure({name: np.asarray(alone.read(stored[name]))}, self.metric)
            layers[name].sparse_loss = baseline - score

    def _measure_quantized(self, model, split, held_out, units: list[_Unit], folder: Path, baseline: float) -> None:
        """Each quantizable unit's loss alone: the model with that unit alone quantized, measured held out."""
        for unit in units:
            if unit.quantize_reason is not None:
                continue
            alone = copy.deepcopy(model)
            names = [layer.weight for layer in unit.members]
            QuantizePass(calibration=split, precision=self.precision, layers=names, **self.quantize)(alone)
            unit.quantized_loss = baseline - held_out.measure_model(alone.save(folder / "alone.onnx"), self.metric)

    def _build(
        self,
        model: OnnxModel,
        data: CalibrationData,
        split: CalibrationSplit,
        units: list[_Unit],
        chosen: dict[int, Option],
    ) -> tuple[OnnxModel, OnnxModel, list[ReportRow]]:
        """The dense model with the chosen 2:4 layers converted (and recovered, when asked), then the chosen
        quantized layers quantized; the mix before quantization too."""
        built = copy.deepcopy(model)
        rows: list[ReportRow] = []
        decided = {
            member.weight: units[index].option_of(member, option)
            for index, option in chosen.items()
            for member in units[index].members
        }
        sparse = [name for name, (is_sparse, _) in decided.items() if is_sparse]
        quantized = [name for name, (_, is_quantized) in decided.items() if is_quantized]
        if sparse:
            # The chosen set alone, fitted on the split's training rows and recovered on it when asked; no budget.
            inner = {"calibration": data, "include": exact_names(sparse), "exclude": None, "recover": self.recover}
            options = replace(self.convert, **inner, min_fidelity=None, precision=None, quantize=None, held_out=None)
            rows += self.fit_and_recover(built, options, data, split).report
        unquantized = copy.deepcopy(built) if quantized else built
        if quantized:
            rows += QuantizePass(calibration=split, precision=self.precision, layers=quantized, **self.quantize)(
                built
            ).report
        return built, unquantized, rows


Option = tuple[bool, bool]  # (2:4, quantized)
DENSE: Option = (False, False)


@dataclass
class _Candidate:
    """One weighted layer: its share of the multiply-adds, whether it is large, why 2:4 or INT8 is not an option,
    and its 2:4 loss measured alone."""

    weight: str
    node: str
    share: float
    large: bool
    sparse_reason: str | None
    quantize_reason: str | None
    sparse_loss: float | None = None

    @property
    def can_be_sparse(self) -> bool:
        return self.sparse_reason is None and self.sparse_loss is not None


@dataclass
class _Unit:
    """Layers decided together: the quantizable layers reading one input (one Q/DQ pair and one smoothing serve
    them), or one layer. An option's 2:4 part applies to the members that can be 2:4."""

    members: list[_Candidate]
    quantized_loss: float | None = None
    backed_off: float | None = None  # the measured fidelity that made the budget undo this unit's upgrade

    @property
    def quantize_reason(self) -> str | None:
        return self.members[0].quantize_reason

    @property
    def losses(self) -> dict[Option, float]:
        """Predicted fidelity lost by each available option (2:4 + INT8: the sum of the two measured alone)."""
        found = {DENSE: 0.0}
        sparse = [m.sparse_loss for m in self.members if m.can_be_sparse]
        if sparse:
            found[True, False] = float(sum(sparse))
        if self.quantized_loss is not None:
            found[False, True] = self.quantized_loss
            if sparse:
                found[True, True] = float(sum(sparse)) + self.quantized_loss
        return found

    def option_of(self, member: _Candidate, option: Option) -> Option:
        return (option[0] and member.can_be_sparse, option[1])

    def saved(self, option: Option) -> float:
        """The share of the model's time this option is expected to save."""
        return sum(m.share * (1.0 - 1.0 / SPEED_UPS[self.option_of(m, option)][m.large]) for m in self.members)

    def ratio(self, option: Option) -> float:
        return self.saved(option) / max(self.losses[option], 1e-9)

    def choice_rows(self, option: Option | None, precision: str) -> list[LayerChoice]:
        losses = {option_label(*k, precision): round(v, 6) for k, v in self.losses.items()}
        rows = []
        for member in self.members:
            chosen = self.option_of(member, option or DENSE)
            unavailable = [f"2:4: {member.sparse_reason}"] if member.sparse_reason else []
            if member.quantize_reason:
                unavailable.append(f"{precision.upper()}: {member.quantize_reason}")
            if self.backed_off is not None:
                reason = f"backed off to dense fp16: the mix measured {self.backed_off:.4f}, below the floor"
            elif option is None:
                cheapest = min((v for k, v in self.losses.items() if k != DENSE), default=None)
                reason = (
                    "no faster option is available"
                    if cheapest is None
                    else f"every faster option costs more fidelity than the budget left (cheapest {cheapest:.4f})"
                )
            else:
                reason = (
                    f"most expected time saved per fidelity within the budget (loss {self.losses[option]:.4f}, "
                    f"expected {SPEED_UPS[chosen][member.large]:.2f}x this layer)"
                )
            if len(self.members) > 1:
                reason += f"; decided with the {len(self.members) - 1} other layer(s) reading its input"
            if unavailable:
                reason += "; " + "; ".join(unavailable)
            speed_ups = {
                option_label(*k, precision): SPEED_UPS[self.option_of(member, k)][member.large] for k in self.losses
            }
            rows.append(
                LayerChoice(
                    member.weight,
                    member.node,
                    member.share,
                    option_label(*chosen, precision),
                    reason,
                    losses,
                    speed_ups,
                )
            )
        return rows


def _choose(units: Sequence[_Unit], allowance: float) -> tuple[dict[int, Option], float]:
    """Greedy multiple-choice knapsack: repeatedly take the upgrade (a unit to a faster option) with the most
    expected time saved per unit of predicted fidelity lost, while the predicted losses fit ``allowance``."""
    chosen: dict[int, Option] = {}
    spent = 0.0
    while True:
        best, best_ratio = None, 0.0
        for index, unit in enumerate(units):
            current = chosen.get(index, DENSE)
            for option, loss in unit.losses.items():
                gain = unit.saved(option) - unit.saved(current)
                extra = max(loss, 0.0) - max(unit.losses[current], 0.0)
                if gain <= 0 or spent + extra > allowance:
                    continue
                ratio = gain / max(extra, 1e-9)
                if ratio > best_ratio:
                    best, best_ratio = (index, option, extra), ratio
        if best is None:
            return chosen, spent
        index, option, extra = best
        chosen[index] = option
        spent += extra


def _expected_speed_up(units: Sequence[_Unit], chosen: Mapping[int, Option]) -> float:
    """Over dense fp16, of the weighted layers' time (each layer's share of the multiply-adds)."""
    time = sum(
        member.share / SPEED_UPS[unit.option_of(member, chosen.get(index, DENSE))][member.large]
        for index, unit in enumerate(units)
        for member in unit.members
    )
    return 1.0 / time if time else 1.0


def _multiply_adds(model: OnnxModel) -> dict[str, float]:
    """Multiply-adds per sample of each weight's layers: the weight's size times its output positions (a
    convolution's output pixels where shape inference knows them; one for GEMMs, whose rows every layer shares)."""
    inferred = onnx.shape_inference.infer_shapes(model.proto)
    shapes = {
        value.name: [d.dim_value if d.HasField("dim_value") else 0 for d in value.type.tensor_type.shape.dim]
        for value in (*inferred.graph.value_info, *inferred.graph.output)
    }
    found: dict[str, float] = {}
    for weight in find_prunable_weights(model.proto, model.index).weights:
        positions = 1
        for use in weight.uses:
            if use.op_type == "Conv" and use.consumer is not None:
                spatial = shapes.get(use.consumer.output[0], [])[2:]
                positions = int(np.prod([d for d in spatial if d > 0])) if spatial else 1
        found[weight.name] = float(np.prod(weight.shape)) * positions
    return found


def _plan_options(quantize: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("keep_ops", "quantize_residuals", "quantize_raw_input")
    return {key: quantize[key] for key in keys if quantize.get(key) is not None}
