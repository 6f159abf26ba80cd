"""Explicit INT8 / FP8 quantization (QuantizeLinear/DequantizeLinear pairs) placed as TensorRT's strongly typed,
explicitly quantized networks want it, so that 2:4 layers can run structured-sparse integer kernels.

Weights of Conv, Gemm and MatMul layers (the weight on the second input) are stored quantized with one symmetric
scale per output channel (zero point 0), on the axis the graph model gives for the layer's output channels, and
read through a DequantizeLinear. Zero quantizes to zero, so a 2:4 weight stays exactly 2:4 (checked after the
pass, behind the DequantizeLinear, as ``inspect`` sees it).

Activations get one per-tensor scale from calibration data. TensorRT picks sparse INT8 kernels only for a GEMM
that is INT8 in *and* INT8 out, so a pair goes on the input of every quantized layer, and on the output at the end
of its epilogue (bias, BatchNormalization, activation functions, GELU written out as Erf: what TensorRT fuses into
the GEMM), unless the output already reaches quantized layers only, through data-movement ops, or feeds an op kept
off Q/DQ (Softmax, LayerNorm, ...: ``keep_ops``), or is a graph output. With ``quantize_residuals`` a residual
Add reading a quantized layer's output gets its other input quantized as well, so TensorRT can fuse the Add; it is
off by default because it quantizes the residual stream too (on the 2:4 MiniLM it cost 0.05 of mean embedding
cosine) and the layers are INT8 in and out without it. Each layer's report says whether it is
"2:4 + INT8 in/out: eligible for sparse integer kernels", and otherwise why not.

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
import onnx
from onnx import TensorProto, helper

from nmdeploy.conversion.data import CalibrationData, Source
from nmdeploy.errors import InputError
from nmdeploy.graph.dtypes import QUANTIZABLE_FLOAT_TYPES as _FLOAT_TYPES
from nmdeploy.graph.eligibility import tensorrt_verdict
from nmdeploy.graph.index import SUBGRAPH, GraphIndex
from nmdeploy.graph.inspection import inspect_model
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.tensors import transposable_axes
from nmdeploy.graph.weights import PrunableWeight, find_prunable_weights
from nmdeploy.passes.base import Pass, PassResult, ReportRow, optional
from nmdeploy.passes.cast import decomposed_layer_norms, default_opset, tensor_types
from nmdeploy.passes.quantization_ranges import (
    DEFAULT_PERCENTILE,
    METHODS,
    activation_amax,
    channel_amax,
    check_precision,
    choose_range,
    quantize,
    relative_error,
    scales_for,
    smoothing_scales,
)

log = logging.getLogger(__name__)

QUANTIZED_TYPES: dict[str, int] = {"int8": TensorProto.INT8, "fp8": TensorProto.FLOAT8E4M3FN}
MINIMUM_OPSET: dict[str, int] = {"int8": 13, "fp8": 19}  # per-axis Q/DQ: 13; FLOAT8E4M3FN Q/DQ: 19
DEFAULT_METHODS: dict[str, str] = {"int8": "auto", "fp8": "max"}
"""Activation range method by precision. "auto" judges each GEMM input's candidate ranges (max, percentile, mse,
entropy) by the error they cause in the layers' outputs on a sample of calibration rows, and gives other tensors
FALLBACK_METHODS' range. One-shot 2:4 MiniLM, INT8 with smoothing 0.85 and lossy outputs kept float, mean embedding
cosine to dense on text of the calibration's kind / another kind: entropy everywhere 0.8993 / 0.7588, auto 0.9000 /
0.7635 (2:4 fp32 0.9021 / 0.7682); before smoothing, entropy beat mse and max (0.852, 0.792, 0.788). FP8 E4M3's
exponent covers the outliers that INT8 must clip, so it keeps max (0.8999 / 0.7661)."""
FALLBACK_METHODS: dict[str, str] = {"int8": "entropy", "fp8": "max"}
DEFAULT_SMOOTH: dict[str, bool] = {"int8": True, "fp8": False}
DEFAULT_SMOOTHING_STRENGTH = 0.85
"""SmoothQuant by precision, and its strength. One-shot 2:4 MiniLM, INT8 entropy, mean embedding cosine to dense
on text of the calibration's kind / another kind: no smoothing 0.847 / 0.712, strength 0.85 0.890 / 0.746, strength 1
0.893 / 0.745 (2:4 fp32: 0.902 / 0.768). FP8 E4M3 without it: 0.900 / 0.766."""
DEFAULT_KEEP_OPS: frozenset[str] = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "RMSNormalization",
        "SkipLayerNormalization",
    }
)
"""Ops whose inputs get no Q/DQ: TensorRT runs them (and their fused neighbours) better in floating point."""

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
# Ops TensorRT fuses into a GEMM's or convolution's epilogue when their other inputs are constants.
_EPILOGUE_OPS = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Relu",
        "LeakyRelu",
        "Clip",
        "Sigmoid",
        "Tanh",
        "Erf",
        "Pow",
        "Gelu",
        "HardSigmoid",
        "HardSwish",
        "Elu",
        "Selu",
        "BatchNormalization",
    }
)
# Ops that move data without computing on it: Q/DQ propagates through them, so quantized values pass unchanged.
_DATA_MOVEMENT_OPS = frozenset({"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity", "MaxPool"})
_WEIGHTED_OPS = ("Conv", "Gemm", "MatMul")
OUTPUT_ERROR_LIMIT = 0.05
"""A layer output whose Q/DQ would lose more than this share of its energy on the calibration data is rescaled per
channel (``rescale_outputs``: its outlier channels divided out of the weight's columns and bias, multiplied back
after the DequantizeLinear), or, where that cannot be done, kept in floating point (the layer INT8 in, fp16 out).
On the one-shot 2:4 MiniLM the FFN down-projections' outputs before the residual Add lose 8-76 % to entropy ranges
(max ranges are worse: 3-7 outlier channels per layer, 19-107x the median channel, hold most of the energy; the
outliers Bondarenko et al. 2021 found in BERT's FFN outputs); every other tensor loses under 5 %, most under 0.1 %.
Mean embedding cosine (calibration's kind / another kind; 2:4 fp32 0.9021 / 0.7682): pairs kept 0.8903 / 0.7457,
outputs kept float 0.8993 / 0.7588 (30 of 36 layers INT8 in/out), rescaled 0.8997 / 0.7630 with auto ranges (36 of
36; after rescaling they lose 0.03-0.04 %)."""
RAW_INPUT_CHANNELS = 4
"""A layer reading a graph input with this many channels or fewer stays in floating point unless asked: measured on
the 2:4 digits CNN (one-channel images), FP8 with the first convolution quantized 98.67 % top-1, kept 98.89 % (2:4
fp32 99.11 %); INT8 99.11 % either way."""
_EPILOGUE_LIMIT = 16  # nodes: an erf GELU is 5, bias + BatchNormalization + activation 3


@dataclass
class QuantizedLayer(ReportRow):
    """A weighted layer: the precision of its weight, input and output, its pattern, and whether TensorRT can run
    it on sparse integer (or FP8) kernels, with the reasons when not."""

    item: str = field(default="layer", init=False)
    node: str
    op_type: str
    weight: str
    weight_precision: str  # "int8", "fp8", or "float" when left unquantized
    input: str
    output: str
    pattern: str  # "2:4", or the fraction of 2:4 groups, or "dense"
    sparse_integer: bool
    verdict: str
    notes: str | None = optional()


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
class SmoothedActivation(ReportRow):
    """An activation divided per channel by SmoothQuant factors (a Mul before its Q/DQ), the layers reading it
    given the factors in their weights' rows."""

    item: str = field(default="smoothing", init=False)
    tensor: str
    layers: list[str]
    strength: float
    largest_factor: float
    smallest_factor: float


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


@dataclass
class _Layer:
    node: onnx.NodeProto
    weight: PrunableWeight
    channel_axis: int | None  # the weight's output-channel axis in stored coordinates; None when not quantized
    skipped: str | None = None  # why the layer is not quantized
    output: str | None = None  # the quantized value standing for the layer's output (end of its epilogue)
    output_reason: str | None = None  # why the output stays in floating point


@dataclass
class QuantizationPlan:
    """Where the Q/DQ pairs go: the weighted layers (quantized or not, and why) and, per activation tensor to
    quantize, the (node, input position) reads that take the dequantized value."""

    layers: list[_Layer]
    activations: dict[str, list[tuple[onnx.NodeProto, int]]]

    @property
    def quantized(self) -> list[_Layer]:
        return [layer for layer in self.layers if layer.skipped is None]


def plan_quantization(
    model: OnnxModel,
    *,
    keep_ops: Iterable[str] = DEFAULT_KEEP_OPS,
    quantize_residuals: bool = False,
    layers: Collection[str] | None = None,
    float_outputs: Mapping[str, str] | None = None,
    quantize_raw_input: bool = False,
) -> QuantizationPlan:
    """Decide, from the graph alone, which weights and activations get Q/DQ pairs (see the module docstring).

    ``layers``: quantize only the layers named (weight or node names; None: every one that can be). ``float_outputs``:
    layers (weight or node names) whose output stays in floating point, each with the reason the report gives.
    ``quantize_raw_input``: quantize a first layer reading the model's few-channel input too (RAW_INPUT_CHANNELS)."""
    index = model.index
    keep = frozenset(keep_ops)
    types = tensor_types(model.proto)
    layers = _weighted_layers(model, types, layers, quantize_raw_input)
    float_outputs = dict(float_outputs or {})
    main = index.main
    activations: dict[str, list[tuple[onnx.NodeProto, int]]] = {}

    def add(tensor: str, node: onnx.NodeProto, position: int) -> None:
        reads = activations.setdefault(tensor, [])
        if not any(known is node and known_position == position for known, known_position in reads):
            reads.append((node, position))

    for layer in layers:
        if layer.skipped is None:
            add(layer.node.input[0], layer.node, 0)
    layer_inputs = {id(layer.node) for layer in layers if layer.skipped is None}
    layer_norms = {id(main.nodes[position]) for position in decomposed_layer_norms(index)}
    outputs = set(index.graph_outputs)
    for layer in layers:
        if layer.skipped is not None:
            continue
        kept_float = float_outputs.get(layer.weight.name, float_outputs.get(layer.node.name))
        if kept_float is not None:
            layer.output_reason = kept_float
            continue
        end = _epilogue_end(index, layer.node.output[0], outputs)
        onward = _through_data_movement(index, end, outputs)
        onward_readers = main.consumer_nodes(onward)
        if (
            onward not in outputs
            and onward_readers
            and all(id(r) in layer_inputs and r.input[0] == onward for r in onward_readers)
        ):
            layer.output = onward  # the next layers' input Q/DQ quantizes it
            continue
        kept = [r for r in main.consumer_nodes(end) if r.op_type in keep or id(r) in layer_norms]
        if end in outputs:
            layer.output_reason = "its output is a graph output, kept in floating point"
        elif kept:
            what = "a decomposed LayerNorm" if id(kept[0]) in layer_norms else kept[0].op_type
            layer.output_reason = f"its output feeds {what}, kept off Q/DQ"
        elif any(use.position == SUBGRAPH for use in main.consumers(end)):
            layer.output_reason = "its output is read inside a subgraph"
        elif types.get(end) not in _FLOAT_TYPES:
            layer.output_reason = "the type of its output is not known to be fp32 or fp16"
        else:
            layer.output = end
            for use in main.consumers(end):
                add(end, main.nodes[use.node], use.position)
    if quantize_residuals:
        layer_outputs = {layer.output for layer in layers if layer.output}
        for node in main.nodes:
            if node.op_type != "Add" or len(node.input) != 2 or not any(name in layer_outputs for name in node.input):
                continue
            for position, name in enumerate(node.input):
                if name in activations or (index.stored(name) is None and types.get(name) in _FLOAT_TYPES):
                    add(name, node, position)
    return QuantizationPlan(layers, activations)


def _weighted_layers(
    model: OnnxModel, types: dict[str, int], selected: Collection[str] | None, quantize_raw_input: bool
) -> list[_Layer]:
    """Every Conv/Gemm/MatMul reading a stored weight on its second input, and why it is not quantized if so (it
    cannot be, or it is not among the ``selected`` weight or node names)."""
    index = model.index
    main = index.main
    outputs = set(index.graph_outputs)
    inputs = {value.name for value in model.proto.graph.input}
    layers = []
    for weight in find_prunable_weights(model.proto, index).weights:
        reason = _weight_reason(weight, main, outputs)
        axes = transposable_axes(weight) if reason is None else (None, None)
        for use in weight.uses:
            if use.op_type not in _WEIGHTED_OPS or use.input_index != 1 or use.consumer is None:
                continue
            layer_reason = reason
            if layer_reason is None and (index.stored(use.consumer.input[0]) is not None):
                layer_reason = "its input is a stored constant, not an activation"
            if layer_reason is None and types.get(use.consumer.input[0]) not in _FLOAT_TYPES:
                layer_reason = "its input is not known to be fp32 or fp16"
            if layer_reason is None and not quantize_raw_input and _reads_raw_input(use.consumer, weight, inputs):
                channels = weight.shape[weight.axis]
                layer_reason = (
                    f"it reads the model's input directly with {channels} channel(s) (raw data such as pixels), kept "
                    "in floating point as TensorRT deployments keep the first layer (quantize_raw_input quantizes it)"
                )
            if layer_reason is None and selected is not None and not {weight.name, use.consumer.name} & set(selected):
                layer_reason = "kept in floating point: not among the layers chosen to quantize"
            layers.append(_Layer(use.consumer, weight, axes[1], layer_reason))
    return layers


def _reads_raw_input(node: onnx.NodeProto, weight: PrunableWeight, inputs: set[str]) -> bool:
    """A layer reading a graph input with at most ``RAW_INPUT_CHANNELS`` channels: the first convolution of an image
    model, where quantizing the pixels costs fidelity and TensorRT gains little on so few channels."""
    return node.input[0] in inputs and weight.axis is not None and weight.shape[weight.axis] <= RAW_INPUT_CHANNELS


def _weight_reason(weight: PrunableWeight, main, outputs: set[str]) -> str | None:
    if weight.graph != "main":
        return f"the weight is stored in {weight.graph}"
    if weight.dtype not in _FLOAT_TYPES.values():
        return f"weight dtype {weight.dtype} (fp32 or fp16 weights are quantized)"
    if weight.needs_transposable:
        return "the weight is shared by layers that reduce over different axes"
    if any(use.op_type not in _WEIGHTED_OPS or use.input_index != 1 for use in weight.uses):
        return "the weight is also read as a first GEMM input or by a ConvTranspose"
    if weight.name in outputs or any(use.position == SUBGRAPH for use in main.consumers(weight.name)):
        return "the weight is a graph output or read inside a subgraph"
    return None


def _epilogue_end(index: GraphIndex, start: str, outputs: set[str]) -> str:
    """The value at the end of what TensorRT fuses after a GEMM producing ``start``: the last value that is the
    only one leaving a growing region of epilogue ops reading only the region, ``start`` and stored constants."""
    main = index.main
    region: list[onnx.NodeProto] = []
    made = {start}
    end = start
    while len(region) < _EPILOGUE_LIMIT:
        candidates = [
            node
            for value in made
            for node in main.consumer_nodes(value)
            if node.op_type in _EPILOGUE_OPS
            and node.domain in ("", "ai.onnx")
            and all(node is not r for r in region)
            and all(name in made or index.stored(name) is not None for name in node.input if name)
        ]
        if not candidates:
            break
        node = candidates[0]
        region.append(node)
        made.update(name for name in node.output if name)
        leaving = [
            value
            for value in made
            if value in outputs or any(all(r is not n for n in region) for r in main.consumer_nodes(value))
        ]
        if len(leaving) == 1 and leaving[0] != start:
            end = leaving[0]
    return end


def _through_data_movement(index: GraphIndex, value: str, outputs: set[str]) -> str:
    """Follow ``value`` through a chain of single-reader data-movement ops (Reshape, Transpose, MaxPool, ...)."""
    main = index.main
    while value not in outputs:
        readers = main.consumer_nodes(value)
        if len(readers) != 1 or readers[0].op_type not in _DATA_MOVEMENT_OPS or readers[0].input[0] != value:
            break
        value = readers[0].output[0]
    return value


class QuantizePass(Pass):
    """Quantize weights per output channel and activations per tensor (ranges from ``calibration``: an .npz, a
    folder of them, "random", an iterable of feed dicts, or the :class:`CalibrationData` of a conversion, whose
    fit rows are read) to ``precision`` ("int8" or "fp8"), with Q/DQ pairs placed for TensorRT."""

    name = "quantize"

    def __init__(
        self,
        *,
        calibration: Source | CalibrationData,
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
    ):
        self.precision = check_precision(precision)
        method = method or DEFAULT_METHODS[precision]
        if method not in METHODS:
            raise InputError(f"unknown range method {method!r}; choose one of {', '.join(METHODS)}")
        if method == "entropy" and precision != "int8":
            raise InputError(f"the entropy method searches INT8 levels; use max, percentile or mse for {precision}")
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
        self._compliant_before: set[str] = set()

    def requires(self, model: OnnxModel) -> None:
        for scope in model.index.scopes:
            for node in scope.nodes:
                if node.op_type in _QUANTIZATION_OPS:
                    raise InputError(
                        f"the model already holds quantization ({node.op_type} '{node.name or node.output[0]}'); "
                        f"quantize the floating-point model instead"
                    )

    def call(self, model: OnnxModel) -> PassResult:
        from nmdeploy.passes.activation_statistics import activation_histograms_and_rows

        rows: list[ReportRow] = []
        # Q/DQ take fp16 scales and inputs from opset 19 on, whatever the precision.
        half = TensorProto.FLOAT16 in set(tensor_types(model.proto).values())
        raised = _raise_opset(model, max(MINIMUM_OPSET[self.precision], 19 if half else 0))
        if raised:
            rows.append(OpsetRaised(*raised))
        model.check_finite(weight.tensor for weight in find_prunable_weights(model.proto, model.index).weights)
        self._compliant_before = {row.weight for row in inspect_model(model, "2:4").rows if row.compliant == 1.0}
        plan = self._plan(model)
        if not plan.quantized:
            reasons = sorted({layer.skipped for layer in plan.layers if layer.skipped})
            raise InputError(
                "nothing to quantize: no Conv, Gemm or MatMul with a stored fp32/fp16 weight"
                + (f" ({reasons[0]})" if reasons else "")
            )
        if self.smooth:
            rows.extend(_smooth(model, plan, self.calibration, self.batch_size, self.smoothing_strength))
            plan = self._plan(model)
        types = tensor_types(model.proto)
        gemm_weights = _gemm_input_weights(model, plan) if self.method == "auto" else {}
        histograms, row_samples, samples = activation_histograms_and_rows(
            model, plan.activations, gemm_weights, self.calibration, batch_size=self.batch_size
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
        rescaled: dict[str, _Rescaling] = {}
        if self.rescale_outputs and self.output_error_limit is not None:
            lossy = _lossy_outputs(plan, histograms, amax, self.precision, self.output_error_limit)
            rescaled = _rescale_outputs(model, plan, lossy, self.calibration, self.batch_size)
            if rescaled:
                again, _, _ = activation_histograms_and_rows(
                    model, rescaled, (), self.calibration, batch_size=self.batch_size
                )
                for name, rescaling in rescaled.items():
                    histograms[name] = again[name]
                    methods[name] = FALLBACK_METHODS[self.precision] if self.method == "auto" else self.method
                    amax[name] = activation_amax(again[name], methods[name], self.precision, percentile=self.percentile)
                    rescaling.row.lost_after = relative_error(again[name], amax[name], self.precision)
        _keep_lossy_outputs_float(plan, histograms, amax, self.precision, self.output_error_limit, rescaled)
        # The division of a rescaled output's channels is only half of a pair whose other half, the Mul after the
        # output's DequantizeLinear, exists only while that output keeps its Q/DQ. Where the output stays floating
        # point after all, the division is undone (the stored weight and bias restored exactly as they were), so the
        # float layer computes what the original did; leaving the division behind loses the Mul and changes the
        # model's output, and keeping a Mul on a float path would cost a node for nothing.
        for name in [name for name in rescaled if name not in plan.activations]:
            rescaled.pop(name).undo(model)
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
        _rewrite(model, plan, amax, types, self.precision)
        _scale_back(model, {name: rescaling.factor for name, rescaling in rescaled.items()}, types)
        layer_rows = _layer_rows(model, plan, self.precision)
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
            known |= {node.name for node in model.index.main.nodes if node.op_type in _WEIGHTED_OPS}
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
        )

    def ensures(self, result: PassResult) -> None:
        after = {row.weight: row for row in inspect_model(result.model, "2:4").rows}
        lost = [name for name in self._compliant_before if after.get(name) is None or after[name].compliant != 1.0]
        if lost:
            raise AssertionError(f"quantization broke the 2:4 pattern of {lost[:3]}")
        onnx.checker.check_model(result.model.proto, full_check=False)


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


def _smooth(
    model: OnnxModel, plan: QuantizationPlan, calibration, batch_size: int | None, strength: float
) -> list[SmoothedActivation]:
    """SmoothQuant on the inputs of quantized MatMul/Gemm layers that nothing else reads quantized: each channel of
    the input is divided by s (a Mul before its Q/DQ) and the matching rows (reduction axis) of the layers' weights
    multiplied by s, so the product is unchanged and zeros stay zeros (2:4 is kept)."""
    from nmdeploy.passes.activation_statistics import activation_channel_max

    index = model.index
    by_input: dict[str, list[_Layer]] = {}
    for layer in plan.quantized:
        by_input.setdefault(layer.node.input[0], []).append(layer)
    candidates = {}
    for name, layers in by_input.items():
        nodes = {id(layer.node) for layer in layers}
        weights = {id(layer.weight): layer.weight for layer in layers}.values()
        row_channels = {w.shape[w.axis] for w in weights if w.axis is not None}
        if (
            all(
                layer.node.op_type in ("MatMul", "Gemm") and not _attribute(layer.node, "transA", 0) for layer in layers
            )
            and all(id(node) in nodes and position == 0 for node, position in plan.activations.get(name, []))
            and all(use.consumer is not None and id(use.consumer) in nodes for w in weights for use in w.uses)
            and len(row_channels) == 1
        ):
            candidates[name] = (layers, list(weights), row_channels.pop())
    maxima, _ = activation_channel_max(model, candidates, calibration, batch_size=batch_size)
    types = tensor_types(model.proto)
    after: dict[str, list[onnx.NodeProto]] = {}
    rows = []
    for name, (layers, weights, channels) in candidates.items():
        activation = maxima[name].values
        if activation is None or activation.shape != (channels,):
            continue
        weight_max = np.max([channel_amax(model.read(w.tensor), w.axis) for w in weights], axis=0)
        factors = smoothing_scales(activation, weight_max, strength)
        for weight in weights:
            values = model.read(weight.tensor)
            shape = [-1 if d == weight.axis else 1 for d in range(values.ndim)]
            model.write(weight.tensor, (values.astype(np.float32) * factors.reshape(shape)).astype(values.dtype))
        inverse = index.add_initializer(
            onnx.numpy_helper.from_array(
                (1.0 / factors).astype(_numpy_float(types[name])), index.fresh_name(f"{name}_smoothing")
            )
        )
        smoothed = index.fresh_name(f"{name}_smoothed")
        after.setdefault(name, []).append(
            helper.make_node("Mul", [name, inverse.name], [smoothed], name=index.fresh_name(f"{name}/Smooth"))
        )
        for layer in layers:
            layer.node.input[0] = smoothed
        rows.append(
            SmoothedActivation(
                name,
                [layer.node.name or layer.node.op_type for layer in layers],
                strength,
                float(factors.max()),
                float(factors.min()),
            )
        )
    _insert_after_producers(index, after)
    return rows


def _gemm_input_weights(model: OnnxModel, plan: QuantizationPlan) -> dict[str, list[np.ndarray]]:
    """For each planned activation read only as the input of quantized 2-D MatMul/Gemm layers: their weights as
    [K, N] float matrices (the "auto" method judges ranges by these layers' outputs)."""
    readers: dict[str, list[_Layer]] = {}
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


def _lossy_outputs(
    plan: QuantizationPlan, histograms, amax: dict[str, float], precision: str, limit: float
) -> dict[str, tuple[_Layer, float]]:
    """The layer outputs (that no quantized layer reads) whose pair would lose more than ``limit`` of their energy,
    with their layer and the share lost."""
    inputs = {layer.node.input[0] for layer in plan.quantized}
    found = {}
    for layer in plan.quantized:
        name = layer.output
        if name is None or name in inputs or name not in histograms:
            continue
        lost = relative_error(histograms[name], amax[name], precision)
        if lost > limit:
            found[name] = (layer, lost)
    return found


@dataclass
class RescaledOutput(ReportRow):
    """A layer output whose outlier channels were divided by per-channel factors (folded into the layer's weight
    columns and bias) so that one per-tensor range holds it, and multiplied back after its DequantizeLinear."""

    item: str = field(default="rescaled output", init=False)
    tensor: str
    layer: str
    channels: int  # channels divided by a factor above 1
    largest_factor: float
    lost_before: float
    lost_after: float | None = optional()


@dataclass
class _Rescaling:
    """One output's per-channel division: its factors, its report row, and the stored values it replaced (so that
    :meth:`undo` can put them back bit for bit, fp16 included)."""

    factor: np.ndarray
    row: RescaledOutput
    replaced: list[tuple[TensorProto, np.ndarray]]

    def undo(self, model: OnnxModel) -> None:
        for tensor, values in self.replaced:
            model.write(tensor, values)


def _rescale_outputs(
    model: OnnxModel, plan: QuantizationPlan, lossy: dict[str, tuple[_Layer, float]], calibration, batch_size
) -> dict[str, _Rescaling]:
    """Divide each lossy output's channels above twice the median channel max by their excess (in the layer's
    weight columns and bias: a MatMul/Gemm with at most a bias Add after it), so the Q/DQ after the epilogue stays
    (INT8 out, as sparse integer kernels need); :func:`_scale_back` multiplies them back after the DequantizeLinear,
    and a division whose output ends up without its pair must be undone (:meth:`_Rescaling.undo`). Only where the
    weight and bias have no other reader."""
    from nmdeploy.passes.activation_statistics import activation_channel_max

    eligible = {}
    for name, (layer, lost) in lossy.items():
        bias = _bias_only_epilogue(model, layer, name)
        if bias is not False and len(layer.weight.uses) == 1 and layer.channel_axis is not None:
            eligible[name] = (layer, lost, bias)
    if not eligible:
        return {}
    maxima, _ = activation_channel_max(model, eligible, calibration, batch_size=batch_size)
    found = {}
    for name, (layer, lost, bias) in eligible.items():
        channel_max = maxima[name].values
        channels = layer.weight.shape[layer.channel_axis]
        if channel_max is None or channel_max.shape != (channels,):
            continue
        factor = np.maximum(channel_max / max(2.0 * float(np.median(channel_max)), 1e-30), 1.0).astype(np.float32)
        if not (factor > 1.0).any():
            continue
        values = model.read(layer.weight.tensor)
        shape = [-1 if d == layer.channel_axis else 1 for d in range(values.ndim)]
        model.write(layer.weight.tensor, (values.astype(np.float32) / factor.reshape(shape)).astype(values.dtype))
        replaced = [(layer.weight.tensor, values)]
        if bias is not None:
            stored = model.read(bias)
            model.write(bias, (stored.astype(np.float32) / factor).astype(stored.dtype))
            replaced.append((bias, stored))
        label = layer.node.name or layer.node.op_type
        row = RescaledOutput(name, label, int((factor > 1.0).sum()), float(factor.max()), lost)
        found[name] = _Rescaling(factor, row, replaced)
    return found


def _bias_only_epilogue(model: OnnxModel, layer: _Layer, end: str):
    """The stored bias tensor when ``end`` is the layer's MatMul/Gemm output plus a stored per-channel bias (None
    when ``end`` is the product itself); False for any other epilogue (an activation function does not commute with
    a per-channel division)."""
    index = model.index
    main = index.main
    node = layer.node
    if node.op_type not in ("MatMul", "Gemm") or len(layer.weight.shape) != 2:
        return False
    if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
        return False  # Gemm's own bias input: not rescaled here
    if end == node.output[0]:
        return None
    add = main.producer(end)
    if add is None or add.op_type != "Add" or node.output[0] not in add.input:
        return False
    if len(main.consumer_nodes(node.output[0])) != 1:
        return False
    other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
    stored = index.stored(other)
    if stored is None or len(main.consumers(other)) != 1:
        return False
    channels = layer.weight.shape[layer.channel_axis]
    return stored.tensor if list(stored.tensor.dims) == [channels] else False


def _scale_back(model: OnnxModel, factors: dict[str, np.ndarray], types: dict[str, int]) -> None:
    """After each rescaled output's DequantizeLinear, a Mul by its factors: the readers see the original values."""
    if not factors:
        return
    index = model.index
    main = index.main
    after: dict[str, list[onnx.NodeProto]] = {}
    renamed: dict[str, str] = {}
    for name, factor in factors.items():
        quantizer = next(n for n in main.consumer_nodes(name) if n.op_type == "QuantizeLinear")
        dequantizer = next(n for n in main.consumer_nodes(quantizer.output[0]) if n.op_type == "DequantizeLinear")
        scale = index.add_initializer(
            onnx.numpy_helper.from_array(factor.astype(_numpy_float(types[name])), index.fresh_name(f"{name}_rescale"))
        )
        restored = index.fresh_name(f"{name}_restored")
        renamed[dequantizer.output[0]] = restored
        after[dequantizer.output[0]] = [
            helper.make_node(
                "Mul", [dequantizer.output[0], scale.name], [restored], name=index.fresh_name(f"{name}/Rescale")
            )
        ]
    readers = [(node, position) for node in main.nodes for position, value in enumerate(node.input) if value in renamed]
    for node, position in readers:
        node.input[position] = renamed[node.input[position]]
    _insert_after_producers(index, after)


def _keep_lossy_outputs_float(
    plan: QuantizationPlan,
    histograms,
    amax: dict[str, float],
    precision: str,
    limit: float | None,
    rescaled: Mapping[str, _Rescaling],
) -> None:
    """Drop the output pair of every layer whose output would still lose more than ``limit`` of its energy (and that
    no quantized layer reads), so that the layer is INT8 in, floating-point out, with the measured reason (for an
    output in ``rescaled``: the share lost as it was and the share still lost rescaled)."""
    if limit is None:
        return
    for name, (layer, lost) in _lossy_outputs(plan, histograms, amax, precision, limit).items():
        del plan.activations[name]
        layer.output = None
        rescaling = rescaled.get(name)
        if rescaling is None:
            share = _share(lost)
        else:
            share = f"{_share(rescaling.row.lost_before)} ({_share(lost)} with its outlier channels rescaled)"
        layer.output_reason = (
            f"its output would lose {share} of its energy to a per-tensor {precision.upper()} range on the "
            f"calibration data (outlier channels), kept in floating point"
        )


def _share(lost: float) -> str:
    """A share of energy as a percentage, with two decimals below 1 % (so a small limit never reads "0%")."""
    return f"{lost:.0%}" if lost >= 0.01 else f"{lost:.2%}"


def _insert_after_producers(index: GraphIndex, after: dict[str, list[onnx.NodeProto]]) -> None:
    """Put each list of new nodes right after the producer of its value (graph inputs and stored values: first),
    replacing the node list once."""
    main = index.main
    produced = {output for node in main.nodes for output in node.output}
    nodes = [new for name, added in after.items() if name not in produced for new in added]
    for node in list(main.nodes):
        nodes.append(node)
        for output in node.output:
            nodes.extend(after.get(output, []))
    index.set_nodes(nodes)


def _attribute(node: onnx.NodeProto, name: str, default):
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


def _rewrite(
    model: OnnxModel,
    plan: QuantizationPlan,
    amax: dict[str, float],
    types: dict[str, int],
    precision: str,
) -> None:
    """Store each planned weight quantized, read through a DequantizeLinear, and put a QuantizeLinear/
    DequantizeLinear pair after each planned activation's producer; the node list is replaced once, at the end,
    because node objects taken from the plan belong to the graph as it was."""
    index = model.index
    after: dict[str, list[onnx.NodeProto]] = {}  # new nodes to place after the producer of each value
    seen: set[int] = set()
    for layer in plan.quantized:
        if id(layer.weight) not in seen:
            seen.add(id(layer.weight))
            after.setdefault(layer.weight.name, []).append(
                _quantize_weight(model, layer.weight, layer.channel_axis, precision)
            )
    for name, reads in plan.activations.items():
        scale = index.add_initializer(
            onnx.numpy_helper.from_array(
                np.asarray(scales_for(amax[name], precision), dtype=_numpy_float(types[name])),
                index.fresh_name(f"{name}_scale"),
            )
        )
        zero = index.add_initializer(_zero_point(index.fresh_name(f"{name}_zero_point"), precision, None))
        quantized = index.fresh_name(f"{name}_quantized")
        dequantized = index.fresh_name(f"{name}_dequantized")
        after.setdefault(name, []).extend(
            [
                helper.make_node(
                    "QuantizeLinear",
                    [name, scale.name, zero.name],
                    [quantized],
                    name=index.fresh_name(f"{name}/QuantizeLinear"),
                ),
                helper.make_node(
                    "DequantizeLinear",
                    [quantized, scale.name, zero.name],
                    [dequantized],
                    name=index.fresh_name(f"{name}/DequantizeLinear"),
                ),
            ]
        )
        for node, position in reads:
            node.input[position] = dequantized
    _insert_after_producers(index, after)


def _quantize_weight(model: OnnxModel, weight: PrunableWeight, axis: int, precision: str) -> onnx.NodeProto:
    """Store the weight quantized per output channel (``axis``); its readers now read the returned
    DequantizeLinear's output."""
    index = model.index
    main = index.main
    values = model.read(weight.tensor).astype(np.float32)
    scales = scales_for(channel_amax(values, axis), precision)
    quantized = quantize(values, scales.reshape([-1 if d == axis else 1 for d in range(values.ndim)]), precision)
    float_type = weight.tensor.data_type
    name = weight.name
    readers = [(main.nodes[use.node], use.position) for use in main.consumers(name)]
    model.write_as(weight.tensor, quantized, QUANTIZED_TYPES[precision])
    scale = index.add_initializer(
        onnx.numpy_helper.from_array(scales.astype(_numpy_float(float_type)), index.fresh_name(f"{name}_scale"))
    )
    zero = index.add_initializer(_zero_point(index.fresh_name(f"{name}_zero_point"), precision, scales.size))
    dequantized = index.fresh_name(f"{name}_dequantized")
    for reader, position in readers:
        reader.input[position] = dequantized
    return helper.make_node(
        "DequantizeLinear",
        [name, scale.name, zero.name],
        [dequantized],
        name=index.fresh_name(f"{name}/DequantizeLinear"),
        axis=axis,
    )


def _layer_rows(model: OnnxModel, plan: QuantizationPlan, precision: str) -> list[QuantizedLayer]:
    """Each weighted layer's precision, pattern (measured on the quantized model) and sparse-kernel verdict."""
    inspection = {row.weight: row for row in inspect_model(model, "2:4").rows}
    weights = {weight.name: weight for weight in find_prunable_weights(model.proto, model.index).weights}
    label = precision.upper()
    rows = []
    for layer in plan.layers:
        name = layer.weight.name
        row = inspection.get(name)
        reasons: list[str] = []
        quantized = layer.skipped is None
        if not quantized:
            reasons.append(f"not quantized: {layer.skipped}")
        elif layer.output is None:
            reasons.append(f"{label} in, floating-point out ({layer.output_reason}): TensorRT falls back to fp16")
        verdict = tensorrt_verdict(weights[name], _pattern_2of4()) if name in weights else None
        if verdict is not None and not verdict.eligible:
            reasons.extend(f"TensorRT: {reason}" for reason in verdict.reasons)
        compliant = row.compliant if row is not None else None
        if compliant is None or compliant < 1.0:
            reasons.append("not 2:4" if not compliant else f"not 2:4 ({compliant:.0%} of groups)")
        pattern = "2:4" if compliant == 1.0 else "dense" if not compliant else f"{compliant:.0%} 2:4"
        eligible = not reasons
        hints = [h for h in (verdict.reasons if verdict and verdict.eligible else ()) if h.startswith("small layer")]
        kernels = "sparse integer kernels" if precision == "int8" else "sparse FP8 kernels"
        rows.append(
            QuantizedLayer(
                node=layer.node.name or layer.node.op_type,
                op_type=layer.node.op_type,
                weight=name,
                weight_precision=precision if quantized else "float",
                input=precision if quantized else "float",
                output=precision if quantized and layer.output else "float",
                pattern=pattern,
                sparse_integer=eligible,
                verdict=f"2:4 + {label} in/out: eligible for {kernels}"
                if eligible
                else f"not eligible for {kernels}: " + "; ".join(reasons),
                notes="; ".join(hints) or None,
            )
        )
    return rows


def _pattern_2of4():
    from nmdeploy.masks.pattern import Pattern

    return Pattern.parse("2:4")


def _numpy_float(data_type: int) -> np.dtype:
    return np.dtype(np.float16) if data_type == TensorProto.FLOAT16 else np.dtype(np.float32)


def _zero_point(name: str, precision: str, channels: int | None) -> TensorProto:
    shape = () if channels is None else (channels,)
    if precision == "int8":
        return onnx.numpy_helper.from_array(np.zeros(shape, dtype=np.int8), name)
    return helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, list(shape), [0.0] * (channels or 1))


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


def quantized_io(model: OnnxModel) -> dict[str, tuple[bool, bool]]:
    """For every Conv/Gemm/MatMul whose second input comes from a DequantizeLinear (a model quantized by any tool):
    (input quantized, output quantized) by the rules the pass places pairs by: the first input read from a
    DequantizeLinear; the end of the epilogue, followed through data-movement ops, read by QuantizeLinear nodes only."""
    index = model.index
    main = index.main
    outputs = set(index.graph_outputs)
    found = {}
    for node in main.nodes:
        if node.op_type not in _WEIGHTED_OPS or len(node.input) < 2:
            continue
        weight_producer = main.producer(node.input[1])
        if weight_producer is None or weight_producer.op_type != "DequantizeLinear":
            continue
        producer = main.producer(node.input[0])
        quantized_in = producer is not None and producer.op_type == "DequantizeLinear"
        end = _epilogue_end(index, node.output[0], outputs)
        readers = main.consumer_nodes(_through_data_movement(index, end, outputs))
        direct = main.consumer_nodes(end)
        quantized_out = any(
            bool(group) and all(r.op_type == "QuantizeLinear" for r in group) for group in (readers, direct)
        )
        found[node.name or node.output[0]] = (quantized_in, quantized_out)
    return found
