"""One-shot starts of sparse fine-tuning: SparseGPT masks and kept-weight updates from calibration batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern, is_nm, is_transposable, reconstruction_error, sparsegpt
from nmdeploy.train import finalize, sparsify

PATTERN = Pattern.parse("2:4")


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 4))


def correlated_batches(count: int = 4, seed: int = 1) -> list[torch.Tensor]:
    # Correlated inputs: SparseGPT's choice then differs from magnitude's, so the test can tell them apart.
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(16, 16, generator=generator)
    return [torch.randn(32, 16, generator=generator) @ mixing for _ in range(count)]


def second_moments(rows: list[torch.Tensor]) -> torch.Tensor:
    stacked = torch.cat([r.reshape(-1, r.shape[-1]) for r in rows]).double()
    return (stacked.T @ stacked).float()


def test_sparsegpt_start_prunes_layer_after_layer_on_the_pruned_outputs() -> None:
    model, dense = mlp(), mlp()
    batches = correlated_batches()
    sparsifier = sparsify(model, "2:4", method="fixed", keep_dense="none", init="sparsegpt", calibration=batches)
    assert sparsifier.initialized == {"0": "sparsegpt", "2": "sparsegpt", "4": "sparsegpt"}
    # Independent replay: each layer pruned by SparseGPT on the inputs the already pruned layers before it give.
    expected, inputs = [], batches
    for index in (0, 2, 4):
        layer = dense[index]
        weight = sparsegpt(layer.weight.detach(), second_moments(inputs), 2, 4)
        expected.append(weight)
        with torch.no_grad():
            layer.weight.copy_(weight)
            outputs = [layer(x) for x in inputs]
        inputs = [torch.relu(y) for y in outputs] if index < 4 else outputs
    for index, weight in zip((0, 2, 4), expected, strict=True):
        torch.testing.assert_close(model[index].weight, weight, rtol=1e-4, atol=1e-5)
        mask = sparsifier.layers[str(index)].mask
        assert is_nm(mask, PATTERN, axis=1)
        assert not (model[index].parametrizations.weight.original[~mask]).any()


def test_sparsegpt_start_fits_the_calibration_outputs_better_than_magnitude() -> None:
    batches = correlated_batches()
    model, magnitude = mlp(), mlp()
    dense_layer = mlp()[0]
    sparsify(model, "2:4", method="fixed", keep_dense="none", init="sparsegpt", calibration=batches)
    sparsify(magnitude, "2:4", method="fixed", keep_dense="none")
    hessian = second_moments(batches)
    ours = reconstruction_error(dense_layer.weight.detach(), model[0].weight.detach(), hessian)
    theirs = reconstruction_error(dense_layer.weight.detach(), magnitude[0].weight.detach(), hessian)
    assert ours < 0.7 * theirs


def test_convolution_statistics_follow_the_kernel_layout_of_the_masks() -> None:
    # If H were accumulated in another column order than the kernel matrix, the predicted output error would not
    # be the measured one.
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 3, padding=1, stride=2)
    model = nn.Sequential(conv)
    dense = nn.Conv2d(8, 8, 3, padding=1, stride=2)
    dense.load_state_dict(conv.state_dict())
    batches = [torch.randn(2, 8, 7, 7) for _ in range(3)]
    sparsifier = sparsify(model, "2:4", method="fixed", keep_dense="none", init="sparsegpt", calibration=batches)
    assert sparsifier.initialized == {"0": "sparsegpt"}
    pruned = model[0].weight.detach()
    assert is_nm(pruned != 0, PATTERN, axis=1) and is_nm(sparsifier.layers["0"].mask, PATTERN, axis=1)
    with torch.no_grad():
        measured = sum(
            float((dense(x) - functional.conv2d(x, pruned, dense.bias, 2, 1)).square().sum()) for x in batches
        )
    columns = [
        functional.unfold(x, 3, padding=1, stride=2).view(2, 8, 9, -1).permute(0, 3, 2, 1).reshape(-1, 72)
        for x in batches
    ]
    matrix = [w.permute(0, 2, 3, 1).reshape(8, 72) for w in (dense.weight.detach(), pruned)]
    predicted = reconstruction_error(matrix[0], matrix[1], second_moments(columns))
    assert measured == pytest.approx(predicted, rel=1e-3)
    # and SparseGPT beat magnitude on the same data
    magnitude = nn.Conv2d(8, 8, 3, padding=1, stride=2)
    magnitude.load_state_dict(dense.state_dict())
    sparsify(nn.Sequential(magnitude), "2:4", method="fixed", keep_dense="none")
    with torch.no_grad():
        worse = sum(float((dense(x) - magnitude(x)).square().sum()) for x in batches)
    assert measured < worse


def test_transposable_backward_keeps_transposable_masks_and_refits_inside_them() -> None:
    model = mlp()
    sparsifier = sparsify(
        model,
        "2:4",
        method="srste",
        backward="transposable",
        keep_dense="none",
        init="sparsegpt",
        calibration=correlated_batches(),
    )
    for name in ("2",):
        mask = sparsifier.layers[name].mask
        assert is_transposable(mask, PATTERN, axis=1, out_axis=0)
        assert not model[2].parametrizations.weight.original[~mask].any()


class Block(nn.Module):
    """Cross-attention (keys and values from ``memory``), then a Linear; one Linear is never called."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.unused = nn.Linear(16, 16)
        self.mlp = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attention(x, memory, memory, need_weights=False)[0])


def test_attention_projections_are_measured_per_input_and_unused_layers_keep_magnitude() -> None:
    block, dense = Block(), Block()
    before = block.unused.weight.detach().clone()
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2, 5, 16, generator=generator), torch.randn(2, 7, 16, generator=generator))]
    sparsifier = sparsify(block, "2:4", method="ste", keep_dense="none", init="sparsegpt", calibration=batches)
    assert sparsifier.initialized["mlp"] == "sparsegpt"
    assert sparsifier.initialized["attention.in_proj_weight"] == "sparsegpt"
    assert sparsifier.initialized["attention.out_proj"] == "sparsegpt"
    assert "never called" in sparsifier.initialized["unused"]
    torch.testing.assert_close(block.unused.parametrizations.weight.original, before)  # left as it was
    # The packed projection: query rows fitted on the queries, key and value rows on the memory.
    weight = dense.attention.in_proj_weight.detach()
    queries, memory = batches[0]
    expected = torch.cat(
        [
            sparsegpt(weight[:16], second_moments([queries]), 2, 4),
            sparsegpt(weight[16:], second_moments([memory]), 2, 4),
        ]
    )
    torch.testing.assert_close(block.attention.parametrizations.in_proj_weight.original, expected)
    assert is_nm(sparsifier.layers["attention.in_proj_weight"].mask, PATTERN, axis=1)


def test_fixed_masks_from_sparsegpt_survive_fine_tuning_and_finalize() -> None:
    model = mlp()
    batches = correlated_batches()
    sparsifier = sparsify(model, "2:4", method="fixed", keep_dense="none", init="sparsegpt", calibration=iter(batches))
    masks = {name: mask.clone() for name, mask in sparsifier.masks().items()}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x in batches:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        sparsifier.step()
    for name, mask in sparsifier.masks().items():
        assert torch.equal(mask, masks[name])
    finalize(model)
    for index in (0, 2, 4):
        assert torch.equal(model[index].weight != 0, masks[str(index)] & (model[index].weight != 0))
        assert is_nm(model[index].weight != 0, PATTERN, axis=1)


def test_mapping_batches_are_keyword_arguments() -> None:
    class Keyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 8)

        def forward(self, *, features: torch.Tensor) -> torch.Tensor:
            return self.layer(features)

    model = Keyword()
    sparsifier = sparsify(
        model,
        "2:4",
        method="fixed",
        keep_dense="none",
        init="sparsegpt",
        calibration=[{"features": torch.randn(4, 8)}],
    )
    assert sparsifier.initialized == {"layer": "sparsegpt"}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"init": "sparsegpt"}, "needs calibration batches"),
        ({"init": "wanda", "calibration": [torch.randn(2, 16)]}, "unknown init 'wanda'"),
        ({"init": "sparsegpt", "calibration": []}, "no batches"),
        ({"init": "sparsegpt", "calibration": [torch.randn(2, 5)]}, "fails on calibration batch 0"),
        ({"init": "sparsegpt", "calibration": [torch.randn(2, 16)], "method": "lbc", "removal_end": 4}, "starts dense"),
        ({"init": "sparsegpt", "calibration": [torch.randn(2, 16)], "dense_steps": 3}, "starts dense"),
    ],
)
def test_bad_starts_are_input_errors(arguments: dict, message: str) -> None:
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = {"method": "srste", **arguments}
    with pytest.raises(InputError, match=message):
        sparsify(model, "2:4", keep_dense="none", **options)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_torch_transformer_layers_are_measured_despite_their_fused_paths() -> None:
    # In eval mode without gradients nn.TransformerEncoderLayer runs one fused kernel that calls no submodule.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    sparsifier = sparsify(
        layer, "2:4", method="fixed", keep_dense="none", init="sparsegpt", calibration=[torch.randn(2, 5, 16)]
    )
    assert set(sparsifier.initialized.values()) == {"sparsegpt"} and len(sparsifier.initialized) == 4
