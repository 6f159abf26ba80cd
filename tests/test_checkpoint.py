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
from nmdeploy.train.checkpoint import load_checkpoint
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
    return load_checkpoint(checkpoint)["model"]


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
    a, b = load_checkpoint(straight.checkpoint), load_checkpoint(resumed.checkpoint)
    masks = [k for k in a["model"] if k.endswith("mask")]
    assert masks, "the model state holds the mask buffers"
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["sparsifier"]["step"] == b["sparsifier"]["step"] == 6
    generators = a["sparsifier"]["generators"]
    assert all(torch.equal(generators[k], b["sparsifier"]["generators"][k]) for k in generators)
    assert [e.mask_flips for e in resumed.epochs] == [e.mask_flips for e in straight.epochs]


def test_checkpoint_holds_everything_needed(tmp_path):
    result = train(short_config(), tmp_path, progress=False, stop_after_steps=1)
    payload = load_checkpoint(result.checkpoint)
    assert payload["position"] == {"epoch": 0, "batch": 1, "step": 1}
    assert set(payload["rng"]) == {"torch", "cuda", "numpy", "python", "data_order"}
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
        load_checkpoint(tmp_path / "missing.pt")
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(InputError, match="not a readable"):
        load_checkpoint(garbage)
    foreign = tmp_path / "state_dict.pt"
    torch.save({"weight": torch.ones(2)}, foreign)
    with pytest.raises(InputError, match="not an nmdeploy training checkpoint"):
        load_checkpoint(foreign)


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
    position = load_checkpoint(checkpoint)["position"]
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
    a, b = load_checkpoint(tmp_path / "straight" / "checkpoint.pt"), load_checkpoint(checkpoint)
    assert all(torch.equal(a["model"][key], b["model"][key]) for key in a["model"])
