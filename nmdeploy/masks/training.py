"""Mask math that only sparse training needs: LBC combination tables, bi-directional backward masks and their
output-channel permutation search, and the pattern sequence of sparse-structure decay.

Weights are in torch layout ``[out, in, *kernel]``: the forward N:M runs along axis 1 (input channels), the backward
(input-gradient) N:M along axis 0 (output channels).
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from nmdeploy.errors import PatternError, ShapeError
from nmdeploy.masks.pattern import Pattern, PatternLike
from nmdeploy.masks.select import nm_mask

__all__ = [
    "backward_mask",
    "combination_table",
    "permutation_scores",
    "search_output_permutation",
    "structure_decay_patterns",
]

# Candidates scored together, bounded by the elements of the gathered masks (about 16 M booleans).
_SCORE_CHUNK_ELEMENTS = 1 << 24
# More combinations than this per group makes per-group scores impractical (8:16 already has 12870).
_MAX_COMBINATIONS = 20000


@functools.cache
def _combination_table(n: int, m: int) -> torch.Tensor:
    rows = [[j in chosen for j in range(m)] for chosen in itertools.combinations(range(m), n)]
    return torch.tensor(rows, dtype=torch.bool)


def combination_table(pattern: PatternLike) -> torch.Tensor:
    """All ``C(M, N)`` ways to keep N of M, as a boolean ``[C(M, N), M]`` table in lexicographic order."""
    pattern = Pattern.parse(pattern)
    count = math.comb(pattern.m, pattern.n)
    if count > _MAX_COMBINATIONS:
        raise PatternError(
            f"pattern {pattern} has {count} combinations per group, too many to learn a score for each; "
            f"use a smaller M (for example 2:4 or 4:8)"
        )
    return _combination_table(pattern.n, pattern.m).clone()


def _check_output_axis(shape: torch.Size, pattern: Pattern) -> None:
    if len(shape) < 2 or shape[0] % pattern.m:
        raise ShapeError(
            f"a backward N:M mask {pattern} groups output channels (axis 0) in groups of M={pattern.m}; "
            f"the weight of shape {tuple(shape)} has {shape[0] if shape else 0} output channels"
        )


def backward_mask(
    weight: torch.Tensor, forward_mask: torch.Tensor, pattern: PatternLike, permutation: torch.Tensor | None = None
) -> torch.Tensor:
    """Backward mask of a bi-directional pair (Bi-Mask): N:M along the permuted output axis, inside ``forward_mask``.

    The N largest ``|weight|`` among the forward-kept entries of every group of M consecutive output channels (in
    ``permutation`` order, identity when None) are kept; a group with fewer than N forward survivors keeps them all.
    """
    pattern = Pattern.parse(pattern)
    _check_output_axis(weight.shape, pattern)
    # Forward-pruned entries rank below every kept one (scores are used as given, not by magnitude).
    scores = weight.detach().abs().masked_fill(~forward_mask, -1.0)
    if permutation is None:
        return nm_mask(scores, pattern, axis=0, score=scores) & forward_mask
    permuted_scores = scores[permutation]
    permuted = nm_mask(permuted_scores, pattern, axis=0, score=permuted_scores) & forward_mask[permutation]
    return torch.empty_like(permuted).index_copy_(0, permutation, permuted)


def permutation_scores(forward_mask: torch.Tensor, pattern: PatternLike, permutations: torch.Tensor) -> torch.Tensor:
    """For each ``[candidates, out]`` permutation, how many forward-kept weights its backward mask can keep.

    That is ``sum over groups of min(N, forward-kept in the group)`` along the permuted output axis: the higher, the
    closer the backward mask stays to the forward one.
    """
    pattern = Pattern.parse(pattern)
    _check_output_axis(forward_mask.shape, pattern)
    rows = forward_mask.reshape(forward_mask.shape[0], -1)
    out, width = rows.shape
    chunk = max(1, _SCORE_CHUNK_ELEMENTS // max(1, out * width))
    count_dtype = torch.uint8 if pattern.m < 256 else torch.int32
    scores = []
    for part in permutations.split(chunk):
        grouped = rows[part].reshape(part.shape[0], out // pattern.m, pattern.m, width)
        counts = grouped.sum(dim=2, dtype=count_dtype).clamp_(max=pattern.n)
        scores.append(counts.sum(dim=(1, 2), dtype=torch.int64))
    return torch.cat(scores)


def search_output_permutation(
    forward_mask: torch.Tensor,
    pattern: PatternLike,
    *,
    candidates: int,
    generator: torch.Generator,
    current: torch.Tensor | None = None,
) -> torch.Tensor:
    """The best of ``candidates`` random output-channel permutations and ``current`` (identity when None).

    The incumbent is always among the candidates, so the score never drops (the reference implementation never
    scored the identity, so its first random draw always replaced it). Ties keep the incumbent.
    """
    pattern = Pattern.parse(pattern)
    out = forward_mask.shape[0]
    incumbent = torch.arange(out) if current is None else current.detach().cpu()
    random = torch.stack([torch.randperm(out, generator=generator) for _ in range(candidates)]) if candidates else None
    pool = incumbent[None] if random is None else torch.cat([incumbent[None], random])
    scores = permutation_scores(forward_mask, pattern, pool.to(forward_mask.device))
    # argmax returns the first maximum, which is the incumbent on ties.
    return pool[int(scores.argmax())].to(forward_mask.device)


def structure_decay_patterns(pattern: PatternLike) -> list[Pattern]:
    """Progressively sparser patterns with the target's M, ending at the target (Kao et al., sparse structure decay).

    ``(M-1):M`` first, then ``M/2:M, M/4:M, ...`` while sparser patterns stay denser than the target, then the
    target: 1:16 gives 15:16, 8:16, 4:16, 2:16, 1:16; 2:4 gives 3:4, 2:4.
    """
    pattern = Pattern.parse(pattern)
    counts = [pattern.m - 1]
    halved = pattern.m // 2
    while halved > pattern.n:
        if halved < counts[-1]:
            counts.append(halved)
        halved //= 2
    if counts[-1] != pattern.n:
        counts.append(pattern.n)
    return [Pattern(n, pattern.m) for n in counts]
