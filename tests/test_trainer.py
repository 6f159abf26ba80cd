"""The training loop, its configuration files and the ``nmdeploy train`` verb."""

import csv
import json
from pathlib import Path

import pytest
import torch

from nmdeploy.cli import main
from nmdeploy.errors import InputError
from nmdeploy.train.config import config_from_dict, load_config
from nmdeploy.train.trainer import TrainingRun, train

pytest.importorskip("sklearn")

MODELS = Path(__file__).resolve().parent.parent / "models"
# Training configs; baselines.toml files beside them belong to `nmdeploy pipeline`.
CONFIGS = sorted(
    p for folder in ("digits", "transformer") for p in (MODELS / folder).glob("*.toml") if p.stem != "baselines"
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(sparsity=None, **train_options):
    data = {
        "task": {"name": "digits-cnn", "train_size": 128},
        "train": {"epochs": 2, "batch_size": 64, **train_options},
    }
    if sparsity is not None:
        data["sparsity"] = sparsity
    return config_from_dict(data)


# -- configuration ---------------------------------------------------------------------------------------------


def test_bundled_configs_are_valid_and_share_one_recipe_per_task():
    assert len(CONFIGS) >= 7
    recipes = {}
    for path in CONFIGS:
        config = load_config(path)
        recipes.setdefault(config.task.name, set()).add(config.train)
    assert set(recipes) == {"digits-cnn", "digits-transformer"}
    assert all(len(r) == 1 for r in recipes.values()), "dense and sparse runs of a task must use the same recipe"


def test_defaults_and_normalisation():
    config = config_from_dict({"task": {"name": "digits-cnn"}, "sparsity": {"method": "srste", "backward": "mvue"}})
    assert config.sparsity.backward == ("mvue",)
    assert config.sparsity.enabled and not config_from_dict({"task": {"name": "digits-cnn"}}).sparsity.enabled
    assert config.train.lr == 3e-3 and config.train.seed == 0
    assert config_from_dict(config.to_dict()) == config  # what a checkpoint stores reads back equal


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"task": {"name": "digits-cnn"}, "trian": {}}, "unknown table 'trian'; valid: task, train, sparsity"),
        ({"task": {"name": "digits-cnn"}, "train": {"epoch": 3}}, "unknown key in \\[train\\] 'epoch'; valid: epochs,"),
        ({"task": {"name": "digits-cnn"}, "train": {"epochs": "3"}}, "\\[train\\] epochs must be int"),
        ({"task": {"name": "digits-cnn"}, "train": {"epochs": 0}}, "epochs must be at least 1"),
        ({"task": {"name": "digits-cnn"}, "train": {"epochs": 10**9}}, "epochs = 1000000000 is more than nmdeploy"),
        ({"task": {"name": "digits-cnn"}, "train": {"epochs": 2**70}}, "is more than nmdeploy runs \\(at most 100000"),
        ({"task": {"name": "mnist"}}, "'mnist' is not one of digits-cnn, digits-transformer"),
        ({"train": {}}, "missing \\[task\\] table"),
        ({"task": {"name": "digits-cnn"}, "sparsity": {"method": "magic"}}, "'magic' is not one of dense, ste"),
        ({"task": {"name": "digits-cnn"}, "sparsity": {"backward": ["dense", 4]}}, "list of strings"),
        ({"task": {"name": "digits-cnn"}, "sparsity": {"pattern": "4:2"}}, "\\[sparsity\\] pattern"),
        ({"task": {"name": "digits-cnn"}, "train": {"optimizer": "lbfgs"}}, "'lbfgs' is not one of adam, adamw, sgd"),
    ],
)
def test_bad_configs_are_refused_up_front(data, message):
    with pytest.raises(InputError, match=message):
        config_from_dict(data)


def test_bad_method_options_are_refused_before_training(tmp_path):
    with pytest.raises(InputError, match="unknown option"):
        train(tiny({"method": "srste", "options": {"lambda": 1.0}}), tmp_path, progress=False)
    assert not (tmp_path / "checkpoint.pt").exists()


# -- the loop ----------------------------------------------------------------------------------------------------


def test_runs_are_deterministic_and_logged(tmp_path):
    config = tiny({"method": "ste", "backward": "mvue"})
    first = train(config, tmp_path / "a", progress=False)
    second = train(config, tmp_path / "b", progress=False)
    assert first.step_losses == second.step_losses and len(first.step_losses) == 4
    assert [e.mask_flips for e in first.epochs] == [e.mask_flips for e in second.epochs]

    with open(tmp_path / "a" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["epoch"]) for r in rows] == [1, 2] and [int(r["step"]) for r in rows] == [2, 4]
    with open(tmp_path / "a" / "steps.csv") as handle:
        steps = list(csv.DictReader(handle))
    assert [float(s["loss"]) for s in steps] == first.step_losses
    # Per-epoch flips are the sum of the per-step flips, and SAD divides them by the number of mask positions.
    assert int(rows[0]["mask_flips"]) == sum(int(s["mask_flips"]) for s in steps[:2])
    positions = sum(
        torch.Size(p.shape).numel()
        for name, p in TrainingRun.from_checkpoint(first.checkpoint).model.named_buffers()
        if name.endswith("mask")
    )
    assert float(rows[1]["sad"]) == pytest.approx(int(rows[1]["mask_flips"]) / positions)
    summary = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert summary["finished"] and summary["sparsified"] == first.sparsified == [
        "classifier.1",
        "features.3",
        "features.7",
    ]
    assert summary["skipped"]["features.0"].startswith("1 input channels")  # the stem; the head is dense by default
    assert summary["epochs"][-1]["test_accuracy"] == first.test_accuracy


def test_each_epoch_visits_every_sample_once_in_a_new_order_that_a_fresh_run_repeats():
    run = TrainingRun(tiny({"method": "ste"}))
    epochs = []
    while not run.finished:
        epochs.append(run._epoch_order().clone())
        run.train_step()
        run.train_step()
    size = len(run.splits.train_x)
    assert len(epochs) == 2 and all(sorted(order.tolist()) == list(range(size)) for order in epochs)
    assert not torch.equal(epochs[0], epochs[1])  # set_epoch: a new permutation every epoch
    again = TrainingRun(tiny({"method": "ste"}))
    assert torch.equal(again._epoch_order(), epochs[0])


def test_batch_size_must_split_evenly_across_processes(monkeypatch):
    monkeypatch.setattr("nmdeploy.train.trainer._distributed", lambda: (3, 0))
    with pytest.raises(InputError, match=r"batch_size = 64 must be a multiple of the 3 processes"):
        TrainingRun(tiny({"method": "ste"}))


def test_flips_count_changed_mask_positions(tmp_path):
    run = TrainingRun(tiny({"method": "ste"}))
    before = run.masks()
    run.train_step()
    after = run.masks()
    expected = sum(int((before[k] ^ after[k]).sum()) for k in before)
    assert expected > 0 and run.history.step_flips == [expected]


def test_dense_training_learns_the_digits(tmp_path):
    config = config_from_dict({"task": {"name": "digits-cnn"}, "train": {"epochs": 3, "batch_size": 64}})
    result = train(config, tmp_path, progress=False)
    assert result.test_accuracy >= 0.9
    assert result.epochs[0].train_loss > result.epochs[-1].train_loss
    assert result.epochs[-1].lr == pytest.approx(0.0, abs=1e-12)  # cosine schedule ends at zero


def test_warmup_then_cosine_learning_rate(tmp_path):
    run = TrainingRun(tiny(epochs=4, warmup_epochs=1, lr=1e-2))
    rates = []
    for _ in range(8):
        run.train_step()
        rates.append(run.optimizer.param_groups[0]["lr"])
    assert rates[0] == pytest.approx(1e-2) and rates[1] == pytest.approx(1e-2)  # after 2 warm-up steps: full rate
    assert all(a > b for a, b in zip(rates[1:], rates[2:], strict=False))
    assert rates[-1] == pytest.approx(0.0, abs=1e-12)


# -- the verb ----------------------------------------------------------------------------------------------------


def write_config(tmp_path, extra=""):
    path = tmp_path / "run.toml"
    path.write_text(
        '[task]\nname = "digits-transformer"\ntrain_size = 128\n\n[train]\nepochs = 1\nbatch_size = 64\n\n'
        '[sparsity]\nmethod = "srste"\nbackward = ["transposable", "mvue"]\n' + extra
    )
    return path


def test_train_verb_fails_when_the_loss_diverges(tmp_path, capsys):
    config = tmp_path / "diverging.toml"
    config.write_text('[task]\nname = "digits-transformer"\ntrain_size = 128\n\n[train]\nepochs = 3\nlr = 1e30\n')
    assert main(["train", str(config), "-o", str(tmp_path / "out" / "run"), "--no-progress"]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("FAILED | train: digits-transformer dense: the loss is not finite from epoch 1")
    assert last.endswith("nothing kept")
    assert main(["train", str(config), "-o", str(tmp_path / "run-json"), "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["diverged_at_epoch"] == 1 and document["checkpoint"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diverging.toml"]  # a failed run leaves nothing


def test_a_diverged_run_stops_and_removes_only_what_it_wrote(tmp_path):
    config = tiny(lr=1e30, epochs=4, checkpoint_every=1)
    result = train(config, tmp_path / "new" / "run", progress=False)
    assert result.diverged_at_epoch == 1 and len(result.epochs) == 1 and not result.finished
    assert result.checkpoint is None and not (tmp_path / "new").exists()
    kept = tmp_path / "existing"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert train(config, kept, progress=False).diverged_at_epoch == 1
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]
    finite = train(tiny(epochs=1), tmp_path / "fine", progress=False)
    assert finite.diverged_at_epoch is None and finite.checkpoint.is_file()


def test_an_epoch_count_past_the_limit_is_one_line_and_writes_nothing(tmp_path, capsys):
    config = tmp_path / "long.toml"
    config.write_text('[task]\nname = "digits-cnn"\ntrain_size = 64\n\n[train]\nepochs = 1000000000\n')
    assert main(["train", str(config), "-o", str(tmp_path / "run"), "--no-progress"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "[train] epochs = 1000000000 is more than nmdeploy runs (at most 100000)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long.toml"]


def test_train_verb_trains_and_resumes(tmp_path, capsys):
    config = write_config(tmp_path)
    assert main(["train", str(config), "-o", str(tmp_path / "run"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("PASSED | train: digits-transformer srste 2:4")
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    assert (
        main(
            [
                "train",
                str(config),
                "-o",
                str(tmp_path / "run"),
                "--resume",
                str(tmp_path / "run" / "checkpoint.pt"),
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert len(report["epochs"]) == 1 and len(report["sparsified"]) == 8


def test_train_verb_reports_config_errors_in_one_line(tmp_path, capsys):
    config = write_config(tmp_path, "lamda = 2e-4\n")
    assert main(["train", str(config), "-o", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown key in [sparsity] 'lamda'; valid: method, pattern" in err
    assert main(["train", str(tmp_path / "missing.toml")]) == 2
    assert "no such config file" in capsys.readouterr().err
