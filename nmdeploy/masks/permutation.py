"""Channel permutations for N:M: reorder the columns of a score matrix so that N:M selection keeps more score.

N:M groups are M consecutive channels of the reduction axis. Which channels share a group is arbitrary as long as
the layer feeding those channels is permuted the same way (Pool & Yu, "Channel Permutations for N:M Sparsity",
NeurIPS 2021), so the column order is free to choose. The search starts from the better of the identity and a
balanced deal of the columns (strong columns spread over all groups), then climbs by column swaps between groups:
the gain of every possible swap comes from one L1 distance matrix, each iteration applies the best swap of many
disjoint group pairs at once, and only the moved groups are re-evaluated. The result is never worse than the
identity.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch

from nmdeploy.errors import ShapeError
from nmdeploy.masks.groups import scores_as_float
from nmdeploy.masks.pattern import Pattern, PatternLike

# Exact re-splits of two groups are tried when a sweep over all group pairs costs at most this many score reads,
# and M is small enough that the C(2M-1, M-1) splits (35 for M = 4) are few.
_RESPLIT_BUDGET = 50_000_000
_MAX_SPLITS = 128


@dataclass(frozen=True)
class PermutationSearch:
    """A column permutation (new column j is old column ``permutation[j]``) and the retained N:M score."""

    permutation: torch.Tensor
    before: float  # sum of the top-N scores of every group in the original column order
    after: float  # the same after permuting; never below ``before``
    upper_bound: float  # the top N/M of every row, unstructured: what no permutation can beat
    iterations: int  # rounds of simultaneous swaps evaluated
    converged: bool  # True when no single swap of two columns between groups improves the score

    @property
    def improved(self) -> bool:
        return self.after > self.before

    @property
    def efficacy(self) -> float:
        """Fraction of the gap between the identity and the unstructured bound that the permutation closes."""
        gap = self.upper_bound - self.before
        return (self.after - self.before) / gap if gap > 0 else 0.0


def retained_nm_score(
    scores: torch.Tensor, pattern: PatternLike = "2:4", permutation: torch.Tensor | None = None
) -> float:
    """Sum over rows and groups of the N highest scores of each group of M consecutive columns of ``scores``."""
    pattern = Pattern.parse(pattern)
    matrix = _as_matrix(scores, pattern)
    if permutation is not None:
        matrix = matrix[:, permutation]
    grouped = matrix.reshape(matrix.shape[0], -1, pattern.m)
    return float(grouped.topk(pattern.n, dim=-1).values.sum(dtype=torch.float64))


def is_permutation(permutation: torch.Tensor, length: int) -> bool:
    """True when ``permutation`` holds each of 0..length-1 exactly once."""
    if permutation.ndim != 1 or permutation.numel() != length:
        return False
    return bool(torch.equal(permutation.sort().values.cpu(), torch.arange(length)))


def search_permutation(
    scores: torch.Tensor,
    pattern: PatternLike = "2:4",
    *,
    max_iterations: int = 200,
    time_limit: float | None = None,
) -> PermutationSearch:
    """Search a permutation of the columns of ``scores`` [rows, K] that maximises the retained N:M score.

    ``scores`` are non-negative (|w|, or |w| times the input channel norm for saliency). Each iteration applies
    the best improving column swaps between disjoint pairs of groups; the search stops when no swap improves, after
    ``max_iterations``, or after ``time_limit`` seconds (which trades determinism for a bounded run time).
    """
    pattern = Pattern.parse(pattern)
    matrix = _as_matrix(scores, pattern)
    if bool((matrix < 0).any()):
        raise ShapeError("permutation scores must be non-negative (use |w|, or |w| times the input channel norm)")
    rows, length = matrix.shape
    identity = torch.arange(length, device=matrix.device)
    before = retained_nm_score(matrix, pattern)
    upper = float(matrix.topk(length * pattern.n // pattern.m, dim=1).values.sum(dtype=torch.float64))
    if length // pattern.m < 2 or rows == 0:
        return PermutationSearch(identity, before, before, upper, 0, True)

    start = _balanced_deal(matrix, pattern)
    groups = start if retained_nm_score(matrix, pattern, start) > before else identity
    groups = groups.reshape(-1, pattern.m).clone()
    deadline = None if time_limit is None else time.monotonic() + time_limit
    swaps = _SwapGains(matrix, groups, pattern.n)
    iterations, converged = 0, False
    while iterations < max_iterations and (deadline is None or time.monotonic() < deadline):
        iterations += 1
        changed = _apply_best_swaps(groups, swaps)
        if len(changed) == 0:
            # No single swap helps: try exchanging several columns at once between two groups, where affordable.
            changed = _resplit_pairs(swaps.values, groups, pattern.n)
            if len(changed) == 0:
                converged = True
                break
        swaps.update(groups, changed)

    permutation = groups.reshape(-1)
    after = retained_nm_score(matrix, pattern, permutation)
    if after <= before:
        return PermutationSearch(identity, before, before, upper, iterations, converged)
    return PermutationSearch(permutation, before, after, upper, iterations, converged)


def _as_matrix(scores: torch.Tensor, pattern: Pattern) -> torch.Tensor:
    if scores.ndim != 2:
        raise ShapeError(f"permutation scores must be a [rows, K] matrix, got shape {tuple(scores.shape)}")
    if scores.shape[1] % pattern.m:
        raise ShapeError(
            f"pattern {pattern} needs the number of columns (axis 1) to be a multiple of {pattern.m}, "
            f"got {scores.shape[1]}"
        )
    return scores_as_float(scores)


def _balanced_deal(matrix: torch.Tensor, pattern: Pattern) -> torch.Tensor:
    """Columns sorted by total score and dealt out in snake order, so every group gets one column of each tier."""
    groups_count = matrix.shape[1] // pattern.m
    order = torch.sort(matrix.sum(dim=0, dtype=torch.float64), descending=True, stable=True).indices
    tiers = order.reshape(pattern.m, groups_count).clone()
    tiers[1::2] = tiers[1::2].flip(1)  # snake: the strongest of one tier meets the weakest of the next
    return tiers.T.reshape(-1)


class _SwapGains:
    """The best column swap between every two groups, kept up to date group by group.

    Replacing column c of group A by column d changes A's retained score, row by row, by base_c + relu(v_d - t_c):
    base_c <= 0 is what removing c loses and t_c the N-th highest score of A without c, the bar d must clear.
    Both depend on c's group only, so after a swap only the moved groups are recomputed. The row sums of
    relu(v_d - t_c) over all (c, d) come from one L1 distance matrix: relu(x - y) = (x - y + |x - y|) / 2.
    """

    def __init__(self, matrix: torch.Tensor, groups: torch.Tensor, n: int):
        self.n = n
        self.values = matrix.T.contiguous()  # [K, rows]: a column's scores are contiguous
        self.value_sums = self.values.sum(dim=1, dtype=torch.float64)
        length, count = matrix.shape[1], groups.shape[0]
        self.base = torch.zeros(length, dtype=torch.float64)
        self.cleared = torch.zeros(length, length, dtype=torch.float64)  # [c, d]: sum of relu(v_d - t_c)
        self.best = torch.full((count, count), float("-inf"), dtype=torch.float64)  # best swap gain per group pair
        self.where = torch.zeros(count, count, 2, dtype=torch.int64)  # (i, j): group a's i-th with group b's j-th
        self.update(groups, torch.arange(count))

    def update(self, groups: torch.Tensor, changed: torch.Tensor) -> None:
        """Recompute everything that depends on the members of the ``changed`` groups."""
        members = groups[changed]  # [C, M]
        columns = members.reshape(-1)
        values = self.values[columns].reshape(*members.shape, -1)  # [C, M, rows]
        top = values.topk(self.n + 1, dim=1).values
        nth, next_best = top[:, self.n - 1 : self.n], top[:, self.n :]
        in_top = values > next_best
        # A kept column leaves its place to the (N+1)-th; a pruned one changes nothing and the bar stays the N-th.
        self.base[columns] = torch.where(in_top, next_best - values, 0.0).sum(dim=2, dtype=torch.float64).reshape(-1)
        bars = torch.where(in_top, next_best, nth).reshape(len(columns), -1)
        distance = torch.cdist(bars, self.values, p=1).to(torch.float64)
        bar_sums = bars.sum(dim=1, dtype=torch.float64)
        self.cleared[columns] = 0.5 * (self.value_sums[None, :] - bar_sums[:, None] + distance)

        count, m = groups.shape
        order = groups.reshape(-1)
        gain = (
            self.base[columns, None]
            + self.base[None, order]
            + self.cleared[columns][:, order]
            + self.cleared[order][:, columns].T
        )  # [C*M, K]: swapping a changed group's column with any column
        gain = gain.reshape(len(changed), m, count, m).permute(0, 2, 1, 3).reshape(len(changed), count, m * m)
        best, flat = gain.max(dim=-1)
        where = torch.stack([flat // m, flat % m], dim=-1)
        self.best[changed] = best
        self.where[changed] = where
        self.best[:, changed] = best.T
        self.where[:, changed] = where.transpose(0, 1).flip(-1)
        self.best.fill_diagonal_(float("-inf"))


def _apply_best_swaps(groups: torch.Tensor, swaps: _SwapGains) -> torch.Tensor:
    """Apply the best swap of as many disjoint group pairs as possible, best first, each one checked exactly.

    The predicted gains assume the other groups stay as they are, which holds because the pairs are disjoint. A
    swap is kept only when recomputing both groups' retained scores confirms a gain, so the total never drops.
    Returns the indices of the groups that changed.
    """
    count = groups.shape[0]
    flat = torch.triu(swaps.best, diagonal=1).reshape(-1)  # each unordered pair once
    positive = (flat > 0).nonzero().squeeze(1)
    order = positive[torch.sort(flat[positive], descending=True, stable=True).indices]
    used = torch.zeros(count, dtype=torch.bool)
    chosen: list[int] = []
    for index in order.tolist():
        first, second = divmod(index, count)
        if not (used[first] or used[second]):
            used[first] = used[second] = True
            chosen.append(index)
    if not chosen:
        return torch.zeros(0, dtype=torch.int64)
    picked = torch.tensor(chosen)
    firsts, seconds = picked // count, picked % count
    where = swaps.where[firsts, seconds]
    before = torch.stack([groups[firsts], groups[seconds]], dim=1)  # [P, 2, M]
    after = before.clone()
    rows = torch.arange(len(picked))
    after[rows, 0, where[:, 0]] = before[rows, 1, where[:, 1]]
    after[rows, 1, where[:, 1]] = before[rows, 0, where[:, 0]]
    confirmed = _group_scores(swaps.values, after, swaps.n) > _group_scores(swaps.values, before, swaps.n)
    groups[firsts[confirmed]] = after[confirmed, 0]
    groups[seconds[confirmed]] = after[confirmed, 1]
    return torch.cat([firsts[confirmed], seconds[confirmed]])


def _group_scores(values: torch.Tensor, groups: torch.Tensor, n: int) -> torch.Tensor:
    """Retained score of each pair of groups [P, 2, M], from the column-major scores ``values`` [K, rows]."""
    return values[groups].topk(n, dim=2).values.sum(dim=(1, 2, 3), dtype=torch.float64)


def _resplit_pairs(values: torch.Tensor, groups: torch.Tensor, n: int) -> torch.Tensor:
    """Split the 2M columns of every pair of groups in the best possible way (a local optimum of single swaps is
    often not one of these); skipped when too costly. Returns the indices of the groups that changed."""
    count, m = groups.shape
    splits = math.comb(2 * m - 1, m - 1)
    if splits > _MAX_SPLITS or count * (count - 1) // 2 * splits * 2 * m * values.shape[1] > _RESPLIT_BUDGET:
        return torch.zeros(0, dtype=torch.int64)
    positions = range(2 * m)
    candidates = torch.tensor(
        [
            [0, *rest, *(p for p in positions if p not in (0, *rest))]
            for rest in itertools.combinations(positions[1:], m - 1)
        ]
    )  # the first column stays in the first group, so each split appears once; row 0 is the current split
    changed = torch.zeros(count, dtype=torch.bool)
    for pairs in _round_robin(count):  # disjoint pairs, so their improvements can be applied together
        members = torch.cat([groups[pairs[:, 0]], groups[pairs[:, 1]]], dim=1)[:, candidates]  # [P, S, 2M]
        totals = _group_scores(values, members.reshape(-1, 2, m), n).reshape(len(pairs), -1)
        best = totals.argmax(dim=1)  # the first maximum: the current split wins ties
        better = totals.gather(1, best[:, None]).squeeze(1) > totals[:, 0]
        chosen = members[better, best[better]]
        groups[pairs[better, 0]] = chosen[:, :m]
        groups[pairs[better, 1]] = chosen[:, m:]
        changed[pairs[better].reshape(-1)] = True
    return changed.nonzero().squeeze(1)


def _round_robin(count: int) -> list[torch.Tensor]:
    """The circle-method schedule: rounds of disjoint pairs of groups that together cover every pair once."""
    players = list(range(count)) + ([-1] if count % 2 else [])
    size = len(players)
    rounds = []
    for _ in range(size - 1):
        pairs = [(players[i], players[size - 1 - i]) for i in range(size // 2)]
        rounds.append(torch.tensor([(a, b) for a, b in pairs if a >= 0 and b >= 0], dtype=torch.int64).reshape(-1, 2))
        players = [players[0], players[-1], *players[1:-1]]
    return rounds
