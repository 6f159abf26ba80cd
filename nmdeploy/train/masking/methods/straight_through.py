"""Methods whose pruned weights keep a path to the gradient or none: ``ste``, ``srste``, ``step``, ``fixed``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern
from nmdeploy.train.masking.methods.base import (
    MaskSelector,
    MethodOptions,
    NMParametrization,
    SparseRefined,
    StraightThrough,
    register_training_method,
)
from nmdeploy.train.masking.schedules import check_count


@dataclass(frozen=True)
class SRSTEOptions(MethodOptions):
    decay: float = 2e-4
    """lambda_W: the pull of pruned weights towards zero."""
    dense_steps: int = 0
    """Dense warm-up: the model trains dense for this many steps, then masks start from the weights' magnitudes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.decay, int | float) and self.decay >= 0):
            raise InputError(f"decay must be a non-negative number, got {self.decay!r}")
        check_count(self.dense_steps, "dense_steps")


@dataclass(frozen=True)
class FixedOptions(MethodOptions):
    masks: Mapping[str, torch.Tensor] | None = None
    """Given masks by layer name (bool, or any tensor whose non-zeros are kept); magnitude for the others."""


@register_training_method("ste", help="magnitude mask on schedule, gradient straight through to the dense weights")
class STE(NMParametrization):
    """Magnitude mask recomputed on schedule; the gradient passes straight through to the dense weights."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return StraightThrough.apply(weight, self.multiplier)


@register_training_method("srste", help="STE plus a decay of the pruned weights, so masks stop flipping")
class SRSTE(NMParametrization):
    """STE plus a decay of ``lambda * W`` on pruned weights, which keeps the mask from flipping back and forth.

    With ``dense_steps`` the layer first trains dense (mask all ones, so the gradient is the plain one), and the
    magnitude mask starts at that step.
    """

    options_type = SRSTEOptions

    def __init__(self, weight: torch.Tensor, pattern: Pattern, selector: MaskSelector, options: MethodOptions) -> None:
        super().__init__(weight, pattern, selector, options)
        # 1.0 where pruned: the backward's decay term in one multiply-add, for one more weight-sized buffer.
        self.register_buffer("pruned", torch.zeros_like(weight), persistent=False)

    def sparse_from(self) -> int | None:
        """The step at which masks start (None: not decided yet)."""
        return self.options.dense_steps

    def update(self, weight: torch.Tensor, step: int) -> bool:
        start = self.sparse_from()
        if start is None or step < start:
            if not bool(self.mask.all()):
                self.set_mask(torch.ones_like(self.mask))
            return False
        if step == start:
            self.recompute(weight)
            return True
        return super().update(weight, step)

    def reads_weight(self, step: int) -> bool:
        start = self.sparse_from()
        return start is not None and step >= start and (step == start or self.interval.due(step))

    @property
    def sparse_pattern(self) -> Pattern | None:
        start = self.sparse_from()
        return self.pattern if start == 0 or not bool(self.mask.all()) else None

    def hard_mask(self, weight: torch.Tensor) -> torch.Tensor:
        return self.selector(weight.detach(), self.pattern) if bool(self.mask.all()) else self.mask

    @classmethod
    def starts_sparse(cls, options: MethodOptions) -> bool:
        return getattr(options, "dense_steps", 0) == 0

    def refresh_multiplier(self, positions: torch.Tensor | None = None) -> None:
        super().refresh_multiplier(positions)
        if positions is None:
            self.pruned.fill_(1.0).sub_(self.multiplier)
        else:
            self.pruned.view(-1)[positions] = 1.0 - self.multiplier.view(-1)[positions]

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return SparseRefined.apply(weight, self.multiplier, self.pruned, self.options.decay)


@dataclass(frozen=True)
class STEPOptions(SRSTEOptions):
    switch_step: int | None = None
    """The last dense step; None: chosen by :class:`~nmdeploy.train.masking.step.STEPAdam` from the change of
    Adam's second-moment estimate (relative L1 change over ``switch_every`` steps at most ``switch_tolerance``).
    A settled estimate under Adam's default beta2 = 0.999 is a running mean, whose change over k steps is about
    k / t, so the defaults switch near step 100 on steady gradients; a small beta2 (0.95) keeps the change at the
    noise of the gradients' squares (0.2-0.4 on the character LM), so give ``max_dense_steps`` there."""
    switch_every: int = 10
    switch_tolerance: float = 0.1
    min_dense_steps: int = 10
    max_dense_steps: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dense_steps:
            raise InputError("method 'step' takes its dense phase from switch_step (or the automatic switch)")
        for name in ("switch_step", "max_dense_steps"):
            if getattr(self, name) is not None:
                check_count(getattr(self, name), name, minimum=1)
        check_count(self.switch_every, "switch_every", minimum=1)
        check_count(self.min_dense_steps, "min_dense_steps")
        if not (isinstance(self.switch_tolerance, int | float) and self.switch_tolerance > 0):
            raise InputError(f"switch_tolerance must be a positive number, got {self.switch_tolerance!r}")


@register_training_method("step", help="dense under Adam until its second moment settles, then SR-STE with it frozen")
class STEP(SRSTE):
    """STEP (Lu et al. 2023): dense under Adam until the second-moment estimate settles, then SR-STE masks while
    the optimiser keeps that estimate frozen. The switch is :class:`~nmdeploy.train.masking.step.STEPAdam`'s
    (it calls :meth:`begin`); ``switched_at`` is a buffer, so a checkpoint carries it."""

    options_type = STEPOptions

    def __init__(self, weight: torch.Tensor, pattern: Pattern, selector: MaskSelector, options: MethodOptions) -> None:
        super().__init__(weight, pattern, selector, options)
        self.register_buffer("switched_at", torch.tensor(-1, dtype=torch.int64))

    def begin(self, step: int) -> None:
        """Masks start at ``step`` (the optimiser step that just froze the second moment)."""
        self.switched_at.fill_(step)

    def sparse_from(self) -> int | None:
        start = int(self.switched_at)
        return None if start < 0 else start

    @classmethod
    def starts_sparse(cls, options: MethodOptions) -> bool:
        return False


@register_training_method("fixed", help="one mask for the whole run; pruned weights get no gradient")
class FixedMask(NMParametrization):
    """One mask for the whole run (magnitude at the start, or given); pruned weights get no gradient."""

    options_type = FixedOptions

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.multiplier

    def update(self, weight: torch.Tensor, step: int) -> bool:
        return False

    def reads_weight(self, step: int) -> bool:
        return False

    def initialize(self, weight: torch.Tensor, given: torch.Tensor | None = None) -> None:
        if given is None:
            self.recompute(weight)
        else:
            super().initialize(weight, given)
