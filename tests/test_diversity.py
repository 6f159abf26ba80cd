"""Mask diversity: exact tile counts against brute force and OEIS, and the digest's log10-per-64-weights table."""

from __future__ import annotations

import itertools
import math
from dataclasses import FrozenInstanceError

import numpy as np
import pytest

from nmdeploy.errors import Error, InputError, PatternError, ShapeError
from nmdeploy.masks.diversity import (
    EXACT_NUMEL_LIMIT,
    MASK_KINDS,
    IntractableCountError,
    MaskDiversity,
    count_binary_matrices,
    estimate_log10_binary_matrices,
    mask_diversity,
)
from nmdeploy.masks.pattern import Pattern


def brute_force_square(m: int, n: int) -> int:
    """Count m x m 0/1 matrices with row and column sums n by trying every choice of row patterns."""
    rows = [tuple(1 if c in cols else 0 for c in range(m)) for cols in itertools.combinations(range(m), n)]
    return sum(all(sum(col) == n for col in zip(*choice, strict=True)) for choice in itertools.product(rows, repeat=m))


def test_r_4_2_is_90_by_enumerating_all_4x4_binary_matrices() -> None:
    codes = np.arange(1 << 16)
    matrices = ((codes[:, None] >> np.arange(16)) & 1).reshape(-1, 4, 4)
    for n in range(5):
        ok = (matrices.sum(axis=2) == n).all(axis=1) & (matrices.sum(axis=1) == n).all(axis=1)
        assert count_binary_matrices(4, n) == int(ok.sum())
    assert count_binary_matrices(4, 2) == 90  # the paper's product formula would say 4!*3! = 144


@pytest.mark.parametrize(("m", "n"), [(m, n) for m in range(1, 6) for n in range(m + 1)])
def test_small_tiles_match_brute_force(m: int, n: int) -> None:
    assert count_binary_matrices(m, n) == brute_force_square(m, n)


@pytest.mark.parametrize(
    ("m", "n", "expected"),
    [
        # OEIS A008300 (n x n, all line sums k) and A058527 (its central column).
        (4, 1, 24),
        (4, 2, 90),
        (5, 2, 2040),
        (6, 2, 67950),
        (6, 3, 297200),
        (7, 3, 68938800),
        (8, 2, 187530840),
        (8, 3, 24046189440),
        (8, 4, 116963796250),
        (9, 4, 315031400802720),
        (10, 4, 1289144584143523800),
        (10, 5, 6736218287430460752),
        (11, 4, 7722015017013984456000),
        (12, 4, 65599839591251908982712750),
    ],
)
def test_known_counts(m: int, n: int, expected: int) -> None:
    assert count_binary_matrices(m, n) == expected


def test_r_16_8_for_the_8_16_pattern_is_exact() -> None:
    # Pinned value; it was cross-checked with an independent full-row DP (no meeting in the middle) while writing
    # this module, and sits where the Canfield-McKay estimate says it should (ratio 0.97).
    value = count_binary_matrices(16, 8)
    assert value == 34812290428176298285394893936773707951192224124239796250
    assert 0.96 < 10 ** (estimate_log10_binary_matrices(16, 8) - math.log10(value)) < 0.98


@pytest.mark.parametrize("m", range(1, 11))
def test_count_is_symmetric_under_complement(m: int) -> None:
    for n in range(m + 1):
        assert count_binary_matrices(m, n) == count_binary_matrices(m, m - n)


def test_one_per_line_counts_permutation_matrices() -> None:
    for m in range(1, 9):
        assert count_binary_matrices(m, 1) == math.factorial(m)
    assert count_binary_matrices(0, 0) == 1
    assert count_binary_matrices(7, 7) == 1


def test_count_rejects_impossible_sizes() -> None:
    with pytest.raises(PatternError):
        count_binary_matrices(3, 4)
    with pytest.raises(PatternError):
        count_binary_matrices(4, -1)
    with pytest.raises(InputError):
        count_binary_matrices(4, True)


def test_out_of_reach_count_raises_fast_and_names_the_alternative() -> None:
    with pytest.raises(IntractableCountError, match=r"R\(32, 16\)") as info:
        count_binary_matrices(32, 16)
    assert isinstance(info.value, Error)
    assert "estimate_log10_binary_matrices" in str(info.value)
    with pytest.raises(IntractableCountError):
        count_binary_matrices(8, 4, max_work=10)


@pytest.mark.parametrize(("m", "n"), [(8, 4), (12, 6), (16, 4), (32, 4)])
def test_estimate_tracks_exact_counts(m: int, n: int) -> None:
    exact = math.log10(count_binary_matrices(m, n))
    estimate = estimate_log10_binary_matrices(m, n)
    assert exact - 0.03 < estimate < exact  # underestimates, by less than 7%


def test_tile_diversity_is_the_tile_count() -> None:
    assert mask_diversity(16, "transposable", "2:4") == MaskDiversity(90, math.log10(90))
    eight = mask_diversity(64, "transposable", Pattern(4, 8))
    assert eight.count == 116_963_796_250 and eight.exact
    assert mask_diversity(2 * 64, "transposable", "4:8").count == 116_963_796_250**2


# Digest section 3.1: log10 of the mask diversity of 64 weights.
@pytest.mark.parametrize(
    ("kind", "pattern", "density", "expected"),
    [
        ("unstructured", None, 0.5, 18.26),
        ("unstructured", "2:4", None, 18.26),
        ("nm", "16:32", None, 17.56),
        ("nm", "8:16", None, 16.44),
        ("nm", "4:8", None, 14.76),
        ("nm", "2:4", None, 12.45),
        ("nm", "2:8", None, 11.58),
        ("transposable", "4:8", None, 11.07),
        ("nm", "1:2", None, 9.63),
        ("nm", "1:4", None, 9.63),
        ("transposable", "2:8", None, 8.27),
        ("transposable", "2:4", None, 7.82),
        ("transposable", "1:4", None, 5.52),
    ],
)
def test_log10_per_64_weights_matches_the_digest(
    kind: str, pattern: str | None, density: float | None, expected: float
) -> None:
    result = mask_diversity(64, kind, pattern, density)
    assert round(result.log10, 2) == expected
    assert result.exact and result.count is not None
    assert result.log10 == pytest.approx(math.log10(result.count))


def test_one_dimensional_and_unstructured_counts_are_exact_integers() -> None:
    assert mask_diversity(100, "nm", "2:4").count == 6**25
    assert mask_diversity(12, "nm", "1:3").count == 3**4
    assert mask_diversity(10, "unstructured", density=0.3).count == math.comb(10, 3)
    assert mask_diversity(0, "nm", "2:4") == MaskDiversity(1, 0.0)


def test_large_tensors_give_log10_without_the_integer() -> None:
    numel = 100_016  # just above the limit, and a multiple of 16
    assert numel > EXACT_NUMEL_LIMIT
    unstructured = mask_diversity(numel, "unstructured", density=0.5)
    assert unstructured.count is None and unstructured.exact
    assert unstructured.log10 == pytest.approx(math.log10(math.comb(numel, numel // 2)), rel=1e-12)
    nm = mask_diversity(numel, "nm", "2:4")
    assert nm.count is None and nm.log10 == pytest.approx(numel / 4 * math.log10(6), rel=1e-12)
    tiles = mask_diversity(numel, "transposable", "2:4")
    assert tiles.count is None and tiles.log10 == pytest.approx(numel / 16 * math.log10(90), rel=1e-12)


def test_16_32_transposable_falls_back_to_a_marked_estimate() -> None:
    result = mask_diversity(1024, "transposable", "16:32")
    assert result.count is None and not result.exact
    assert result.log10 == pytest.approx(estimate_log10_binary_matrices(32, 16))
    # Between 4:8-T and 1-D 16:32 per 64 weights, like every other transposable pattern against its 1-D form.
    assert 11.07 < result.log10 / 16 < 17.56
    with pytest.raises(IntractableCountError, match="16:32"):
        mask_diversity(1024, "transposable", "16:32", allow_estimate=False)


@pytest.mark.parametrize(
    ("numel", "kind", "pattern"),
    [(10, "nm", "2:4"), (24, "transposable", "2:4"), (96, "transposable", "4:8"), (-4, "nm", "2:4")],
)
def test_sizes_the_pattern_does_not_divide_are_shape_errors(numel: int, kind: str, pattern: str) -> None:
    with pytest.raises(ShapeError):
        mask_diversity(numel, kind, pattern)


def test_bad_arguments_are_nmdeploy_errors() -> None:
    with pytest.raises(InputError) as info:
        mask_diversity(64, "blocked", "2:4")
    assert all(kind in str(info.value) for kind in MASK_KINDS)
    with pytest.raises(InputError):
        mask_diversity(64, "nm")
    with pytest.raises(InputError):
        mask_diversity(64, "unstructured")
    with pytest.raises(InputError):
        mask_diversity(64, "nm", "2:4", density=0.25)
    with pytest.raises(InputError):
        mask_diversity(64, "unstructured", density=1.5)
    with pytest.raises(InputError):
        mask_diversity(64, "unstructured", density=float("nan"))
    with pytest.raises(PatternError):
        mask_diversity(64, "nm", "4:2")
    assert mask_diversity(64, "nm", "2:4", density=0.5) == mask_diversity(64, "nm", "2:4")


def test_result_is_frozen() -> None:
    result = mask_diversity(16, "transposable", "2:4")
    with pytest.raises(FrozenInstanceError):
        result.count = 1  # type: ignore[misc]
