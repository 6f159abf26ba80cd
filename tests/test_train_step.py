"""Dense phases before masks: SR-STE's dense warm-up and STEP (Adam whose second moment freezes at the switch),
each checked against its update rule step by step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern, is_nm, nm_mask
from nmdeploy.train import STEPAdam, sparsify

PATTERN = Pattern.parse("2:4")
LR, BETAS, EPS = 1e-2, (0.9, 0.999), 1e-8


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def batch(step: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 + step))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    return model(batch(step)).square().mean()


def original(model: nn.Module) -> torch.Tensor:
    return model[0].parametrizations.weight.original


def srste_gradient(model: nn.Module, x: torch.Tensor, mask: torch.Tensor, decay: float) -> torch.Tensor:
    """The SR-STE rule for the first layer's dense weight, from a plain leaf: g on kept, g + decay * W on pruned."""
    weight = original(model).detach()
    masked = (weight * mask).requires_grad_(True)
    hidden = torch.relu(nn.functional.linear(x, masked, model[0].bias.detach()))
    nn.functional.linear(hidden, model[2].weight.detach(), model[2].bias.detach()).square().mean().backward()
    return masked.grad + decay * weight * ~mask


def test_srste_dense_warm_up_trains_dense_then_applies_the_srste_rule() -> None:
    model, reference = mlp(), mlp()
    sparsifier = sparsify(model, "2:4", method="srste", keep_dense="none", dense_steps=2, decay=0.5)
    layer = sparsifier.layers["0"]
    for step in range(2):
        assert layer.mask.all() and layer.sparse_pattern is None
        # the dense phase: the same forward and the same gradient as the unmodified model
        torch.testing.assert_close(model(batch(step)), reference(batch(step)))
        model.zero_grad()
        reference.zero_grad()
        loss_of(model, step).backward()
        loss_of(reference, step).backward()
        torch.testing.assert_close(original(model).grad, reference[0].weight.grad)
        with torch.no_grad():
            for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
                ours -= 0.1 * ours.grad
                theirs -= 0.1 * theirs.grad
        sparsifier.step()
    # step 2: the magnitude mask of the weights as they are now, then g + decay * W on pruned positions
    weight = original(model).detach()
    mask = layer.mask
    assert torch.equal(mask, nm_mask(weight, PATTERN, axis=1)) and layer.sparse_pattern == PATTERN
    x = batch(5)
    expected = srste_gradient(model, x, mask, 0.5)
    model.zero_grad()
    model(x).square().mean().backward()
    torch.testing.assert_close(original(model).grad, expected)


def run(model: nn.Module, optimizer: torch.optim.Optimizer, sparsifier, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        loss_of(model, step).backward()
        optimizer.step()
        if sparsifier is not None:
            sparsifier.step()


def test_step_adam_is_adam_until_the_given_switch() -> None:
    model, reference = mlp(), mlp()
    sparsifier = sparsify(model, "2:4", method="step", keep_dense="none", switch_step=3)
    optimizer = STEPAdam(model.parameters(), sparsifier, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.01)
    adam = torch.optim.Adam(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.01)
    run(model, optimizer, sparsifier, range(2))
    run(reference, adam, None, range(2))
    assert optimizer.switched_at is None and sparsifier.layers["0"].mask.all()
    torch.testing.assert_close(original(model), reference[0].weight)
    torch.testing.assert_close(model[2].parametrizations.weight.original, reference[2].weight)


def test_after_the_switch_the_second_moment_is_frozen_and_masks_follow_srste() -> None:
    model = mlp()
    sparsifier = sparsify(model, "2:4", method="step", keep_dense="none", switch_step=3, decay=0.5)
    optimizer = STEPAdam(model.parameters(), sparsifier, lr=LR, betas=BETAS, eps=EPS)
    run(model, optimizer, sparsifier, range(3))
    assert optimizer.switched_at == 3
    layer = sparsifier.layers["0"]
    parameter = original(model)
    weight = parameter.detach().clone()
    # the masks start at the switch, from the weights' magnitudes then
    assert torch.equal(layer.mask, nm_mask(weight, PATTERN, axis=1)) and is_nm(layer.mask, PATTERN, axis=1)
    frozen = optimizer.state[parameter]["exp_avg_sq"].clone()
    exp_avg = optimizer.state[parameter]["exp_avg"].clone()
    # step 4 by hand: SR-STE gradient, first moment moves, second moment stays v_3, bias corrections as Adam's
    optimizer.zero_grad()
    loss_of(model, 3).backward()
    grad = parameter.grad.clone()
    torch.testing.assert_close(grad, srste_gradient(model, batch(3), layer.mask, 0.5))
    optimizer.step()
    assert torch.equal(optimizer.state[parameter]["exp_avg_sq"], frozen)
    m = BETAS[0] * exp_avg + (1 - BETAS[0]) * grad
    expected = weight - LR * (m / (1 - BETAS[0] ** 4)) / ((frozen / (1 - BETAS[1] ** 3)).sqrt() + EPS)
    torch.testing.assert_close(parameter.detach(), expected)
    assert optimizer.switched_at == 3


def test_the_automatic_switch_waits_for_the_second_moment_to_settle() -> None:
    def switch_step(gradients) -> int | None:
        model = nn.Sequential(nn.Linear(4, 4, bias=False))
        sparsifier = sparsify(
            model, "2:4", method="step", keep_dense="none", switch_every=5, switch_tolerance=0.05, min_dense_steps=5
        )
        optimizer = STEPAdam(model.parameters(), sparsifier, lr=1e-3)
        for step in range(1, 41):
            model[0].parametrizations.weight.original.grad = gradients(step)
            optimizer.step()
            sparsifier.step()
            if optimizer.switched_at is not None:
                assert sparsifier.layers["0"].sparse_from() == step
                return step
        assert sparsifier.layers["0"].mask.all()
        return None

    # Constant gradients: the bias-corrected estimate is g^2 at every step, so the second check (step 10) sees no
    # change; growing gradients keep changing it by more than 5 % between checks, so the phase stays dense.
    assert switch_step(lambda step: torch.full((4, 4), 0.3)) == 10
    assert switch_step(lambda step: torch.full((4, 4), 1.1**step)) is None


def test_step_state_resumes_exactly() -> None:
    model = mlp()
    sparsifier = sparsify(model, "2:4", method="step", keep_dense="none", switch_step=2)
    optimizer = STEPAdam(model.parameters(), sparsifier, lr=LR)
    run(model, optimizer, sparsifier, range(3))
    copy_model = mlp(seed=5)
    copy_sparsifier = sparsify(copy_model, "2:4", method="step", keep_dense="none", switch_step=2)
    copy_optimizer = STEPAdam(copy_model.parameters(), copy_sparsifier, lr=LR)
    copy_model.load_state_dict(copy.deepcopy(model.state_dict()))
    copy_sparsifier.load_state_dict(sparsifier.state_dict())
    copy_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    run(model, optimizer, sparsifier, range(3, 6))
    run(copy_model, copy_optimizer, copy_sparsifier, range(3, 6))
    assert copy_optimizer.switched_at == 2
    torch.testing.assert_close(original(copy_model), original(model), rtol=0, atol=0)
    assert torch.equal(copy_sparsifier.layers["0"].mask, sparsifier.layers["0"].mask)


def test_bad_step_settings_are_input_errors() -> None:
    with pytest.raises(InputError, match="sparsify the model with method='step'"):
        STEPAdam(mlp().parameters(), sparsify(mlp(), method="srste"))
    with pytest.raises(InputError, match="switch_tolerance"):
        sparsify(mlp(), method="step", switch_tolerance=0)
    with pytest.raises(InputError, match="takes its dense phase from switch_step"):
        sparsify(mlp(), method="step", dense_steps=3)
