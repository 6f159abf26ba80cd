"""`nmdeploy train` from pretrained weights: ``[task] weights``, ``[sparsity] init``, method ``step``; the callbacks
take ``sparsify``'s options."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nmdeploy.cli import main
from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern, is_nm
from nmdeploy.train.config import config_from_dict
from nmdeploy.train.trainer import TrainingRun, train

pytest.importorskip("sklearn")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dense")
    data = {"task": {"name": "digits-cnn", "train_size": 512}, "train": {"epochs": 3, "batch_size": 64}}
    return train(config_from_dict(data), folder, progress=False).checkpoint


def fine_tune(weights: Path | str, train_size: int = 128, **sparsity) -> dict:
    return {
        "task": {"name": "digits-cnn", "train_size": train_size, "weights": str(weights)},
        "train": {"epochs": 1, "batch_size": 64, "lr": 1e-3},
        "sparsity": {"method": "fixed", **sparsity},
    }


def test_sparse_fine_tuning_starts_from_the_weights_and_sparsegpt_beats_magnitude(dense_checkpoint):
    dense = TrainingRun(config_from_dict({"task": {"name": "digits-cnn", "weights": str(dense_checkpoint)}}))
    dense_loss, dense_accuracy = dense.evaluate()
    assert dense_accuracy > 0.8  # the pretrained weights were loaded, not a fresh initialisation
    runs = {
        init: TrainingRun(config_from_dict(fine_tune(dense_checkpoint, init=init, calibration_samples=256)))
        for init in ("magnitude", "sparsegpt")
    }
    sparsegpt = runs["sparsegpt"].sparsifier
    assert set(sparsegpt.initialized.values()) == {"sparsegpt"} and len(sparsegpt.layers) == 3
    for mask in sparsegpt.masks().values():
        assert is_nm(mask, Pattern.parse("2:4"), axis=1)
    losses = {init: run.evaluate()[0] for init, run in runs.items()}
    assert dense_loss < losses["sparsegpt"] < losses["magnitude"]


def test_a_resumed_run_reads_neither_the_weights_nor_the_calibration_again(tmp_path, dense_checkpoint):
    weights = tmp_path / "weights.pt"
    weights.write_bytes(dense_checkpoint.read_bytes())
    config = config_from_dict(fine_tune(weights, init="sparsegpt"))
    stopped = train(config, tmp_path / "run", progress=False, stop_after_steps=1)
    weights.unlink()  # the checkpoint holds the state now
    resumed = train(config, tmp_path / "run", resume=stopped.checkpoint, progress=False)
    assert resumed.finished and len(resumed.step_losses) == 2


def test_step_trains_through_the_config(tmp_path, dense_checkpoint):
    config = config_from_dict(fine_tune(dense_checkpoint, method="step", options={"switch_step": 1}))
    run = TrainingRun(config)
    assert type(run.optimizer).__name__ == "STEPAdam"
    run.train_step()
    run.train_step()
    assert run.optimizer.switched_at == 1
    assert not next(iter(run.sparsifier.masks().values())).all()
    with pytest.raises(InputError, match="use \\[train\\] optimizer = 'adam'"):
        config_from_dict({**fine_tune(dense_checkpoint, method="step"), "train": {"optimizer": "sgd"}})


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ("missing.pt", "no such file"),
        ("garbage.pt", "not a readable state dict or checkpoint"),
        ("other.pt", "the weights do not fit the task's model"),
        ("python.pt", "holds Python objects"),
    ],
)
def test_bad_weights_are_one_line_and_write_nothing(tmp_path, capsys, weights, message):
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    torch.save({"layer.weight": torch.zeros(3, 3)}, tmp_path / "other.pt")
    torch.save({"model": {"x": torch.zeros(1)}, "note": object()}, tmp_path / "python.pt")
    config = tmp_path / "run.toml"
    config.write_text(
        f'[task]\nname = "digits-cnn"\ntrain_size = 64\nweights = "{tmp_path / weights}"\n\n'
        '[train]\nepochs = 1\n\n[sparsity]\nmethod = "fixed"\ninit = "sparsegpt"\n'
    )
    assert main(["train", str(config), "-o", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not (tmp_path / "run").exists()


def test_unknown_or_idle_init_is_refused_up_front():
    with pytest.raises(InputError, match="\\[sparsity\\] init = 'obs' is not one of magnitude, sparsegpt"):
        config_from_dict({"task": {"name": "digits-cnn"}, "sparsity": {"method": "fixed", "init": "obs"}})
    with pytest.raises(InputError, match="method = 'dense' trains none"):
        config_from_dict({"task": {"name": "digits-cnn"}, "sparsity": {"init": "sparsegpt"}})


def test_callbacks_take_the_options_of_sparsify():
    pytest.importorskip("transformers")
    from nmdeploy.train import sparsify
    from nmdeploy.train.integrations.huggingface import SparsityCallback

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    batches = [torch.randn(16, 8) for _ in range(2)]
    callback = SparsityCallback(
        model, pattern="2:4", method="fixed", keep_dense="none", init="sparsegpt", calibration=batches
    )
    assert callback.sparsifier.initialized == {"0": "sparsegpt", "2": "sparsegpt"}
    with pytest.raises(InputError, match="give a model with the options, or the sparsifier alone"):
        SparsityCallback(sparsify(torch.nn.Linear(8, 8), keep_dense="none"), init="sparsegpt")
