"""N:M mask math on torch tensors: scoring, selection, checking, solvers and metrics. No I/O, no ONNX.

Everything here is device-agnostic and vectorised; the ONNX passes and the trainer both call these functions.
"""

from nmdeploy.masks.check import Compliance, is_nm, is_transposable
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
    "transposable_mask",
]
