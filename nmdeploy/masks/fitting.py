"""Fitting methods: how a layer's N:M weights are chosen and fitted, one small class each, in one registry.

A method declares its contract: whether it needs calibration statistics (H = X^T X of the layer's GEMM input;
without them the conversion reads no data), whether it updates the kept weights (else they keep their dense values)
and whether it chooses its own mask (else the pass selects the top-N scores in every group of M and hands the mask
over). ``--method`` lists the registry's names and helps. Adding one is a subclass registered with
``@register_method(name, help=...)`` (:mod:`nmdeploy.registry`), in this module or one it imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from nmdeploy.registry import Registry

if TYPE_CHECKING:
    import torch

    from nmdeploy.masks import Pattern
    from nmdeploy.masks.blockwise import Statistics

DEFAULT_METHOD = "sparsegpt"


@dataclass
class LayerFit:
    """One layer's fitting problem on its [out, K] GEMM matrix (float64).

    ``support``: where the fitted weight may be non-zero: the selected N:M mask (less existing zeros), or, for a
    method that chooses its own mask, every non-zero entry (the transposable mask when one is imposed).
    ``hessian``: H = X^T X of the layer's input (float32, or its diagonal blocks: ``masks.blockwise.Statistics``),
    None for a method that needs no statistics. ``overwrite``: the fit may factorise the statistics in place (no
    one reads them afterwards); a method that uses them up sets ``error_masked`` / ``error_converted`` (the output
    errors on the statistics), which the pass otherwise computes from them.
    """

    matrix: torch.Tensor
    support: torch.Tensor
    hessian: Statistics | None
    pattern: Pattern
    damping: float
    overwrite: bool = False
    error_masked: float | None = None
    error_converted: float | None = None
    precision: str | None = None  # the fit's precision, where it reports one ("float64": float32 failed)


class FittingMethod:
    """A fitting method: ``score`` ranks the entries (the mask keeps the top N of every M), ``fit`` gives the
    converted matrix, zero outside ``LayerFit.support``."""

    name: ClassVar[str]  # set by the registry
    help: ClassVar[str]
    needs_statistics: ClassVar[bool] = True
    updates_kept_weights: ClassVar[bool] = False
    chooses_mask: ClassVar[bool] = False

    def score(self, matrix: torch.Tensor, hessian: Statistics | None) -> torch.Tensor:
        """Saliency |w| x input norm where statistics exist, magnitude otherwise."""
        from nmdeploy.masks.blockwise import saliency_blockwise

        return matrix.abs() if hessian is None else saliency_blockwise(matrix, hessian)

    def fit(self, layer: LayerFit) -> torch.Tensor:
        return layer.matrix * layer.support


METHODS: Registry[type[FittingMethod]] = Registry("conversion method")
register_method = METHODS.register


def fitting_method(name: str) -> FittingMethod:
    """The registered method ``name``; an unknown name is an InputError listing the known ones."""
    return METHODS.lookup(name)()


def method_names() -> tuple[str, ...]:
    """The registered methods' names, in registration order (``--method``'s choices)."""
    return tuple(METHODS)


def methods_help() -> str:
    """``--method``'s help: every registered method with its own help, the default marked."""
    return METHODS.help_text(DEFAULT_METHOD)


@register_method("magnitude", help="largest |w| of every group, no calibration data read")
class Magnitude(FittingMethod):
    needs_statistics = False

    def score(self, matrix: torch.Tensor, hessian: Statistics | None) -> torch.Tensor:
        return matrix.abs()


@register_method("wanda", help="Wanda: |w| x input norm, top N of every M per output row, kept weights unchanged")
class Wanda(FittingMethod):
    """Wanda (Sun et al. 2023): score |W_ij| * ||X_j||_2 (the base class's), the N largest of every group of M
    along each output row's reduction axis kept, no weight update. Needs only the diagonal of H."""


@register_method("saliency", help="wanda under its earlier name")
class Saliency(Wanda):
    """The base class's score and fit: the saliency mask on the dense values."""


@register_method("refit", help="wanda mask, then exact least-squares refit of each row's kept weights")
class Refit(FittingMethod):
    updates_kept_weights = True

    def fit(self, layer: LayerFit) -> torch.Tensor:
        from nmdeploy.masks.blockwise import refit_blockwise

        return refit_blockwise(layer.matrix, layer.support, layer.hessian, layer.damping)


@register_method("sparsegpt", help="OBS column sweep choosing mask and values together")
class SparseGPT(FittingMethod):
    updates_kept_weights = True
    chooses_mask = True

    def fit(self, layer: LayerFit) -> torch.Tensor:
        from nmdeploy.masks.blockwise import sparsegpt_blockwise

        pattern = layer.pattern
        fit = sparsegpt_blockwise(
            layer.matrix,
            layer.hessian,
            pattern.n,
            pattern.m,
            layer.damping,
            allowed=layer.support,
            overwrite=layer.overwrite,
        )
        layer.error_masked, layer.error_converted = fit.error_masked, fit.error_converted
        layer.precision = str(fit.precision).removeprefix("torch.")
        return fit.weight


@register_method("sparsegpt-refit", help="sparsegpt's mask, then exact least-squares refit of each row's kept weights")
class SparseGPTRefit(FittingMethod):
    """SparseGPT's mask, then the exact least-squares optimum of its kept weights: the column sweep freezes each
    column once visited, so its values are not the optimum for the mask it chose; the refit is."""

    updates_kept_weights = True
    chooses_mask = True

    def fit(self, layer: LayerFit) -> torch.Tensor:
        from nmdeploy.masks.blockwise import refit_blockwise, sparsegpt_blockwise

        pattern = layer.pattern
        # Not in place: the refit reads the statistics again.
        swept = sparsegpt_blockwise(
            layer.matrix, layer.hessian, pattern.n, pattern.m, layer.damping, allowed=layer.support
        )
        return refit_blockwise(layer.matrix, swept.weight != 0, layer.hessian, layer.damping)


@register_method(
    "alps", help="ALPS: ADMM search of the mask on the layer's output error, then exact least-squares refit"
)
class Alps(FittingMethod):
    """ALPS (Meng et al. 2024): ADMM on the layer's output error with an N:M projection chooses the mask, then an
    exact least-squares refit gives its values (the paper refines them by PCG towards the same optimum)."""

    updates_kept_weights = True
    chooses_mask = True

    def fit(self, layer: LayerFit) -> torch.Tensor:
        from nmdeploy.masks.blockwise import alps_blockwise

        pattern = layer.pattern
        return alps_blockwise(layer.matrix, layer.hessian, pattern.n, pattern.m, layer.damping, allowed=layer.support)
