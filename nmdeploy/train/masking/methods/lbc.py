"""``lbc``: learnable best combination, a score per way of keeping N of M, combinations removed on a schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern
from nmdeploy.masks.select import topn_in_groups
from nmdeploy.masks.training import combination_table
from nmdeploy.train.masking.methods.base import (
    MaskSelector,
    MethodOptions,
    NMParametrization,
    from_groups,
    register_training_method,
    to_groups,
)
from nmdeploy.train.masking.schedules import CombinationRemoval
from nmdeploy.train.masking.sharding import full, shard_like


@dataclass(frozen=True)
class LBCOptions(MethodOptions):
    removal_end: int | None = None
    """Step at which one combination per group remains (required)."""
    removal_start: int = 0
    removal_every: int = 1
    """Advance the removal schedule in steps of this many (steps per epoch reproduces the per-epoch reference)."""
    removal_exponent: float = 3.0


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
