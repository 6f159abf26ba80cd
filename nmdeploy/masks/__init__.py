"""N:M mask math: scoring, selection, checking, solvers and metrics. No I/O, no ONNX.

Everything here is device-agnostic and vectorised; the ONNX passes and the trainer both call these functions.
The 1-D selection and the checks run on numpy arrays in :mod:`nmdeploy.masks.arrays` (no torch); the torch
functions hand CPU tensors to it. Names are imported on first use, so ``import nmdeploy.masks`` (or any of its
torch-free modules) does not load torch: pruning and inspecting an ONNX model never need it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nmdeploy.imports import lazy_exports

if TYPE_CHECKING:
    from nmdeploy.masks.arrays import Compliance, nm_compliance, nm_keep, transposable_compliance
    from nmdeploy.masks.check import is_nm, is_transposable
    from nmdeploy.masks.diversity import MaskDiversity, count_binary_matrices, mask_diversity
    from nmdeploy.masks.metrics import retained_score_fraction, sparse_architecture_divergence
    from nmdeploy.masks.mvue import mvue_probabilities, mvue_prune, mvue_variance
    from nmdeploy.masks.pattern import Pattern
    from nmdeploy.masks.permutation import PermutationSearch, is_permutation, retained_nm_score, search_permutation
    from nmdeploy.masks.reconstruct import reconstruction_error, refit, saliency, shifted_target, sparsegpt
    from nmdeploy.masks.scoring import magnitude
    from nmdeploy.masks.select import apply_nm, as_float, nm_mask
    from nmdeploy.masks.training import (
        backward_mask,
        combination_table,
        permutation_scores,
        search_output_permutation,
        structure_decay_patterns,
    )
    from nmdeploy.masks.transposable import greedy_tiles, solve_tiles, transposable_mask

_MODULES: dict[str, str] = {
    "Compliance": "arrays",
    "MaskDiversity": "diversity",
    "Pattern": "pattern",
    "PermutationSearch": "permutation",
    "apply_nm": "select",
    "as_float": "select",
    "backward_mask": "training",
    "combination_table": "training",
    "count_binary_matrices": "diversity",
    "greedy_tiles": "transposable",
    "is_nm": "check",
    "is_permutation": "permutation",
    "is_transposable": "check",
    "magnitude": "scoring",
    "mask_diversity": "diversity",
    "mvue_probabilities": "mvue",
    "mvue_prune": "mvue",
    "mvue_variance": "mvue",
    "nm_compliance": "arrays",
    "nm_keep": "arrays",
    "nm_mask": "select",
    "permutation_scores": "training",
    "reconstruction_error": "reconstruct",
    "refit": "reconstruct",
    "retained_nm_score": "permutation",
    "retained_score_fraction": "metrics",
    "saliency": "reconstruct",
    "search_output_permutation": "training",
    "search_permutation": "permutation",
    "shifted_target": "reconstruct",
    "solve_tiles": "transposable",
    "sparse_architecture_divergence": "metrics",
    "sparsegpt": "reconstruct",
    "structure_decay_patterns": "training",
    "transposable_compliance": "arrays",
    "transposable_mask": "transposable",
}
"""Each public name -> the module of nmdeploy.masks that defines it."""

__all__ = [
    "Compliance",
    "MaskDiversity",
    "Pattern",
    "PermutationSearch",
    "apply_nm",
    "as_float",
    "backward_mask",
    "combination_table",
    "count_binary_matrices",
    "greedy_tiles",
    "is_nm",
    "is_permutation",
    "is_transposable",
    "magnitude",
    "mask_diversity",
    "mvue_probabilities",
    "mvue_prune",
    "mvue_variance",
    "nm_compliance",
    "nm_keep",
    "nm_mask",
    "permutation_scores",
    "reconstruction_error",
    "refit",
    "retained_nm_score",
    "retained_score_fraction",
    "saliency",
    "search_output_permutation",
    "search_permutation",
    "shifted_target",
    "solve_tiles",
    "sparse_architecture_divergence",
    "sparsegpt",
    "structure_decay_patterns",
    "transposable_compliance",
    "transposable_mask",
]


__getattr__, __dir__ = lazy_exports(__name__, _MODULES)
