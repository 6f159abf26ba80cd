"""Distillation losses of a sparse student against its dense teacher, in pure torch: the one implementation that
ONNX recovery (:mod:`nmdeploy.conversion.recovery`) and the PyTorch trainer (:mod:`nmdeploy.train.distillation`)
both train with.

- :func:`relative_squared_error`: squared error relative to the teacher tensor's energy (a scale-free match of any
  tensor; per layer it is SquareHead's loss, Kurtic et al. 2023, which Sparse-Llama recovered with).
- :func:`next_token_divergence`: KL(teacher || student) of a language model's next-token distributions, the
  distillation loss of logits.
"""

from __future__ import annotations

import torch


def relative_squared_error(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the mean square of ``expected`` (floored so that an all-zero target stays finite), in
    the wider of the two precisions."""
    return (actual - expected).pow(2).mean() / expected.pow(2).mean().clamp_min(1e-12)


def next_token_divergence(
    actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over token positions (those ``mask`` keeps) of KL(teacher || student) between the softmax distributions of
    logits [rows, tokens, vocabulary], in float32 whatever the training precision."""
    teacher = expected.float().log_softmax(-1)
    divergence = (teacher.exp() * (teacher - actual.float().log_softmax(-1))).sum(-1)
    if mask is None:
        return divergence.mean()
    weights = (mask != 0).to(divergence.dtype)
    return (divergence * weights).sum() / weights.sum().clamp_min(1.0)
