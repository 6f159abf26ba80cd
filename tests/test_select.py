"""1-D N:M masks: validity, equality with brute force, axes, dtypes, ties and remainder policies."""

import itertools

import pytest
import torch

from nmdeploy import InputError, ShapeError
from nmdeploy.masks import Pattern, apply_nm, as_float, is_nm, nm_mask

PATTERNS = ["1:2", "2:4", "4:8", "8:16", "16:32"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def brute_force_group(scores: list[float], n: int) -> tuple[int, ...]:
    """Index set of the best N: highest total score, ties to the lexicographically smallest index set."""
    best = max(
        itertools.combinations(range(len(scores)), n),
        key=lambda chosen: (sum(scores[i] for i in chosen), [-i for i in chosen]),
    )
    return tuple(sorted(best))


@pytest.mark.parametrize("pattern", ["1:2", "2:4", "3:4", "2:8", "4:8"])
@pytest.mark.parametrize("seed", range(3))
def test_matches_brute_force(pattern, seed):
    p = Pattern.parse(pattern)
    generator = torch.Generator().manual_seed(seed)
    # Small integers make ties common, which exercises the tie-breaking rule.
    scores = torch.randint(0, 4, (24, 2 * p.m), generator=generator).float()
    mask = nm_mask(scores, p, axis=1, score=scores)
    for row in range(scores.shape[0]):
        for group in range(2):
            chunk = scores[row, group * p.m : (group + 1) * p.m].tolist()
            kept = tuple(i for i in range(p.m) if mask[row, group * p.m + i])
            assert kept == brute_force_group(chunk, p.n)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_every_group_keeps_exactly_n(pattern, dtype, axis):
    p = Pattern.parse(pattern)
    shape = [3, 5, 7]
    shape[axis] = 2 * p.m
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    mask = nm_mask(tensor, p, axis)
    assert mask.shape == tensor.shape and mask.dtype == torch.bool
    counts = mask.movedim(axis, -1).reshape(-1, p.m).sum(dim=1)
    assert (counts == p.n).all()
    assert is_nm(apply_nm(tensor, p, axis), p, axis).fraction == 1.0
    # Magnitude: every kept element is at least as large as every pruned one in its group.
    groups = tensor.float().abs().movedim(axis, -1).reshape(-1, p.m)
    kept = mask.movedim(axis, -1).reshape(-1, p.m)
    smallest_kept = torch.where(kept, groups, torch.inf).amin(dim=1)
    largest_pruned = torch.where(kept, -torch.inf, groups).amax(dim=1)
    assert (smallest_kept >= largest_pruned).all()


def test_low_precision_ranks_like_fp32_of_the_same_values():
    values = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert torch.equal(nm_mask(values, "2:4"), nm_mask(values.float(), "2:4"))


def test_custom_scores_select_what_they_rank():
    tensor = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert nm_mask(tensor, "2:4", score=scores).tolist() == [[True, True, False, False]]
    assert nm_mask(tensor, "2:4", score=lambda t: -t).tolist() == [[True, True, False, False]]


def test_ties_prefer_the_lower_index():
    assert nm_mask(torch.ones(1, 8), "2:4").tolist() == [[True, True, False, False] * 2]
    assert nm_mask(torch.zeros(1, 4), "1:4").tolist() == [[True, False, False, False]]


def test_remainder_policies():
    tensor = torch.arange(1.0, 11.0).reshape(1, 10)  # 10 = two groups of 4 plus 2
    with pytest.raises(ShapeError, match=r"pattern 2:4 .* axis 1 .* multiple of 4, got 10"):
        nm_mask(tensor, "2:4", axis=1)
    dense = nm_mask(tensor, "2:4", axis=1, remainder="dense")
    assert dense.tolist() == [[False, False, True, True] * 2 + [True, True]]
    padded = nm_mask(torch.tensor([[1.0, 2, 3, 4, 5, 6, 9, 8, 7]]), "2:4", axis=1, remainder="pad")
    assert padded.tolist() == [[False, False, True, True, False, False, True, True, True]]
    with pytest.raises(ShapeError, match="unknown remainder policy"):
        nm_mask(tensor, "2:4", remainder="drop")
    assert is_nm(dense * tensor, "2:4", axis=1, remainder="dense").fraction == 1.0
    assert is_nm(dense * tensor, "2:4", axis=1, remainder="pad").fraction == pytest.approx(1.0)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(InputError, match="NaN"):
        nm_mask(torch.tensor([[1.0, float("nan"), 2.0, 3.0]]), "2:4")
    with pytest.raises(ShapeError, match="axis 3 is out of range"):
        nm_mask(torch.ones(4, 4), "2:4", axis=3)
    with pytest.raises(ShapeError, match="do not match"):
        nm_mask(torch.ones(4, 4), "2:4", score=torch.ones(4, 8))
    with pytest.raises(ShapeError, match="scalar"):
        nm_mask(torch.tensor(1.0), "2:4")


def test_integer_tensors_are_ranked_by_magnitude():
    tensor = torch.tensor([[-5, 1, 2, 3]])
    assert nm_mask(tensor, "2:4").tolist() == [[True, False, False, True]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_as_float_is_the_mask_as_zeros_and_ones(dtype):
    mask = torch.rand(6, 8, generator=torch.Generator().manual_seed(0)) > 0.5
    values = as_float(mask, dtype)
    assert values.dtype == dtype
    assert torch.equal(values, mask.to(dtype))
    assert torch.equal(as_float(mask[:, ::2], dtype), mask[:, ::2].to(dtype))  # strided views too
