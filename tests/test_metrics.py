import pytest
import torch

from nmdeploy import ShapeError
from nmdeploy.masks import (
    is_nm,
    nm_mask,
    retained_score_fraction,
    sparse_architecture_divergence,
    transposable_mask,
)


def test_sparse_architecture_divergence_counts_flips():
    before = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    after = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)
    assert sparse_architecture_divergence(before, after) == 2
    assert sparse_architecture_divergence(before, after, normalize=True) == pytest.approx(2 / 8)
    assert sparse_architecture_divergence(before, before) == 0
    with pytest.raises(ShapeError, match="differ"):
        sparse_architecture_divergence(before, after[:, :2])


def test_retained_score_fraction():
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    assert retained_score_fraction(nm_mask(scores, "2:4"), scores) == pytest.approx(0.7)
    assert retained_score_fraction(torch.zeros(1, 4, dtype=torch.bool), torch.zeros(1, 4)) == 1.0
    with pytest.raises(ShapeError):
        retained_score_fraction(torch.ones(2, 2, dtype=torch.bool), scores)


def test_retained_score_orders_the_mask_families():
    # More freedom keeps more: 1-D N:M >= exact transposable >= greedy transposable.
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    scores = weight.abs()
    one_d = retained_score_fraction(nm_mask(weight, "4:8", axis=1), scores)
    exact = retained_score_fraction(transposable_mask(weight, "4:8"), scores)
    greedy = retained_score_fraction(transposable_mask(weight, "4:8", method="greedy"), scores)
    assert one_d > exact > greedy > 0.5 * exact


def test_is_nm_fraction_and_tail_policies():
    tensor = torch.tensor([[1.0, 1, 0, 0, 1, 1, 1, 0, 5, 5]])
    with pytest.raises(ShapeError):
        is_nm(tensor, "2:4")
    assert is_nm(tensor, "2:4", remainder="dense").fraction == pytest.approx(0.5)
    result = is_nm(tensor, "2:4", remainder="pad")
    assert (result.compliant, result.total) == (2, 3)
    assert is_nm(torch.zeros(0, 4), "2:4").fraction == 1.0
    # A bool tensor is read as a mask; NaN counts as non-zero.
    assert is_nm(torch.tensor([[True, True, True, False]]), "2:4").fraction == 0.0
    assert is_nm(torch.tensor([[float("nan"), 1.0, 0.0, 0.0]]), "2:4").fraction == 1.0
    assert is_nm(torch.tensor([[float("nan"), 1.0, 1.0, 0.0]]), "2:4").fraction == 0.0
