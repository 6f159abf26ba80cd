"""FSDP2 (``fully_shard``) on CPU: two gloo processes, each holding half of every weight and training on half of
each batch, end with the weights, losses and masks of one process training on the whole batch; MVUE's gradient
masks come from per-rank streams, and everything the ranks must share agrees."""

import faulthandler
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from nmdeploy.train import finalize, sparsify
from nmdeploy.train.masking.backward import stream_seed
from nmdeploy.train.masking.finalize import finalized_state_dict
from nmdeploy.train.masking.sharding import full

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORLD = 2
STEPS = 4
# Every forward method with the dense backward, and SR-STE with every backward option. Masks are recomputed every
# step so that each step's selection on the gathered weight is compared.
RECIPES = {
    "srste+transposable": {"method": "srste", "backward": "transposable", "mask_interval": 1},
    "srste+transposable+mvue": {"method": "srste", "backward": ("transposable", "mvue"), "mask_interval": 1},
    "srste+bimask": {"method": "srste", "backward": "bimask", "permutation_interval": 2},
    "srste+mvue": {"method": "srste", "backward": "mvue", "mvue_pattern": "1:2"},
    "ste": {"method": "ste"},
    "fixed": {"method": "fixed"},
    "lbc": {"method": "lbc", "removal_end": 3},
    "mask-decay": {"method": "mask-decay", "decay_steps": 3},
    "structure-decay": {"method": "structure-decay", "decay_steps": 3},
}
DETERMINISTIC = [name for name, recipe in RECIPES.items() if "mvue" not in recipe.get("backward", ())]


def mlp():
    """The middle layer has 20 outputs: each rank holds 10 rows, so transposable 4x4 tiles straddle the shards."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 20), nn.ReLU(), nn.Linear(20, 8))


def batches():
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 16, generator=generator), torch.randint(0, 8, (16,), generator=generator))
        for _ in range(STEPS)
    ]


def train(recipe, world=1, rank=0):
    """Train ``recipe`` for STEPS steps; under FSDP2 each rank takes its contiguous share of every batch."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    sparsifier = sparsify(model, keep_dense="none", seed=7, **RECIPES[recipe])
    if world > 1:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, masks = [], []
    for x, y in batches():
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        sparsifier.step()
        losses.append(global_mean(loss, world))
        masks.append({name: mask.clone() for name, mask in sparsifier.masks().items()})
    state = {key: full(value).detach().clone() for key, value in model.state_dict().items()}
    drawn = torch.rand(4, generator=sparsifier.generators.gradients("cpu"))
    return {
        "losses": losses,
        "masks": masks,
        "state": state,
        "finalized": finalized_state_dict(model),
        "drawn": drawn,
        "bytes": sparsifier.buffer_bytes(),
    }


def global_mean(loss: torch.Tensor, world: int) -> float:
    """The loss of the whole batch: the mean over ranks of each rank's mean over its equal share."""
    loss = loss.detach()
    if world > 1:
        dist.all_reduce(loss)
        loss /= world
    return float(loss)


def start_worker(rank, folder):
    """Joins the two-rank gloo group; a crash in native code prints the Python stack to the test's output."""
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD)


def end_worker():
    """Leaves a worker whose results are saved and whose group is destroyed without running interpreter shutdown:
    FSDP and checkpointing keep references to the gloo group, whose native threads were then torn down during
    finalization and once in a while aborted the process ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train_attention(world=1, rank=0):
    """A transformer layer (nn.MultiheadAttention's packed projection and out_proj, two Linear) with SR-STE and
    the transposable backward, sharded as one unit."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True, dropout=0.0)
    sparsifier = sparsify(model, method="srste", backward="transposable", keep_dense="none", mask_interval=1)
    if world > 1:
        fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randn(4, 8, 16, generator=generator).chunk(world)[rank]
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        sparsifier.step()
        losses.append(global_mean(loss, world))
    masks = {name: mask.clone() for name, mask in sparsifier.masks().items()}
    return {"losses": losses, "masks": masks, "state": {k: full(v).clone() for k, v in model.state_dict().items()}}


def worker(rank, folder):
    start_worker(rank, folder)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = {name: train(name, WORLD, rank) for name in RECIPES}
            results["attention"] = train_attention(WORLD, rank)
        results["warnings"] = [str(warning.message) for warning in caught]
        torch.save(results, f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    end_worker()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp")
    mp.spawn(worker, args=(str(folder),), nprocs=WORLD, join=True)
    return [torch.load(folder / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]


def assert_close_states(a, b, atol=1e-6):
    assert a.keys() == b.keys()
    for key in a:
        if a[key].dtype == torch.bool or not a[key].is_floating_point():
            assert torch.equal(a[key], b[key]), key
        else:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=atol, msg=key)


@pytest.mark.parametrize("recipe", DETERMINISTIC)
def test_two_sharded_processes_equal_one_on_the_full_batch(ranks, recipe):
    torch.set_num_threads(1)
    reference = train(recipe)
    for rank in ranks:
        sharded = rank[recipe]
        assert sharded["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        for step, (a, b) in enumerate(zip(sharded["masks"], reference["masks"], strict=True)):
            assert a.keys() == b.keys() == {"0", "2", "4"}
            assert all(torch.equal(a[k], b[k]) for k in a), f"masks differ after step {step + 1}"
        assert_close_states(sharded["state"], reference["state"])
        assert_close_states(sharded["finalized"], reference["finalized"])


def test_attention_layers_shard_like_the_rest(ranks):
    reference = train_attention()
    assert "self_attn.in_proj_weight" in reference["masks"]
    for rank in ranks:
        sharded = rank["attention"]
        assert sharded["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert all(torch.equal(sharded["masks"][k], reference["masks"][k]) for k in reference["masks"])
        # Adam divides tiny bias gradients by their own size: fp32 rounding of the two reductions shows as 1e-5
        assert_close_states(sharded["state"], reference["state"], atol=2e-5)


def test_no_module_returns_a_view(ranks):
    # FSDP2 warns when a module returns a view (an in-place op on it would skip the pre-backward all-gather); the
    # masked backward's Linear returns a fresh tensor.
    assert not [message for rank in ranks for message in rank["warnings"] if "view tensor" in message]


def test_transposable_masks_straddle_the_shards_and_stay_transposable(ranks):
    from nmdeploy.masks import Pattern, is_transposable

    mask = ranks[0]["srste+transposable"]["masks"][-1]["2"]
    assert mask.shape == (20, 32)  # rows 0-9 on rank 0, 10-19 on rank 1: tile rows 8-11 span both
    assert is_transposable(mask, Pattern.parse("2:4"), axis=1, out_axis=0)


@pytest.mark.parametrize("recipe", ["srste+transposable+mvue", "srste+mvue"])
def test_mvue_ranks_draw_independent_streams_and_agree_on_the_rest(ranks, recipe):
    first, second = ranks[0][recipe], ranks[1][recipe]
    assert first["losses"] == second["losses"]
    assert_close_states(first["state"], second["state"])
    for a, b in zip(first["masks"], second["masks"], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    # each rank's gradient stream is the one of (seed, rank, step), and the two differ
    for rank, state in enumerate((first, second)):
        expected = torch.rand(4, generator=torch.Generator().manual_seed(stream_seed(7, rank, STEPS)))
        assert torch.equal(state["drawn"], expected)
    assert not torch.equal(first["drawn"], second["drawn"])


def test_mask_buffers_are_reported_against_the_weight_shards(ranks):
    sharded = ranks[0]["srste+transposable"]["bytes"]
    whole = train("srste+transposable")["bytes"]
    assert sharded["buffers"] == whole["buffers"] > 0  # whole on every rank
    assert sharded["weights"] * WORLD == whole["weights"]  # 32, 20 and 8 rows split evenly


def test_finalized_state_loads_into_a_plain_model_and_matches_finalize():
    model = mlp()
    sparsify(model, method="srste", keep_dense="none")
    state = finalized_state_dict(model)
    plain = mlp()
    plain.load_state_dict(state)
    finalize(model)
    a, b = plain.state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sparsify_refuses_a_model_already_sharded():
    from nmdeploy.errors import InputError

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(mlp())
        with pytest.raises(InputError, match="call sparsify on the plain model first, then fully_shard"):
            sparsify(model)
    finally:
        dist.destroy_process_group()
