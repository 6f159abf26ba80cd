"""Distillation losses of a sparse student against its dense teacher, in pure torch: the one implementation that
ONNX recovery (:mod:`nmdeploy.conversion.recovery`) and the PyTorch trainer (:mod:`nmdeploy.train.distillation`)
both train with.

- :func:`relative_squared_error`: squared error relative to the teacher tensor's energy (a scale-free match of any
  tensor; per layer it is SquareHead's loss, Kurtic et al. 2023, which Sparse-Llama recovered with).
- :func:`next_token_divergence`: KL(teacher || student) of a language model's next-token distributions, the
  distillation loss of logits. A vocabulary of 50-260 thousand tokens makes every float32 copy of a batch's logits
  gigabytes, so the divergence and its gradient (softmax(student) - softmax(teacher)) are computed a slice of
  positions at a time: the float32 work stays at :data:`SLICE_VALUES` values whatever the batch.
"""

from __future__ import annotations

import torch

SLICE_VALUES = 1 << 24  # logits per slice of positions (64 MB in float32)


def relative_squared_error(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the mean square of ``expected`` (floored so that an all-zero target stays finite), in
    the wider of the two precisions."""
    return (actual - expected).pow(2).mean() / expected.pow(2).mean().clamp_min(1e-12)


def _slice_rows(vocabulary: int) -> int:
    """Positions per slice: SLICE_VALUES logits, at least one position."""
    return max(1, SLICE_VALUES // max(1, vocabulary))


class _NextTokenDivergence(torch.autograd.Function):
    """Sum over positions of weight * KL(softmax(teacher) || softmax(student)), slice by slice; the gradient with
    respect to the student's logits is weight * (softmax(student) - softmax(teacher)), in the student's dtype."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=student.device)
        step = _slice_rows(student.shape[-1])
        for start in range(0, len(student), step):
            target = teacher[start : start + step].float().log_softmax(-1)
            own = student[start : start + step].float().log_softmax(-1)
            total += ((target.exp() * (target - own)).sum(-1) * weights[start : start + step]).sum()
        ctx.save_for_backward(student, teacher, weights)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        student, teacher, weights = ctx.saved_tensors
        result = torch.empty_like(student)
        step = _slice_rows(student.shape[-1])
        for start in range(0, len(student), step):
            chosen = slice(start, start + step)
            difference = student[chosen].float().softmax(-1) - teacher[chosen].float().softmax(-1)
            result[chosen] = (difference * (weights[chosen] * grad)[:, None]).to(result.dtype)
        return result, None, None


def next_token_divergence(
    actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean over token positions (those ``mask`` keeps) of KL(teacher || student) between the softmax distributions of
    logits [rows, tokens, vocabulary], computed in float32 whatever the training precision; differentiable in
    ``actual`` (the teacher's ``expected`` is a constant)."""
    vocabulary = actual.shape[-1]
    student, teacher = actual.reshape(-1, vocabulary), expected.detach().reshape(-1, vocabulary)
    weights = torch.ones(len(student), dtype=torch.float32, device=student.device)
    if mask is not None:
        weights = (mask.reshape(-1) != 0).to(torch.float32)
    return _NextTokenDivergence.apply(student, teacher, weights) / weights.sum().clamp_min(1.0)
