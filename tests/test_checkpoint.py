"""Checkpoints: atomic, validated on load, and a resumed run continues exactly like an uninterrupted one (CPU), also
after the training process was killed."""

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from nmdeploy.errors import InputError
from nmdeploy.train.checkpoint import read_checkpoint
from nmdeploy.train.config import config_from_dict
from nmdeploy.train.trainer import TrainingRun, train

pytest.importorskip("sklearn")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def short_config(sparsity=None, task="digits-cnn"):
    """Two epochs of three steps each (batches of 64 from 192 training images), so six steps cross an epoch end."""
    data = {"task": {"name": task, "train_size": 192}, "train": {"epochs": 2, "batch_size": 64, "seed": 3}}
    if sparsity:
        data["sparsity"] = sparsity
    return config_from_dict(data)


def scramble_global_rng():
    """Whatever the fresh process would have in its global generators; resume must not depend on it."""
    torch.manual_seed(987654)
    np.random.seed(4321)
    random.seed(55)


def straight_and_resumed(config, tmp_path, stop):
    straight = train(config, tmp_path / "straight", progress=False)
    first = train(config, tmp_path / "resumed", progress=False, stop_after_steps=stop)
    assert not first.finished and len(first.step_losses) == stop
    scramble_global_rng()
    resumed = train(config, tmp_path / "resumed", resume=first.checkpoint, progress=False)
    return straight, resumed


def final_state(checkpoint):
    return read_checkpoint(checkpoint)["model"]


def test_dense_resume_continues_exactly(tmp_path, stop=2):
    config = short_config()
    straight, resumed = straight_and_resumed(config, tmp_path, stop)
    assert resumed.finished
    assert resumed.step_losses == straight.step_losses  # bit for bit, not approximately
    assert [e.test_accuracy for e in resumed.epochs] == [e.test_accuracy for e in straight.epochs]
    assert resumed.epochs == [
        type(e)(**{**e.__dict__, "seconds": r.seconds}) for e, r in zip(straight.epochs, resumed.epochs, strict=True)
    ]
    a, b = final_state(straight.checkpoint), final_state(resumed.checkpoint)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


SPARSE_RECIPES = {
    # MVUE draws a fresh random gradient mask every step from the sparsifier's generator.
    "srste+transposable+mvue": {
        "method": "srste",
        "backward": ["transposable", "mvue"],
        "options": {"mask_interval": 2, "transposable_method": "greedy"},
    },
    # Bi-directional masks search output-channel permutations with random candidates.
    "ste+bimask": {"method": "ste", "backward": "bimask", "options": {"permutation_interval": 2}},
    # LBC's learnable scores and removal schedule.
    "lbc": {"method": "lbc", "options": {"removal_end": 5}},
}


@pytest.mark.parametrize("recipe", SPARSE_RECIPES)
def test_sparse_resume_gives_the_same_losses_and_masks(tmp_path, recipe):
    config = short_config(SPARSE_RECIPES[recipe])
    straight, resumed = straight_and_resumed(config, tmp_path, stop=4)
    assert resumed.step_losses == straight.step_losses
    a, b = read_checkpoint(straight.checkpoint), read_checkpoint(resumed.checkpoint)
    masks = [k for k in a["model"] if k.endswith("mask")]
    assert masks, "the model state holds the mask buffers"
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["sparsifier"]["step"] == b["sparsifier"]["step"] == 6
    generators = a["sparsifier"]["generators"]
    assert all(torch.equal(generators[k], b["sparsifier"]["generators"][k]) for k in generators)
    assert [e.mask_flips for e in resumed.epochs] == [e.mask_flips for e in straight.epochs]


def test_checkpoint_holds_everything_needed(tmp_path):
    result = train(short_config(), tmp_path, progress=False, stop_after_steps=1)
    payload = read_checkpoint(result.checkpoint)
    assert payload["position"] == {"epoch": 0, "batch": 1, "step": 1}
    assert set(payload["rng"]) == {"torch", "cuda", "numpy", "python"}
    assert payload["optimizer"]["state"], "Adam moments are saved"
    assert payload["scheduler"]["last_epoch"] == 1
    assert payload["config"]["train"]["seed"] == 3
    assert payload["history"]["step_losses"] == result.step_losses
    assert not list(tmp_path.glob(".*")), "no temporary files left behind"


def test_resume_rejects_a_different_config(tmp_path):
    result = train(short_config(), tmp_path, progress=False, stop_after_steps=1)
    other = config_from_dict({"task": {"name": "digits-cnn", "train_size": 192}, "train": {"epochs": 3, "seed": 3}})
    with pytest.raises(InputError, match="different config"):
        train(other, tmp_path, resume=result.checkpoint, progress=False)


def test_load_rejects_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(InputError, match="no such checkpoint"):
        read_checkpoint(tmp_path / "missing.pt")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(InputError, match="not a readable"):
        read_checkpoint(garbage)
    foreign = tmp_path / "state_dict.pt"
    torch.save({"weight": torch.ones(2)}, foreign)
    with pytest.raises(InputError, match="not an nmdeploy training checkpoint"):
        read_checkpoint(foreign)


def test_from_checkpoint_restores_the_live_objects(tmp_path):
    result = train(short_config(), tmp_path, progress=False, stop_after_steps=4)
    scramble_global_rng()
    run = TrainingRun.from_checkpoint(result.checkpoint)
    assert (run.position.epoch, run.position.batch, run.position.step) == (1, 1, 4)
    assert run.scheduler.last_epoch == 4
    assert run.history.step_losses == result.step_losses
    assert len(run.history.epochs) == 1


_KILLED_RUN = """
[task]
name = "digits-cnn"
train_size = 640

[train]
epochs = 4
batch_size = 64
seed = 3

[sparsity]
method = "srste"
backward = ["transposable", "mvue"]

[sparsity.options]
mask_interval = 2
transposable_method = "greedy"
"""


@pytest.mark.slow
def test_a_killed_training_process_resumes_exactly(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(_KILLED_RUN)
    command = [sys.executable, "-m", "nmdeploy", "train", str(config), "--no-progress", "-o"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same threads in every process: bit-identical arithmetic
    subprocess.run([*command, str(tmp_path / "straight")], env=env, check=True, capture_output=True, timeout=600)

    victim = subprocess.Popen([*command, str(tmp_path / "killed")], env=env, stdout=subprocess.DEVNULL)
    checkpoint = tmp_path / "killed" / "checkpoint.pt"
    deadline = time.monotonic() + 600
    while not checkpoint.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)  # no chance to save anything: the last epoch's checkpoint is all there is
    assert victim.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    position = read_checkpoint(checkpoint)["position"]
    assert 0 < position["epoch"] < 4 and position["batch"] == 0, position

    subprocess.run(
        [*command, str(tmp_path / "killed"), "--resume", str(checkpoint)],
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    straight_steps = (tmp_path / "straight" / "steps.csv").read_text()
    assert (tmp_path / "killed" / "steps.csv").read_text() == straight_steps  # every loss and flip count
    assert len(straight_steps.splitlines()) == 1 + 4 * 10
    a, b = read_checkpoint(tmp_path / "straight" / "checkpoint.pt"), read_checkpoint(checkpoint)
    assert all(torch.equal(a["model"][key], b["model"][key]) for key in a["model"])


# -- the Python API: save_checkpoint / load_checkpoint ----------------------------------------------------------


def api_model(hidden=16):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 4),
    )


def api_steps(model, sparsifier, optimizer, steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        sparsifier.step()
        losses.append(float(loss.detach()))
    return losses


def test_api_checkpoint_resumes_a_fresh_dense_model_exactly(tmp_path):
    from nmdeploy.train import load_checkpoint, save_checkpoint, sparsify

    recipe = {"method": "srste", "backward": ("transposable", "mvue"), "mask_interval": 2, "keep_dense": "none"}
    model = api_model()
    sparsifier = sparsify(model, **recipe)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    api_steps(model, sparsifier, optimizer, 3)
    path = save_checkpoint(tmp_path / "run.pt", model, sparsifier, optimizer=optimizer, extra={"epoch": 7})
    straight = api_steps(model, sparsifier, optimizer, 3, seed=2)

    fresh = api_model()  # dense, as a user's factory builds it
    restored = load_checkpoint(path, fresh)  # sparsifies it as the run was; the optimiser comes after
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    load_checkpoint(path, fresh, restored.sparsifier, optimizer=fresh_optimizer)
    assert restored.extra == {"epoch": 7}
    assert sorted(restored.sparsifier.layers) == sorted(sparsifier.layers) == ["0", "2", "4"]
    assert restored.sparsifier.step_count == 3
    resumed = api_steps(fresh, restored.sparsifier, fresh_optimizer, 3, seed=2)
    assert resumed == straight
    a, b = model.state_dict(), fresh.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_api_and_cli_checkpoints_share_one_format(tmp_path):
    from nmdeploy.train import load_checkpoint
    from nmdeploy.train.tasks import TASKS

    result = train(short_config(SPARSE_RECIPES["lbc"]), tmp_path, progress=False, stop_after_steps=2)
    model = TASKS["digits-cnn"].build_model(0)
    restored = load_checkpoint(result.checkpoint, model)
    assert restored.sparsifier is not None and restored.sparsifier.method == "lbc"
    saved = read_checkpoint(result.checkpoint)["model"]
    assert all(torch.equal(value, saved[key]) for key, value in model.state_dict().items())


def test_api_checkpoint_mismatches_are_one_line(tmp_path):
    from nmdeploy.errors import Error
    from nmdeploy.train import CheckpointMismatchError, load_checkpoint, save_checkpoint, sparsify

    model = api_model()
    sparsifier = sparsify(model, method="ste", keep_dense="none")
    path = save_checkpoint(tmp_path / "run.pt", model, sparsifier)
    before = path.read_bytes()
    wider = api_model(hidden=32)
    with pytest.raises(
        CheckpointMismatchError, match=r"0.parametrizations.weight.original is \[16, 8\] in the checkpoint, \[32, 8\]"
    ):
        load_checkpoint(path, wider)
    assert not any("parametrizations" in name for name, _ in wider.named_parameters()), "nothing changed"
    deeper = torch.nn.Sequential(*api_model(), torch.nn.Linear(4, 4))
    with pytest.raises(CheckpointMismatchError, match=r"\(missing 5.bias, 5.weight\)") as error:
        load_checkpoint(path, deeper)
    assert "\n" not in str(error.value) and isinstance(error.value, Error)
    with pytest.raises(CheckpointMismatchError, match="no optimiser state"):
        load_checkpoint(path, api_model(), optimizer=torch.optim.SGD(api_model().parameters(), lr=0.1))
    assert path.read_bytes() == before


def test_api_checkpoints_load_weights_only(tmp_path, monkeypatch):
    from nmdeploy.train import load_checkpoint, save_checkpoint, sparsify

    seen = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.append(k.get("weights_only")) or real_load(*a, **k))
    model = api_model()
    path = save_checkpoint(tmp_path / "run.pt", model, sparsify(model, keep_dense="none"))
    load_checkpoint(path, api_model())
    assert seen == [True]


def test_api_checkpoint_of_an_attention_model_loads_into_a_fresh_one(tmp_path):
    from nmdeploy.train import load_checkpoint, save_checkpoint, sparsify
    from nmdeploy.train.masking.finalize import finalized_state_dict

    def build():
        torch.manual_seed(0)
        return torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)

    model = build()
    sparsifier = sparsify(model, method="srste", keep_dense="none")
    assert "self_attn.in_proj_weight" in sparsifier.layers
    with torch.no_grad():
        model.self_attn.parametrizations.in_proj_weight.original.mul_(2)
    path = save_checkpoint(tmp_path / "run.pt", model, sparsifier)
    fresh = build()
    restored = load_checkpoint(path, fresh)
    assert sorted(restored.sparsifier.layers) == sorted(sparsifier.layers)
    a, b = finalized_state_dict(model), finalized_state_dict(fresh)
    assert a.keys() == b.keys() and "self_attn.in_proj_weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
