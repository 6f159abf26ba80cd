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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from nmdeploy.masks import Pattern, as_float, nm_mask, transposable_mask
from nmdeploy.registry import Registry
from nmdeploy.train.masking.schedules import Every, check_count


@dataclass(frozen=True)
class MaskSelector:
    """Magnitude N:M along input channels; transposable (``"exact"`` or ``"greedy"``) when the backward needs it."""

    transposable: str | None = None

    def __call__(self, weight: torch.Tensor, pattern: Pattern) -> torch.Tensor:
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


class StraightThrough(torch.autograd.Function):
    """``W * mask`` forward; the gradient passes to every dense weight unchanged."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
        return weight * multiplier

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class SparseRefined(torch.autograd.Function):
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
