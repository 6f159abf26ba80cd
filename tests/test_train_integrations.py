"""The Hugging Face Trainer and Lightning callbacks: they step the sparsifier, keep its state in the trainer's
checkpoints (a resumed run ends where an uninterrupted one does) and log mask flips and SAD."""

import csv
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional

from nmdeploy.masks import Pattern, is_nm
from nmdeploy.train import sparsify

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.body(x)
        return {"loss": functional.cross_entropy(logits, labels), "logits": logits}


def examples(count: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(count, 8, generator=generator)
    return x, (x[:, :4].argmax(dim=1))


def sparse_tiny():
    model = Tiny()
    return model, sparsify(model, method="srste", backward="mvue", keep_dense="none", decay=0.0)


def final_state(model, sparsifier):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, sparsifier.state_dict()["step"]


def test_nmdeploy_imports_without_either_framework():
    # A fresh interpreter where importing transformers or lightning fails: nmdeploy and its trainer still work.
    code = (
        "import sys; sys.modules['transformers'] = None; sys.modules['lightning'] = None\n"
        "import nmdeploy, nmdeploy.train, nmdeploy.train.integrations, nmdeploy.cli\n"
        "try:\n    import nmdeploy.train.integrations.huggingface\n"
        "except ImportError as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "MissingDependencyError" in out and "pip install transformers" in out


def test_hugging_face_trainer_callback(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from nmdeploy.train.integrations.huggingface import SparsityCallback

    x, y = examples()
    data = [{"x": a, "labels": b} for a, b in zip(x, y, strict=True)]

    def run(folder, resume=None, max_steps=6):
        model, sparsifier = sparse_tiny()
        args = transformers.TrainingArguments(
            output_dir=str(folder), max_steps=max_steps, per_device_train_batch_size=8, learning_rate=0.05,
            logging_steps=2, save_steps=3, report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
            lr_scheduler_type="constant", dataloader_num_workers=0,
        )  # fmt: skip
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=data, callbacks=[SparsityCallback(sparsifier)]
        )
        trainer.train(resume_from_checkpoint=resume)
        return model, sparsifier, trainer

    model, sparsifier, trainer = run(tmp_path / "full")
    assert sparsifier.step_count == 6
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3 and all("sparsity/mask_flips" in e and "sparsity/sad" in e for e in logged)
    assert sum(e["sparsity/mask_flips"] for e in logged) > 0  # SR-STE moved masks and the log saw it
    assert all(0 <= e["sparsity/sad"] <= 1 for e in logged)
    assert (tmp_path / "full" / "checkpoint-3" / "nmdeploy_sparsifier.pt").is_file()
    for mask in sparsifier.masks().values():
        assert is_nm(mask, Pattern.parse("2:4"), axis=1)

    # Resumed from step 3 of a run of the same recipe: the same weights, masks and step as the full run.
    run(tmp_path / "part", max_steps=3)
    resumed_model, resumed, _ = run(tmp_path / "part", resume=str(tmp_path / "part" / "checkpoint-3"))
    assert resumed.step_count == 6
    expected, _ = final_state(model, sparsifier)
    for key, value in final_state(resumed_model, resumed)[0].items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)


def test_lightning_callback(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from nmdeploy.train.integrations.lightning import SparsityCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.sparsifier = sparse_tiny()

        def training_step(self, batch, batch_index):
            x, y = batch
            loss = self.model(x, y)["loss"]
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    x, y = examples(24)  # three batches an epoch: the step-3 checkpoint ends an epoch, where Lightning resumes exactly
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)

    def run(folder, steps, ckpt_path=None):
        module = Module()
        checkpoints = pl.callbacks.ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_top_k=-1)
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", logger=pl.loggers.CSVLogger(folder), log_every_n_steps=1,
            callbacks=[SparsityCallback(module.sparsifier), checkpoints], enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return module, trainer

    module, trainer = run(tmp_path / "full", 6)
    assert module.sparsifier.step_count == 6
    with open(trainer.logger.experiment.metrics_file_path) as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("sparsity/mask_flips")]
    assert len(rows) == 6 and sum(float(r["sparsity/mask_flips"]) for r in rows) > 0
    assert all(0 <= float(r["sparsity/sad"]) <= 1 for r in rows)

    run(tmp_path / "part", 3)
    (checkpoint,) = (tmp_path / "part").glob("*step=3.ckpt")
    assert "nmdeploy.SparsityCallback" in torch.load(checkpoint, weights_only=False)["callbacks"]
    resumed, _ = run(tmp_path / "part", 6, ckpt_path=str(checkpoint))
    assert resumed.sparsifier.step_count == 6
    expected = module.model.state_dict()
    for key, value in resumed.model.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
