"""Transposable N:M masks: every row and every column of every M x M tile keeps N elements.

A tile mask is a maximum-weight b-matching between the tile's M rows and M columns (each side has degree N); its
LP relaxation is integral, which is what the exact solver builds on. Two solvers share the tile layout of
:mod:`nmdeploy.masks.tiles`:

* ``"exact"``: the optimum (maximum kept score). For M <= 4 every valid tile is enumerated (90 for 2:4) and scored
  with one matrix product. For larger M, rounds of over-relaxed coordinate descent on the LP dual give row and
  column prices u, v; a tile is finished as soon as keeping exactly its cells with w_ij > u_i + v_j puts N in every
  row and column, because primal and dual objectives are then equal (a certificate, not a heuristic). The few
  tiles left after 4M rounds are finished by cancelling negative cycles of their residual graphs, with a
  Bellman-Ford sweep over all of them at once, until a sweep moves no potential (again a dual certificate).
  Prices are computed in float32 for speed (fp64 scores stay fp64) and cycles in float64, so the result is
  optimal up to float32 rounding of the normalised scores: choices that differ by less than about 1e-6 of a
  tile's largest score are ties.
* ``"greedy"``: the 2-approximation of Hubara et al. (2021): visit entries from the highest score down and keep one
  while its row and column each hold fewer than N. It keeps at least half the optimal score and may keep fewer
  than N in some rows and columns, which hardware accepts.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from nmdeploy.errors import ShapeError
from nmdeploy.masks.groups import check_remainder, scores_as_float
from nmdeploy.masks.pattern import Pattern, PatternLike
from nmdeploy.masks.scoring import Score, magnitude, resolve_scores
from nmdeploy.masks.tiles import to_tiles

METHODS: tuple[str, ...] = ("exact", "greedy")

_ENUMERATION_MAX_M = 4
_CHUNK_ELEMENTS = 1 << 22
_PRICE_ROUNDS_PER_M = 4
# Over-relaxation of the price updates, tuned by counting the rounds needed to settle random tiles.
_PRICE_STEP = 1.3
_PRICE_STEP_LARGE_M = 1.45
_PRICE_DTYPE = torch.float32
# Scores are normalised to [-1, 1] per tile, so this tolerance is relative: cycles that improve the kept score by
# less than this are ties, and are not worth (or safe, in floating point) cancelling.
_TOLERANCE = 1e-9


def transposable_mask(
    tensor: torch.Tensor,
    pattern: PatternLike = "2:4",
    *,
    axis: int = -1,
    out_axis: int = -2,
    method: str = "exact",
    score: Score = magnitude,
    remainder: str = "error",
) -> torch.Tensor:
    """Transposable N:M mask over the (``out_axis``, ``axis``) matrix of ``tensor``; other axes are a batch.

    ``axis`` is the reduction axis (columns), ``out_axis`` the output channels (rows). ``remainder="pad"`` solves
    partial edge tiles as if padded with zeros that are never kept; ``"dense"`` leaves partial edge tiles whole.
    """
    pattern = Pattern.parse(pattern)
    if method not in METHODS:
        raise ShapeError(f"unknown transposable method {method!r}; choose one of {', '.join(METHODS)}")
    check_remainder(remainder)
    scores = scores_as_float(resolve_scores(tensor, score))
    tiles, view = to_tiles(scores, pattern, axis=axis, out_axis=out_axis, remainder=remainder, fill=-math.inf)
    keep = solve_tiles(tiles, pattern.n, method)
    if remainder == "dense":
        keep[view.partial_tiles(keep.device)] = True
    mask = view.untile(keep)
    return mask


def solve_tiles(scores: torch.Tensor, n: int, method: str = "exact") -> torch.Tensor:
    """Boolean ``[tiles, M, M]`` masks for ``[tiles, M, M]`` scores, with at most (greedy) or exactly N per line.

    Scores may contain -inf (padding); such entries are kept only when nothing else is left, and the caller cuts
    them off.
    """
    tiles, m, _ = scores.shape
    if n == m or tiles == 0:
        return torch.ones_like(scores, dtype=torch.bool)
    if method == "greedy":
        return greedy_tiles(scores, n)
    if m <= _ENUMERATION_MAX_M:
        return _best_enumerated(scores, n)
    chunk = max(1, _CHUNK_ELEMENTS // (m * m))
    # Chunks bound the solver's working memory; within a chunk all tiles are solved together.
    return torch.cat([_exact_by_prices(part, n) for part in scores.split(chunk)])


@functools.cache
def valid_tiles(m: int, n: int) -> torch.Tensor:
    """All M x M 0/1 tiles with N ones in every row and column, in lexicographic order (``[count, M, M]``)."""
    rows = torch.tensor(
        [[j in chosen for j in range(m)] for chosen in itertools.combinations(range(m), n)], dtype=torch.bool
    )
    picks = torch.cartesian_prod(*[torch.arange(len(rows))] * m).reshape(-1, m)
    candidates = rows[picks]
    ok = (candidates.sum(dim=1) == n).all(dim=1)
    return candidates[ok]


def _best_enumerated(scores: torch.Tensor, n: int) -> torch.Tensor:
    tiles, m, _ = scores.shape
    patterns = valid_tiles(m, n).to(scores.device)
    # -inf padding would turn the product into NaN; a large negative stand-in keeps the ranking.
    finite = torch.nan_to_num(scores, neginf=-_padding_penalty(scores))
    totals = finite.reshape(tiles, m * m) @ patterns.reshape(-1, m * m).to(finite.dtype).T
    return patterns[totals.argmax(dim=1)]


def _padding_penalty(scores: torch.Tensor) -> float:
    finite = scores[torch.isfinite(scores)]
    largest = float(finite.abs().max()) if finite.numel() else 1.0
    return (largest + 1.0) * scores.shape[-1] ** 2


def greedy_tiles(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Keep-side greedy: entries in descending score order, kept while row and column hold fewer than N."""
    tiles, m, _ = scores.shape
    order = torch.sort(scores.reshape(tiles, m * m), dim=1, descending=True, stable=True).indices
    offsets = torch.arange(tiles, device=scores.device) * m
    # Rank-major layout so each step reads one contiguous row of indices.
    by_rank = order.T.contiguous()
    row_ids = offsets + by_rank // m
    col_ids = offsets + by_rank % m
    row_count = torch.zeros(tiles * m, dtype=torch.int32, device=scores.device)
    col_count = torch.zeros_like(row_count)
    kept = torch.zeros(m * m, tiles, dtype=torch.bool, device=scores.device)
    full = tiles * m * n
    for rank in range(m * m):
        rows, cols = row_ids[rank], col_ids[rank]
        ok = (row_count.gather(0, rows) < n) & (col_count.gather(0, cols) < n)
        kept[rank] = ok
        taken = ok.to(torch.int32)
        row_count.scatter_add_(0, rows, taken)
        col_count.scatter_add_(0, cols, taken)
        if rank % m == m - 1 and int(row_count.sum()) == full:
            break
    return (
        torch.zeros(tiles, m * m, dtype=torch.bool, device=scores.device)
        .scatter_(1, order, kept.T)
        .reshape(tiles, m, m)
    )


def _price_round(
    w: torch.Tensor, row_price: torch.Tensor, col_price: torch.Tensor, n: int, step: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One round of coordinate descent on the LP dual, over-relaxed by ``step``.

    With column prices v fixed, the dual is minimised by any row price u_i between the N-th and (N+1)-th largest
    of w_ij - v_j (the midpoint keeps the rounding away from ties); columns are symmetric. Moving a little past
    that minimiser (step > 1) settles tiles in about half as many rounds for M = 32; any prices remain valid
    for the certificate.
    """
    top = (w - col_price[:, None, :]).topk(n + 1, dim=2).values
    row_price = row_price + step * ((top[..., n - 1] + top[..., n]) / 2 - row_price)
    top = (w - row_price[:, :, None]).topk(n + 1, dim=1).values
    return row_price, col_price + step * ((top[:, n - 1] + top[:, n]) / 2 - col_price)


def _exact_by_prices(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Exact tiles for large M: dual prices with a certificate, then cycle cancelling for the few left over.

    Keeping exactly the cells with positive reduced score w_ij - u_i - v_j is optimal whenever it puts N in every
    row and column (primal and dual objectives are then equal), so each price round retires the tiles it settles.
    """
    tiles, m, _ = scores.shape
    w = scores.to(_PRICE_DTYPE) if scores.dtype != torch.float64 else scores
    finite = torch.isfinite(w)
    scale = torch.where(finite, w.abs(), torch.zeros_like(w)).amax(dim=(1, 2)).clamp_min(1e-30)
    # Padding (-inf) becomes a score below any real one, so it is kept only where the tile has nothing else.
    w = torch.where(finite, w / scale[:, None, None], torch.full_like(w, -2.0 * m))
    result = torch.empty(tiles, m, m, dtype=torch.bool, device=scores.device)
    ids = torch.arange(tiles, device=scores.device)
    row_price = torch.zeros(tiles, m, dtype=w.dtype, device=w.device)
    col_price = torch.zeros_like(row_price)
    step = _PRICE_STEP_LARGE_M if m > 16 else _PRICE_STEP
    # Almost no tile settles in the first rounds (fewer the larger M is), so checking starts a little later.
    first_check = max(0, m.bit_length() - 4)
    for round_ in range(int(_PRICE_ROUNDS_PER_M * m)):
        row_price, col_price = _price_round(w, row_price, col_price, n, 1.0 if round_ == 0 else step)
        if round_ < first_check:
            continue
        keep = w - row_price[:, :, None] - col_price[:, None, :] > 0
        settled = (keep.sum(dim=1) == n).all(dim=1) & (keep.sum(dim=2) == n).all(dim=1)
        if not settled.any():
            continue
        result[ids[settled]] = keep[settled]
        unsettled = ~settled
        ids, w, col_price, row_price = ids[unsettled], w[unsettled], col_price[unsettled], row_price[unsettled]
        if not ids.numel():
            return result
    # The few tiles left are finished in float64, where cycle costs compare reliably.
    w, row_price, col_price = (t.to(torch.float64) for t in (w, row_price, col_price))
    keep = greedy_tiles(w - row_price[:, :, None] - col_price[:, None, :], n)
    result[ids] = _CycleCanceller(w, keep, row_price, -col_price, n).run()
    return result


class _CycleCanceller:
    """Min-cost circulation on each tile's residual graph, all unfinished tiles advanced together.

    Nodes: rows 0..M-1, columns M..2M-1 and a node s = 2M. Edges: row i -> column j for an unkept cell (cost -w_ij,
    keep it), column j -> row i for a kept cell (cost +w_ij, drop it), s -> row with a missing one (a large
    reward) and column with a missing one -> s. A negative cycle through s fills one missing one per row and
    column; any other negative cycle swaps cells for a higher kept score. A sweep that moves no potential proves
    the tile optimal.
    """

    _STATE = (
        "ids",
        "w",
        "keep",
        "add_cost",
        "drop_cost",
        "row_missing",
        "col_missing",
        "start",
        "dist",
        "pred",
        "rounds",
    )

    def __init__(self, w: torch.Tensor, keep: torch.Tensor, row_price: torch.Tensor, col_price: torch.Tensor, n: int):
        self.m = w.shape[1]
        self.n = n
        # Any path alternates at most 2M cells of |w| <= 1, so this reward makes every cycle through s negative.
        self.reward = 4.0 * self.m + 1.0
        self.result = keep.clone()
        self.ids = torch.arange(w.shape[0], device=w.device)
        self.w = w
        self.keep = keep.clone()
        inf = torch.full_like(w, math.inf)
        self.add_cost = torch.where(keep, inf, -w)
        self.drop_cost = torch.where(keep, w, inf)
        self.row_missing = keep.sum(dim=2) < n
        self.col_missing = keep.sum(dim=1) < n
        self.start = torch.cat([row_price, col_price, torch.zeros_like(row_price[:, :1])], dim=1)
        self.dist = self.start.clone()
        self.pred = torch.full_like(self.dist, -1, dtype=torch.long)
        self.rounds = torch.zeros(w.shape[0], dtype=torch.long, device=w.device)

    def run(self) -> torch.Tensor:
        limit = 4 * (2 * self.m + 1) + 8
        while self.ids.numel():
            changed = self._relax()
            start = self._cycle_start()
            has_cycle = start >= 0
            if has_cycle.any():
                self._cancel(has_cycle.nonzero().squeeze(1), start[has_cycle])
            self.rounds += 1
            self.rounds[has_cycle] = 0
            if bool((self.rounds > limit).any()):
                raise RuntimeError("transposable solver did not converge; please report this input")
            done = ~changed & ~has_cycle
            if done.any():
                self.result[self.ids[done]] = self.keep[done]
                alive = ~done
                for name in self._STATE:
                    setattr(self, name, getattr(self, name)[alive])
        return self.result

    def _relax(self) -> torch.Tensor:
        """One Gauss-Seidel Bellman-Ford sweep (columns, then rows, then s); True where a potential moved."""
        m, dist, pred = self.m, self.dist, self.pred
        inf = torch.tensor(math.inf, dtype=dist.dtype, device=dist.device)
        rows, cols = dist[:, :m], dist[:, m : 2 * m]

        best, via_row = (rows[:, :, None] + self.add_cost).min(dim=1)
        col_moves = best < cols - _TOLERANCE
        cols.copy_(torch.where(col_moves, best, cols))
        pred[:, m : 2 * m] = torch.where(col_moves, via_row, pred[:, m : 2 * m])

        best, via = (cols[:, None, :] + self.drop_cost).min(dim=2)
        via = via + m
        from_s = torch.where(self.row_missing, dist[:, 2 * m, None] - self.reward, inf)
        use_s = from_s < best
        best = torch.where(use_s, from_s, best)
        via = torch.where(use_s, torch.full_like(via, 2 * m), via)
        row_moves = best < rows - _TOLERANCE
        rows.copy_(torch.where(row_moves, best, rows))
        pred[:, :m] = torch.where(row_moves, via, pred[:, :m])

        best_s, via_s = torch.where(self.col_missing, cols, inf).min(dim=1)
        s_moves = best_s < dist[:, 2 * m] - _TOLERANCE
        dist[:, 2 * m] = torch.where(s_moves, best_s, dist[:, 2 * m])
        pred[:, 2 * m] = torch.where(s_moves, via_s + m, pred[:, 2 * m])
        return col_moves.any(dim=1) | row_moves.any(dim=1) | s_moves

    def _cycle_start(self) -> torch.Tensor:
        """A node on a cycle of each tile's predecessor graph, or -1. Such a cycle is always negative."""
        nodes = self.pred.shape[1]
        root = nodes
        parent = torch.cat([self.pred.where(self.pred >= 0, root), torch.full_like(self.pred[:, :1], root)], dim=1)
        jump, steps = parent, 1
        while steps <= nodes:
            jump = jump.gather(1, jump)
            steps *= 2
        # After more than `nodes` steps a walk is either at the root or inside a cycle.
        ends = jump[:, :nodes]
        cyclic = ends != root
        first = cyclic.to(torch.uint8).argmax(dim=1, keepdim=True)
        start = ends.gather(1, first).squeeze(1)
        return torch.where(cyclic.any(dim=1), start, torch.full_like(start, -1))

    def _cancel(self, tiles: torch.Tensor, start: torch.Tensor) -> None:
        """Flip every edge of the predecessor cycle through ``start`` in the given tiles, then restart their sweep."""
        m = self.m
        keep, add_cost, drop_cost, w = (t.view(-1) for t in (self.keep, self.add_cost, self.drop_cost, self.w))
        pred = self.pred[tiles]
        base = tiles * m * m
        current = start
        walking = torch.ones_like(start, dtype=torch.bool)
        for _ in range(2 * m + 1):
            previous = pred.gather(1, current[:, None]).squeeze(1)
            added = (base + previous * m + current - m)[walking & (previous < m) & (current >= m) & (current < 2 * m)]
            dropped = (base + current * m + previous - m)[
                walking & (previous >= m) & (previous < 2 * m) & (current < m)
            ]
            keep[added], add_cost[added], drop_cost[added] = True, math.inf, w[added]
            keep[dropped], add_cost[dropped], drop_cost[dropped] = False, -w[dropped], math.inf
            current = previous
            walking = walking & (current != start)
            if not walking.any():
                break
        self.row_missing[tiles] = self.keep[tiles].sum(dim=2) < self.n
        self.col_missing[tiles] = self.keep[tiles].sum(dim=1) < self.n
        self.dist[tiles] = self.start[tiles]
        self.pred[tiles] = -1
