"""``SparsityCallback`` for Lightning (``lightning.pytorch.Trainer``).

    sparsifier = sparsify(module.model, "2:4", method="srste")
    trainer = lightning.pytorch.Trainer(max_steps=1000, callbacks=[SparsityCallback(sparsifier)])
    trainer.fit(module)        # or trainer.fit(module, ckpt_path="last")
    finalize(module.model)

After every optimiser step (gradient accumulation included) the callback steps the sparsifier. Its state travels
in Lightning's checkpoints as the callback's state (the masks are in the module's ``state_dict``), so a run resumed
with ``ckpt_path`` continues the schedules and the gradient-mask generators. ``sparsity/mask_flips`` and
``sparsity/sad`` (flips per mask position in that step) are logged with ``LightningModule.log`` every step.
"""

from __future__ import annotations

from typing import Any

from nmdeploy.imports import require
from nmdeploy.train.integrations import FlipCounter, sparsifier_of
from nmdeploy.train.masking.sparsify import Sparsifier

require(
    "lightning", purpose="nmdeploy.train.integrations.lightning", package="Lightning", install="pip install lightning"
)
from lightning.pytorch import Callback  # noqa: E402 - after the check that names what to install

__all__ = ["SparsityCallback"]


class SparsityCallback(Callback):
    """Steps ``sparsifier`` after every optimiser step, checkpoints its state and logs mask flips and SAD.

    Give a :class:`Sparsifier`, or the model with ``sparsify``'s options (``SparsityCallback(model, pattern="2:4",
    method="fixed", init="sparsegpt", calibration=batches)``), sparsified here, before the trainer's optimiser.
    """

    def __init__(self, sparsifier: Sparsifier | Any, **options: Any) -> None:
        self.sparsifier = sparsifier_of(sparsifier, options)
        self.counter = FlipCounter(self.sparsifier)

    @property
    def state_key(self) -> str:
        return "nmdeploy.SparsityCallback"

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.counter.resync()  # a resumed run has loaded the module's masks since this callback was built

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        behind = trainer.global_step - self.sparsifier.step_count  # optimiser steps since the last call
        for _ in range(behind):
            self.counter.step()
        if behind:
            metrics = self.counter.read()
            for name, value in metrics.items():
                pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        return {"sparsifier": self.sparsifier.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.sparsifier.load_state_dict(state_dict["sparsifier"])
