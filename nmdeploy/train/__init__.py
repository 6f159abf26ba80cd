"""Sparse training: N:M masks on Linear/Conv layers as parametrisations, with masked backward passes.

Uses :mod:`nmdeploy.masks` for every mask and never the ONNX layers::

    sparsifier = sparsify(model, "2:4", method="srste", backward=("transposable", "mvue"))
    for batch in data:
        ...; optimizer.step(); sparsifier.step()
    finalize(model)  # plain modules whose weights are N:M along input channels

From a pretrained model: ``sparsify(model, "2:4", method="fixed", init="sparsegpt", calibration=batches)`` (first
masks and kept weights from SparseGPT, layer by layer); under Adam, ``method="step"`` with :class:`STEPAdam`.
Methods and masking live in :mod:`nmdeploy.train.masking`; running a training (loop, configs, tasks, checkpoints,
export, callbacks) in the modules beside it.

Checkpoints: ``save_checkpoint(path, model, sparsifier, optimizer=...)`` and ``load_checkpoint(path, model, ...)``
(see :mod:`nmdeploy.train.checkpoint`), the same format ``nmdeploy train`` writes; sharded ones for FSDP2 with
``save_distributed``/``load_distributed`` (:mod:`nmdeploy.train.distributed`).
"""

from nmdeploy.train.checkpoint import CheckpointMismatchError, Restored, load_checkpoint, save_checkpoint
from nmdeploy.train.distributed import latest_checkpoint, load_distributed, save_distributed
from nmdeploy.train.masking.backward import BACKWARD_CHOICES, BackwardOptions
from nmdeploy.train.masking.finalize import finalize, finalized_state_dict
from nmdeploy.train.masking.methods import METHODS, NMParametrization
from nmdeploy.train.masking.oneshot import INITS
from nmdeploy.train.masking.sparsify import Sparsifier, sparsify, sparsify_like
from nmdeploy.train.masking.step import STEPAdam

__all__ = [
    "BACKWARD_CHOICES",
    "METHODS",
    "INITS",
    "BackwardOptions",
    "CheckpointMismatchError",
    "NMParametrization",
    "Restored",
    "STEPAdam",
    "Sparsifier",
    "finalize",
    "finalized_state_dict",
    "latest_checkpoint",
    "load_checkpoint",
    "load_distributed",
    "save_checkpoint",
    "save_distributed",
    "sparsify",
    "sparsify_like",
]
