"""Sharded checkpoints (torch.distributed.checkpoint): a resumed run continues exactly, a run killed while saving
keeps its previous checkpoint, and a checkpoint of two FSDP2 processes resumes on one (and one on two)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_fsdp import end_worker, global_mean, start_worker
from torch import nn

from nmdeploy.errors import InputError
from nmdeploy.train import CheckpointMismatchError, sparsify
from nmdeploy.train.distributed import latest_checkpoint, load_distributed, save_distributed

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"),
    pytest.mark.usefixtures("one_torch_thread"),
]

WORLD = 2
RECIPE = {"method": "srste", "backward": ("transposable", "mvue"), "mask_interval": 1, "keep_dense": "none", "seed": 7}
DETERMINISTIC = {**RECIPE, "backward": "transposable"}


def mlp(hidden=20):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, 8))


def build(recipe, world=1):
    model = mlp()
    sparsifier = sparsify(model, **recipe)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return model, sparsifier, optimizer, scheduler


def fresh(world=1):
    """A dense model and nothing else: load_distributed sparsifies it as the checkpoint says."""
    model = mlp()
    return model


def run_steps(model, sparsifier, optimizer, scheduler, start, stop, world=1, rank=0, dropout=0.1):
    """Steps ``start`` to ``stop`` of the run (batch i is the same whatever the start); dropout draws from torch's
    global generator, which the checkpoint restores (per rank: runs on different numbers of processes compare
    without it). Returns the global-batch losses and the masks after each step."""
    generator = torch.Generator().manual_seed(1)
    losses, masks = [], []
    for index in range(stop):
        x, y = torch.randn(16, 16, generator=generator), torch.randint(0, 8, (16,), generator=generator)
        if index < start:
            continue
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(nn.functional.dropout(model(x), dropout), y)
        loss.backward()
        optimizer.step()
        sparsifier.step()
        scheduler.step()
        losses.append(global_mean(loss, world))
        masks.append({name: mask.clone() for name, mask in sparsifier.masks().items()})
    return losses, masks


def full_state(model):
    from nmdeploy.train.masking.sharding import full

    return {key: full(value).detach().clone() for key, value in model.state_dict().items()}


def assert_masks_equal(a, b):
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b, strict=True):
        assert step_a.keys() == step_b.keys() and all(torch.equal(step_a[k], step_b[k]) for k in step_a)


# -- one process: exact resume, kill during a save ---------------------------------------------------------------


def test_resume_continues_exactly_on_a_fresh_model(tmp_path):
    straight = build(RECIPE)
    run_steps(*straight, 0, 2)
    save_distributed(tmp_path, *straight[:2], optimizer=straight[2], scheduler=straight[3], extra={"epoch": 1})
    expected_losses, expected_masks = run_steps(*straight, 2, 5)

    torch.manual_seed(1234)  # whatever the new process would have
    model = fresh()
    restored = load_distributed(tmp_path, model)  # sparsified as the run was
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    restored = load_distributed(tmp_path, model, restored.sparsifier, optimizer=optimizer, scheduler=scheduler)
    assert restored.extra == {"epoch": 1} and restored.sparsifier.step_count == 2
    assert scheduler.last_epoch == 2 and optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.81)
    losses, masks = run_steps(model, restored.sparsifier, optimizer, scheduler, 2, 5)
    assert losses == expected_losses  # bit for bit
    assert_masks_equal(masks, expected_masks)
    a, b = full_state(straight[0]), full_state(model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


_CHILD = """
import os, sys, time, torch
import torch.distributed.checkpoint as dcp
sys.path.insert(0, {tests!r})
from test_dcp import RECIPE, build, run_steps
from nmdeploy.train.distributed import save_distributed
torch.set_num_threads(1)
run = build(RECIPE)
run_steps(*run, 0, 2)
save_distributed({root!r}, *run[:2], optimizer=run[2], scheduler=run[3])
run_steps(*run, 2, 4)
real_save = dcp.save
def save_then_hang(*args, **kwargs):
    real_save(*args, **kwargs)  # every shard and DCP's metadata written, not yet committed
    open({ready!r}, "w").close()
    time.sleep(600)
dcp.save = save_then_hang
save_distributed({root!r}, *run[:2], optimizer=run[2], scheduler=run[3])
"""


def test_a_run_killed_while_saving_keeps_the_previous_checkpoint(tmp_path):
    root, ready = tmp_path / "ckpt", tmp_path / "ready"
    code = textwrap.dedent(_CHILD).format(tests=os.path.dirname(__file__), root=str(root), ready=str(ready))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    victim = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    stderr = victim.communicate()[1].decode()
    assert victim.returncode == -signal.SIGKILL, stderr
    assert (root / ".tmp-step-00000004" / ".metadata").is_file(), "killed after the shards were written"
    assert latest_checkpoint(root) == root / "step-00000002"

    straight = build(RECIPE)
    run_steps(*straight, 0, 2)
    expected_losses, expected_masks = run_steps(*straight, 2, 6)
    resumed = build(RECIPE)
    load_distributed(root, resumed[0], resumed[1], optimizer=resumed[2], scheduler=resumed[3])
    losses, masks = run_steps(*resumed, 2, 6)
    assert losses == expected_losses
    assert_masks_equal(masks, expected_masks)

    save_distributed(root, *resumed[:2], optimizer=resumed[2], scheduler=resumed[3], keep=1)
    assert sorted(path.name for path in root.iterdir()) == ["step-00000006"], "stale temporary and old step removed"


def test_load_refuses_what_does_not_fit(tmp_path):
    run = build(DETERMINISTIC)
    save_distributed(tmp_path, run[0], run[1])
    wider = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 8))
    with pytest.raises(CheckpointMismatchError, match=r"2.parametrizations.weight.original is \[20, 32\] in the"):
        load_distributed(tmp_path, wider)
    assert not any("parametrizations" in name for name, _ in wider.named_parameters())
    with pytest.raises(CheckpointMismatchError, match="no optimiser state"):
        load_distributed(tmp_path, fresh(), optimizer=torch.optim.SGD(mlp().parameters(), lr=0.1))
    with pytest.raises(InputError, match="no committed checkpoint"):
        load_distributed(tmp_path / "nowhere", fresh())
    folder = latest_checkpoint(tmp_path)
    meta = json.loads((folder / "nmdeploy.json").read_text())
    (folder / "nmdeploy.json").write_text(json.dumps({**meta, "format": "other"}))
    with pytest.raises(InputError, match="not an nmdeploy distributed checkpoint"):
        load_distributed(folder, fresh())


def test_metadata_that_would_run_code_is_refused(tmp_path):
    import pickle

    run = build(DETERMINISTIC)
    folder = save_distributed(tmp_path, run[0], run[1])

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo owned > " + str(tmp_path / "owned"),))

    metadata = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(InputError, match="posix.system is not part of a checkpoint's metadata"):
        load_distributed(folder, fresh())
    assert not (tmp_path / "owned").exists()

    # a tensor entry turned into a bytes entry, which DCP would read with a full unpickler
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    (folder / ".metadata").write_bytes(metadata)
    from nmdeploy.train.distributed import safe_reader

    parsed = safe_reader(folder).read_metadata()
    parsed.state_dict_metadata["model.0.bias"] = BytesStorageMetadata()
    (folder / ".metadata").write_bytes(pickle.dumps(parsed))
    with pytest.raises(InputError, match=r"entries that are not tensors \(model.0.bias\)"):
        load_distributed(folder, fresh())


# -- two processes: FSDP2 resume on 2, then 2 -> 1 and 1 -> 2 --------------------------------------------------


def worker(rank, folder):
    start_worker(rank, folder)
    try:
        results = {}
        # with MVUE and dropout: each rank's own random streams must be restored
        for name, recipe, dropout in (("deterministic", DETERMINISTIC, 0.0), ("mvue", RECIPE, 0.1)):
            run = build(recipe, WORLD)
            run_steps(*run, 0, 2, WORLD, rank, dropout)
            save_distributed(f"{folder}/{name}-two", *run[:2], optimizer=run[2], scheduler=run[3])
            straight = run_steps(*run, 2, 4, WORLD, rank, dropout)
            resumed_run = build(recipe, WORLD)
            load_distributed(
                f"{folder}/{name}-two", *resumed_run[:2], optimizer=resumed_run[2], scheduler=resumed_run[3]
            )
            resumed = run_steps(*resumed_run, 2, 4, WORLD, rank, dropout)
            results[name] = {"straight": straight, "resumed": resumed, "state": full_state(resumed_run[0])}
        # 1 -> 2: the checkpoint the test process wrote alone
        run = build(DETERMINISTIC, WORLD)
        load_distributed(f"{folder}/one", *run[:2], optimizer=run[2], scheduler=run[3])
        results["from-one"] = {"losses": run_steps(*run, 2, 4, WORLD, rank, 0.0)[0], "state": full_state(run[0])}
        torch.save(results, f"{folder}/rank{rank}.pt")
        dist.barrier()  # both ranks reach the teardown together
    finally:
        dist.destroy_process_group()
    end_worker()


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dcp")
    torch.set_num_threads(1)
    one = build(DETERMINISTIC)
    run_steps(*one, 0, 2, dropout=0.0)
    save_distributed(folder / "one", *one[:2], optimizer=one[2], scheduler=one[3])
    mp.spawn(worker, args=(str(folder),), nprocs=WORLD, join=True)
    results = [torch.load(folder / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)]
    return folder, results


@pytest.mark.parametrize("recipe", ["deterministic", "mvue"])
def test_two_processes_resume_exactly(two, recipe):
    _, results = two
    for rank in results:
        (straight_losses, straight_masks), (losses, masks) = rank[recipe]["straight"], rank[recipe]["resumed"]
        assert losses == straight_losses
        assert_masks_equal(masks, straight_masks)
    assert results[0][recipe]["resumed"][0] == results[1][recipe]["resumed"][0]


def test_two_processes_resume_on_one(two):
    folder, results = two
    run = build(DETERMINISTIC)
    load_distributed(folder / "deterministic-two", *run[:2], optimizer=run[2], scheduler=run[3])
    losses, masks = run_steps(*run, 2, 4, dropout=0.0)
    straight_losses, straight_masks = results[0]["deterministic"]["straight"]
    # one process sums the whole batch where two averaged their halves: equal to fp32 rounding, masks exactly
    assert losses == pytest.approx(straight_losses, rel=1e-5)
    assert_masks_equal(masks, straight_masks)
    expected = results[0]["deterministic"]["state"]
    got = full_state(run[0])
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)


def test_one_process_resumes_on_two(two):
    _, results = two
    run = build(DETERMINISTIC)
    run_steps(*run, 0, 2, dropout=0.0)
    losses, _ = run_steps(*run, 2, 4, dropout=0.0)
    expected = full_state(run[0])
    for rank in results:
        assert rank["from-one"]["losses"] == pytest.approx(losses, rel=1e-5)
        for key in expected:
            torch.testing.assert_close(rank["from-one"]["state"][key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
