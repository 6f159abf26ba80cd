"""Transposable N:M masks against independent oracles: brute force on 4x4 tiles, networkx min-cost flow beyond."""

import itertools

import networkx as nx
import numpy as np
import pytest
import torch

import nmdeploy.masks.transposable as transposable
from nmdeploy import InputError, ShapeError
from nmdeploy.masks import greedy_tiles, is_nm, is_transposable, solve_tiles, transposable_mask


def all_tiles_by_brute_force(m: int, n: int) -> np.ndarray:
    """Every m x m 0/1 matrix with n ones per row and column, found by checking all 2^(m*m) matrices."""
    bits = (np.arange(2 ** (m * m))[:, None] >> np.arange(m * m)) & 1
    tiles = bits.reshape(-1, m, m)
    ok = (tiles.sum(axis=1) == n).all(axis=1) & (tiles.sum(axis=2) == n).all(axis=1)
    return tiles[ok].astype(bool)


def networkx_optimum(tile: np.ndarray, n: int, scale: float = 1e6) -> float:
    """Maximum kept score of an n-per-line tile by min-cost flow with integer costs (as networkx requires)."""
    m = tile.shape[0]
    graph = nx.DiGraph()
    graph.add_node("source", demand=-n * m)
    graph.add_node("sink", demand=n * m)
    for i in range(m):
        graph.add_edge("source", ("row", i), capacity=n, weight=0)
        graph.add_edge(("col", i), "sink", capacity=n, weight=0)
        for j in range(m):
            graph.add_edge(("row", i), ("col", j), capacity=1, weight=-int(round(tile[i, j] * scale)))
    flow = nx.min_cost_flow(graph)
    return float(sum(tile[i, j] for i in range(m) for j in range(m) if flow[("row", i)][("col", j)]))


def kept(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (scores.double() * mask).sum(dim=(-2, -1))


def assert_exactly_n(mask: torch.Tensor, n: int) -> None:
    assert (mask.sum(dim=-1) == n).all() and (mask.sum(dim=-2) == n).all()


@pytest.fixture(params=["prices", "cycle_cancelling"])
def exact_path(request, monkeypatch):
    """Run exact tests through the price certificate and, separately, through cycle cancelling alone."""
    if request.param == "cycle_cancelling":
        monkeypatch.setattr(transposable, "_PRICE_ROUNDS_PER_M", 0)
        monkeypatch.setattr(transposable, "_ENUMERATION_MAX_M", 0)
    return request.param


def test_there_are_90_valid_2of4_tiles():
    assert len(all_tiles_by_brute_force(4, 2)) == 90
    assert len(transposable.valid_tiles(4, 2)) == 90
    assert len(transposable.valid_tiles(4, 1)) == 24


@pytest.mark.parametrize("n", [1, 2, 3])
def test_exact_equals_brute_force_on_4x4(n, exact_path):
    generator = torch.Generator().manual_seed(n)
    scores = torch.rand(300, 4, 4, generator=generator)
    candidates = torch.from_numpy(all_tiles_by_brute_force(4, n))
    best = (scores.double().reshape(-1, 1, 16) * candidates.reshape(1, -1, 16)).sum(dim=2).amax(dim=1)
    mask = solve_tiles(scores, n)
    assert_exactly_n(mask, n)
    torch.testing.assert_close(kept(scores, mask), best, rtol=0, atol=1e-6)


@pytest.mark.parametrize("m,n,tiles", [(8, 4, 40), (8, 2, 20), (8, 1, 10), (16, 8, 12), (16, 4, 6)])
def test_exact_equals_networkx_min_cost_flow(m, n, tiles, exact_path):
    scores = torch.rand(tiles, m, m, generator=torch.Generator().manual_seed(m * 100 + n))
    mask = solve_tiles(scores, n)
    assert_exactly_n(mask, n)
    ours = kept(scores, mask)
    for t in range(tiles):
        # Integer costs round each score to 1e-6, so the two optima agree to m*m*1e-6.
        assert ours[t].item() == pytest.approx(networkx_optimum(scores[t].double().numpy(), n), abs=m * m * 1e-6)


@pytest.mark.parametrize("m,n", [(4, 2), (8, 4), (16, 8)])
def test_exact_handles_ties_negative_scores_and_zeros(m, n, exact_path):
    generator = torch.Generator().manual_seed(7)
    cases = [
        torch.randint(0, 3, (10, m, m), generator=generator).float(),  # many ties
        torch.randn(10, m, m, generator=generator),  # negative scores are allowed (learned scores)
        torch.zeros(3, m, m),
        torch.ones(3, m, m),
    ]
    for scores in cases:
        mask = solve_tiles(scores, n)
        assert_exactly_n(mask, n)
        for t in range(min(len(scores), 4)):
            expected = networkx_optimum(scores[t].double().numpy(), n)
            assert kept(scores[t], mask[t]).item() == pytest.approx(expected, abs=m * m * 1e-6)


def test_exact_is_deterministic():
    scores = torch.randint(0, 2, (50, 8, 8), generator=torch.Generator().manual_seed(3)).float()
    assert torch.equal(solve_tiles(scores, 4), solve_tiles(scores.clone(), 4))


@pytest.mark.parametrize("m,n", [(4, 2), (8, 4), (16, 8), (32, 16), (8, 2)])
def test_greedy_is_valid_and_keeps_at_least_half_the_optimum(m, n):
    generator = torch.Generator().manual_seed(m + n)
    scores = torch.cat(
        [
            torch.rand(50, m, m, generator=generator),
            torch.arange(m * m, dtype=torch.float32).reshape(1, m, m),  # the reference code's failing input
            torch.arange(m * m, dtype=torch.float32).flip(0).reshape(1, m, m),
            torch.ones(1, m, m),
        ]
    )
    greedy = greedy_tiles(scores, n)
    assert (greedy.sum(dim=-1) <= n).all() and (greedy.sum(dim=-2) <= n).all()
    exact = solve_tiles(scores, n)
    assert (kept(scores, greedy) >= 0.5 * kept(scores, exact) - 1e-9).all()
    assert (kept(scores, greedy) <= kept(scores, exact) + 1e-9).all()


def test_greedy_on_arange_tiles_matches_a_hand_check():
    # Descending: 15, 14 fill row 3; 11, 10 fill row 2 and close columns 2 and 3; 5, 4 fill row 1;
    # 1 and 0 are the only cells left for row 0. (The reference code kept 4 per line here.)
    mask = greedy_tiles(torch.arange(16.0).reshape(1, 4, 4), 2)[0]
    assert mask.int().tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]


@pytest.mark.parametrize("pattern", ["2:4", "4:8", "8:16"])
@pytest.mark.parametrize("method", ["exact", "greedy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_masks_of_matrices_are_transposable(pattern, method, dtype):
    m = int(pattern.split(":")[1])
    weight = torch.randn(2 * m, 3 * m, generator=torch.Generator().manual_seed(m)).to(dtype)
    mask = transposable_mask(weight, pattern, method=method)
    assert mask.shape == weight.shape
    assert is_transposable(mask, pattern).fraction == 1.0
    assert is_nm(mask, pattern, axis=1).fraction == 1.0 and is_nm(mask, pattern, axis=0).fraction == 1.0
    if method == "exact":
        n = int(pattern.split(":")[0])
        assert (mask.sum(dim=1) == 3 * n).all() and (mask.sum(dim=0) == 2 * n).all()


def test_matrix_tiles_follow_output_and_reduction_axes():
    # Scores that only a correct tiling keeps intact: each 4x4 tile holds a distinct permutation-like optimum.
    weight = torch.zeros(8, 8)
    weight[:4, :4] = torch.tensor([[9, 9, 0, 0], [9, 9, 0, 0], [0, 0, 9, 9], [0, 0, 9, 9.0]])
    weight[4:, 4:] = torch.tensor([[0, 9, 9, 0], [9, 0, 0, 9], [9, 0, 0, 9], [0, 9, 9, 0.0]])
    mask = transposable_mask(weight, "2:4")
    assert torch.equal(mask[:4, :4], weight[:4, :4] > 0)
    assert torch.equal(mask[4:, 4:], weight[4:, 4:] > 0)
    # A conv weight [K, C, R, S]: tiles over (K, C) at every kernel position.
    conv = torch.randn(8, 16, 3, 3, generator=torch.Generator().manual_seed(5))
    conv_mask = transposable_mask(conv, "2:4", axis=1, out_axis=0)
    for r, s in itertools.product(range(3), range(3)):
        assert torch.equal(conv_mask[:, :, r, s], transposable_mask(conv[:, :, r, s], "2:4"))
    assert is_transposable(conv_mask, "2:4", axis=1, out_axis=0).fraction == 1.0


def test_remainder_policies_for_matrices():
    weight = torch.randn(6, 10, generator=torch.Generator().manual_seed(9))
    with pytest.raises(ShapeError, match="multiple of 4"):
        transposable_mask(weight, "2:4")
    padded = transposable_mask(weight, "2:4", remainder="pad")
    assert padded.shape == weight.shape
    assert is_transposable(padded, "2:4", remainder="pad").fraction == 1.0
    dense = transposable_mask(weight, "2:4", remainder="dense")
    assert dense[4:, :].all() and dense[:, 8:].all()
    assert torch.equal(dense[:4, :8], transposable_mask(weight[:4, :8], "2:4"))
    assert is_transposable(dense, "2:4", remainder="dense").fraction == 1.0


def test_transposable_errors():
    with pytest.raises(ShapeError, match="unknown transposable method"):
        transposable_mask(torch.ones(4, 4), "2:4", method="fastest")
    with pytest.raises(ShapeError, match="rank 1"):
        transposable_mask(torch.ones(8), "2:4")
    with pytest.raises(ShapeError, match="must differ"):
        transposable_mask(torch.ones(8, 8), "2:4", axis=0, out_axis=0)
    with pytest.raises(InputError, match="NaN"):
        transposable_mask(torch.full((4, 4), float("nan")), "2:4")


def test_is_transposable_counts_tiles():
    mask = transposable_mask(torch.randn(8, 8, generator=torch.Generator().manual_seed(4)), "2:4")
    broken = mask.clone()
    broken[0, :] = True  # the top-left and top-right tiles now have a full row
    result = is_transposable(broken, "2:4")
    assert (result.compliant, result.total) == (2, 4)
    assert not result and bool(is_transposable(mask, "2:4"))
    # 1-D N:M along the reduction axis alone is not enough.
    rows_only = torch.tensor([[1, 1, 0, 0]] * 4, dtype=torch.bool)
    assert is_nm(rows_only, "2:4", axis=1).fraction == 1.0
    assert is_transposable(rows_only, "2:4").fraction == 0.0
