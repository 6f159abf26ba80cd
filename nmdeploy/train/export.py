"""Checkpoint -> ONNX: rebuild the trained model, bake its masks into plain weights and export it.

The exported weights are exactly the masked weights the checkpoint trained, so every sparsified layer is N:M along
its input channels in the ONNX file too (``nmdeploy inspect --require`` checks this on the other side). The task's
exporter writes the file atomically with the legacy TorchScript exporter at IR version <= 10.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nmdeploy.train.checkpoint import load_checkpoint, restoring
from nmdeploy.train.config import config_from_dict
from nmdeploy.train.tasks import TASKS
from nmdeploy.train.trainer import build_model


@dataclass(frozen=True)
class ExportResult:
    path: Path
    task: str
    pattern: str | None  # None for a dense run
    sparsified: tuple[str, ...]  # torch module names whose weights were baked N:M
    skipped: dict[str, str]


def export_checkpoint(checkpoint: str | Path, output: str | Path) -> ExportResult:
    """Export the model of a training checkpoint to ONNX with its masks baked in."""
    payload = load_checkpoint(checkpoint)
    config = config_from_dict(payload["config"])
    model, sparsifier = build_model(config)
    with restoring(checkpoint):
        model.load_state_dict(payload["model"])
    sparsified: tuple[str, ...] = ()
    skipped: dict[str, str] = {}
    if sparsifier is not None:
        from nmdeploy.train import finalize

        with restoring(checkpoint):
            sparsifier.load_state_dict(payload["sparsifier"])
        sparsified, skipped = tuple(sorted(sparsifier.layers)), dict(sparsifier.skipped)
        finalize(model)
    model.eval()
    path = TASKS[config.task.name].export_onnx(model, Path(output))
    return ExportResult(
        path, config.task.name, config.sparsity.pattern if sparsifier is not None else None, sparsified, skipped
    )
