"""Explicit INT8 / FP8 quantization (QuantizeLinear/DequantizeLinear pairs) placed as TensorRT's strongly typed,
explicitly quantized networks want it, so that 2:4 layers can run structured-sparse integer kernels.

Weights of Conv, Gemm and MatMul layers (the weight on the second input) are stored quantized with one symmetric
scale per output channel (zero point 0), on the axis the graph model gives for the layer's output channels, and
read through a DequantizeLinear. Zero quantizes to zero, so a 2:4 weight stays exactly 2:4 (checked after the
pass, behind the DequantizeLinear, as ``inspect`` sees it). Which grid value each weight takes is GPTQ's choice by
default (``weight_rounding``, :mod:`nmdeploy.passes.quantization_weights`: the least output error on the calibration
data), else the nearest.

Activations get one per-tensor scale from calibration data. TensorRT picks sparse INT8 kernels only for a GEMM that
is INT8 in *and* INT8 out, so with INT8 a pair goes on the input of every quantized layer, and on the output at the
end of its epilogue (bias, BatchNormalization, activation functions, GELU written out as Erf: what TensorRT fuses
into the GEMM), unless the output already reaches quantized layers only, through data-movement ops, or feeds an op
kept off Q/DQ (Softmax, LayerNorm, ...: ``keep_ops``), or is a graph output. With ``quantize_residuals`` a residual
Add reading a quantized layer's output gets its other input quantized as well, so TensorRT can fuse the Add; it is
off by default because it quantizes the residual stream too (on the 2:4 MiniLM it cost 0.05 of mean embedding
cosine) and the layers are INT8 in and out without it. Each layer's report says whether it is "2:4 + INT8 in/out:
eligible for sparse integer kernels", and otherwise why not. Sparse FP8 GEMMs read E4M3 and write fp16/bf16/fp32, so
with FP8 the outputs stay in floating point by default (``layer_outputs``: "auto"; ModelOpt places its FP8 pairs the
same way), which keeps 8-bit rounding off the tensors that feed no GEMM: on the 2:4 SmolLM2-135M, perplexity +10.8 %
over 2:4 float32 with FP8 outputs, +5.5 % without.

A layer output that one per-tensor range cannot hold (its Q/DQ would lose more than OUTPUT_ERROR_LIMIT of its
energy: a few outlier channels) is divided per channel inside the layer (weight columns and bias) and multiplied back
after its DequantizeLinear, so the layer stays INT8 in and out; where that is impossible, or the output still loses
too much once rescaled, it stays floating point with the measured reason (and any division is undone). A first
layer reading the model's few-channel input (pixels) stays floating point.

With ``smooth`` (SmoothQuant, strength alpha; on by default for INT8) the inputs of MatMul/Gemm layers are first
divided per channel by max|x|^alpha / max|w|^(1 - alpha) (a Mul before their Q/DQ) and the weights' matching rows
multiplied by it: the product is unchanged, the outlier channels of transformer activations move into the per-
channel weight scales, and zeros stay zeros.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from onnx import TensorProto

from nmdeploy.calibration.data import CalibrationData, CalibrationSplit, Source
from nmdeploy.errors import InputError
from nmdeploy.graph.declared import default_opset, tensor_types
from nmdeploy.graph.inspection import WeightRow, inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.model_checks import check_structure
from nmdeploy.graph.quantization import WEIGHTED_OPS, quantized_io
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.masks.rounding import check_precision
from nmdeploy.passes.base import Pass, PassResult, PostconditionError, ReportRow
from nmdeploy.passes.quantization_layers import QuantizedLayer, quantized_layer_rows
from nmdeploy.passes.quantization_outputs import (
    OUTPUT_ERROR_LIMIT,
    RescaledOutput,
    Rescaling,
    keep_lossy_outputs_float,
    lossy_outputs,
    rescale_outputs,
    scale_back,
    undo_unpaired,
)
from nmdeploy.passes.quantization_plan import (
    DEFAULT_KEEP_OPS,
    RAW_INPUT_CHANNELS,
    PlannedLayer,
    QuantizationPlan,
    plan_quantization,
)
from nmdeploy.passes.quantization_ranges import (
    DEFAULT_PERCENTILE,
    activation_amax,
    check_range_method,
    choose_range,
    relative_error,
    scales_for,
)
from nmdeploy.passes.quantization_rewrite import QUANTIZED_TYPES, insert_pairs
from nmdeploy.passes.quantization_smoothing import (
    DEFAULT_SMOOTH,
    DEFAULT_SMOOTHING_STRENGTH,
    SmoothedActivation,
    smooth_layer_inputs,
)
from nmdeploy.passes.quantization_weights import WEIGHT_ROUNDINGS, RoundedWeight, round_weights

__all__ = [
    "DEFAULT_KEEP_OPS",
    "DEFAULT_LAYER_OUTPUTS",
    "DEFAULT_METHODS",
    "DEFAULT_SMOOTH",
    "DEFAULT_SMOOTHING_STRENGTH",
    "FALLBACK_METHODS",
    "LAYER_OUTPUTS",
    "MINIMUM_OPSET",
    "OUTPUT_ERROR_LIMIT",
    "QUANTIZED_TYPES",
    "RAW_INPUT_CHANNELS",
    "OpsetRaised",
    "QuantizationPlan",
    "QuantizationSummary",
    "QuantizeOutcome",
    "QuantizePass",
    "QuantizedActivation",
    "QuantizedLayer",
    "RescaledOutput",
    "RoundedWeight",
    "SmoothedActivation",
    "WEIGHT_ROUNDINGS",
    "plan_quantization",
    "quantize_model",
    "quantize_model_file",
    "quantized_io",
]

log = logging.getLogger(__name__)

MINIMUM_OPSET: dict[str, int] = {"int8": 13, "fp8": 19}  # per-axis Q/DQ: 13; FLOAT8E4M3FN Q/DQ: 19

LAYER_OUTPUTS = ("auto", "quantized", "float")
"""Whether layer outputs get Q/DQ pairs: "quantized" where the placement rules allow, "float" never, "auto" as the
precision's sparse kernels need it (DEFAULT_LAYER_OUTPUTS)."""

DEFAULT_LAYER_OUTPUTS: dict[str, str] = {"int8": "quantized", "fp8": "float"}


DEFAULT_METHODS: dict[str, str] = {"int8": "auto", "fp8": "max"}
"""Activation range method by precision. "auto" judges each GEMM input's candidate ranges (max, percentile, mse,
entropy) by the error they cause in the layers' outputs on a sample of calibration rows, and gives other tensors
FALLBACK_METHODS' range. One-shot 2:4 MiniLM, INT8 with smoothing 0.85 and lossy outputs kept float, mean embedding
cosine to dense on text of the calibration's kind / another kind: entropy everywhere 0.8993 / 0.7588, auto 0.9000 /
0.7635 (2:4 fp32 0.9021 / 0.7682); before smoothing, entropy beat mse and max (0.852, 0.792, 0.788). FP8 E4M3's
exponent covers the outliers that INT8 must clip, so it keeps max (0.8999 / 0.7661)."""


FALLBACK_METHODS: dict[str, str] = {"int8": "entropy", "fp8": "max"}


_QUANTIZATION_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "DynamicQuantizeLinear",
        "QLinearConv",
        "QLinearMatMul",
        "MatMulInteger",
        "ConvInteger",
        "QGemm",
        "TRT_FP8QuantizeLinear",
        "TRT_FP8DequantizeLinear",
    }
)


@dataclass
class QuantizedActivation(ReportRow):
    """A tensor given a Q/DQ pair: its calibrated range and scale, and the layers and adds that read it."""

    item: str = field(default="activation", init=False)
    tensor: str
    method: str
    amax: float
    max_abs: float
    scale: float
    readers: list[str]


@dataclass
class OpsetRaised(ReportRow):
    """The model's default-domain opset was raised for the Q/DQ precision (by onnx's version converter)."""

    item: str = field(default="opset", init=False)
    before: int
    after: int


@dataclass
class QuantizationSummary(ReportRow):
    item: str = field(default="summary", init=False)
    precision: str
    method: str
    layers: int
    quantized_layers: int
    sparse_integer_layers: int
    activations: int
    calibration_samples: int


class QuantizePass(Pass):
    """Quantize weights per output channel and activations per tensor (ranges from ``calibration``: an .npz, a
    folder of them, "random", an iterable of feed dicts, the :class:`CalibrationData` of a conversion, or its
    :class:`CalibrationSplit`, whose training rows alone are read) to ``precision`` ("int8" or "fp8"), with Q/DQ
    pairs placed for TensorRT."""

    name = "quantize"

    def __init__(
        self,
        *,
        calibration: Source | CalibrationData | CalibrationSplit,
        precision: str = "int8",
        method: str | None = None,
        percentile: float = DEFAULT_PERCENTILE,
        keep_ops: Iterable[str] | None = None,
        quantize_residuals: bool = False,
        smooth: bool | None = None,
        smoothing_strength: float = DEFAULT_SMOOTHING_STRENGTH,
        batch_size: int | None = None,
        layers: Collection[str] | None = None,
        float_outputs: Mapping[str, str] | None = None,
        quantize_raw_input: bool = False,
        output_error_limit: float | None = OUTPUT_ERROR_LIMIT,
        rescale_outputs: bool = True,
        layer_outputs: str = "auto",
        weight_rounding: str = "gptq",
    ):
        self.precision = check_precision(precision)
        method = check_range_method(method or DEFAULT_METHODS[precision], precision)
        if not 0.0 < percentile <= 100.0:
            raise InputError(f"percentile must be in (0, 100], got {percentile}")
        self.calibration = calibration
        self.method = method
        self.percentile = percentile
        self.keep_ops = DEFAULT_KEEP_OPS if keep_ops is None else frozenset(keep_ops)
        self.quantize_residuals = quantize_residuals
        if not 0.0 <= smoothing_strength <= 1.0:
            raise InputError(f"smoothing strength must be in [0, 1], got {smoothing_strength}")
        self.smooth = DEFAULT_SMOOTH[precision] if smooth is None else smooth
        self.smoothing_strength = smoothing_strength
        self.batch_size = batch_size
        self.layers = None if layers is None else frozenset(layers)
        self.float_outputs = dict(float_outputs or {})
        self.quantize_raw_input = quantize_raw_input
        if output_error_limit is not None and not output_error_limit > 0.0:
            raise InputError(f"the output error limit must be above 0 (None: no limit), got {output_error_limit}")
        self.output_error_limit = output_error_limit
        self.rescale_outputs = rescale_outputs
        if layer_outputs not in LAYER_OUTPUTS:
            raise InputError(f"layer outputs {layer_outputs!r}: choose one of {', '.join(LAYER_OUTPUTS)}")
        self.layer_outputs = DEFAULT_LAYER_OUTPUTS[self.precision] if layer_outputs == "auto" else layer_outputs
        if weight_rounding not in WEIGHT_ROUNDINGS:
            raise InputError(f"weight rounding {weight_rounding!r}: choose one of {', '.join(WEIGHT_ROUNDINGS)}")
        self.weight_rounding = weight_rounding

    def requires(self, model: OnnxModel) -> None:
        for scope in model.index.scopes:
            for node in scope.nodes:
                if node.op_type in _QUANTIZATION_OPS:
                    raise InputError(
                        f"the model already holds quantization ({node.op_type} '{node.name or node.output[0]}'); "
                        f"quantize the floating-point model instead"
                    )

    def call(self, model: OnnxModel) -> PassResult:
        from nmdeploy.calibration.activation_statistics import activation_histograms_and_rows
        from nmdeploy.calibration.batch_probe import rows_that_run

        rows: list[ReportRow] = []
        # Q/DQ take fp16 scales and inputs from opset 19 on, whatever the precision.
        half = TensorProto.FLOAT16 in set(tensor_types(model.proto).values())
        raised = _raise_opset(model, max(MINIMUM_OPSET[self.precision], 19 if half else 0))
        if raised:
            rows.append(OpsetRaised(*raised))
        model.check_finite(weight.tensor for weight in find_prunable_weights(model.proto, model.index).weights)
        compliant_before = {row.weight for row in inspect_model(model, "2:4").rows if row.compliant == 1.0}
        plan = self._plan(model)
        if not plan.quantized:
            reasons = sorted({layer.skipped for layer in plan.layers if layer.skipped})
            raise InputError(
                "nothing to quantize: no Conv, Gemm or MatMul with a stored fp32/fp16 weight"
                + (f" ({reasons[0]})" if reasons else "")
            )
        # One data object for every run below, fed one row at a time to a model that runs only at batch 1.
        calibration = self.calibration
        if not isinstance(calibration, CalibrationSplit):  # a split was made from data probed already
            calibration = rows_that_run(model, CalibrationData.of(calibration, model.proto, self.batch_size))
        if self.smooth:
            rows.extend(smooth_layer_inputs(model, plan, calibration, self.batch_size, self.smoothing_strength))
            plan = self._plan(model)
        weight_scales: dict[str, np.ndarray] = {}
        if self.weight_rounding == "gptq":
            weight_scales, rounded = round_weights(model, plan, calibration, self.precision, self.batch_size)
            rows.extend(rounded)
        types = tensor_types(model.proto)
        gemm_weights = _gemm_input_weights(model, plan) if self.method == "auto" else {}
        histograms, row_samples, samples = activation_histograms_and_rows(
            model, plan.activations, gemm_weights, calibration, batch_size=self.batch_size
        )
        if not samples:
            raise InputError(f"{self.calibration}: no calibration samples")
        amax, methods = {}, {}
        for name, histogram in histograms.items():
            sample = row_samples.get(name)
            if sample is not None and sample.values is not None:
                methods[name], amax[name] = choose_range(
                    histogram, sample.values, gemm_weights[name], self.precision, percentile=self.percentile
                )
                continue
            methods[name] = self.method if self.method != "auto" else FALLBACK_METHODS[self.precision]
            amax[name] = activation_amax(histogram, methods[name], self.precision, percentile=self.percentile)
        rescaled: dict[str, Rescaling] = {}
        if self.rescale_outputs and self.output_error_limit is not None:
            lossy = lossy_outputs(plan, histograms, amax, self.precision, self.output_error_limit)
            rescaled = rescale_outputs(model, plan, lossy, calibration, self.batch_size)
            if rescaled:
                again, _, _ = activation_histograms_and_rows(
                    model, rescaled, (), calibration, batch_size=self.batch_size
                )
                for name, rescaling in rescaled.items():
                    histograms[name] = again[name]
                    methods[name] = FALLBACK_METHODS[self.precision] if self.method == "auto" else self.method
                    amax[name] = activation_amax(again[name], methods[name], self.precision, percentile=self.percentile)
                    rescaling.row.lost_after = relative_error(again[name], amax[name], self.precision)
        keep_lossy_outputs_float(plan, histograms, amax, self.precision, self.output_error_limit, rescaled)
        rescaled = undo_unpaired(model, plan, rescaled)
        for rescaling in rescaled.values():  # a weight divided per output channel is on its grid divided alike
            name = rescaling.replaced[0][0].name
            if name in weight_scales:
                weight_scales[name] = weight_scales[name] / rescaling.factor
        rows.extend(rescaling.row for rescaling in rescaled.values())
        for name, reads in plan.activations.items():
            rows.append(
                QuantizedActivation(
                    name,
                    methods[name] if self.method != "auto" else f"auto: {methods[name]}",
                    float(amax[name]),
                    histograms[name].max_abs,
                    float(scales_for(amax[name], self.precision)),
                    list(dict.fromkeys(node.name or node.op_type for node, _ in reads)),
                )
            )
        insert_pairs(model, plan, amax, types, self.precision, weight_scales)
        scale_back(model, {name: rescaling.factor for name, rescaling in rescaled.items()}, types)
        after = {row.weight: row for row in inspect_model(model, "2:4").rows}
        _check_pattern_kept(after, compliant_before)
        layer_rows = quantized_layer_rows(model, plan, self.precision, after)
        rows.extend(layer_rows)
        rows.append(
            QuantizationSummary(
                self.precision,
                self.method,
                len(layer_rows),
                len(plan.quantized),
                sum(row.sparse_integer for row in layer_rows),
                len(plan.activations),
                samples,
            )
        )
        return PassResult(model, True, rows)

    def _plan(self, model: OnnxModel) -> QuantizationPlan:
        named = set(self.layers or ()) | set(self.float_outputs)
        if named:
            known = {w.name for w in find_prunable_weights(model.proto, model.index).weights}
            known |= {node.name for node in model.index.main.nodes if node.op_type in WEIGHTED_OPS}
            unknown = sorted(named - known)
            if unknown:
                raise InputError(
                    f"no Conv, Gemm or MatMul layer or weight named {unknown[0]!r}; name layers by weight or node name"
                )
        return plan_quantization(
            model,
            keep_ops=self.keep_ops,
            quantize_residuals=self.quantize_residuals,
            layers=self.layers,
            float_outputs=self.float_outputs,
            quantize_raw_input=self.quantize_raw_input,
            quantize_outputs=self.layer_outputs == "quantized",
        )

    def ensures(self, result: PassResult) -> None:
        check_structure(result.model.proto)


def _check_pattern_kept(after: dict[str, WeightRow], compliant_before: set[str]) -> None:
    """Every weight that was 2:4 before quantization is 2:4 behind its DequantizeLinear in the quantized model's
    inspection ``after`` (a bug otherwise, not a user error); checked inside the pass because only the pass saw the
    model before it changed."""
    lost = [name for name in sorted(compliant_before) if after.get(name) is None or after[name].compliant != 1.0]
    if lost:
        raise PostconditionError(f"quantization broke the 2:4 pattern of {lost[:3]}")


def quantize_model(model: OnnxModel, **options) -> PassResult:
    """Python API mirror of ``nmdeploy quantize``: run :class:`QuantizePass` with ``options`` on ``model``."""
    return QuantizePass(**options)(model)


def _raise_opset(model: OnnxModel, minimum: int) -> tuple[int, int] | None:
    """Raise the default-domain opset to ``minimum`` with onnx's version converter; refuse when it cannot."""
    before = default_opset(model.proto)
    if before >= minimum:
        return None
    from onnx import version_converter

    try:
        converted = version_converter.convert_version(model.proto, minimum)
    except Exception as error:  # the converter raises RuntimeError/ValueError/ConvertError by adapter
        raise InputError(
            f"Q/DQ of this precision needs opset {minimum}, the model has {before} and onnx's version converter "
            f"cannot raise it ({str(error).splitlines()[0][:120]}); re-export the model at opset {minimum}"
        ) from None
    model.proto.CopyFrom(converted)
    model.index.mark_stale()
    return before, minimum


def _gemm_input_weights(model: OnnxModel, plan: QuantizationPlan) -> dict[str, list[np.ndarray]]:
    """For each planned activation read only as the input of quantized 2-D MatMul/Gemm layers: their weights as
    [K, N] float matrices (the "auto" method judges ranges by these layers' outputs)."""
    readers: dict[str, list[PlannedLayer]] = {}
    for layer in plan.quantized:
        readers.setdefault(layer.node.input[0], []).append(layer)
    found = {}
    for name, reads in plan.activations.items():
        layers = readers.get(name, [])
        nodes = {id(layer.node) for layer in layers}
        if not layers or any(id(node) not in nodes or position != 0 for node, position in reads):
            continue
        if any(layer.node.op_type == "Conv" or len(layer.weight.shape) != 2 for layer in layers):
            continue
        matrices = []
        for layer in layers:
            values = np.asarray(model.read(layer.weight.tensor), dtype=np.float32)
            matrices.append(np.moveaxis(values, layer.weight.axis, 0))
        found[name] = matrices
    return found


@dataclass
class QuantizeOutcome:
    output: Path
    report: list[ReportRow]

    @property
    def layers(self) -> list[QuantizedLayer]:
        return [row for row in self.report if isinstance(row, QuantizedLayer)]

    @property
    def activations(self) -> list[QuantizedActivation]:
        return [row for row in self.report if isinstance(row, QuantizedActivation)]

    @property
    def summary(self) -> QuantizationSummary:
        return next(row for row in self.report if isinstance(row, QuantizationSummary))


def quantize_model_file(model: str | Path, output: str | Path, **options) -> QuantizeOutcome:
    """Load ``model``, quantize it (:class:`QuantizePass` ``options``) and save it to ``output`` atomically; any
    error leaves nothing written."""
    loaded = OnnxModel.load(model)
    loaded.check_save_target(output)
    result = QuantizePass(**options)(loaded)
    return QuantizeOutcome(loaded.save(output), result.report)
