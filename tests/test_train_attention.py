"""Users' models: nn.MultiheadAttention (packed and separate projections), weights read around a Linear's forward,
tied weights and the dense-layer defaults. Every masked backward is checked against an independent computation."""

import json
import math
import warnings

import onnx
import pytest
import torch
from torch import nn
from torch.nn import functional

from nmdeploy.cli import main
from nmdeploy.masks import Pattern, is_nm, is_transposable, mvue_prune
from nmdeploy.train import finalize, sparsify
from nmdeploy.train.export import export_onnx
from nmdeploy.train.masking.backward import stream_seed

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TWO_FOUR = Pattern.parse("2:4")


class TinyLM(nn.Module):
    """Embedding, one nn.TransformerEncoderLayer (packed self-attention), LM head: the usual user model."""

    def __init__(self, vocabulary: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.block = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.lm_head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.block(self.embed(tokens)))


def masked(sparsifier, name):
    module, attribute = sparsifier._slots[name]
    return getattr(module, attribute).detach().clone()


def original(sparsifier, name):
    return sparsifier._weight(name)


def reference_self_attention(x, w_in, b_in, w_out, b_out, heads):
    """Multi-head self-attention written out by hand (batch first): returns the packed projection, the mixed
    heads and the output, so the test can read the gradient at each projection."""
    batch, length, width = x.shape
    packed = x @ w_in.T + b_in
    q, k, v = (t.reshape(batch, length, heads, width // heads).transpose(1, 2) for t in packed.split(width, -1))
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(width // heads), dim=-1)
    mixed = (weights @ v).transpose(1, 2).reshape(batch, length, width)
    return packed, mixed, mixed @ w_out.T + b_out


@pytest.mark.parametrize("backward", [("transposable", "mvue"), ("bimask", "mvue")])
def test_attention_masked_backward_matches_the_hand_written_gradients(backward):
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(16, 4, batch_first=True)
    nn.init.normal_(attention.in_proj_bias)
    nn.init.normal_(attention.out_proj.bias)
    model = nn.ModuleDict({"attn": attention})
    decay = 0.01
    sparsifier = sparsify(model, method="srste", backward=backward, keep_dense="none", decay=decay, seed=4)
    assert sorted(sparsifier.layers) == ["attn.in_proj_weight", "attn.out_proj"]
    for name, mask in sparsifier.masks().items():
        assert is_nm(mask, TWO_FOUR, axis=1), name
        if "transposable" in backward:
            assert is_transposable(mask, TWO_FOUR, axis=1, out_axis=0), name
    draws = torch.Generator().manual_seed(stream_seed(4, 0, 0))  # MVUE's stream of seed 4, rank 0, step 0

    x = torch.randn(2, 8, 16, requires_grad=True)
    out, weights = attention(x, x, x, need_weights=False)
    assert weights is None
    upstream = torch.randn_like(out)
    out.backward(upstream)
    assert all(sparsifier._backwards[name].ran for name in sparsifier.layers)
    assert set(sparsifier.kernels_used()["attn.in_proj_weight"]) == {"forward", "input", "weight"}

    w_in, w_out = masked(sparsifier, "attn.in_proj_weight"), masked(sparsifier, "attn.out_proj")
    reference_x = x.detach().clone().requires_grad_()
    packed, mixed, reference_out = reference_self_attention(
        reference_x, w_in, attention.in_proj_bias.detach(), w_out, attention.out_proj.bias.detach(), 4
    )
    torch.testing.assert_close(out, reference_out, rtol=1e-5, atol=1e-6)

    def tokens(t):  # torch's attention runs sequence-first: its projections see tokens in (position, batch) order
        return t.transpose(0, 1).reshape(-1, t.shape[-1])

    flat_upstream = tokens(upstream)
    backward_masks = sparsifier.backward_masks()
    if "bimask" in backward:  # dX = dY (W~ * M_b): replace what plain autograd would send back
        out_operand = w_out * backward_masks["attn.out_proj"]
        mixed.register_hook(lambda grad: (upstream @ out_operand).reshape(grad.shape))
    packed.retain_grad()
    reference_out.backward(upstream)
    flat_packed = tokens(packed.grad)
    in_operand = w_in * backward_masks["attn.in_proj_weight"] if "bimask" in backward else w_in
    torch.testing.assert_close(x.grad, packed.grad @ in_operand, rtol=1e-4, atol=1e-5)

    # MVUE prunes each projection's output gradient along tokens, out_proj's first (autograd order).
    pruned_out = mvue_prune(flat_upstream, TWO_FOUR, axis=0, generator=draws, remainder="dense")
    pruned_in = mvue_prune(flat_packed, TWO_FOUR, axis=0, generator=draws, remainder="dense")
    assert not torch.equal(pruned_in, flat_packed)  # the pruning really happened
    expected = {
        "attn.out_proj": pruned_out.T @ tokens(mixed.detach()),
        "attn.in_proj_weight": pruned_in.T @ tokens(x.detach()),
    }
    for name, weight_grad in expected.items():
        mask = sparsifier.masks()[name]
        dense = original(sparsifier, name).detach()
        srste = weight_grad + decay * dense * (~mask)  # SR-STE's pull on pruned weights, through the parametrisation
        torch.testing.assert_close(original(sparsifier, name).grad, srste, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(attention.out_proj.bias.grad, flat_upstream.sum(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(attention.in_proj_bias.grad, flat_packed.sum(0), rtol=1e-4, atol=1e-5)


def _plain_copy(sparsifier, attention, **kwargs):
    """A fresh MultiheadAttention with the sparse module's masked weights, run by torch's own code."""
    plain = nn.MultiheadAttention(attention.embed_dim, attention.num_heads, **kwargs)
    with torch.no_grad():
        for name, parameter in plain.named_parameters():
            owner = attention.out_proj if name.startswith("out_proj.") else attention
            parameter.copy_(getattr(owner, name.rpartition(".")[2]))  # the masked value of a parametrised weight
    return plain


@pytest.mark.parametrize(
    ("method", "backward", "options"),
    [
        ("ste", ("transposable",), {}),
        ("srste", ("transposable",), {}),
        ("fixed", ("transposable",), {}),
        ("mask-decay", ("transposable",), {"decay_steps": 4}),
        ("structure-decay", ("transposable",), {"decay_steps": 4}),
        ("lbc", ("bimask",), {"removal_end": 4}),
    ],
)
def test_every_method_trains_separate_projections_with_the_masked_backward(method, backward, options):
    # kdim and vdim differ from the width: separate q/k/v_proj_weight; cross-attention with masks and weights out.
    torch.manual_seed(1)
    attention = nn.MultiheadAttention(16, 2, kdim=8, vdim=12)
    sparsifier = sparsify(
        nn.ModuleDict({"attn": attention}), method=method, backward=backward, keep_dense="none", **options
    )
    names = {"attn.q_proj_weight", "attn.k_proj_weight", "attn.v_proj_weight", "attn.out_proj"}
    assert set(sparsifier.layers) == names
    query, key, value = torch.randn(5, 3, 16), torch.randn(7, 3, 8), torch.randn(7, 3, 12)
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[0, -2:] = True
    causal = torch.ones(5, 7, dtype=torch.bool).triu(1)
    leaf = query.clone().requires_grad_()
    out, weights = attention(leaf, key, value, key_padding_mask=padding, attn_mask=causal)
    (out.square().sum() + weights.sum()).backward()
    assert all(sparsifier._backwards[name].ran for name in names)
    plain = _plain_copy(sparsifier, attention, kdim=8, vdim=12)
    plain_leaf = query.clone().requires_grad_()
    expected, expected_weights = plain(plain_leaf, key, value, key_padding_mask=padding, attn_mask=causal)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)
    if "transposable" in backward:  # the masked weight is its own transposable operand: dX is plain autograd's
        (expected.square().sum() + expected_weights.sum()).backward()
        torch.testing.assert_close(leaf.grad, plain_leaf.grad, rtol=1e-4, atol=1e-5)
    sparsifier.step()


@pytest.mark.parametrize("shared", ["query-key-value", "key-value", "none"])
def test_packed_projection_splits_for_cross_attention(shared):
    torch.manual_seed(2)
    attention = nn.MultiheadAttention(16, 4, batch_first=True)
    sparsifier = sparsify(nn.ModuleDict({"attn": attention}), backward=("bimask", "mvue"), keep_dense="none")
    query = torch.randn(2, 5, 16)
    key = query if shared == "query-key-value" else torch.randn(2, 5, 16)
    value = key if shared != "none" else torch.randn(2, 5, 16)
    out, _ = attention(query, key, value, need_weights=False)
    out.sum().backward()
    assert sparsifier._backwards["attn.in_proj_weight"].ran and sparsifier._backwards["attn.out_proj"].ran
    grad = original(sparsifier, "attn.in_proj_weight").grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    with torch.no_grad():
        expected, _ = _plain_copy(sparsifier, attention, batch_first=True)(query, key, value, need_weights=False)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_transformer_lm_trains_with_transposable_mvue_and_exports_for_inspect_require(tmp_path, capsys):
    torch.manual_seed(3)
    model = TinyLM()
    sparsifier = sparsify(model, backward=("transposable", "mvue"))  # defaults otherwise
    assert sorted(sparsifier.layers) == [
        "block.linear1",
        "block.linear2",
        "block.self_attn.in_proj_weight",
        "block.self_attn.out_proj",
    ]
    assert "output head" in sparsifier.skipped["lm_head"]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 32, (4, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every masked backward runs: no warning after the first step
        for _ in range(3):
            loss = functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sparsifier.step()
    assert set(sparsifier.kernels_used()) == set(sparsifier.layers)
    dense_gemms = {"forward": False, "input": False, "weight": False}  # the masked GEMMs ran, densely on a CPU
    assert all(used == dense_gemms for used in sparsifier.kernels_used().values())
    for name, mask in sparsifier.masks().items():
        assert is_transposable(mask, TWO_FOUR, axis=1, out_axis=0), name
    model.eval()
    with torch.no_grad():
        before = model(tokens)
    path = export_onnx(model, (tokens,), tmp_path / "lm.onnx", sparsifier, input_names=["tokens"])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), before)  # finalised in place, same function
    record = json.loads({p.key: p.value for p in onnx.load(str(path)).metadata_props}["nmdeploy.sparsity"])
    assert record["layers"]["lm_head"]["status"] == "dense" and record["layers"]["lm_head"]["initializers"]
    assert all(record["layers"][name]["initializers"] for name in sparsifier.layers)
    assert main(["inspect", str(path), "--require"]) == 0
    output = capsys.readouterr().out
    assert "dense on purpose: " in output and "lm_head" in output


def test_unsupported_attention_is_skipped_with_a_warning_and_dense_backward_still_masks_it():
    attention = nn.MultiheadAttention(16, 4, add_bias_kv=True)
    with pytest.warns(UserWarning, match="add_bias_kv"):
        sparsifier = sparsify(nn.ModuleDict({"attn": attention}), backward="mvue", keep_dense="none")
    assert not sparsifier.layers
    assert all("add_bias_kv" in reason for reason in sparsifier.skipped.values())
    assert set(sparsifier.skipped) == {"attn.in_proj_weight", "attn.out_proj"}
    dense = sparsify(nn.ModuleDict({"attn": nn.MultiheadAttention(16, 4, add_bias_kv=True)}), keep_dense="none")
    assert set(dense.layers) == {"attn.in_proj_weight", "attn.out_proj"}  # the forward mask needs no backward


class ReadsAround(nn.Module):
    """Calls F.linear on a child Linear's weight: the Linear's own forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(functional.linear(x, self.inner.weight, self.inner.bias))


class Scaled(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_weights_read_around_the_layer_forward_warn_or_stay_dense():
    model = ReadsAround()
    sparsifier = sparsify(model, backward="mvue", keep_dense="none")
    model(torch.randn(4, 8)).sum().backward()
    with pytest.warns(UserWarning, match="did not run in the first step: inner"):
        sparsifier.step()
    with pytest.warns(UserWarning, match="overrides Linear.forward"):
        scaled = sparsify(nn.Sequential(Scaled(8, 8), nn.Linear(8, 4)), backward="mvue", keep_dense="none")
    assert set(scaled.layers) == {"1"} and "overrides Linear.forward" in scaled.skipped["0"]
    plain = sparsify(nn.Sequential(Scaled(8, 8), nn.Linear(8, 4)), keep_dense="none")  # dense backward: fine
    assert set(plain.layers) == {"0", "1"}


def test_dense_defaults_keep_heads_embeddings_and_tied_weights():
    model = TinyLM()
    model.lm_head.weight = model.embed.weight  # tied
    sparsifier = sparsify(model)
    assert "tied to the embedding embed.weight" in sparsifier.skipped["lm_head"]
    assert "block.self_attn.in_proj_weight" in sparsifier.layers  # the first Linear by position is not special
    regex = sparsify(TinyLM(), dense_layers=[r"block\.linear\d"])
    assert {"block.linear1", "block.linear2"} <= set(regex.skipped) and "lm_head" in regex.skipped
    by_position = sparsify(TinyLM(), keep_dense="first-last")
    assert set(by_position.skipped) == {"block.self_attn.in_proj_weight", "lm_head"}
    named = nn.Sequential()
    named.add_module("embed", nn.Linear(8, 16))
    named.add_module("classifier", nn.Linear(16, 4))
    named.add_module("aux", nn.Linear(16, 16))
    auto = sparsify(named)
    assert set(auto.skipped) == {"embed", "classifier"} and set(auto.layers) == {"aux"}
    from nmdeploy.errors import InputError

    with pytest.raises(InputError, match="keep_dense"):
        sparsify(TinyLM(), keep_dense="heads")
    with pytest.raises(InputError, match="names no Linear"):
        sparsify(TinyLM(), dense_layers=["decoder.*"])


def test_finalize_bakes_attention_weights_and_restores_the_stock_forward():
    torch.manual_seed(5)
    model = TinyLM()
    sparsifier = sparsify(model, backward="bimask")
    masks = {name: mask.clone() for name, mask in sparsifier.masks().items()}
    finalize(model)
    attention = model.block.self_attn
    assert "forward" not in attention.__dict__ and type(attention) is nn.MultiheadAttention
    assert isinstance(attention.in_proj_weight, nn.Parameter)
    assert torch.equal(attention.in_proj_weight != 0, masks["block.self_attn.in_proj_weight"])
    assert set(model.state_dict()) == set(TinyLM().state_dict())


def test_checkpoint_of_an_attention_model_restores_into_a_fresh_dense_model(tmp_path):
    from nmdeploy.train import CheckpointMismatchError, load_checkpoint, save_checkpoint

    torch.manual_seed(6)
    model = TinyLM()
    sparsifier = sparsify(model, backward=("transposable", "mvue"), mask_interval=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 32, (4, 12))

    def steps(model, sparsifier, optimizer, count):
        losses = []
        for _ in range(count):
            loss = functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sparsifier.step()
            losses.append(float(loss.detach()))
        return losses

    steps(model, sparsifier, optimizer, 2)
    path = save_checkpoint(tmp_path / "lm.pt", model, sparsifier, optimizer=optimizer)
    straight = steps(model, sparsifier, optimizer, 2)
    fresh = TinyLM()
    restored = load_checkpoint(path, fresh)  # sparsified as the run was, attention projections included
    assert sorted(restored.sparsifier.layers) == sorted(sparsifier.layers)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    load_checkpoint(path, fresh, restored.sparsifier, optimizer=fresh_optimizer)
    assert steps(fresh, restored.sparsifier, fresh_optimizer, 2) == straight
    for name, mask in sparsifier.masks().items():
        assert torch.equal(restored.sparsifier.masks()[name], mask), name
    with pytest.raises(CheckpointMismatchError):
        load_checkpoint(path, TinyLM(width=32))


def test_a_tied_head_is_recorded_dense_and_passes_inspect_require(tmp_path, capsys):
    torch.manual_seed(7)
    model = TinyLM()
    model.lm_head.weight = model.embed.weight
    sparsifier = sparsify(model)
    path = export_onnx(model, (torch.randint(0, 32, (2, 12)),), tmp_path / "tied.onnx", sparsifier)
    assert main(["inspect", str(path), "--require"]) == 0
    assert "lm_head: weight tied to the embedding" in capsys.readouterr().out
