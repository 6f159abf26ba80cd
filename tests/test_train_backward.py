"""Masked backward passes: transposable and bi-directional input gradients, MVUE weight gradients, kernel dispatch."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern, is_nm, is_transposable, transposable_mask
from nmdeploy.masks.training import backward_mask, permutation_scores, search_output_permutation
from nmdeploy.train import sparsify
from nmdeploy.train.masking import backward as backward_module
from nmdeploy.train.masking.backward import fits_two_four, parse_backward, sparse_kernel_reason


def linear_model(seed: int = 0, out: int = 16, inputs: int = 12) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, out))


def grads(layer: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input gradient, dense-weight gradient, bias gradient) for loss = sum(output * upstream)."""
    x = x.clone().requires_grad_(True)
    original = layer.parametrizations.weight.original
    original.grad = layer.bias.grad = None
    (layer(x) * upstream).sum().backward()
    return x.grad, original.grad.clone(), layer.bias.grad.clone()


def test_backward_options_are_validated() -> None:
    assert parse_backward("dense") == frozenset()
    assert parse_backward(("transposable", "mvue")) == {"transposable", "mvue"}
    for bad in ("sideways", ("dense", "mvue"), ("transposable", "bimask"), ()):
        with pytest.raises(InputError):
            parse_backward(bad)


@pytest.mark.parametrize("method", ["exact", "greedy"])
def test_transposable_mask_is_nm_along_both_axes_and_input_gradient_uses_it(method: str) -> None:
    model = linear_model()
    sparsifier = sparsify(model, method="ste", backward="transposable", keep_dense="none", transposable_method=method)
    layer = model[0]
    mask = sparsifier.masks()["0"]
    assert is_nm(mask, "2:4", axis=1) and is_nm(mask, "2:4", axis=0)
    assert is_transposable(mask, "2:4", axis=1, out_axis=0)
    original = layer.parametrizations.weight.original.detach()
    assert torch.equal(mask, transposable_mask(original, "2:4", axis=1, out_axis=0, method=method))
    x, upstream = torch.randn(6, 12), torch.randn(6, 16)
    grad_x, grad_w, grad_b = grads(layer, x, upstream)
    masked = original * mask
    torch.testing.assert_close(grad_x, upstream @ masked)
    torch.testing.assert_close(grad_w, upstream.T @ x)  # STE: dense weight gradient
    torch.testing.assert_close(grad_b, upstream.sum(0))


def test_transposable_masks_default_to_every_40_steps() -> None:
    model = linear_model()
    sparsifier = sparsify(model, method="srste", backward="transposable", keep_dense="none")
    original = model[0].parametrizations.weight.original
    first = sparsifier.masks()["0"].clone()
    for step in range(1, 41):
        with torch.no_grad():
            original.copy_(torch.randn_like(original))
        sparsifier.step()
        if step < 40:
            assert torch.equal(sparsifier.masks()["0"], first)
    assert torch.equal(sparsifier.masks()["0"], transposable_mask(original.detach(), "2:4", axis=1, out_axis=0))


def test_bimask_backward_mask_is_a_subset_and_nm_along_permuted_outputs() -> None:
    model = linear_model(out=16, inputs=8)
    sparsifier = sparsify(
        model, method="srste", backward="bimask", keep_dense="none", permutation_interval=1, permutation_candidates=20
    )
    layer = model[0]
    params = layer.parametrizations.weight
    for _ in range(3):
        with torch.no_grad():
            params.original.add_(torch.randn_like(params.original))
        sparsifier.step()
        forward, back, perm = params[0].mask, sparsifier.backward_masks()["0"], params[0].permutation
        assert not (back & ~forward).any()
        assert is_nm(back[perm], "2:4", axis=0)
        assert torch.equal(torch.sort(perm).values, torch.arange(16))
        # The backward mask keeps min(N, forward survivors) in every group: as many as the score says.
        assert int(back.sum()) == int(permutation_scores(forward, "2:4", perm[None])[0])
    x, upstream = torch.randn(6, 8), torch.randn(6, 16)
    grad_x, grad_w, _ = grads(layer, x, upstream)
    original = params.original.detach()
    torch.testing.assert_close(grad_x, upstream @ (original * back))
    # Weight gradient: dense and unmasked, plus SR-STE's decay on the forward-pruned weights.
    torch.testing.assert_close(grad_w, upstream.T @ x + 2e-4 * original * ~forward)


def test_bimask_helpers_against_brute_force() -> None:
    torch.manual_seed(3)
    weight = torch.randn(8, 4)
    forward = torch.rand(8, 4) > 0.4
    perm = torch.randperm(8)
    back = backward_mask(weight, forward, "2:4", perm)
    for column in range(4):
        for group in perm.reshape(2, 4):
            candidates = [int(o) for o in group if forward[o, column]]
            best = sorted(candidates, key=lambda o: -abs(float(weight[o, column])))[:2]
            assert sorted(int(o) for o in group if back[o, column]) == sorted(best)
    perms = torch.stack([torch.randperm(8) for _ in range(5)])
    expected = [sum(min(2, int(forward[group, c].sum())) for group in p.reshape(2, 4) for c in range(4)) for p in perms]
    assert permutation_scores(forward, "2:4", perms).tolist() == expected
    generator = torch.Generator().manual_seed(0)
    chosen = search_output_permutation(forward, "2:4", candidates=30, generator=generator, current=perm)
    scores = permutation_scores(forward, "2:4", torch.stack([perm, chosen]))
    assert scores[1] >= scores[0]


def test_mvue_weight_gradient_is_nm_along_tokens_and_input_gradient_is_exact() -> None:
    # With one-hot tokens as input, dW = G^T: the pruned neural gradient itself.
    model = linear_model(out=8, inputs=16)
    sparsify(model, method="ste", backward="mvue", keep_dense="none", mvue_pattern="1:2")
    layer, x, upstream = model[0], torch.eye(16), torch.randn(16, 8)
    grad_x, grad_w, grad_b = grads(layer, x, upstream)
    assert is_nm(grad_w, "1:2", axis=1)
    kept = grad_w != 0
    # 1:2 MVUE keeps one of each pair with value sign(a) * (|a| + |b|).
    pair_sums = upstream.T.abs().reshape(8, 8, 2).sum(-1).repeat_interleave(2, dim=1)
    torch.testing.assert_close(grad_w[kept].abs(), pair_sums[kept])
    torch.testing.assert_close(grad_x, upstream @ layer.weight.detach())
    torch.testing.assert_close(grad_b, upstream.sum(0))


def batch_means(layer: nn.Module, x: torch.Tensor, upstream: torch.Tensor, copies: int, batches: int) -> torch.Tensor:
    """``batches`` estimates of the weight gradient, each the mean of ``copies`` independent MVUE samples.

    The copies are stacked along the batch axis: their token groups never mix (each copy's token count is a multiple
    of M), so one backward pass draws ``copies`` independent gradient masks.
    """
    repeat = (copies,) + (1,) * (x.ndim - 1)
    return torch.stack([grads(layer, x.repeat(repeat), upstream.repeat(repeat))[1] / copies for _ in range(batches)])


@pytest.mark.parametrize("pattern", ["1:2", "2:4"])
def test_mvue_weight_gradient_is_unbiased(pattern: str) -> None:
    model = linear_model(out=4, inputs=8)
    sparsify(model, method="ste", backward="mvue", keep_dense="none", mvue_pattern=pattern, seed=5)
    torch.manual_seed(1)
    layer, x, upstream = model[0], torch.randn(32, 8), torch.randn(32, 4)
    dense = upstream.T @ x
    means = batch_means(layer, x, upstream, copies=200, batches=25)
    spread = means.std(0)
    assert (spread > 0).all()  # really random
    # The overall mean lies within 5 standard errors of the dense gradient, for every entry.
    assert ((means.mean(0) - dense).abs() <= 5 * spread / 25**0.5).all()
    # And the noise is real: a single sample is far from the dense gradient somewhere.
    assert not torch.allclose(grads(layer, x, upstream)[1], dense, atol=1e-3)


def test_mvue_on_convolutions_is_unbiased_and_exact_for_inputs_and_bias() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv1d(4, 4, 3, padding=1))
    sparsify(model, method="ste", backward="mvue", keep_dense="none", seed=1)
    layer = model[0]
    x, upstream = torch.randn(2, 4, 10), torch.randn(2, 4, 10)
    reference = nn.Conv1d(4, 4, 3, padding=1)
    reference.load_state_dict({"weight": layer.weight.detach(), "bias": layer.bias.detach()})
    x_ref = x.clone().requires_grad_(True)
    (reference(x_ref) * upstream).sum().backward()
    grad_x, _, grad_b = grads(layer, x, upstream)
    torch.testing.assert_close(grad_x, x_ref.grad)
    torch.testing.assert_close(grad_b, reference.bias.grad)
    means = batch_means(layer, x, upstream, copies=200, batches=25)
    assert ((means.mean(0) - reference.weight.grad).abs() <= 5 * means.std(0) / 25**0.5).all()


def test_conv_transposable_and_bimask_gradients_match_their_formulas() -> None:
    torch.manual_seed(4)
    for backward in ("transposable", "bimask"):
        model = nn.Sequential(nn.Conv2d(8, 8, 3, padding="same", padding_mode="reflect"))
        sparsifier = sparsify(model, method="fixed", backward=backward, keep_dense="none")
        layer = model[0]
        params = layer.parametrizations.weight
        operand = params.original.detach() * (
            sparsifier.backward_masks()["0"] if backward == "bimask" else params[0].mask
        )
        x, upstream = torch.randn(2, 8, 5, 5), torch.randn(2, 8, 5, 5)
        grad_x, grad_w, _ = grads(layer, x, upstream)

        def through(
            weight: torch.Tensor,
            inputs: torch.Tensor,
            bias: torch.Tensor = layer.bias,
            upstream: torch.Tensor = upstream,
        ) -> torch.Tensor:
            padded = nn.functional.pad(inputs, (1, 1, 1, 1), mode="reflect")
            return (nn.functional.conv2d(padded, weight, bias.detach()) * upstream).sum()

        forward_weight = layer.weight.detach().requires_grad_(True)
        x_leaf = x.clone().requires_grad_(True)
        (expected_w,) = torch.autograd.grad(through(forward_weight, x), forward_weight)
        (expected_x,) = torch.autograd.grad(through(operand, x_leaf), x_leaf)
        torch.testing.assert_close(grad_w, expected_w * params[0].mask)  # fixed mask: g * mask
        torch.testing.assert_close(grad_x, expected_x)


def test_mvue_generator_makes_gradients_reproducible() -> None:
    runs = []
    for _ in range(2):
        model = linear_model(out=8, inputs=8)
        sparsify(model, method="ste", backward="mvue", keep_dense="none", seed=11)
        x, upstream = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)), torch.ones(16, 8)
        runs.append([grads(model[0], x, upstream)[1] for _ in range(3)])
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)
    assert not torch.equal(runs[0][0], runs[0][1])


# ------------------------------------------------------------------------------------------------ kernel dispatch


def test_two_four_compatibility() -> None:
    assert [fits_two_four(Pattern.parse(p)) for p in ("1:2", "2:4", "1:4", "3:4", "4:8", "2:8")] == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    assert not fits_two_four(None)


def test_sparse_kernel_reason() -> None:
    table = {torch.float16: (16, 16), torch.bfloat16: (16, 16)}
    two_four = Pattern(2, 4)
    assert sparse_kernel_reason((64, 128), torch.float16, "cuda", two_four, table) is None
    assert sparse_kernel_reason((64, 128), torch.bfloat16, "cuda", Pattern(1, 2), table) is None
    assert "CUDA" in sparse_kernel_reason((64, 128), torch.float16, "cpu", two_four, table)
    assert "not 2:4-compatible" in sparse_kernel_reason((64, 128), torch.float16, "cuda", Pattern(4, 8), table)
    assert "not N:M" in sparse_kernel_reason((64, 128), torch.float16, "cuda", None, table)
    assert "dtype" in sparse_kernel_reason((64, 128), torch.float32, "cuda", two_four, table)
    assert "multiple" in sparse_kernel_reason((64, 120), torch.float16, "cuda", two_four, table)
    assert "backend" in sparse_kernel_reason((64, 128), torch.float16, "cuda", two_four, None)
    assert backward_module.constraints("cpu") is None


@pytest.fixture
def emulated_kernels(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Pretend the CPU has float32 semi-structured kernels: check each sparse operand, then multiply densely."""
    calls: list[tuple[int, int]] = []
    real_reason = backward_module.sparse_kernel_reason

    def reason(shape, dtype, device_type, pattern, constraints):  # noqa: ANN001, ANN202
        return real_reason(shape, dtype, "cuda", pattern, {torch.float32: (4, 4)})

    def linear(dense: torch.Tensor, sparse: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert is_nm(sparse, "2:4", axis=-1), "the sparse operand must be 2:4 along its last axis"
        calls.append(tuple(sparse.shape))
        return nn.functional.linear(dense, sparse, bias)

    monkeypatch.setattr(backward_module, "sparse_kernel_reason", reason)
    monkeypatch.setattr(backward_module, "semi_structured_linear", linear)
    return calls


@pytest.mark.parametrize("backward", [("transposable", "mvue"), ("bimask", "mvue")])
def test_sparse_kernel_path_gives_the_dense_path_gradients(emulated_kernels: list, backward: tuple) -> None:
    results = []
    for kernels in (False, True):
        model = linear_model(out=16, inputs=32)
        sparsifier = sparsify(
            model, method="srste", backward=backward, keep_dense="none", sparse_kernels=kernels, seed=3
        )
        x, upstream = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)), torch.randn(8, 16)
        output = model[0](x)
        results.append((output.detach(), *grads(model[0], x, upstream)))
        used = sparsifier.kernels_used()["0"]
        assert used == {"forward": kernels, "input": kernels, "weight": kernels}
    for dense, sparse in zip(*results, strict=True):
        torch.testing.assert_close(sparse, dense)
    # forward W [16, 32]; input gradient operand B^T [32, 16]; weight gradient operand G^T [16, 8 tokens].
    assert sorted(set(emulated_kernels)) == [(16, 8), (16, 32), (32, 16)]


def test_kernels_are_not_used_for_patterns_they_cannot_run(emulated_kernels: list) -> None:
    model = linear_model(out=16, inputs=32)
    sparsifier = sparsify(model, "4:8", method="srste", backward=("transposable", "mvue"), keep_dense="none")
    grads(model[0], torch.randn(8, 32), torch.randn(8, 16))
    assert sparsifier.kernels_used()["0"] == {"forward": False, "input": False, "weight": True}  # MVUE stays 2:4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="semi-structured sparse kernels need a CUDA GPU")
@pytest.mark.parametrize("backward", [("transposable", "mvue"), ("bimask", "mvue")])
def test_cuda_sparse_kernels_agree_with_the_dense_masked_math(backward: tuple) -> None:
    results = []
    for kernels in (False, True):
        torch.manual_seed(0)
        layer = nn.Linear(256, 128).cuda().half()
        model = nn.Sequential(layer)
        sparsifier = sparsify(model, method="srste", backward=backward, keep_dense="none", sparse_kernels=kernels)
        x = torch.randn(64, 256, device="cuda", dtype=torch.float16, generator=None)
        upstream = torch.randn(64, 128, device="cuda", dtype=torch.float16)
        torch.manual_seed(1)
        output = model[0](x)
        results.append((output.detach().float(), *(g.float() for g in grads(model[0], x, upstream))))
        if kernels:
            assert all(sparsifier.kernels_used()["0"].values()), sparsifier.kernels_used()
    for dense, sparse in zip(*results, strict=True):
        torch.testing.assert_close(sparse, dense, rtol=2e-2, atol=2e-2)


def test_every_combination_of_options_trains() -> None:
    choices = ["transposable", "bimask", "mvue"]
    for size in (1, 2):
        for combo in itertools.combinations(choices, size):
            if {"transposable", "bimask"} <= set(combo):
                continue
            model = nn.Sequential(nn.Conv1d(4, 8, 3), nn.Flatten(), nn.Linear(8 * 6, 8))
            sparsifier = sparsify(model, method="srste", backward=combo, keep_dense="none")
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            x = torch.randn(4, 4, 8)
            for _ in range(2):
                loss = model(x).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                sparsifier.step()
            assert torch.isfinite(loss), combo
            assert sorted(sparsifier.layers) == ["0", "2"], combo
