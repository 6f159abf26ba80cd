"""``SparsityCallback`` for the Hugging Face ``transformers.Trainer``.

    sparsifier = sparsify(model, "2:4", method="srste")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[SparsityCallback(sparsifier)])
    trainer.train()            # or trainer.train(resume_from_checkpoint=True)
    finalize(model)

After every optimiser step the callback steps the sparsifier. Every checkpoint folder gets the sparsifier's state
(``nmdeploy_sparsifier.pt``) beside the model's weights, which hold the masks; a run resumed from a checkpoint of
its ``output_dir`` reads it back. Each log line gains ``sparsity/mask_flips`` and ``sparsity/sad`` (flips per mask
position since the previous log line), in ``trainer.state.log_history`` and for the reporting callbacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nmdeploy.errors import InputError
from nmdeploy.files import atomic_output
from nmdeploy.imports import require
from nmdeploy.train.integrations import STATE_FILE, FlipCounter, load_state, sparsifier_of
from nmdeploy.train.masking.sparsify import Sparsifier

require(
    "transformers",
    purpose="nmdeploy.train.integrations.huggingface",
    install="pip install transformers accelerate",
)
from transformers import TrainerCallback  # noqa: E402 - after the check that names what to install
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR  # noqa: E402

__all__ = ["SparsityCallback"]


class SparsityCallback(TrainerCallback):
    """Steps ``sparsifier`` after every optimiser step, checkpoints its state and logs mask flips and SAD.

    Give a :class:`Sparsifier`, or the model with ``sparsify``'s options (``SparsityCallback(model, pattern="2:4",
    method="fixed", init="sparsegpt", calibration=batches)``), sparsified here, before the trainer's optimiser.
    """

    def __init__(self, sparsifier: Sparsifier | Any, **options: Any) -> None:
        self.sparsifier = sparsifier_of(sparsifier, options)
        self.counter = FlipCounter(self.sparsifier)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.sparsifier.step_count:
            return
        # Resumed: the trainer has loaded the model (masks included) and its state; the sparsifier's is beside them.
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        path = folder / STATE_FILE
        if not path.is_file():
            raise InputError(
                f"resuming at step {state.global_step} but {path} does not exist: resume from a checkpoint written "
                "with SparsityCallback in this output_dir, or start a fresh run"
            )
        self.sparsifier.load_state_dict(load_state(path)["sparsifier"])
        self.counter.resync()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.counter.step()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        folder.mkdir(parents=True, exist_ok=True)
        _save(folder / STATE_FILE, {"sparsifier": self.sparsifier.state_dict()})

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs is None or "loss" not in logs:  # training log lines only, not evaluation or the final summary
            return
        metrics = self.counter.read()
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)


def _save(path: Path, payload: dict[str, Any]) -> None:
    import torch

    with atomic_output(path) as temporary:
        torch.save(payload, temporary)
