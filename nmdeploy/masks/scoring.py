"""Scoring functions: how important each element is. Selection (which N of M to keep) is separate."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nmdeploy.errors import ShapeError

Score = Callable[[torch.Tensor], torch.Tensor] | torch.Tensor
"""A function of the tensor, or a precomputed score tensor of the same shape."""


def magnitude(tensor: torch.Tensor) -> torch.Tensor:
    """Absolute value: the default importance of a weight."""
    return tensor.abs()


def resolve_scores(tensor: torch.Tensor, score: Score) -> torch.Tensor:
    """Apply a score function, or check that a precomputed score tensor matches ``tensor``'s shape."""
    scores = score(tensor) if callable(score) else score
    if scores.shape != tensor.shape:
        raise ShapeError(f"scores of shape {tuple(scores.shape)} do not match the tensor's shape {tuple(tensor.shape)}")
    return scores
