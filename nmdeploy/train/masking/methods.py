"""Forward methods: one parametrisation per published way of training N:M masks.

Each class is a ``torch.nn.utils.parametrize`` parametrisation: ``module.weight`` reads as ``forward(original)``, the
dense weight stays the Parameter the optimiser updates, and the mask is a boolean buffer in weight layout
(``[out, in, *kernel]``, N:M along axis 1, i.e. along input channels at each kernel position), updated in place by
:meth:`NMParametrization.update`. Masks always come from :mod:`nmdeploy.masks`.

The forward multiplies by ``multiplier``, a second, non-persistent buffer in the weight's dtype that follows the mask
(and, for mask decay, the decay factor): on CPU, multiplying by a boolean tensor, or converting one, costs two to
three times a float multiply, and this product runs on every forward. ``state_dict`` carries only the boolean mask;
loading one rebuilds the multiplier.

Gradient rules (``g`` is the gradient with respect to the masked weight):

* ``ste``: ``g`` reaches every dense weight (straight-through), so pruned weights can grow back.
* ``srste``: ``g + decay * W`` on pruned positions, ``g`` on kept ones (Zhou et al. 2021, decay 2e-4); with
  ``dense_steps``, plain ``g`` (dense) until then.
* ``step``: dense ``g`` until the optimiser's switch, then as ``srste`` (the optimiser, ``STEPAdam``, freezes its
  second moment at the switch).
* ``fixed``: ``g * mask``: pruned weights are frozen out.
* ``lbc``: ``g * mask`` for the weights; the scores of alive combinations get ``sum_j theta_kj * W_j * g_j``.
* ``mask-decay``: plain differentiation of ``W * (mask + (1 - mask) * beta)``, so pruned weights get ``beta * g``
  (the convention of the authors' own implementation); then ``g * mask`` once beta reaches 0.
* ``structure-decay``: straight-through while the pattern tightens, then ``g * mask`` with the target pattern.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern, as_float, nm_mask, transposable_mask
from nmdeploy.masks.select import topn_in_groups
from nmdeploy.masks.training import combination_table, structure_decay_patterns
from nmdeploy.registry import Registry
from nmdeploy.train.masking.schedules import CombinationRemoval, Every, LinearDecay, PatternSchedule, check_count
from nmdeploy.train.masking.sharding import full, shard_like


@dataclass(frozen=True)
class MaskSelector:
    """Magnitude N:M along input channels; transposable (``"exact"`` or ``"greedy"``) when the backward needs it."""

    transposable: str | None = None

    def __call__(self, weight: torch.Tensor, pattern: Pattern) -> torch.Tensor:
        if pattern.n == pattern.m:
            return torch.ones_like(weight, dtype=torch.bool)
        if self.transposable is not None:
            return transposable_mask(weight, pattern, axis=1, out_axis=0, method=self.transposable)
        return nm_mask(weight, pattern, axis=1)


def to_groups(tensor: torch.Tensor, m: int) -> torch.Tensor:
    """``[out, in, *kernel]`` as ``[groups, M]`` with M consecutive input channels per group."""
    return tensor.movedim(1, -1).reshape(-1, m)


def from_groups(grouped: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`to_groups` for a weight of ``shape``."""
    moved = (shape[0], *shape[2:], shape[1])
    return grouped.reshape(moved).movedim(-1, 1)


class _StraightThrough(torch.autograd.Function):
    """``W * mask`` forward; the gradient passes to every dense weight unchanged."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
        return weight * multiplier

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SparseRefined(torch.autograd.Function):
    """``W * mask`` forward; ``g + decay * W`` on pruned positions backward (SR-STE)."""

    @staticmethod
    def forward(
        ctx: Any, weight: torch.Tensor, multiplier: torch.Tensor, pruned: torch.Tensor, decay: float
    ) -> torch.Tensor:
        ctx.save_for_backward(weight, pruned)
        ctx.decay = decay
        return weight * multiplier

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        weight, pruned = ctx.saved_tensors
        # One fused pass, exact: g + decay * W * 1 on pruned positions, g + decay * W * 0 = g on kept ones.
        return torch.addcmul(grad, weight, pruned, value=ctx.decay), None, None, None


@dataclass(frozen=True)
class MethodOptions:
    """Options every method accepts."""

    mask_interval: int | None = None
    """Recompute the mask every this many steps; None: every step, or every 40 with a transposable backward."""

    def __post_init__(self) -> None:
        if self.mask_interval is not None:
            check_count(self.mask_interval, "mask_interval", minimum=1)


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


@dataclass(frozen=True)
class LBCOptions(MethodOptions):
    removal_end: int | None = None
    """Step at which one combination per group remains (required)."""
    removal_start: int = 0
    removal_every: int = 1
    """Advance the removal schedule in steps of this many (steps per epoch reproduces the per-epoch reference)."""
    removal_exponent: float = 3.0


@dataclass(frozen=True)
class DecayOptions(MethodOptions):
    decay_steps: int | None = None
    """Steps over which the decay runs (required); a fixed-mask fine-tune follows."""
    dense_steps: int = 0
    """Dense steps before the decay starts."""


_FEW_CHANGES = 8
"""Below one changed position in this many, :meth:`NMParametrization.set_mask` rewrites only those positions."""


def _changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor | None:
    """Flat indices where two boolean masks differ, or None when rewriting everything is the better plan (many
    changes, or not a pair of contiguous CPU tensors, where finding the positions would need a device sync)."""
    if not (old.device.type == new.device.type == "cpu" and old.is_contiguous() and new.is_contiguous()):
        return None
    # numpy finds non-zeros several times faster than torch.nonzero on the CPU
    changed = np.flatnonzero(np.not_equal(old.numpy().reshape(-1), new.numpy().reshape(-1)))
    if len(changed) * _FEW_CHANGES > old.numel():
        return None
    return torch.from_numpy(changed)


METHODS: Registry[type[NMParametrization]] = Registry("training method")
"""Method name -> parametrisation class, each registered with ``@register_training_method(name, help=...)``."""
register_training_method = METHODS.register


class NMParametrization(nn.Module):
    """Base of every method: holds the pattern, the mask buffer and how to select a mask."""

    name: ClassVar[str]  # set by the registry
    help: ClassVar[str]
    options_type: ClassVar[type[MethodOptions]] = MethodOptions

    def __init__(self, weight: torch.Tensor, pattern: Pattern, selector: MaskSelector, options: MethodOptions) -> None:
        super().__init__()
        self.pattern = pattern
        self.selector = selector
        self.options = options
        self.interval = Every(options.mask_interval or 1)
        self.register_buffer("mask", torch.ones_like(weight, dtype=torch.bool))
        self.register_buffer("multiplier", torch.ones_like(weight), persistent=False)

    def set_mask(self, mask: torch.Tensor) -> None:
        """Write ``mask`` (boolean, or anything whose non-zeros are kept) into the buffer; the multiplier follows.

        A recomputed mask usually differs from the last one in few places, so on the CPU only those are rewritten:
        finding them is one compare, whereas rebuilding the weight-sized float buffers is several passes.
        """
        with torch.no_grad():
            mask = mask if mask.dtype == torch.bool else mask != 0
            positions = _changed_positions(self.mask, mask) if self.multiplier.is_contiguous() else None
            if positions is None:
                self.mask.copy_(mask)
                self.refresh_multiplier()
            elif positions.numel():
                self.mask.view(-1)[positions] = mask.reshape(-1)[positions]
                self.refresh_multiplier(positions)

    def multiplier_of(self, mask: torch.Tensor) -> torch.Tensor:
        """What the forward multiplies weights by where ``mask`` (any part of the mask buffer) keeps or prunes."""
        return as_float(mask, self.multiplier.dtype)

    def refresh_multiplier(self, positions: torch.Tensor | None = None) -> None:
        """Rebuild ``multiplier`` from the mask, everywhere or at the flat ``positions``."""
        if positions is None:
            self.multiplier.copy_(self.multiplier_of(self.mask))
        else:
            self.multiplier.view(-1)[positions] = self.multiplier_of(self.mask.view(-1)[positions])

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        with torch.no_grad():
            self.refresh_multiplier()

    def recompute(self, weight: torch.Tensor, pattern: Pattern | None = None) -> None:
        """Select a fresh mask for ``weight`` and copy it into the buffer."""
        self.set_mask(self.selector(weight.detach(), pattern or self.pattern))

    def update(self, weight: torch.Tensor, step: int) -> bool:
        """Advance to ``step`` (optimiser steps done); return whether the mask was recomputed."""
        if self.interval.due(step):
            self.recompute(weight)
            return True
        return False

    def reads_weight(self, step: int) -> bool:
        """Whether :meth:`update` at ``step`` reads the weight (a sharded one is then gathered first)."""
        return self.interval.due(step)

    def sync(self, step: int) -> None:
        """Restore state that derives from the step alone (after loading a checkpoint)."""

    @property
    def sparse_pattern(self) -> Pattern | None:
        """The N:M pattern the masked weight follows exactly now, or None (dense or soft phases)."""
        return self.pattern

    def hard_mask(self, weight: torch.Tensor) -> torch.Tensor:
        """The N:M mask to bake at export, even in the middle of a schedule."""
        return self.mask

    def initialize(self, weight: torch.Tensor, given: torch.Tensor | None = None) -> None:
        """Set the mask for step 0: ``given`` when the caller has one, else as the method's schedule says."""
        if given is not None:
            self.set_mask(given)
        else:
            self.update(weight, 0)

    @classmethod
    def starts_sparse(cls, options: MethodOptions) -> bool:
        """Whether step 0 already trains an N:M mask (which a one-shot start such as SparseGPT may then give)."""
        return True


@register_training_method("ste", help="magnitude mask on schedule, gradient straight through to the dense weights")
class STE(NMParametrization):
    """Magnitude mask recomputed on schedule; the gradient passes straight through to the dense weights."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return _StraightThrough.apply(weight, self.multiplier)


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
        return _SparseRefined.apply(weight, self.multiplier, self.pruned, self.options.decay)


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


@register_training_method("lbc", help="learnable best combination: a score per way of keeping N of M")
class LBC(NMParametrization):
    """Learnable best combination (Zhang et al. 2022): a score per group and per way of keeping N of M.

    A weight is kept while some alive combination contains it; the cubic schedule removes the lowest-scored
    combinations until one per group remains, which is then an exact N:M mask. Scores are an ``nn.Parameter`` of
    shape ``[groups, C(M, N)]`` so the optimiser and ``state_dict`` see them.
    """

    options_type = LBCOptions

    def __init__(self, weight: torch.Tensor, pattern: Pattern, selector: MaskSelector, options: MethodOptions) -> None:
        super().__init__(weight, pattern, selector, options)
        assert isinstance(options, LBCOptions)
        table = combination_table(pattern)
        groups = weight.numel() // pattern.m
        self.register_buffer("combinations", table.to(torch.float32), persistent=False)
        # Every weight sits in C(M-1, N-1) combinations, so it starts with an aggregated score of exactly 1.
        start = 1.0 / math.comb(pattern.m - 1, pattern.n - 1)
        self.scores = nn.Parameter(torch.full((groups, table.shape[0]), start, device=weight.device))
        self.register_buffer("alive", torch.ones(groups, table.shape[0], dtype=torch.bool, device=weight.device))
        if options.removal_end is None:
            raise InputError("method 'lbc' needs removal_end: the step at which one combination per group remains")
        self.schedule = CombinationRemoval(
            table.shape[0], options.removal_start, options.removal_end, options.removal_exponent, options.removal_every
        )

    @classmethod
    def starts_sparse(cls, options: MethodOptions) -> bool:
        return False

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        relaxed = (self.scores * self.alive) @ self.combinations
        # Straight-through binarisation: the value is the mask, the gradient reaches the relaxed scores.
        binary = to_groups(self.multiplier, self.pattern.m)
        straight = (relaxed - relaxed.detach()).to(weight.dtype) + binary
        return weight * from_groups(straight, weight.shape)

    def recompute(self, weight: torch.Tensor, pattern: Pattern | None = None) -> None:
        with torch.no_grad():
            covered = (self.alive.to(torch.float32) @ self.combinations) > 0
        self.set_mask(from_groups(covered, self.mask.shape))

    def update(self, weight: torch.Tensor, step: int) -> bool:
        target = self.schedule.alive(step)
        changed = False
        with torch.no_grad():
            if int(self.alive[0].sum()) > target:
                ranking = full(self.scores.detach()).masked_fill(~self.alive, -math.inf)
                self.alive.copy_(topn_in_groups(ranking, target))
                changed = True
            # Removal is permanent: momentum or weight decay must not revive a removed score.
            self.scores.masked_fill_(shard_like(~self.alive, self.scores), 0.0)
        if changed:
            self.recompute(weight)
        self.sync(step)
        return changed

    def sync(self, step: int) -> None:
        frozen = self.schedule.finished(step)
        if frozen and self.scores.requires_grad:
            self.scores.requires_grad_(False)
            self.scores.grad = None
        elif not frozen and not self.scores.requires_grad:
            self.scores.requires_grad_(True)

    def reads_weight(self, step: int) -> bool:
        return False

    @property
    def sparse_pattern(self) -> Pattern | None:
        return None if self.scores.requires_grad else self.pattern

    def hard_mask(self, weight: torch.Tensor) -> torch.Tensor:
        ranking = full(self.scores.detach()).masked_fill(~self.alive, -math.inf)
        best = self.combinations[ranking.argmax(dim=1)] > 0
        return from_groups(best, self.mask.shape)


@register_training_method("mask-decay", help="pruned weights scaled by a factor falling from 1 to 0")
class MaskDecay(NMParametrization):
    """Pruning-mask decay (Kao et al. 2022): pruned weights are scaled by a factor falling from 1 to 0.

    Dense for ``dense_steps``, then the factor falls linearly over ``decay_steps`` while the magnitude mask is
    recomputed on schedule; after that the mask is fixed (fine-tune phase).
    """

    options_type = DecayOptions

    def __init__(self, weight: torch.Tensor, pattern: Pattern, selector: MaskSelector, options: MethodOptions) -> None:
        super().__init__(weight, pattern, selector, options)
        assert isinstance(options, DecayOptions)
        if options.decay_steps is None:
            raise InputError(f"method '{self.name}' needs decay_steps: the number of steps the decay lasts")
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
        assert isinstance(options, DecayOptions)
        if options.decay_steps is None:
            raise InputError(f"method '{self.name}' needs decay_steps: the number of steps the decay lasts")
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
        return _StraightThrough.apply(weight, self.multiplier)

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
