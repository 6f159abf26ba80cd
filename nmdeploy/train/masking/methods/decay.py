"""``mask-decay`` and ``structure-decay``: pruned weights or the pattern relaxed first, tightened over a schedule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern
from nmdeploy.masks.training import structure_decay_patterns
from nmdeploy.train.masking.methods.base import (
    MaskSelector,
    MethodOptions,
    NMParametrization,
    StraightThrough,
    register_training_method,
)
from nmdeploy.train.masking.schedules import LinearDecay, PatternSchedule


@dataclass(frozen=True)
class DecayOptions(MethodOptions):
    decay_steps: int | None = None
    """Steps over which the decay runs (required); a fixed-mask fine-tune follows."""
    dense_steps: int = 0
    """Dense steps before the decay starts."""


def _decay_options(method: str, options: MethodOptions) -> DecayOptions:
    """``options`` of a decaying method, checked: the decay needs its length."""
    assert isinstance(options, DecayOptions)
    if options.decay_steps is None:
        raise InputError(f"method '{method}' needs decay_steps: the number of steps the decay lasts")
    return options


@register_training_method("mask-decay", help="pruned weights scaled by a factor falling from 1 to 0")
class MaskDecay(NMParametrization):
    """Pruning-mask decay (Kao et al. 2022): pruned weights are scaled by a factor falling from 1 to 0.

    Dense for ``dense_steps``, then the factor falls linearly over ``decay_steps`` while the magnitude mask is
    recomputed on schedule; after that the mask is fixed (fine-tune phase).
    """

    options_type = DecayOptions

    def __init__(self, weight: torch.Tensor, pattern: Pattern, selector: MaskSelector, options: MethodOptions) -> None:
        super().__init__(weight, pattern, selector, options)
        options = _decay_options(self.name, options)
        self.schedule = LinearDecay(options.dense_steps, options.decay_steps)
        self.register_buffer("factor", torch.ones((), dtype=weight.dtype, device=weight.device))

    @classmethod
    def starts_sparse(cls, options: MethodOptions) -> bool:
        return False

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.multiplier

    def multiplier_of(self, mask: torch.Tensor) -> torch.Tensor:
        # m + (1 - m) * factor: exactly 1 on kept weights and exactly the factor on pruned ones
        kept = super().multiplier_of(mask)
        return kept.add_((1 - kept) * float(self.factor))

    def update(self, weight: torch.Tensor, step: int) -> bool:
        factor = self.schedule.factor(step)
        factor_changed = factor != float(self.factor)
        self.factor.fill_(factor)
        recomputed = self.reads_weight(step)
        if recomputed:
            self.recompute(weight)
        if factor_changed:  # every pruned position's multiplier moves, not only where the mask changed
            with torch.no_grad():
                self.refresh_multiplier()
        return recomputed

    def reads_weight(self, step: int) -> bool:
        return step <= self.schedule.start + self.schedule.length and self.interval.due(step)

    @property
    def sparse_pattern(self) -> Pattern | None:
        return self.pattern if float(self.factor) == 0.0 else None


@register_training_method("structure-decay", help="progressively sparser N:M with the target's M, then fixed")
class StructureDecay(NMParametrization):
    """Sparse-structure decay (Kao et al. 2022): progressively sparser N:M with the target's M, then fixed.

    Dense for ``dense_steps``; then ``(M-1):M, M/2:M, ...,`` target, each for an equal share of ``decay_steps``
    with a straight-through gradient; then the target mask is fixed and pruned weights get no gradient.
    """

    options_type = DecayOptions

    def __init__(self, weight: torch.Tensor, pattern: Pattern, selector: MaskSelector, options: MethodOptions) -> None:
        super().__init__(weight, pattern, selector, options)
        options = _decay_options(self.name, options)
        patterns = tuple(structure_decay_patterns(pattern))
        self.schedule = PatternSchedule(patterns, options.dense_steps, options.decay_steps)
        self.current: Pattern | None = None
        self.fixed = False

    @classmethod
    def starts_sparse(cls, options: MethodOptions) -> bool:
        return False

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.fixed:
            return weight * self.multiplier
        return StraightThrough.apply(weight, self.multiplier)

    def update(self, weight: torch.Tensor, step: int) -> bool:
        pattern = self.schedule.pattern(step)
        changed = pattern != self.current
        self.sync(step)
        if self.fixed:
            return False
        if pattern is None:
            if changed:
                self.set_mask(torch.ones_like(self.mask))
            return changed
        if changed or self.interval.due(step):
            self.recompute(weight, pattern)
            return True
        return False

    def sync(self, step: int) -> None:
        self.current = self.schedule.pattern(step)
        self.fixed = self.schedule.finished(step)

    def reads_weight(self, step: int) -> bool:
        return not self.schedule.finished(step)

    @property
    def sparse_pattern(self) -> Pattern | None:
        return self.current

    def hard_mask(self, weight: torch.Tensor) -> torch.Tensor:
        if self.current == self.pattern:
            return self.mask
        return self.selector(weight.detach(), self.pattern)
