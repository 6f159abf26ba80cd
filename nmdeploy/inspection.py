"""Per-weight N:M report of an ONNX model: where each weight is, its axis, its compliance and TensorRT's verdict."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from nmdeploy.errors import InputError, MissingDependencyError
from nmdeploy.files import temporary_beside
from nmdeploy.graph.eligibility import tensorrt_verdict
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.tensors import nonzero_positions, to_torch, transposable_axes
from nmdeploy.graph.weights import UntracedWeight, find_prunable_weights
from nmdeploy.masks import Pattern, is_nm, is_transposable
from nmdeploy.masks.pattern import PatternLike


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

    @property
    def parameters(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@dataclass(frozen=True)
class Inspection:
    pattern: str
    rows: tuple[WeightRow, ...]
    untraced: tuple[UntracedWeight, ...]

    @property
    def failing(self) -> tuple[WeightRow, ...]:
        """TensorRT-eligible weights that are not fully N:M along their axis."""
        return tuple(r for r in self.rows if r.eligible and (r.compliant or 0.0) < 1.0)

    def summary(self) -> dict[str, int]:
        return {
            "weights": len(self.rows),
            "eligible": sum(r.eligible for r in self.rows),
            "compliant": sum(r.compliant == 1.0 for r in self.rows),
            "parameters": sum(r.parameters for r in self.rows),
            "parameters_compliant": sum(r.parameters for r in self.rows if r.compliant == 1.0),
            "untraced": len(self.untraced),
        }


def inspect_model(model: OnnxModel, pattern: PatternLike = "2:4") -> Inspection:
    """Find every prunable weight of ``model`` and measure it against ``pattern`` along its reduction axis."""
    pattern = Pattern.parse(pattern)
    report = find_prunable_weights(model.proto, model.index)
    rows = []
    for weight in report.weights:
        values = to_torch(model.read(weight.tensor))
        nonzero = nonzero_positions(model.read, weight, values)
        compliant = transposable = None
        if weight.axis is not None and weight.shape[weight.axis] % pattern.m == 0:
            compliant = is_nm(nonzero, pattern, weight.axis).fraction
        axes = transposable_axes(weight) if len(weight.axes) <= 2 else ()
        if len(axes) == 2 and all(weight.shape[a] % pattern.m == 0 for a in axes):
            transposable = is_transposable(nonzero, pattern, axis=axes[0], out_axis=axes[1]).fraction
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
                sparsity=float((~nonzero).sum()) / max(1, values.numel()),
                transposable=transposable,
                eligible=verdict.eligible,
                likely_to_win=verdict.likely_to_win,
                reasons=verdict.reasons,
            )
        )
    return Inspection(str(pattern), tuple(rows), report.untraced)


def plot_inspection(inspection: Inspection, path: str | Path) -> Path:
    """A bar per weight: N:M compliance, coloured by TensorRT verdict; written atomically (any matplotlib format)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise MissingDependencyError("--plot needs matplotlib: pip install 'nmdeploy[plot]'") from error
    path = Path(path)
    if not path.suffix:
        raise InputError(f"{path}: give the plot a file extension such as .png or .svg")
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
    tmp = temporary_beside(path.resolve(), suffix=path.suffix)
    try:
        figure.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(figure)
        Path(tmp).unlink(missing_ok=True)
    return path
