"""Forward training methods: gradients against their formulas, schedules, skipping, finalize and state round trips."""

from __future__ import annotations

import copy
import math
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern, is_nm, nm_mask
from nmdeploy.masks.training import combination_table, structure_decay_patterns
from nmdeploy.train import finalize, sparsify
from nmdeploy.train.masking.schedules import CombinationRemoval

_COMPILE_BUDGET_S = 60


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def cnn(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 12),
        nn.ReLU(),
        nn.Linear(12, 5),
    )


def reference_gradient(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of sum(output**2) with respect to the masked weight, computed with a plain leaf; and the mask."""
    masked = module.weight.detach().clone().requires_grad_(True)
    output = nn.functional.linear(x, masked, module.bias.detach())
    (output**2).sum().backward()
    return masked.grad, module.parametrizations.weight[0].mask.clone()


def original_gradient(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    original = module.parametrizations.weight.original
    original.grad = None
    (module(x) ** 2).sum().backward()
    return original.grad


def test_ste_passes_the_dense_gradient_through() -> None:
    model = mlp()
    sparsify(model, method="ste", keep_dense="none")
    layer, x = model[2], torch.randn(5, 16)
    g, mask = reference_gradient(layer, x)
    assert (~mask).any()
    torch.testing.assert_close(original_gradient(layer, x), g)


def test_srste_adds_decay_times_weight_on_pruned_positions_only() -> None:
    model = mlp()
    sparsify(model, method="srste", keep_dense="none", decay=0.5)
    layer, x = model[2], torch.randn(5, 16)
    g, mask = reference_gradient(layer, x)
    weight = layer.parametrizations.weight.original.detach()
    grad = original_gradient(layer, x)
    torch.testing.assert_close(grad[mask], g[mask])
    torch.testing.assert_close(grad[~mask], g[~mask] + 0.5 * weight[~mask])


def test_srste_default_decay_is_2e_4() -> None:
    model = mlp()
    sparsify(model, method="srste", keep_dense="none")
    assert model[2].parametrizations.weight[0].options.decay == 2e-4


def test_fixed_mask_blocks_pruned_gradients_and_never_changes() -> None:
    model = mlp()
    sparsifier = sparsify(model, method="fixed", keep_dense="none")
    layer, x = model[2], torch.randn(5, 16)
    g, mask = reference_gradient(layer, x)
    torch.testing.assert_close(original_gradient(layer, x), g * mask)
    with torch.no_grad():
        layer.parametrizations.weight.original.mul_(-3).add_(torch.randn(32, 16))
    sparsifier.step()
    assert torch.equal(sparsifier.masks()["2"], mask)


def test_fixed_mask_takes_given_masks_and_rejects_bad_ones() -> None:
    model = mlp()
    given = nm_mask(torch.randn(32, 16), "2:4", axis=1)
    sparsifier = sparsify(model, method="fixed", keep_dense="none", masks={"2": given.float()})
    assert torch.equal(sparsifier.masks()["2"], given)
    with pytest.raises(InputError, match="not 2:4"):
        sparsify(mlp(), method="fixed", keep_dense="none", masks={"2": torch.ones(32, 16)})
    with pytest.raises(InputError, match="unknown layers"):
        sparsify(mlp(), method="fixed", masks={"nope": given})


def test_masks_follow_the_dense_weights_on_schedule() -> None:
    model = mlp()
    sparsifier = sparsify(model, method="ste", keep_dense="none", mask_interval=3)
    original = model[2].parametrizations.weight.original
    for step in range(1, 7):
        before = sparsifier.masks()["2"].clone()
        with torch.no_grad():
            original.copy_(torch.randn_like(original))
        sparsifier.step()
        expected = nm_mask(original, "2:4", axis=1) if step % 3 == 0 else before
        assert torch.equal(sparsifier.masks()["2"], expected), step


def test_conv_masks_group_input_channels_at_each_kernel_position() -> None:
    model = cnn()
    sparsifier = sparsify(model, "2:4", method="srste")
    weight = model[2].parametrizations.weight.original
    mask = sparsifier.masks()["2"]
    assert mask.shape == (16, 8, 3, 3)
    assert torch.equal(mask, nm_mask(weight.permute(0, 2, 3, 1), "2:4", axis=-1).permute(0, 3, 1, 2))
    assert is_nm(model[2].weight, "2:4", axis=1)


def test_skipped_layers_are_reported_with_reasons() -> None:
    model = nn.Sequential(
        nn.Linear(6, 8), nn.Linear(8, 8), nn.Conv2d(8, 8, 3, groups=2), nn.Linear(8, 12), nn.Linear(12, 4)
    )
    sparsifier = sparsify(model, method="srste", backward="bimask", exclude="^3$")
    assert sorted(sparsifier.layers) == ["1"]
    assert "6 input channels" in sparsifier.skipped["0"]
    assert "bi-directional masks need an ungrouped layer" in sparsifier.skipped["2"]
    assert "exclude" in sparsifier.skipped["3"]
    assert "last layer, taken as the output head" in sparsifier.skipped["4"]
    by_position = sparsify(mlp(), method="ste", keep_dense="first-last")
    assert sorted(by_position.layers) == ["2"] and "first layer" in by_position.skipped["0"]
    assert "last layer" in by_position.skipped["4"]
    plain = sparsify(nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8)), method="ste", keep_dense="none")
    assert "6 input channels" in plain.skipped["0"]
    only = sparsify(mlp(), method="ste", keep_dense="none", include="^2$")
    assert sorted(only.layers) == ["2"] and "include" in only.skipped["0"]
    assert not parametrize.is_parametrized(model[0])


def test_bad_arguments_are_input_errors() -> None:
    with pytest.raises(InputError, match="unknown training method .magic.; choose one of ste, srste"):
        sparsify(mlp(), method="magic")
    with pytest.raises(InputError, match="unknown option"):
        sparsify(mlp(), method="srste", lamda=1e-4)
    with pytest.raises(InputError, match="removal_end"):
        sparsify(mlp(), method="lbc")
    with pytest.raises(InputError, match="transposable"):
        sparsify(mlp(), method="lbc", backward="transposable", removal_end=10)
    for decaying in ("mask-decay", "structure-decay"):
        with pytest.raises(InputError, match=f"method '{decaying}' needs decay_steps"):
            sparsify(mlp(), method=decaying)
    with pytest.raises(InputError, match="dense_layers"):
        sparsify(mlp(), dense_layers=("fc9",))


def test_lbc_learns_one_combination_per_group_on_the_cubic_schedule() -> None:
    model = mlp()
    end = 6
    sparsifier = sparsify(model, method="lbc", keep_dense="none", removal_end=end)
    layer = sparsifier.layers["2"]
    total = math.comb(4, 2)
    # At the start every weight sits in C(3, 1) = 3 combinations with score 1/3: dense.
    relaxed = layer.scores @ combination_table("2:4").float()
    torch.testing.assert_close(relaxed, torch.ones_like(relaxed))
    assert layer.mask.all()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = CombinationRemoval(total, 0, end)
    for step in range(1, end + 2):
        loss = (model(torch.randn(16, 8)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sparsifier.step()
        alive = layer.alive.sum(dim=1)
        assert (alive == schedule.alive(step)).all()
        assert (layer.scores[~layer.alive] == 0).all()
    assert (layer.alive.sum(dim=1) == 1).all()
    assert not layer.scores.requires_grad
    assert torch.equal(layer.mask.reshape(-1, 4).sum(dim=1), torch.full((32 * 4,), 2))
    assert is_nm(model[2].weight, "2:4", axis=1)


def test_lbc_score_gradient_is_the_taylor_importance_of_each_combination() -> None:
    model = mlp()
    sparsify(model, method="lbc", keep_dense="none", removal_end=10)
    layer, x = model[2], torch.randn(5, 16)
    g, _ = reference_gradient(layer, x)
    params = layer.parametrizations.weight
    params[0].scores.grad = None
    original_gradient(layer, x)
    weight = params.original.detach()
    expected = (weight * g).reshape(-1, 4) @ combination_table("2:4").float().T
    torch.testing.assert_close(params[0].scores.grad, expected)


def test_cubic_removal_counts() -> None:
    schedule = CombinationRemoval(6, 0, 10)
    counts = [schedule.alive(step) for step in range(12)]
    assert counts[0] == 6 and counts[10:] == [1, 1]
    assert counts == [1 + math.ceil(5 * (1 - min(t, 10) / 10) ** 3) for t in range(12)]
    assert all(a >= b for a, b in zip(counts, counts[1:], strict=False))


def test_mask_decay_scales_pruned_weights_down_to_zero_then_fixes_the_mask() -> None:
    model = mlp()
    sparsifier = sparsify(model, method="mask-decay", keep_dense="none", dense_steps=2, decay_steps=4)
    layer = sparsifier.layers["2"]
    original = model[2].parametrizations.weight.original
    factors = []
    for _step in range(1, 9):
        sparsifier.step()
        factors.append(float(layer.factor))
        with torch.no_grad():
            original.add_(0.01 * torch.randn_like(original))
    assert factors == pytest.approx([1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0])
    assert torch.equal(model[2].weight, original * layer.mask)
    assert is_nm(model[2].weight, "2:4", axis=1)
    frozen = layer.mask.clone()
    with torch.no_grad():
        original.copy_(torch.randn_like(original))
    sparsifier.step()
    assert torch.equal(layer.mask, frozen)


def test_mask_decay_gradient_on_pruned_weights_is_scaled_by_the_factor() -> None:
    model = mlp()
    sparsifier = sparsify(model, method="mask-decay", keep_dense="none", decay_steps=4)
    for _ in range(2):
        sparsifier.step()
    layer, x = model[2], torch.randn(5, 16)
    g, mask = reference_gradient(layer, x)
    grad = original_gradient(layer, x)
    torch.testing.assert_close(grad, torch.where(mask, g, 0.5 * g))


def test_structure_decay_walks_to_the_target_pattern() -> None:
    assert [str(p) for p in structure_decay_patterns("1:16")] == ["15:16", "8:16", "4:16", "2:16", "1:16"]
    assert [str(p) for p in structure_decay_patterns("1:4")] == ["3:4", "2:4", "1:4"]
    model = mlp()
    sparsifier = sparsify(model, "1:4", method="structure-decay", keep_dense="none", dense_steps=1, decay_steps=6)
    layer = sparsifier.layers["2"]
    kept = [int(layer.mask.reshape(-1, 4).sum(dim=1).max())]
    for _ in range(8):
        sparsifier.step()
        kept.append(int(layer.mask.reshape(-1, 4).sum(dim=1).max()))
    assert kept == [4, 3, 3, 2, 2, 1, 1, 1, 1]
    assert layer.fixed and is_nm(model[2].weight, "1:4", axis=1)
    x = torch.randn(5, 16)
    g, mask = reference_gradient(model[2], x)
    torch.testing.assert_close(original_gradient(model[2], x), g * mask)


@pytest.mark.parametrize(
    ("method", "options"),
    [
        ("srste", {}),
        ("lbc", {"removal_end": 50}),
        ("mask-decay", {"decay_steps": 50}),
        ("structure-decay", {"decay_steps": 50}),
    ],
)
def test_finalize_gives_plain_nm_modules(method: str, options: dict) -> None:
    model = cnn()
    sparsifier = sparsify(model, method=method, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(4, 3, 4, 4)
    for _ in range(3):
        loss = (model(x) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sparsifier.step()
    finalize(model)
    for name in sparsifier.layers:
        module = model.get_submodule(name)
        assert type(module) in (nn.Linear, nn.Conv2d)
        assert "forward" not in module.__dict__
        assert type(module.weight) is nn.Parameter
        assert is_nm(module.weight, "2:4", axis=1)
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    assert not any("parametrizations" in key for key in model.state_dict())


def test_finalize_keeps_the_trained_function_once_masks_are_hard() -> None:
    model = cnn()
    sparsify(model, method="srste", backward=("transposable", "mvue"))
    x = torch.randn(4, 3, 4, 4)
    before = model(x).detach()
    finalize(model)
    torch.testing.assert_close(model(x), before)


def _train(model: nn.Module, sparsifier, optimizer, steps: int, seed: int) -> list[float]:
    data = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 3, 4, 4, generator=data)
        loss = (model(x) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sparsifier.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize(
    ("method", "backward", "options"),
    [
        ("srste", ("transposable", "mvue"), {"mask_interval": 2}),
        ("lbc", ("bimask", "mvue"), {"removal_end": 6, "permutation_interval": 2, "permutation_candidates": 3}),
        # The loaded mask (and decay factor) must reach the forward's multiplier before any mask update.
        ("fixed", "dense", {}),
        ("mask-decay", "dense", {"decay_steps": 6, "mask_interval": 2}),
    ],
)
def test_state_dict_round_trip_resumes_exactly(method: str, backward: tuple, options: dict) -> None:
    model = cnn()
    sparsifier = sparsify(model, method=method, backward=backward, **options)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, sparsifier, optimizer, 3, seed=1)
    saved = (model.state_dict(), sparsifier.state_dict(), optimizer.state_dict())
    saved = copy.deepcopy(saved)
    uninterrupted = _train(model, sparsifier, optimizer, 5, seed=2)

    resumed_model = cnn(seed=7)
    resumed = sparsify(resumed_model, method=method, backward=backward, **options)
    resumed_optimizer = torch.optim.Adam(resumed_model.parameters(), lr=1e-2)
    resumed_model.load_state_dict(saved[0])
    resumed.load_state_dict(saved[1])
    resumed_optimizer.load_state_dict(saved[2])
    assert _train(resumed_model, resumed, resumed_optimizer, 5, seed=2) == uninterrupted
    for name, mask in sparsifier.masks().items():
        assert torch.equal(resumed.masks()[name], mask)


@pytest.mark.parametrize(
    ("method", "options"),
    [("srste", {}), ("ste", {}), ("mask-decay", {"decay_steps": 10}), ("structure-decay", {"decay_steps": 8})],
)
def test_forward_multiplier_follows_the_mask_through_few_and_many_flips(method: str, options: dict) -> None:
    model = cnn()
    sparsifier = sparsify(model, method=method, **options)
    flips = []
    for lr in (0.03, 0.03, 5.0, 0.03, 0.03, 5.0, 0.03, 0.03, 0.03, 0.03):  # few flips, then many, in turn
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        before = {name: mask.clone() for name, mask in sparsifier.masks().items()}
        _train(model, sparsifier, optimizer, 1, seed=len(flips))
        flips.append(sum(int((before[name] != mask).sum()) for name, mask in sparsifier.masks().items()))
        for layer in sparsifier.layers.values():
            factor = getattr(layer, "factor", torch.tensor(0.0))
            assert (layer.multiplier[layer.mask] == 1).all()  # exactly: kept weights pass unchanged
            assert (layer.multiplier[~layer.mask] == factor).all()
            if method == "srste":
                assert torch.equal(layer.pruned, 1.0 - layer.mask.float())
    assert any(0 < count < 8 for count in flips) and max(flips) > 100, flips


def test_sparsifier_state_from_other_settings_is_refused() -> None:
    state = sparsify(cnn(), method="srste").state_dict()
    with pytest.raises(InputError, match="does not match"):
        sparsify(cnn(), method="ste").load_state_dict(state)


_COMPILE_SCRIPT = """
import torch
from torch import nn
from nmdeploy.train import sparsify
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
sparsifier = sparsify(model, method="srste", keep_dense="none")
x = torch.randn(4, 8)
loss = torch.compile(model)(x).square().sum()
loss.backward()
compiled_grad = model[2].parametrizations.weight.original.grad.clone()
model.zero_grad()
eager = model(x).square().sum()
eager.backward()
torch.testing.assert_close(loss, eager)
torch.testing.assert_close(compiled_grad, model[2].parametrizations.weight.original.grad)
sparsifier.step()
print("compiled ok")
"""


@pytest.mark.slow
def test_torch_compile_runs_forward_and_backward() -> None:
    # A separate process, because compiling can take minutes on a loaded machine and cannot be interrupted.
    try:
        result = subprocess.run(
            [sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, timeout=_COMPILE_BUDGET_S
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"torch.compile took more than {_COMPILE_BUDGET_S} s here")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled ok" in result.stdout


def test_pattern_is_kept_on_the_sparsifier() -> None:
    assert sparsify(mlp(), "1:4", keep_dense="none").pattern == Pattern(1, 4)


def test_a_training_method_is_one_registered_class_that_sparsify_and_configs_accept() -> None:
    from nmdeploy.train.masking import methods
    from nmdeploy.train.masking.settings import method_names

    @methods.register_training_method("toy-masked", help="the mask multiplied in, the gradient masked too")
    class Masked(methods.NMParametrization):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight * self.mask

    try:
        assert "toy-masked" in method_names() and Masked.name == "toy-masked"
        model = mlp()
        sparsify(model, method="toy-masked", keep_dense="none")
        x = torch.randn(5, 8)
        (model(x) ** 2).sum().backward()
        for layer in (model[0], model[2], model[4]):
            weight = layer.weight.detach()
            assert is_nm(weight, Pattern(2, 4), 1)
            # The registered forward runs: the masked weight's pruned entries get no gradient.
            grad = layer.parametrizations.weight.original.grad
            assert torch.all(grad[weight == 0] == 0) and torch.any(grad != 0)
    finally:
        methods.METHODS.unregister("toy-masked")
    with pytest.raises(InputError, match="unknown training method 'toy-masked'"):
        sparsify(mlp(), method="toy-masked")
