"""MVUE N:M pruning: exact N:M samples, unbiasedness, minimum variance and the closed forms of Chmiel et al.

Oracles are independent of the code under test where possible: the closed forms of algorithms.md 4.2-4.3,
scipy's SLSQP for the variance minimisation, and Monte-Carlo statistics whose tolerances come from the known variance.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from nmdeploy.errors import InputError, PatternError, ShapeError
from nmdeploy.masks.groups import to_groups
from nmdeploy.masks.mvue import mvue_probabilities, mvue_prune, mvue_variance
from nmdeploy.masks.pattern import Pattern

DRAWS = 20_000
SIGMAS = 5.0  # Monte-Carlo tolerance in standard errors; the seeds are fixed, so this is a bound, not a flake rate


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """The tensors here are small: on a busy machine intra-op threads cost ten times what they save."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float) -> None:
    """Elementwise |actual - expected| <= atol + rtol * |expected| (torch.testing's first call costs a second)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    excess = (actual - expected).abs() - (atol + rtol * expected.abs())
    assert (excess <= 0).all(), f"worst excess over the tolerance: {excess.max().item():.3g}"


def _nonzero(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Magnitudes in [0.1, 1.1) with random signs: no zeros, even after rounding to fp16/bf16."""
    gen = _generator(seed)
    magnitude = torch.rand(shape, generator=gen) + 0.1
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return (magnitude * sign).to(dtype)


def _count_kept(out: torch.Tensor, pattern: str, axis: int = -1) -> torch.Tensor:
    """Non-zeros per group of M along ``axis``."""
    grouped, _ = to_groups((out != 0).to(torch.int64), Pattern.parse(pattern), axis)
    return grouped.sum(-1)


def _closed_form_24(block: np.ndarray) -> np.ndarray:
    """Inclusion probabilities of algorithms.md 4.3, written out per regime (independent of the water-filling code)."""
    magnitude = np.abs(block.astype(np.float64))
    order = np.argsort(magnitude)
    a1, a2, a3, a4 = magnitude[order]
    total = a1 + a2 + a3 + a4
    p = np.empty(4)
    if a4 <= a1 + a2 + a3:  # regime A
        p[order] = 2 * magnitude[order] / total
    else:  # regime B: a4 kept for sure, MVUE 1:3 on the rest
        p[order[:3]] = magnitude[order[:3]] / (a1 + a2 + a3)
        p[order[3]] = 1.0
    return p


def _repeat(blocks: torch.Tensor, draws: int = DRAWS) -> torch.Tensor:
    """``[draws, blocks * M]``: every row holds all the blocks, so one call samples them all ``draws`` times."""
    return blocks.reshape(1, -1).repeat(draws, 1)


# ---------------------------------------------------------------------------------------------------------------------
# Every sample is exactly N:M.


@pytest.mark.parametrize("pattern", ["1:2", "2:4", "4:8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_exactly_n_per_group_along_axis(pattern: str, dtype: torch.dtype, axis: int) -> None:
    n = Pattern.parse(pattern).n
    tensor = _nonzero((8, 16, 24), seed=1, dtype=dtype)
    gen = _generator(2)
    for _ in range(4):
        out = mvue_prune(tensor, pattern, axis, generator=gen)
        assert out.shape == tensor.shape and out.dtype == dtype
        assert torch.isfinite(out).all()
        assert (_count_kept(out, pattern, axis) == n).all()
        kept = out != 0
        # a / p with p <= 1: same sign, never smaller in magnitude (rounding to the dtype is monotone).
        assert (torch.sign(out[kept]) == torch.sign(tensor[kept])).all()
        assert (out[kept].abs() >= tensor[kept].abs()).all()


@pytest.mark.parametrize("axis", [0, 1])
def test_an_axis_is_the_last_axis_moved(axis: int) -> None:
    """Along any axis the result is the last-axis result of the moved tensor, draw for draw."""
    tensor = _nonzero((8, 16, 12), seed=27)
    moved = tensor.movedim(axis, -1)
    for function in (mvue_probabilities, mvue_variance):
        assert torch.equal(function(tensor, "2:4", axis), function(moved, "2:4").movedim(-1, axis))
    sampled = mvue_prune(tensor, "4:8", axis, generator=_generator(28))
    assert torch.equal(sampled, mvue_prune(moved, "4:8", generator=_generator(28)).movedim(-1, axis))


@pytest.mark.parametrize("pattern", ["1:2", "2:4", "4:8", "3:8", "1:4", "7:8", "8:16", "1:64", "63:64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_exact_count_on_adversarial_groups(pattern: str, dtype: torch.dtype) -> None:
    """Zeros, all-zero groups, ties, dominant and tiny elements: the count never drifts to N - 1 or N + 1.

    A zero is kept only in a group with fewer than N non-zeros, so the non-zero count of a sample must be
    exactly ``min(N, non-zeros of the input)``.
    """
    parsed = Pattern.parse(pattern)
    gen = _generator(3)
    palette = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 0.1, 0.7, 1e-3, 3.0, 1e4, 1e-7, 1 / 3])
    groups = max(500, 12_000 // parsed.m)
    magnitude = palette[torch.randint(0, len(palette), (groups, parsed.m), generator=gen)]
    sign = torch.where(torch.rand(groups, parsed.m, generator=gen) < 0.5, -1.0, 1.0)
    tensor = (magnitude * sign).to(dtype)
    tensor[:50] = 0  # all-zero groups
    tensor[50:100] = tensor[50:100, :1]  # all-equal groups (ties)
    nonzero_in = (tensor != 0).sum(-1)
    # A kept value is at most the group's sum of magnitudes; beyond the dtype's range it may round to inf.
    representable = tensor.float().abs().sum(-1) < torch.finfo(dtype).max
    for _ in range(5):
        out = mvue_prune(tensor, pattern, generator=gen)
        assert torch.isfinite(out[representable]).all()
        assert ((out != 0).sum(-1) == nonzero_in.clamp(max=parsed.n)).all()
        assert (out[tensor == 0] == 0).all()


@pytest.mark.parametrize("error", [-1e-3, 1e-3])
def test_sampler_keeps_exactly_n_when_p_does_not_sum_to_n(error: float) -> None:
    """White-box: float rounding makes sum(p) miss N by a few ulps; exaggerated here so a slip would show."""
    from nmdeploy.masks.mvue import _systematic_sample

    groups, n = 20_000, 2
    p = torch.tensor([1.0, 0.5, 0.3, 0.2]).expand(groups, 4).clone()
    p[:, 1] += error
    saturated = torch.tensor([True, False, False, False]).expand(groups, 4)
    kept, used = _systematic_sample(p, saturated, n, _generator(26))
    assert (kept.sum(-1) == n).all()
    assert (kept[:, 0]).all()
    _assert_close(used.sum(-1), torch.full((groups,), float(n)), rtol=0, atol=1e-6)
    frequency = kept.double().mean(0)
    assert ((frequency - used[0]).abs() <= SIGMAS * (used[0] * (1 - used[0]) / groups).sqrt() + 1e-9).all()


def test_degenerate_groups_are_deterministic() -> None:
    tensor = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],  # nothing to keep: output 0, no 0/0
            [0.0, -1.5, 0.0, 0.0],  # fewer than N non-zeros: all of them kept exactly
            [2.0, 0.0, -3.0, 0.0],  # exactly N non-zeros: kept exactly
            [1e6, 1e-6, -1e-6, 1e-6],  # one dominant element (regime B): kept with its own value
        ]
    )
    out = mvue_prune(_repeat(tensor, 500), "2:4", generator=_generator(4)).reshape(500, 4, 4)
    assert (out[:, :3] == tensor[:3]).all()
    assert (out[:, 3, 0] == 1e6).all()
    assert ((out[:, 3, 1:] != 0).sum(-1) == 1).all()
    assert torch.allclose(out[:, 3, 1:].abs().sum(-1), torch.tensor(3e-6), rtol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["1:2", "2:4", "4:8", "3:8"]),
    st.data(),
)
def test_samples_follow_the_probabilities(pattern: str, data: st.DataObject) -> None:
    """Property test: exact count, kept values a / p, and p of the water-filling form min(1, c * |a|)."""
    parsed = Pattern.parse(pattern)
    element = st.one_of(
        st.just(0.0),
        st.sampled_from([1.0, -1.0, 0.5]),
        st.floats(min_value=1e-4, max_value=1e4).flatmap(lambda v: st.sampled_from([v, -v])),
    )
    rows = data.draw(st.lists(st.lists(element, min_size=parsed.m, max_size=parsed.m), min_size=1, max_size=6))
    tensor = torch.tensor(rows, dtype=torch.float32)
    p = mvue_probabilities(tensor, pattern)
    assert ((p >= 0) & (p <= 1)).all()
    assert torch.allclose(p.sum(-1), torch.full((len(rows),), float(parsed.n)), atol=1e-5)
    magnitude = tensor.abs()
    for p_row, a_row in zip(p, magnitude, strict=True):
        free = (p_row < 1) & (a_row > 0)
        if free.any():
            slope = p_row[free] / a_row[free]  # the water level c, one per group
            assert torch.allclose(slope, slope[0].expand_as(slope), rtol=1e-5)
            assert (a_row[p_row == 1] >= a_row[free].max() * (1 - 1e-6)).all()
        assert (p_row[(a_row == 0) & (a_row.count_nonzero() >= parsed.n)] == 0).all()
    out = mvue_prune(tensor, pattern, generator=_generator(5))
    assert ((out != 0).sum(-1) == (tensor != 0).sum(-1).clamp(max=parsed.n)).all()
    kept = out != 0
    assert torch.allclose(out[kept], tensor[kept] / p[kept], rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Probabilities and variance: closed forms and optimality.


def test_24_probabilities_match_the_closed_forms_in_both_regimes() -> None:
    gen = _generator(6)
    # Log-normal magnitudes give plenty of both regimes; random signs must not matter.
    blocks = torch.exp(2 * torch.randn(4000, 4, generator=gen, dtype=torch.float64))
    blocks = blocks * torch.where(torch.rand(4000, 4, generator=gen) < 0.5, -1.0, 1.0).double()
    p = mvue_probabilities(blocks, "2:4").numpy()
    expected = np.stack([_closed_form_24(row) for row in blocks.numpy()])
    np.testing.assert_allclose(p, expected, rtol=1e-12, atol=1e-12)
    sorted_magnitude = np.sort(np.abs(blocks.numpy()), axis=-1)
    regime_b = sorted_magnitude[:, 3] > sorted_magnitude[:, :3].sum(-1)
    assert 500 < regime_b.sum() < 3500, "both regimes must be exercised"
    # Same in float32 (the default compute dtype), to float32 precision.
    p32 = mvue_probabilities(blocks.float(), "2:4").double().numpy()
    np.testing.assert_allclose(p32, expected, atol=2e-6)


def test_12_probabilities_and_variance_match_the_closed_forms() -> None:
    gen = _generator(7)
    blocks = torch.randn(2000, 2, generator=gen, dtype=torch.float64)
    a, b = blocks[:, 0].abs(), blocks[:, 1].abs()
    p = mvue_probabilities(blocks, "1:2")
    _assert_close(p[:, 0], a / (a + b), rtol=1e-12, atol=0)
    variance = mvue_variance(blocks, "1:2")
    _assert_close(variance.sum(-1), 2 * a * b, rtol=1e-12, atol=1e-15)
    out = mvue_prune(blocks, "1:2", generator=gen)
    kept = out != 0
    assert (kept.sum(-1) == 1).all()
    _assert_close(out[kept], torch.sign(blocks[kept]) * (a + b), rtol=1e-12, atol=0)


def test_24_kept_values_match_the_closed_forms() -> None:
    """Regime A keeps sign(a_i) * S / 2; regime B keeps a4 as is and one other at sign(a_i) * (a1 + a2 + a3)."""
    regime_a = torch.tensor([0.5, -1.0, 1.5, -2.0])
    regime_b = torch.tensor([0.3, -0.5, 0.2, -3.0])
    out = mvue_prune(_repeat(torch.stack([regime_a, regime_b]), 2000), "2:4", generator=_generator(8))
    out = out.reshape(2000, 2, 4)
    kept_a = out[:, 0] != 0
    _assert_close(out[:, 0][kept_a], (torch.sign(regime_a) * 2.5).expand(2000, 4)[kept_a], rtol=1e-5, atol=0)
    assert (out[:, 1, 3] == -3.0).all()
    kept_b = out[:, 1, :3] != 0
    assert (kept_b.sum(-1) == 1).all()
    _assert_close(out[:, 1, :3][kept_b], (torch.sign(regime_b[:3]) * 1.0).expand(2000, 3)[kept_b], rtol=1e-5, atol=0)


def _slsqp_minimum_variance(block: np.ndarray, pattern: Pattern) -> tuple[float, float]:
    """(minimum of sum a_i^2 (1/p_i - 1), sum of the minimising p) found by SLSQP."""
    squares = block**2
    result = minimize(
        lambda p: float(np.sum(squares * (1 / p - 1))),
        x0=np.full(pattern.m, pattern.n / pattern.m),
        jac=lambda p: -squares / p**2,
        bounds=[(1e-9, 1.0)] * pattern.m,
        constraints=[{"type": "eq", "fun": lambda p: np.sum(p) - pattern.n, "jac": np.ones_like}],
        method="SLSQP",
        options={"ftol": 1e-14, "maxiter": 500},
    )
    return float(result.fun), float(result.x.sum())


@pytest.mark.parametrize("pattern", ["2:4", "3:8", "4:8"])
def test_water_filling_minimises_the_variance(pattern: str) -> None:
    """SLSQP on sum a_i^2 (1/p_i - 1) subject to sum p = N, 0 < p <= 1 lands on our variance.

    SLSQP may stop with "positive directional derivative" at the optimum itself, so its status is not asserted;
    its objective, from an independent solver, is.
    """
    parsed = Pattern.parse(pattern)
    rng = np.random.default_rng(9)
    blocks = np.exp(1.5 * rng.standard_normal((12, parsed.m)))
    ours = mvue_variance(torch.from_numpy(blocks), pattern).sum(-1).numpy()
    for block, our_variance in zip(blocks, ours, strict=True):
        optimum, total = _slsqp_minimum_variance(block, parsed)
        assert abs(total - parsed.n) < 1e-6
        # SLSQP's stopping point can lie a little above the minimum (1.7e-5 relative on an AVX2 CPU), never below it
        assert -1e-4 * optimum <= our_variance - optimum <= 1e-5 * optimum


def test_probabilities_ignore_the_scale_of_a_group() -> None:
    """Near the float32 limits the sums must neither overflow nor underflow."""
    base = torch.tensor([[3.0, 1.0, 1.0, 1.0], [1.0, 2.0, 0.5, 0.25], [4.0, 1.0, 1.0, 1.0]])
    expected = mvue_probabilities(base, "2:4")
    for scale in (2.0**125, 2.0**-126, 2.0**-140):  # powers of two keep base * scale exact; 2**-140 is subnormal
        _assert_close(mvue_probabilities(base * scale, "2:4"), expected, rtol=1e-6, atol=1e-7)
    huge = mvue_prune(base * 2.0**125, "2:4", generator=_generator(10))
    assert torch.isfinite(huge).all() and ((huge != 0).sum(-1) == 2).all()


# ---------------------------------------------------------------------------------------------------------------------
# Monte-Carlo: unbiased, with the predicted variance and marginals.

MC_CASES = {
    "1:2": [[0.3, -1.2], [2.0, 2.0], [-0.5, 0.0], [1e-3, -4.0]],
    "2:4": [
        [0.5, -1.0, 1.5, -2.0],  # regime A, 2 a1 + a3 >= a4
        [0.1, -0.9, 1.0, -1.5],  # regime A, 2 a1 + a3 < a4
        [0.3, -0.5, 0.2, -3.0],  # regime B
        [0.0, 0.7, -0.2, 0.4],  # a zero
        [-1.0, 1.0, -1.0, 1.0],  # ties
    ],
    "4:8": [[0.1, -2.0, 0.3, 0.3, -0.05, 1.0, 5.0, -0.7], [1.0, -1.0, 2.0, 0.0, 0.0, 3.0, -0.5, 0.25]],
}


def _expected_probabilities(pattern: str, blocks: torch.Tensor) -> torch.Tensor:
    """Closed forms for 1:2 and 2:4; for 4:8 the module's own water-filling (checked against SLSQP above)."""
    if pattern == "1:2":
        magnitude = blocks.abs()
        return magnitude / magnitude.sum(-1, keepdim=True)
    if pattern == "2:4":
        return torch.from_numpy(np.stack([_closed_form_24(row) for row in blocks.numpy()]))
    return mvue_probabilities(blocks, pattern)


@pytest.mark.parametrize("pattern", list(MC_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_monte_carlo_mean_variance_and_marginals(pattern: str, dtype: torch.dtype) -> None:
    parsed = Pattern.parse(pattern)
    blocks = torch.tensor(MC_CASES[pattern], dtype=torch.float64)
    p = _expected_probabilities(pattern, blocks).double()
    element_variance = torch.where(p > 0, blocks**2 * (1 / p - 1), torch.zeros_like(p))
    _assert_close(mvue_variance(blocks, pattern), element_variance, rtol=1e-9, atol=1e-12)

    out = mvue_prune(_repeat(blocks.to(dtype)), pattern, generator=_generator(11)).double()
    out = out.reshape(DRAWS, len(blocks), parsed.m)
    assert ((out != 0).sum(-1) == (blocks != 0).sum(-1).clamp(max=parsed.n)).all()

    # Unbiased: the mean is within SIGMAS standard errors of the input.
    error = (out.mean(0) - blocks).abs()
    assert (error <= SIGMAS * (element_variance / DRAWS).sqrt() + 1e-6).all(), error

    # Minimum variance: the mean squared deviation per group matches sum a_i^2 (1/p_i - 1).
    deviation = ((out - blocks) ** 2).sum(-1)
    predicted = element_variance.sum(-1)
    spread = deviation.std(0) / DRAWS**0.5
    assert ((deviation.mean(0) - predicted).abs() <= SIGMAS * spread + 1e-6).all()

    # The marginals of systematic sampling are the inclusion probabilities.
    frequency = (out != 0).double().mean(0)
    nonzero = blocks != 0
    tolerance = SIGMAS * (p * (1 - p) / DRAWS).sqrt() + 1e-9
    assert ((frequency - p).abs()[nonzero] <= tolerance[nonzero]).all()


# ---------------------------------------------------------------------------------------------------------------------
# Randomness, remainders, errors.


def test_seeded_generator_reproduces_and_seeds_differ() -> None:
    tensor = _nonzero((64, 32), seed=12)
    first = mvue_prune(tensor, "2:4", generator=_generator(13))
    again = mvue_prune(tensor, "2:4", generator=_generator(13))
    other = mvue_prune(tensor, "2:4", generator=_generator(14))
    assert torch.equal(first, again)
    assert not torch.equal(first != 0, other != 0)
    gen = _generator(13)
    assert not torch.equal(mvue_prune(tensor, "2:4", generator=gen), mvue_prune(tensor, "2:4", generator=gen))
    with torch.random.fork_rng():
        torch.manual_seed(15)
        global_first = mvue_prune(tensor, "2:4")
        torch.manual_seed(15)
        assert torch.equal(global_first, mvue_prune(tensor, "2:4"))


@pytest.mark.parametrize("axis", [0, 1])
def test_remainder_error_names_pattern_and_axis(axis: int) -> None:
    shape = [8, 8]
    shape[axis] = 10
    tensor = _nonzero(tuple(shape), seed=16)
    for call in (
        lambda: mvue_prune(tensor, "4:8", axis),
        lambda: mvue_probabilities(tensor, "4:8", axis),
        lambda: mvue_variance(tensor, "4:8", axis),
    ):
        with pytest.raises(ShapeError, match=rf"4:8.*axis {axis}"):
            call()
    with pytest.raises(ShapeError, match="remainder"):
        mvue_prune(tensor, "2:4", axis, remainder="drop")


@pytest.mark.parametrize("axis", [0, -1])
def test_remainder_dense_leaves_the_tail_untouched(axis: int) -> None:
    tensor = _nonzero((10, 10), seed=17)
    out = mvue_prune(tensor, "2:4", axis, remainder="dense", generator=_generator(18))
    head = (slice(None), slice(0, 8)) if axis == -1 else (slice(0, 8), slice(None))
    tail = (slice(None), slice(8, 10)) if axis == -1 else (slice(8, 10), slice(None))
    assert torch.equal(out[tail], tensor[tail])
    assert (_count_kept(out[head], "2:4", axis) == 2).all()
    assert (mvue_probabilities(tensor, "2:4", axis, remainder="dense")[tail] == 1).all()
    assert (mvue_variance(tensor, "2:4", axis, remainder="dense")[tail] == 0).all()


def test_remainder_pad_samples_the_tail_as_zero_padded() -> None:
    short = _nonzero((50, 10), seed=19)  # tail of 2 real elements: both kept with p = 1
    out = mvue_prune(short, "2:4", remainder="pad", generator=_generator(20))
    assert torch.equal(out[:, 8:], short[:, 8:])
    assert (_count_kept(out[:, :8], "2:4") == 2).all()
    longer = _nonzero((50, 11), seed=21)  # tail of 3 real elements: exactly 2 of them kept
    out = mvue_prune(longer, "2:4", remainder="pad", generator=_generator(22))
    assert ((out[:, 8:] != 0).sum(-1) == 2).all()
    p = mvue_probabilities(longer, "2:4", remainder="pad")
    padded = torch.nn.functional.pad(longer[:, 8:], (0, 1)).double()
    _assert_close(p[:, 8:].double(), _expected_probabilities("2:4", padded)[:, :3], rtol=0, atol=1e-6)


@pytest.mark.parametrize("pattern", ["1:2", "2:4", "4:8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(bad: float, pattern: str) -> None:
    tensor = _nonzero((4, 8), seed=23)
    tensor[2, 5] = bad
    for function in (mvue_prune, mvue_probabilities, mvue_variance):
        with pytest.raises(InputError, match=rf"{pattern} along axis -1.*NaN or infinite"):
            function(tensor, pattern)
    with pytest.raises(InputError, match="NaN"):
        mvue_prune(tensor.half(), pattern)


@pytest.mark.parametrize("pattern", ["1:2", "2:4"])
def test_group_sums_beyond_the_dtype_range_are_sampled_at_a_smaller_scale(pattern: str) -> None:
    # |a| + |b| = 3e38 is representable, but the running sums of 2:4 groups of such values are not.
    tensor = _repeat(torch.tensor([[2e38, -1e38, 2e38, -1e38]]), 2000)
    out = mvue_prune(tensor, pattern, generator=_generator(30))
    m, n = Pattern.parse(pattern).m, Pattern.parse(pattern).n
    groups = out.reshape(-1, m)
    assert torch.isfinite(out).all()
    assert ((groups != 0).sum(-1) == n).all()
    kept = groups[groups != 0].abs().double()
    # 1:2 keeps one element as |a| + |b|; 2:4 (no dominant element here) keeps two as half the group's sum.
    torch.testing.assert_close(kept, torch.full_like(kept, 3e38), rtol=1e-6, atol=0)
    first = (groups[:, 0] != 0).double().mean()
    p_first = 2 / 3 if pattern == "1:2" else 2 * 2 / 6
    assert abs(float(first) - p_first) < SIGMAS * (p_first * (1 - p_first) / len(groups)) ** 0.5


def test_other_bad_inputs_raise_nmdeploy_errors() -> None:
    with pytest.raises(InputError, match="floating-point"):
        mvue_prune(torch.arange(8).reshape(2, 4), "2:4")
    with pytest.raises(InputError, match="floating-point"):
        mvue_probabilities(torch.ones(2, 4, dtype=torch.bool), "2:4")
    with pytest.raises(PatternError):
        mvue_prune(torch.ones(2, 4), "4:2")
    with pytest.raises(ShapeError, match="scalar"):
        mvue_prune(torch.tensor(1.0), "2:4")
    with pytest.raises(ShapeError, match="out of range"):
        mvue_prune(torch.ones(2, 4), "2:4", axis=2)


def test_empty_tensors_and_dtypes() -> None:
    assert mvue_prune(torch.empty(0, 8), "2:4").shape == (0, 8)
    assert mvue_prune(torch.empty(3, 0), "2:4").shape == (3, 0)
    assert mvue_probabilities(torch.ones(2, 4, dtype=torch.float16)).dtype == torch.float32
    assert mvue_probabilities(torch.ones(2, 4, dtype=torch.float64)).dtype == torch.float64
    assert mvue_variance(torch.ones(2, 4, dtype=torch.bfloat16)).dtype == torch.float32
    assert mvue_prune(torch.ones(2, 4, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_the_cpu_contract() -> None:
    blocks = torch.tensor(MC_CASES["2:4"], dtype=torch.float32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(24)
    out = mvue_prune(_repeat(blocks), "2:4", generator=gen).reshape(DRAWS, len(blocks), 4)
    assert out.device.type == "cuda"
    assert ((out != 0).sum(-1) == (blocks != 0).sum(-1).clamp(max=2)).all()
    p = _expected_probabilities("2:4", blocks.double().cpu()).cuda()
    variance = torch.where(p > 0, blocks.double() ** 2 * (1 / p - 1), torch.zeros_like(p))
    assert ((out.double().mean(0) - blocks).abs() <= SIGMAS * (variance / DRAWS).sqrt() + 1e-6).all()
    for dtype in (torch.float16, torch.bfloat16):
        sample = mvue_prune(_nonzero((64, 128), seed=25, dtype=dtype).cuda(), "4:8", 0, generator=gen)
        assert (_count_kept(sample, "4:8", 0) == 4).all()


# ---------------------------------------------------------------------------------------------------------------------
# The closed-form path (N <= 2, M <= 4) against the general water-filling path.

CLOSED_FORM_PATTERNS = ["1:2", "1:3", "1:4", "2:3", "2:4"]


def _adversarial_groups(m: int, groups: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Log-normal magnitudes (both regimes), with zeros, all-zero groups, ties and exact regime-B boundaries."""
    gen = _generator(seed)
    magnitude = torch.exp(2 * torch.randn(groups, m, generator=gen, dtype=torch.float64))
    magnitude[torch.rand(groups, m, generator=gen) < 0.15] = 0.0
    magnitude[:20] = 0.0
    magnitude[20:40] = magnitude[20:40, :1]  # ties
    magnitude[40:60, 1:] = 0.0
    magnitude[40:60, 1] = magnitude[40:60, 0]  # two equal tops, rest zero: 2 * top == S
    magnitude[60:80, 0] = magnitude[60:80, 1:].sum(-1)  # 2 * top == S exactly in float64
    sign = torch.where(torch.rand(groups, m, generator=gen) < 0.5, -1.0, 1.0).double()
    return (magnitude * sign).to(dtype)


@pytest.mark.parametrize("pattern", CLOSED_FORM_PATTERNS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_closed_form_probabilities_equal_water_filling(pattern: str, dtype: torch.dtype) -> None:
    from nmdeploy.masks.mvue import _closed_form_probabilities, _water_filling_probabilities

    parsed = Pattern.parse(pattern)
    grouped = _adversarial_groups(parsed.m, 3000, seed=30, dtype=dtype)
    closed = _closed_form_probabilities(grouped.unsqueeze(-1), parsed, -1).squeeze(-1)
    _assert_close(closed, _water_filling_probabilities(grouped, parsed.n), rtol=0, atol=1e-6)
    _assert_close(closed.sum(-1), torch.full((3000,), float(parsed.n), dtype=dtype), rtol=0, atol=1e-6)


@pytest.mark.parametrize("pattern", CLOSED_FORM_PATTERNS)
@pytest.mark.parametrize("axis", [0, 1])
def test_closed_form_keeps_exactly_n_with_the_general_paths_marginals(pattern: str, axis: int) -> None:
    """Both samplers realise the same inclusion probabilities; frequencies are checked against the general path's."""
    from nmdeploy.masks.mvue import _closed_form_prune, _water_filling_prune

    parsed = Pattern.parse(pattern)
    blocks = _adversarial_groups(parsed.m, 40, seed=31, dtype=torch.float64)[15:55]  # all the special groups
    draws = 5000
    tensor = _repeat(blocks, draws)  # [draws, 40 * M], groups along axis 1
    if axis == 0:
        tensor = tensor.t().contiguous()
    gen = _generator(32)
    out = _closed_form_prune(tensor, parsed, axis, "error", gen)
    reference = _water_filling_prune(tensor, parsed, axis, "error", gen)
    if axis == 0:
        out, reference = out.t(), reference.t()
    out = out.reshape(draws, len(blocks), parsed.m)
    reference = reference.reshape(draws, len(blocks), parsed.m)
    nonzero = (blocks != 0).sum(-1).clamp(max=parsed.n)
    assert ((out != 0).sum(-1) == nonzero).all()
    p = mvue_probabilities(blocks, pattern)
    for sample in (out, reference):
        frequency = (sample != 0).double().mean(0)
        tolerance = SIGMAS * (p * (1 - p) / draws).sqrt() + 1e-9
        assert ((frequency - p).abs()[blocks != 0] <= tolerance[blocks != 0]).all()
    kept = out != 0
    expanded = blocks.expand_as(out)
    _assert_close(out[kept], expanded[kept] / p.expand_as(out)[kept], rtol=1e-9, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_closed_form_exact_count_at_the_regime_boundary(dtype: torch.dtype) -> None:
    """2 * |a_max| within a few ulps of S, either side: the two picks never coincide on any draw."""
    eps = torch.finfo(dtype).eps
    gen = _generator(33)
    rest = torch.rand(4000, 3, generator=gen, dtype=torch.float64) + 0.01
    offset = torch.randint(-80, 80, (4000, 1), generator=gen).double() * eps
    top = rest.sum(-1, keepdim=True) * (1 + offset)
    groups = torch.cat([rest, top], -1)[:, torch.randperm(4, generator=gen)].to(dtype)
    tensor = _repeat(groups, 50)
    out = mvue_prune(tensor, "2:4", generator=gen)
    assert ((out != 0).sum(-1) == 2 * len(groups)).all() and (_count_kept(out, "2:4") == 2).all()


def test_closed_form_sample_depends_on_the_generator_state_only() -> None:
    """What exact resumption of training needs: same state, same sample; the trainer's [tokens, out] layout."""
    tensor = _nonzero((64, 48), seed=34)
    first = mvue_prune(tensor, "2:4", 0, generator=_generator(35), remainder="dense")
    assert torch.equal(first, mvue_prune(tensor, "2:4", 0, generator=_generator(35), remainder="dense"))
    assert not torch.equal(first != 0, mvue_prune(tensor, "2:4", 0, generator=_generator(36)) != 0)


# ---------------------------------------------------------------------------------------------------------------------
# The compiled kernel (torch.compile of the closed form, for large tensors) against the eager one.


@pytest.mark.parametrize("pattern", ["1:2", "2:4"])
def test_compiled_and_eager_closed_forms_draw_the_same_sample(pattern: str, monkeypatch) -> None:
    """Same generator state, same sample, bit for bit: a resumed run may take either path. Huge values included, which
    take the rescaled second pass."""
    from nmdeploy.masks import compiled, mvue

    tensor = _nonzero((1024, 512), seed=40)  # [tokens, outputs], groups along tokens, above MIN_ELEMENTS
    tensor[:4, 0] = torch.finfo(torch.float32).max / 2
    assert mvue._compiled_kernel.applies(tensor) and tensor.numel() >= compiled.MIN_ELEMENTS
    fused = mvue_prune(tensor, pattern, axis=0, generator=_generator(41))
    assert not mvue._compiled_kernel.failed, "torch.compile failed here; the comparison below would be eager twice"
    monkeypatch.setenv(compiled.SWITCH, "0")
    assert not mvue._compiled_kernel.applies(tensor)
    eager = mvue_prune(tensor, pattern, axis=0, generator=_generator(41))
    assert torch.equal(fused, eager)
    assert (_count_kept(fused, pattern, axis=0) == Pattern.parse(pattern).n).all()
    assert torch.isfinite(fused).all()


def test_a_failing_compiler_falls_back_to_eager_with_one_warning(monkeypatch, caplog) -> None:
    from nmdeploy.masks import compiled, mvue

    def broken_compile(function):
        def run(*args):
            raise RuntimeError("C++ compiler not found\nmore detail")

        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    kernel = compiled.CompiledKernel(mvue._closed_form_kernel)
    monkeypatch.setattr(mvue, "_compiled_kernel", kernel)
    tensor = _nonzero((1024, 512), seed=42)
    with caplog.at_level("WARNING", logger="nmdeploy.masks.compiled"):
        first = mvue_prune(tensor, "2:4", axis=0, generator=_generator(43))
        second = mvue_prune(tensor, "2:4", axis=0, generator=_generator(43))
    assert kernel.failed and not kernel.applies(tensor)
    assert torch.equal(first, second) and (_count_kept(first, "2:4", axis=0) == 2).all()
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1 and "C++ compiler not found" in messages[0] and "more detail" not in messages[0]
