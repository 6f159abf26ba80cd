"""Reconstruction math against direct least squares on explicit calibration inputs."""

import pytest
import torch

from nmdeploy import ShapeError
from nmdeploy.masks import is_nm, nm_mask, transposable_mask
from nmdeploy.masks.reconstruct import reconstruction_error, refit, saliency, shifted_target, sparsegpt


@pytest.fixture
def layer():
    generator = torch.Generator().manual_seed(0)
    # Correlated channels (8 latent factors), as in real activations, and every other channel loud, as in
    # transformers' outlier features.
    latent = torch.randn(256, 8, generator=generator, dtype=torch.float64)
    inputs = latent @ torch.randn(8, 32, generator=generator, dtype=torch.float64)
    inputs += 0.1 * torch.randn(256, 32, generator=generator, dtype=torch.float64)
    inputs[:, ::2] *= 5
    weight = torch.randn(12, 32, generator=generator, dtype=torch.float64)
    return inputs, weight, inputs.T @ inputs


def test_refit_equals_least_squares_on_the_inputs(layer):
    inputs, weight, hessian = layer
    keep = nm_mask(weight, "2:4", axis=1)
    fitted = refit(weight, keep, hessian, damping=0.0)
    assert torch.equal(fitted[~keep], torch.zeros_like(fitted[~keep]))
    for row in range(weight.shape[0]):
        support = keep[row].nonzero().squeeze(1)
        target = inputs @ weight[row]
        expected = torch.linalg.lstsq(inputs[:, support], target[:, None]).solution.squeeze(1)
        torch.testing.assert_close(fitted[row, support], expected, rtol=1e-8, atol=1e-8)


def test_refit_minimises_the_reconstruction_error(layer):
    inputs, weight, hessian = layer
    keep = nm_mask(weight, "2:4", axis=1)
    masked = weight * keep
    fitted = refit(weight, keep, hessian, damping=0.0)
    direct = ((inputs @ weight.T - inputs @ fitted.T) ** 2).sum().item()
    assert reconstruction_error(weight, fitted, hessian) == pytest.approx(direct, rel=1e-9)
    assert reconstruction_error(weight, fitted, hessian) < 0.5 * reconstruction_error(weight, masked, hessian)
    # Any other weights on the same support do worse.
    other = fitted + 0.01 * torch.randn_like(fitted) * keep
    assert reconstruction_error(weight, other, hessian) > reconstruction_error(weight, fitted, hessian)


def test_refit_keeps_a_transposable_support_and_damping_trades_fit_for_stability(layer):
    _, weight, hessian = layer
    keep = transposable_mask(weight[:8], "2:4")
    damped = refit(weight[:8], keep, hessian)
    assert torch.equal(damped != 0, keep)
    undamped = refit(weight[:8], keep, hessian, damping=0.0)
    best = reconstruction_error(weight[:8], undamped, hessian)
    masked = reconstruction_error(weight[:8], weight[:8] * keep, hessian)
    # Damping pulls the solution towards smaller corrections: never better than the exact fit, still far
    # better than not refitting at all, and with smaller weights than the exact fit on ill-conditioned inputs.
    assert best <= reconstruction_error(weight[:8], damped, hessian) < 0.5 * masked
    assert damped.norm() < undamped.norm()


def test_saliency_ranks_loud_inputs_higher(layer):
    _, weight, hessian = layer
    scores = saliency(weight, hessian)
    assert scores.shape == weight.shape
    keep = nm_mask(weight, "2:4", axis=1, score=scores)
    # Every group of 4 has two loud channels (five times the scale): saliency keeps them far more often.
    assert keep[:, ::2].float().mean() > 0.7 > 0.6 > nm_mask(weight, "2:4", axis=1)[:, ::2].float().mean()


def test_refit_input_errors(layer):
    _, weight, hessian = layer
    with pytest.raises(ShapeError, match="does not match K"):
        refit(weight, weight != 0, hessian[:4, :4])
    with pytest.raises(ShapeError, match=r"\[out, K\]"):
        refit(weight[None], weight[None] != 0, hessian)


def test_rows_with_different_supports_are_each_least_squares(layer):
    inputs, weight, hessian = layer
    keep = nm_mask(weight, "2:4", axis=1)
    keep[0, keep[0].nonzero()[:3, 0]] = False  # row 0 keeps three fewer weights (existing zeros, say)
    keep[1] = False  # row 1 keeps nothing
    fitted = refit(weight, keep, hessian, damping=0.0)
    assert torch.equal(fitted[1], torch.zeros_like(fitted[1])) and torch.equal(fitted[~keep], fitted[~keep] * 0)
    for row in (0, 2):
        support = keep[row].nonzero().squeeze(1)
        expected = torch.linalg.lstsq(inputs[:, support], (inputs @ weight[row])[:, None]).solution.squeeze(1)
        torch.testing.assert_close(fitted[row, support], expected, rtol=1e-8, atol=1e-8)


def test_rank_deficient_statistics_without_damping_still_fit_best():
    # 8 samples for 32 inputs: H is singular, Cholesky fails and the least-squares fallback takes over.
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(8, 32, generator=generator, dtype=torch.float64)
    weight = torch.randn(6, 32, generator=generator, dtype=torch.float64)
    hessian = inputs.T @ inputs
    keep = nm_mask(weight, "2:4", axis=1)
    fitted = refit(weight, keep, hessian, damping=0.0)
    assert torch.isfinite(fitted).all() and torch.equal(fitted[~keep], fitted[~keep] * 0)
    # Fitted outputs are unique even when the weights are not: compare them with a direct least-squares fit.
    for row in range(weight.shape[0]):
        support = keep[row].nonzero().squeeze(1)
        direct = torch.linalg.lstsq(inputs[:, support], (inputs @ weight[row])[:, None], driver="gelsd").solution
        torch.testing.assert_close(inputs[:, support] @ fitted[row, support], (inputs[:, support] @ direct).squeeze(1))


def test_sparsegpt_is_nm_and_close_to_the_exact_refit(layer):
    inputs, weight, hessian = layer
    pruned = sparsegpt(weight, hessian, 2, 4, damping=0.0)
    assert is_nm(pruned, "2:4", axis=1).fraction == 1.0
    masked = weight * nm_mask(weight, "2:4", axis=1)
    exact_on_its_mask = refit(weight, pruned != 0, hessian, damping=0.0)
    error = reconstruction_error(weight, pruned, hessian)
    # Far better than plain magnitude pruning, and no better than the exact refit on the mask it chose.
    assert error < 0.5 * reconstruction_error(weight, masked, hessian)
    assert reconstruction_error(weight, exact_on_its_mask, hessian) <= error * (1 + 1e-9)


def test_sparsegpt_respects_an_allowed_support(layer):
    _, weight, hessian = layer
    sparse = weight.clone()
    sparse[weight.abs() < weight.abs().median()] = 0  # 50% unstructured
    pruned = sparsegpt(sparse, hessian, 2, 4, allowed=sparse != 0)
    assert is_nm(pruned, "2:4", axis=1)
    assert torch.equal(pruned[sparse == 0], torch.zeros_like(pruned[sparse == 0]))  # no zero is filled
    # A given transposable mask is kept exactly: the sweep only fits the values.
    keep = transposable_mask(weight[:8], "2:4")
    fitted = sparsegpt(weight[:8], hessian, 2, 4, allowed=keep)
    assert torch.equal(fitted != 0, keep)
    assert reconstruction_error(weight[:8], fitted, hessian) < reconstruction_error(
        weight[:8], weight[:8] * keep, hessian
    )


def test_shifted_target_matches_dense_outputs_from_shifted_inputs(layer):
    inputs, weight, hessian = layer
    generator = torch.Generator().manual_seed(3)
    shifted = inputs + 0.3 * torch.randn(inputs.shape, generator=generator, dtype=torch.float64)
    target = shifted_target(weight, shifted.T @ shifted, shifted.T @ inputs, damping=0.0)
    # Without damping W* is the least-squares map from the shifted inputs to the dense outputs.
    expected = torch.linalg.lstsq(shifted, inputs @ weight.T).solution.T
    torch.testing.assert_close(target, expected, rtol=1e-7, atol=1e-7)
    dense_outputs = inputs @ weight.T
    assert ((shifted @ target.T - dense_outputs) ** 2).sum() < ((shifted @ weight.T - dense_outputs) ** 2).sum()
    # Unshifted inputs give back the dense weight, damped or not.
    torch.testing.assert_close(shifted_target(weight, hessian, hessian), weight, rtol=1e-9, atol=1e-9)


def test_shifted_target_from_cross_outputs_equals_the_one_from_cross_moments(layer):
    inputs, weight, _ = layer
    generator = torch.Generator().manual_seed(4)
    shifted = inputs + 0.3 * torch.randn(inputs.shape, generator=generator, dtype=torch.float64)
    hessian = shifted.T @ shifted
    from_cross = shifted_target(weight, hessian, shifted.T @ inputs, damping=0.1)
    # X~^T (X W^T): the dense outputs instead of the dense inputs, all the target needs.
    from_outputs = shifted_target(weight, hessian, None, damping=0.1, cross_outputs=shifted.T @ (inputs @ weight.T))
    torch.testing.assert_close(from_outputs, from_cross, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(from_cross, weight, atol=1e-3)  # the inputs really shifted the target
    with pytest.raises(TypeError, match="exactly one"):
        shifted_target(weight, hessian, shifted.T @ inputs, cross_outputs=shifted.T @ (inputs @ weight.T))
    with pytest.raises(ShapeError):
        shifted_target(weight, hessian, None, cross_outputs=shifted.T @ inputs[:, :3])


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_gptq_rounding_lands_on_the_grid_keeps_zeros_and_beats_nearest(layer, precision):
    from nmdeploy.masks.reconstruct import sparsegpt_fit
    from nmdeploy.masks.rounding import grid_rounding, round_to_grid
    from nmdeploy.passes.quantization_ranges import channel_amax, scales_for

    _, weight, hessian = layer
    weight = weight * nm_mask(weight, "2:4", axis=1)  # a 2:4 layer: rounding must keep its support
    scales = torch.from_numpy(scales_for(channel_amax(weight.numpy(), 0), precision))
    fit = sparsegpt_fit(weight, hessian, 1, 1, 0.01, allowed=weight != 0, round_kept=grid_rounding(scales, precision))
    assert torch.equal(round_to_grid(fit.weight, scales, precision), fit.weight)  # every value on its row's grid
    assert not fit.weight[weight == 0].any()
    nearest = reconstruction_error(weight, round_to_grid(weight, scales, precision), hessian)
    # The column sweep spreads each rounding error over the kept inputs still to come: on these correlated inputs it
    # leaves 0.62x (int8) and 0.71x (fp8) of nearest rounding's output error.
    assert reconstruction_error(weight, fit.weight, hessian) < 0.8 * nearest


def test_the_grid_is_the_one_quantize_stores():
    import numpy as np

    from nmdeploy.masks.rounding import round_to_grid
    from nmdeploy.passes.quantization_ranges import channel_amax, quantize, scales_for

    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 64, generator=generator) * torch.rand(16, 1, generator=generator)
    weight[3] = 0.0  # an all-zero row: scale 1, zeros stay zeros
    for precision in ("int8", "fp8"):
        scales = scales_for(channel_amax(weight.numpy(), 0), precision)
        stored = quantize(weight.numpy(), scales[:, None], precision).astype(np.float32) * scales[:, None]
        np.testing.assert_array_equal(round_to_grid(weight, torch.from_numpy(scales), precision).numpy(), stored)
