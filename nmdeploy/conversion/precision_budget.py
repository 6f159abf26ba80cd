"""A per-layer precision-and-sparsity budget: each weighted layer becomes 2:4 + INT8, dense INT8, 2:4 fp16 or stays
dense fp16, chosen by measured sensitivity and expected speed gain, with held-out fidelity >= a floor.

Built on the fidelity budget of :mod:`nmdeploy.conversion.budget` (the same held-out rows of the calibration data's
one split, the same metric handling, its measurement helpers). Each layer's sensitivity to each option is measured
alone on the held-out rows: 2:4 from one parallel fit of every sparse candidate (each weight swapped in alone), INT8
(or FP8) from the model with that layer alone quantized; 2:4 + INT8 is predicted as the sum of the two. A greedy
multiple-choice knapsack then upgrades layers, best expected time saved per unit of fidelity first, while the
predicted losses fit the allowance. The chosen mix is built for real (convert the 2:4 layers, then quantize the
INT8 ones, calibrated on the fit rows) and measured; while it falls short, the worst upgrade is undone and the build
repeated. The result is one Q/DQ model; every fidelity reported is measured in ONNX Runtime on the held-out rows.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from nmdeploy.conversion.budget import _exact, _HeldOut
from nmdeploy.conversion.convert import ConvertOptions, ConvertPass
from nmdeploy.conversion.data import CalibrationData, Source
from nmdeploy.conversion.recovery import RecoveryOptions
from nmdeploy.errors import InputError
from nmdeploy.fidelity import FidelityMetric, check_min_fidelity, metric_label
from nmdeploy.graph.eligibility import WIN_CHANNELS, gemm_channels, tensorrt_verdict
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.passes.base import Pass, PassResult, ReportRow
from nmdeploy.passes.prune import select_weights
from nmdeploy.passes.quantization_ranges import check_precision
from nmdeploy.passes.quantize import QuantizePass, plan_quantization

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


@dataclass
class LayerChoice:
    """One weighted layer's options (predicted fidelity loss of each, measured alone on the held-out rows), the
    one chosen and why."""

    weight: str
    node: str
    share: float  # the layer's share of the model's multiply-adds per sample (weights x output positions)
    choice: str  # "2:4 + INT8", "dense INT8", "2:4 fp16" or "dense fp16" (FP8 in place of INT8 for --precision fp8)
    reason: str
    losses: dict[str, float] = field(default_factory=dict)  # option -> fidelity lost (2:4 + INT8: the sum, predicted)
    speed_ups: dict[str, float] = field(default_factory=dict)  # option -> expected speed-up over dense fp16

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PrecisionBudgetReport(ReportRow):
    """The budget's outcome: the held-out fidelity measured on exactly the written model, every layer's choice and
    each verified attempt."""

    step: str = field(default="precision-budget", init=False)
    min_fidelity: float = 0.0
    metric: str = "auto"
    precision: str = "int8"
    fidelity: float = 0.0
    predicted: float = 0.0
    held_out_rows: int = 0
    expected_speed_up: float = 1.0  # over dense fp16, weighted by each layer's share of the multiply-adds
    layers: list[LayerChoice] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        document = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "layers"}
        return {**document, "layers": [layer.to_json() for layer in self.layers]}


def option_label(sparse: bool, quantized: bool, precision: str) -> str:
    """ "2:4 + INT8", "dense INT8", "2:4 fp16" or "dense fp16" (fp16: left in floating point for the engine)."""
    if sparse and quantized:
        return f"2:4 + {precision.upper()}"
    return f"{'2:4' if sparse else 'dense'} {precision.upper() if quantized else 'fp16'}"


class PrecisionBudgetPass(Pass):
    """Choose, per weighted layer, among 2:4 + INT8 (FP8), dense INT8, 2:4 fp16 and dense fp16 so that held-out
    fidelity stays >= ``min_fidelity`` and the expected speed-up is largest; write the chosen mix as one Q/DQ model.

    ``convert``: the options of the 2:4 conversion (its calibration, budget and selection fields are replaced);
    ``quantize``: keywords of :class:`~nmdeploy.passes.quantize.QuantizePass` (calibration, precision and layer
    selection are set here)."""

    name = "precision-budget"

    def __init__(
        self,
        *,
        calibration: Source | CalibrationData,
        min_fidelity: float,
        precision: str = "int8",
        metric: FidelityMetric = "auto",
        outputs: Sequence[str] | None = None,
        convert: ConvertOptions | None = None,
        quantize: Mapping[str, Any] | None = None,
    ):
        self.calibration = calibration
        self.min_fidelity = check_min_fidelity(min_fidelity)
        self.precision = check_precision(precision)
        self.metric = metric
        self.outputs = tuple(outputs) if outputs is not None else None
        self.convert = convert or ConvertOptions(calibration=calibration)
        self.quantize = dict(quantize or {})
        clash = {"calibration", "precision", "layers"} & set(self.quantize)
        if clash:
            raise InputError(f"the precision budget sets {', '.join(sorted(clash))} of the quantization itself")
        QuantizePass(calibration=calibration, precision=precision, **self.quantize)  # bad options refused up front
        # The one split every step reads: recovery's, when the conversion recovers, else its defaults.
        recover = self.convert.recover
        self.split = recover if isinstance(recover, RecoveryOptions) else RecoveryOptions(metric=metric)

    def requires(self, model: OnnxModel) -> None:
        QuantizePass(calibration=self.calibration, precision=self.precision).requires(model)

    def call(self, model: OnnxModel) -> PassResult:
        data = CalibrationData.of(self.calibration, model.proto, self.convert.batch_size)
        split = data.split(self.split.batch_size, self.split.held_out, self.split.seed)
        layers = self._layers(model)
        with tempfile.TemporaryDirectory(prefix="nmdeploy-precision-budget-") as folder_name:
            folder = Path(folder_name)
            sparse = [name for name, layer in layers.items() if layer.sparse_reason is None]
            held_out = _HeldOut(model, sparse, split.held_out, folder, self.outputs, callable(self.metric))
            baseline = held_out.measure({}, self.metric)
            self._measure_sparse(model, data, held_out, layers, sparse)
            self._measure_quantized(model, data, held_out, layers, folder, baseline)
            chosen, spent = _choose(layers, baseline - self.min_fidelity)
            attempts: list[dict[str, Any]] = []
            while True:
                built, rows = self._build(model, data, chosen)
                measured = held_out.measure_model(built.save(folder / "attempt.onnx"), self.metric)
                attempts.append({"upgraded": len(chosen), "predicted": baseline - spent, "fidelity": measured})
                if measured >= self.min_fidelity or not chosen:
                    break
                worst = min(chosen, key=lambda name: layers[name].ratio(chosen[name]))
                spent -= max(layers[worst].losses[chosen.pop(worst)], 0.0)
                layers[worst].backed_off = measured
        if measured < self.min_fidelity:
            raise InputError(
                f"held-out {metric_label(self.metric, held_out.selection)} is {measured:.4f} with every layer dense "
                f"fp16, below --min-fidelity {self.min_fidelity}"
            )
        model.proto.CopyFrom(built.proto)
        model.index.mark_stale()
        report = PrecisionBudgetReport(
            min_fidelity=self.min_fidelity,
            metric=metric_label(self.metric, held_out.selection),
            precision=self.precision,
            fidelity=measured,
            predicted=baseline - spent,
            held_out_rows=split.held_out_rows,
            expected_speed_up=_expected_speed_up(layers, chosen),
            layers=[layer.choice_row(chosen.get(name), self.precision) for name, layer in layers.items()],
            attempts=attempts,
        )
        return PassResult(model, bool(chosen), [*rows, report])

    def _layers(self, model: OnnxModel) -> dict[str, _Candidate]:
        """Every quantizable or 2:4-convertible weighted layer, keyed by its weight's name."""
        plan = plan_quantization(model, **_plan_options(self.quantize))
        quantizable = {layer.weight.name: layer for layer in plan.layers}
        convert = ConvertPass(replace(self.convert, calibration=self.calibration, min_fidelity=None, recover=None))
        shares = _multiply_adds(model)
        candidates: dict[str, _Candidate] = {}
        weights = find_prunable_weights(model.proto, model.index).weights
        selected = {w.name for w in select_weights(weights, self.convert.include, self.convert.exclude)}
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
            if sparse_reason is None and weight.graph != "main":
                sparse_reason = f"stored in {weight.graph}, not the main graph"
            reduction, channels = gemm_channels(weight)
            candidates[weight.name] = _Candidate(
                weight.name,
                weight.node_label,
                shares.get(weight.name, float(np.prod(weight.shape))),
                min(reduction, channels) >= WIN_CHANNELS,
                sparse_reason,
                layer.skipped,
                self.precision,
            )
        if not any(c.sparse_reason is None or c.quantize_reason is None for c in candidates.values()):
            raise InputError("nothing to budget: no Conv, Gemm or MatMul weight can be converted to 2:4 or quantized")
        total = sum(c.share for c in candidates.values()) or 1.0
        for candidate in candidates.values():
            candidate.share /= total
        return candidates

    def _measure_sparse(self, model, data, held_out, layers, sparse: list[str]) -> None:
        """Each 2:4 candidate's loss alone: one parallel fit of all of them on the dense model, each put in alone."""
        if not sparse:
            return
        alone = copy.deepcopy(model)
        options = replace(self.convert, calibration=data, min_fidelity=None, recover=None, sequential=False)
        report = ConvertPass(replace(options, include=_exact(sparse), exclude=None))(alone).report
        skipped = {row.weight: row.skipped for row in report if getattr(row, "step", None) == "convert" and row.skipped}
        stored = {w.name: w.tensor for w in find_prunable_weights(alone.proto).weights}
        baseline = held_out.measure({}, self.metric)
        for name in sparse:
            if name in skipped:
                layers[name].sparse_reason = f"the fit skipped it: {skipped[name]}"
                continue
            score = held_out.measure({name: np.asarray(alone.read(stored[name]))}, self.metric)
            layers[name].set_loss(True, False, baseline - score)

    def _measure_quantized(self, model, data, held_out, layers, folder: Path, baseline: float) -> None:
        """Each quantizable layer's loss alone: the model with that layer alone quantized, measured held out."""
        for name, layer in layers.items():
            if layer.quantize_reason is not None:
                continue
            alone = copy.deepcopy(model)
            QuantizePass(calibration=data, precision=self.precision, layers=[name], **self.quantize)(alone)
            score = held_out.measure_model(alone.save(folder / "alone.onnx"), self.metric)
            layer.set_loss(False, True, baseline - score)
            if layer.sparse_reason is None and (True, False) in layer.loss:
                layer.set_loss(True, True, layer.loss[True, False] + layer.loss[False, True])

    def _build(self, model: OnnxModel, data: CalibrationData, chosen: dict[str, tuple[bool, bool]]):
        """The dense model with the chosen 2:4 layers converted, then the chosen quantized layers quantized."""
        built = copy.deepcopy(model)
        rows: list[ReportRow] = []
        sparse = [name for name, (is_sparse, _) in chosen.items() if is_sparse]
        quantized = [name for name, (_, is_quantized) in chosen.items() if is_quantized]
        if sparse:
            options = replace(self.convert, calibration=data, min_fidelity=None, include=_exact(sparse), exclude=None)
            rows += ConvertPass(options)(built).report
        if quantized:
            rows += QuantizePass(calibration=data, precision=self.precision, layers=quantized, **self.quantize)(
                built
            ).report
        return built, rows


@dataclass
class _Candidate:
    weight: str
    node: str
    share: float
    large: bool
    sparse_reason: str | None  # why 2:4 is not an option
    quantize_reason: str | None  # why INT8 is not an option
    precision: str
    loss: dict[tuple[bool, bool], float] = field(default_factory=dict)
    backed_off: float | None = None  # the measured fidelity that made the budget undo this layer's upgrade

    def set_loss(self, sparse: bool, quantized: bool, value: float) -> None:
        self.loss[sparse, quantized] = value

    @property
    def losses(self) -> dict[tuple[bool, bool], float]:
        return {(False, False): 0.0, **self.loss}

    def saved(self, option: tuple[bool, bool]) -> float:
        """The share of the model's time this option is expected to save."""
        return self.share * (1.0 - 1.0 / SPEED_UPS[option][self.large])

    def ratio(self, option: tuple[bool, bool]) -> float:
        return self.saved(option) / max(self.losses[option], 1e-9)

    def choice_row(self, option: tuple[bool, bool] | None, precision: str) -> LayerChoice:
        chosen = option or (False, False)
        label = option_label(*chosen, precision)
        unavailable = [f"2:4: {self.sparse_reason}"] if self.sparse_reason else []
        if self.quantize_reason:
            unavailable.append(f"{precision.upper()}: {self.quantize_reason}")
        if self.backed_off is not None:
            reason = f"backed off to dense fp16: the mix measured {self.backed_off:.4f}, below the floor"
        elif option is None:
            cheapest = min((v for k, v in self.losses.items() if k != (False, False)), default=None)
            reason = (
                "no faster option is available"
                if cheapest is None
                else f"every faster option costs more fidelity than the budget left (cheapest {cheapest:.4f})"
            )
        else:
            reason = (
                f"most expected time saved per fidelity within the budget (loss {self.losses[chosen]:.4f}, "
                f"expected {SPEED_UPS[chosen][self.large]:.2f}x this layer)"
            )
        if unavailable:
            reason += "; " + "; ".join(unavailable)
        return LayerChoice(
            self.weight,
            self.node,
            self.share,
            label,
            reason,
            {option_label(*k, precision): round(v, 6) for k, v in self.losses.items()},
            {option_label(*k, precision): SPEED_UPS[k][self.large] for k in self.losses},
        )


def _choose(layers: Mapping[str, _Candidate], allowance: float) -> tuple[dict[str, tuple[bool, bool]], float]:
    """Greedy multiple-choice knapsack: repeatedly take the upgrade (a layer to a faster option) with the most
    expected time saved per unit of predicted fidelity lost, while the predicted losses fit ``allowance``."""
    chosen: dict[str, tuple[bool, bool]] = {}
    spent = 0.0
    while True:
        best, best_ratio = None, 0.0
        for name, layer in layers.items():
            current = chosen.get(name, (False, False))
            for option, loss in layer.losses.items():
                gain = layer.saved(option) - layer.saved(current)
                extra = max(loss, 0.0) - max(layer.losses[current], 0.0)
                if gain <= 0 or spent + extra > allowance:
                    continue
                ratio = gain / max(extra, 1e-9)
                if ratio > best_ratio:
                    best, best_ratio = (name, option, extra), ratio
        if best is None:
            return chosen, spent
        name, option, extra = best
        chosen[name] = option
        spent += extra


def _expected_speed_up(layers: Mapping[str, _Candidate], chosen: Mapping[str, tuple[bool, bool]]) -> float:
    """Over dense fp16, of the weighted layers' time (each layer's share of the multiply-adds)."""
    time = sum(layer.share / SPEED_UPS[chosen.get(name, (False, False))][layer.large] for name, layer in layers.items())
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


@dataclass
class PrecisionBudgetOutcome:
    output: Path
    report: list[ReportRow]

    @property
    def budget(self) -> PrecisionBudgetReport:
        return next(row for row in self.report if isinstance(row, PrecisionBudgetReport))


def precision_budget_file(model: str | Path, output: str | Path, **options) -> PrecisionBudgetOutcome:
    """Load the dense ``model``, choose each layer's precision and sparsity (:class:`PrecisionBudgetPass`
    ``options``) and save the one Q/DQ model to ``output`` atomically; any error leaves nothing written."""
    loaded = OnnxModel.load(model)
    loaded.check_save_target(output)
    result = PrecisionBudgetPass(**options)(loaded)
    return PrecisionBudgetOutcome(loaded.save(output), result.report)
