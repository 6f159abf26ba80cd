"""Graph passes: small classes with one ``call(model) -> PassResult``, each a function of its options and the model.

The passes that pruning and verifying need are imported here; the calibrated fit (ONNX Runtime and torch), the
cast and fold passes are imported on first use of their names, so ``nmdeploy prune`` and ``nmdeploy inspect`` load
neither. Recipes (the top-level passes/ folder) and the conversion that runs recovery and budgets around the fit
live above, in :mod:`nmdeploy.conversion`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nmdeploy.imports import lazy_exports
from nmdeploy.passes.base import Pass, PassResult, Sequential
from nmdeploy.passes.permute import PermutePass, permute
from nmdeploy.passes.prune import PrunePass, prune
from nmdeploy.passes.verify import VerifyPass

if TYPE_CHECKING:
    from nmdeploy.passes.cast import CastPass
    from nmdeploy.passes.convert import ConvertPass
    from nmdeploy.passes.fold import FoldConstantsPass

_LAZY: dict[str, str] = {
    "CastPass": "cast",
    "ConvertPass": "convert",
    "FoldConstantsPass": "fold",
}
"""Names whose modules are imported on first use -> that module of nmdeploy.passes. (``prune`` and ``permute``
are imported above: each is also a submodule's name, which a lazy name would lose to the submodule.)"""

__all__ = [
    "CastPass",
    "ConvertPass",
    "FoldConstantsPass",
    "Pass",
    "PassResult",
    "PermutePass",
    "PrunePass",
    "Sequential",
    "VerifyPass",
    "permute",
    "prune",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
