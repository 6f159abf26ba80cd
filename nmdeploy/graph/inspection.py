"""Per-weight N:M report of an ONNX model: where each weight is, its axis, its compliance and TensorRT's verdict."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx

from nmdeploy.errors import InputError
from nmdeploy.files import atomic_output, check_output_path
from nmdeploy.graph.declared import value_shapes
from nmdeploy.graph.eligibility import TENSORRT_PATTERN, tensorrt_verdict, untraced_eligible
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.prunable import PrunableWeight, UntracedWeight
from nmdeploy.graph.tensors import nonzero_positions, transposable_axes, zero_points
from nmdeploy.graph.weights import find_prunable_weights
from nmdeploy.imports import require
from nmdeploy.masks.arrays import nm_compliance, transposable_compliance
from nmdeploy.masks.pattern import Pattern, PatternLike


@dataclass(frozen=True)
class WeightRow:
    nodes: tuple[str, ...]
    op_types: tuple[str, ...]
    weight: str
    shape: tuple[int, ...]
    dtype: str
    axis: int | None
    traced: str
    compliant: float | None
    sparsity: float
    transposable: float | None
    eligible: bool
    likely_to_win: bool
    reasons: tuple[str, ...]
    dense_on_purpose: str | None = None
    """Why the weight is dense by design (the trainer's record in the model, ``--allow-dense``, or the graph's rule
    for a tied embedding, ``PrunableWeight.dense_by_default``), or None."""
    node_label: str = ""
    """The layer's name in reports (``PrunableWeight.node_label``): its first consumer node, " (+N)" for more."""
    inputs: tuple[int, ...] = ()
    """Which input of each node of ``nodes`` reads the weight (through any DequantizeLinear, Transpose or Cast)."""
    uncalibrated: str | None = None
    """Why no calibration reaches the weight, so that convert leaves it dense (``PrunableWeight.uncalibrated``: a
    use inside an If, Loop or Scan branch), or None."""
    required: bool = False
    """Whether ``--require`` holds the weight to the pattern: TensorRT could run it sparse as 2:4. Under 2:4 that is
    ``eligible``; under another pattern no weight is eligible (TensorRT's sparse kernels take 2:4 alone), and the
    weights that would be are the ones the other pattern is meant for, so they must follow it."""

    @property
    def parameters(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True)
class UnverifiedWeight:
    """A GEMM weight that could not be traced to its stored tensor (an op the walk does not follow stands between),
    where TensorRT could run it sparse as 2:4 (:func:`~nmdeploy.graph.eligibility.untraced_eligible`): TensorRT folds
    what computes it into one constant weight, whose N:M structure nothing here checked. It fails ``--require``, under
    any pattern (see ``WeightRow.required``), unless dense on purpose."""

    node: str
    op_type: str
    value: str  # the operand the node reads
    reason: str  # why it could not be traced, and what to do
    dense_on_purpose: str | None = None  # matched by --allow-dense, or None


@dataclass(frozen=True)
class Inspection:
    pattern: str
    rows: tuple[WeightRow, ...]
    untraced: tuple[UntracedWeight, ...]
    unverified: tuple[UnverifiedWeight, ...] = ()
    """The untraced operands that are weights TensorRT could run sparse: not known to be N:M."""

    @property
    def failing(self) -> tuple[WeightRow, ...]:
        """Weights ``--require`` holds to the pattern (``WeightRow.required``) that are not fully N:M along their
        axis, unless dense on purpose."""
        return tuple(r for r in self.rows if r.required and (r.compliant or 0.0) < 1.0 and r.dense_on_purpose is None)

    @property
    def failing_untraced(self) -> tuple[UnverifiedWeight, ...]:
        """Weights TensorRT could run sparse as 2:4 whose N:M structure is not known (not traced), unless dense on
        purpose: ``--require`` fails on them as on ``failing``."""
        return tuple(u for u in self.unverified if u.dense_on_purpose is None)

    @property
    def required_failed(self) -> bool:
        """Whether ``--require`` fails: a required weight not N:M, or one not traced, neither on purpose."""
        return bool(self.failing or self.failing_untraced)

    @property
    def allowed_dense(self) -> tuple[WeightRow, ...]:
        """Required weights (``WeightRow.required``) that are not N:M because they are meant to be dense."""
        return tuple(
            r for r in self.rows if r.required and (r.compliant or 0.0) < 1.0 and r.dense_on_purpose is not None
        )

    @property
    def other_pattern(self) -> bool:
        """Whether the pattern is not the 2:4 TensorRT runs, so that ``--require`` holds to it the weights TensorRT
        could run sparse as 2:4 rather than eligible ones (there are none)."""
        return self.pattern != str(TENSORRT_PATTERN)

    def required_weights(self, count: int) -> str:
        """``count`` weights ``--require`` holds to the pattern, in the words of the reports."""
        weights = "weight" if count == 1 else "weights"
        if self.other_pattern:
            return f"{count} {weights} TensorRT could run sparse as 2:4"
        return f"{count} TensorRT-eligible {weights}"

    @property
    def requirement(self) -> str | None:
        """Under a pattern other than 2:4, which weights ``--require`` holds to it and why, in a clause for the
        reports; None under 2:4, where it holds the TensorRT-eligible ones."""
        if not self.other_pattern:
            return None
        rows = [r for r in self.rows if r.required]
        names = ", ".join(r.weight for r in rows[:3]) + (", ..." if len(rows) > 3 else "")
        return (
            f"--require under {self.pattern} holds {self.required_weights(len(rows))} to it (TensorRT's sparse "
            f"kernels take 2:4 alone){': ' + names if names else ''}"
        )

    def summary(self) -> dict[str, int]:
        return {
            "weights": len(self.rows),
            "eligible": sum(r.eligible for r in self.rows),
            "required": sum(r.required for r in self.rows),
            "compliant": sum(r.compliant == 1.0 for r in self.rows),
            "parameters": sum(r.parameters for r in self.rows),
            "parameters_compliant": sum(r.parameters for r in self.rows if r.compliant == 1.0),
            "untraced": len(self.untraced),
            "dense_on_purpose": len(self.allowed_dense),
        }


SPARSITY_METADATA = "nmdeploy.sparsity"
"""Metadata key of the trainer's record of sparse and dense layers (written by ``nmdeploy.train.export``)."""


def recorded_dense(model: OnnxModel) -> dict[str, tuple[str, str]]:
    """ONNX initializer -> (torch layer, reason) for the layers the trainer kept dense on purpose, from the
    model's metadata; empty when the model has no such record."""
    text = next((p.value for p in model.proto.metadata_props if p.key == SPARSITY_METADATA), None)
    if text is None:
        return {}
    try:
        layers = json.loads(text)["layers"]
        return {
            initializer: (layer, str(entry["reason"]))
            for layer, entry in layers.items()
            if entry["status"] == "dense"
            for initializer in entry["initializers"]
        }
    except (ValueError, KeyError, TypeError) as error:
        raise InputError(
            f"metadata {SPARSITY_METADATA!r} of the model is not a valid sparsity record ({error})"
        ) from None


def allow_dense_patterns(patterns: Sequence[str]) -> list[re.Pattern]:
    """The ``--allow-dense`` regular expressions, compiled; a bad one is an InputError (checked before any work)."""
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as error:
            raise InputError(f"--allow-dense {pattern!r} is not a valid regular expression: {error}") from None
    return compiled


def allow_dense(inspection: Inspection, model: OnnxModel, patterns: Sequence[str] = ()) -> Inspection:
    """Mark the weights that are dense on purpose: recorded so by the trainer, or whose ONNX name, consumer node name
    or recorded torch layer name matches one of the regular expressions ``patterns``."""
    compiled = allow_dense_patterns(patterns)
    recorded = recorded_dense(model)
    rows = []
    for row in inspection.rows:
        layer, reason = recorded.get(row.weight, (None, None))
        names = [row.weight, *row.nodes] + ([layer] if layer else [])
        matched = next((p for p in compiled if any(p.search(name) for name in names)), None)
        if matched is not None:
            reason = f"allowed by --allow-dense {matched.pattern!r}"
        elif reason is not None:
            reason = f"{layer}: {reason}"
        else:
            reason = row.dense_on_purpose  # the graph's own rule (a recurrent R, a tied embedding), kept
        rows.append(replace(row, dense_on_purpose=reason))
    unverified = []
    for item in inspection.unverified:
        matched = next((p for p in compiled if any(p.search(name) for name in (item.value, item.node))), None)
        reason = f"allowed by --allow-dense {matched.pattern!r}" if matched is not None else None
        unverified.append(replace(item, dense_on_purpose=reason))
    return replace(inspection, rows=tuple(rows), unverified=tuple(unverified))


def _nonzero(model: OnnxModel, weight: PrunableWeight) -> np.ndarray:
    """Where the weight's consumer sees a non-zero. A float weight is read a piece at a time: a vocabulary-sized
    one (151936 x 896, 545 MB of float32) is never held whole beside its mask (136 MB) at the end of a conversion,
    which has then held a whole run's memory already. Quantized weights (zero points broadcast over the whole
    tensor) are read whole."""
    if not weight.tensor.dims or zero_points(model.read, weight) is not None:
        return nonzero_positions(model.read, weight, model.read(weight.tensor))
    nonzero = np.empty(tuple(weight.tensor.dims), dtype=np.bool_)
    start = 0
    for piece in model.read_pieces(weight.tensor):
        nonzero[start : start + len(piece)] = nonzero_positions(model.read, weight, piece)
        start += len(piece)
    return nonzero


def inspect_model(model: OnnxModel, pattern: PatternLike = "2:4") -> Inspection:
    """Find every prunable weight of ``model`` and measure it against ``pattern`` along its reduction axis."""
    pattern = Pattern.parse(pattern)
    report = find_prunable_weights(model.proto, model.index)
    rows = []
    for weight in report.weights:
        nonzero = _nonzero(model, weight)
        compliant = transposable = None
        if weight.axis is not None and weight.shape[weight.axis] % pattern.m == 0:
            compliant = nm_compliance(nonzero, pattern, weight.axis).fraction
        axes = transposable_axes(weight) if len(weight.axes) <= 2 else ()
        if len(axes) == 2 and all(weight.shape[a] % pattern.m == 0 for a in axes):
            transposable = transposable_compliance(nonzero, pattern, axis=axes[0], out_axis=axes[1]).fraction
        if weight.needs_transposable:
            compliant = transposable
        verdict = tensorrt_verdict(weight, pattern)
        rows.append(
            WeightRow(
                nodes=tuple(use.node for use in weight.uses),
                op_types=tuple(dict.fromkeys(u.op_type for u in weight.uses)),
                weight=weight.name,
                shape=weight.shape,
                dtype=weight.dtype,
                axis=weight.axis,
                traced=" -> ".join([weight.kind, *weight.uses[0].path, weight.uses[0].op_type]),
                compliant=compliant,
                sparsity=float(nonzero.size - np.count_nonzero(nonzero)) / max(1, nonzero.size),
                transposable=transposable,
                eligible=verdict.eligible,
                likely_to_win=verdict.likely_to_win,
                reasons=verdict.reasons,
                node_label=weight.node_label,
                inputs=tuple(use.input_index for use in weight.uses),
                dense_on_purpose=weight.kept_dense or weight.dense_by_default,
                uncalibrated=weight.uncalibrated,
                required=tensorrt_verdict(weight, TENSORRT_PATTERN).eligible,
            )
        )
    return Inspection(str(pattern), tuple(rows), report.untraced, _unverified(model, report.untraced))


def _unverified(model: OnnxModel, untraced: Sequence[UntracedWeight]) -> tuple[UnverifiedWeight, ...]:
    """The untraced operands TensorRT could take as sparse weights (as 2:4; ``--require`` holds them to any
    pattern). Their dtype and shape come from ONNX shape inference, run only when some operand could be one; inside a
    subgraph or function they are not known, and the operand counts."""
    candidates = [item for item in untraced if untraced_eligible(item, None, None)]
    if not candidates:
        return ()
    known = value_shapes(model.proto, {item.value for item in candidates if item.graph == "main"})
    found = []
    for item in candidates:
        data_type, shape = known.get(item.value, (None, None)) if item.graph == "main" else (None, None)
        dtype = onnx.TensorProto.DataType.Name(data_type).lower() if data_type else None
        if untraced_eligible(item, dtype, shape):
            found.append(UnverifiedWeight(item.node, item.op_type, item.value, item.reason))
    return tuple(found)


def plot_inspection(inspection: Inspection, path: str | Path) -> Path:
    """A bar per weight: N:M compliance, coloured by TensorRT verdict; written atomically (any matplotlib format)."""
    require("matplotlib", purpose="--plot", install="pip install 'nmdeploy[plot]'").use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if not path.suffix:
        raise InputError(f"{path}: give the plot a file extension such as .png or .svg")
    check_output_path(path)
    rows = inspection.rows
    colours = ["#2a9d8f" if r.likely_to_win else "#e9c46a" if r.eligible else "#adb5bd" for r in rows]
    figure, axes = plt.subplots(figsize=(10, max(2.5, 0.22 * len(rows) + 1.2)))
    positions = range(len(rows))
    axes.barh(list(positions), [r.compliant or 0.0 for r in rows], color=colours)
    axes.set_yticks(list(positions), [r.weight for r in rows], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlim(0, 1)
    axes.set_xlabel(f"fraction of {inspection.pattern}-compliant groups along the reduction axis")
    axes.set_title(
        f"{len(rows)} prunable weights: green = TensorRT-eligible and likely faster, "
        f"yellow = eligible, grey = not eligible",
        fontsize=9,
    )
    figure.tight_layout()
    try:
        with atomic_output(path.resolve(), suffix=path.suffix) as temporary:  # savefig picks the format by suffix
            figure.savefig(temporary, dpi=120)
    finally:
        plt.close(figure)
    return path
