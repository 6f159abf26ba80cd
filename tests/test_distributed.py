"""DistributedDataParallel on CPU: two gloo processes train together and agree on weights, masks, permutations
and the random stream of the gradient masks."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_fsdp import end_worker, start_worker

from nmdeploy.train.config import config_from_dict
from nmdeploy.train.trainer import TrainingRun, train

pytest.importorskip("sklearn")
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORLD = 2
RECIPES = {
    # masks recomputed every step from the synchronised weights; MVUE draws from the sparsifier's generator
    "transposable+mvue": {
        "method": "srste",
        "backward": ["transposable", "mvue"],
        "options": {"mask_interval": 1, "transposable_method": "greedy"},
    },
    # output-channel permutations searched with random candidates every step
    "bimask": {"method": "ste", "backward": "bimask", "options": {"permutation_interval": 1}},
}


def config(recipe):
    return config_from_dict(
        {
            "task": {"name": "digits-cnn", "train_size": 256},
            "train": {"epochs": 1, "batch_size": 64, "lr": 1e-2, "seed": 5},
            "sparsity": RECIPES[recipe],
        }
    )


def worker(rank, folder):
    """One rank: step each recipe's run to the end and save what this rank holds; then a full ``train`` call."""
    start_worker(rank, folder)
    try:
        for recipe in RECIPES:
            run = TrainingRun(config(recipe))
            order = run._epoch_order().clone()  # this rank's samples of the first epoch, in step order
            while not run.finished:
                run.train_step()
            state = {
                "losses": run.history.step_losses,
                "model": run.model.state_dict(),
                "masks": run.masks(),
                "backward_masks": run.sparsifier.backward_masks(),
                "generators": run.sparsifier.generators.state_dict(),
                "order": order,
            }
            torch.save(state, f"{folder}/{recipe}-rank{rank}.pt")
        # The driver itself: rank 0 alone writes the checkpoint and logs, every rank returns the same history.
        result = train(config("bimask"), f"{folder}/train", progress=False)
        torch.save({"losses": result.step_losses}, f"{folder}/train-rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    end_worker()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp")
    mp.spawn(worker, args=(str(folder),), nprocs=WORLD, join=True)
    return {
        name: [torch.load(folder / f"{name}-rank{r}.pt", weights_only=True) for r in range(WORLD)]
        for name in [*RECIPES, "train"]
    } | {"folder": folder}


@pytest.mark.parametrize("recipe", RECIPES)
def test_ranks_agree_on_everything_that_must_be_shared(ranks, recipe):
    first, second = ranks[recipe]
    assert first["losses"] == second["losses"] and len(first["losses"]) == 4  # all-reduced global-batch losses
    a, b = first, second
    assert a["model"].keys() == b["model"].keys()
    # BatchNorm running statistics are local: DDP copies rank 0's into every rank at the start of each forward, so
    # after the last step they differ by that step's batch shard. Everything else must be identical.
    shared = [k for k in a["model"] if not k.endswith(("running_mean", "running_var"))]
    assert any(k.endswith("mask") for k in shared)
    differing = [k for k in shared if not torch.equal(a["model"][k], b["model"][k])]
    assert not differing, f"ranks differ in {differing}"
    assert a["masks"] and all(torch.equal(a["masks"][k], b["masks"][k]) for k in a["masks"])
    assert all(torch.equal(a["backward_masks"][k], b["backward_masks"][k]) for k in a["backward_masks"])
    assert a["generators"].keys() == b["generators"].keys()
    assert all(torch.equal(a["generators"][k], b["generators"][k]) for k in a["generators"])


def test_each_global_batch_is_the_single_process_batch_split_evenly_across_ranks(ranks):
    orders = [state["order"] for state in ranks["bimask"]]
    single = TrainingRun(config("bimask"))._epoch_order()  # the same seed in one process
    assert sorted(torch.cat(orders).tolist()) == list(range(256))  # every sample once, none padded in
    local = 64 // WORLD
    for step in range(4):
        shares = [order[step * local : (step + 1) * local] for order in orders]
        assert all(len(share) == local for share in shares)
        assert sorted(torch.cat(shares).tolist()) == sorted(single[step * 64 : (step + 1) * 64].tolist())


def test_bimask_permutations_and_backward_masks_are_compared(ranks):
    state = ranks["bimask"][0]
    assert state["backward_masks"], "bi-directional backward masks exist and were compared"
    assert any("perm" in k for k in state["model"]), "permutations live in the model state and were compared"


def test_train_under_ddp_matches_the_stepped_run_and_writes_once(ranks):
    first, second = ranks["train"]
    assert first["losses"] == second["losses"] == ranks["bimask"][0]["losses"]
    folder = ranks["folder"] / "train"
    assert (folder / "checkpoint.pt").is_file() and (folder / "metrics.csv").is_file()
