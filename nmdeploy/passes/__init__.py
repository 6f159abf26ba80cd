"""Graph passes: small classes with one ``call(model) -> PassResult``; recipes in the top-level passes/ folder.

The passes that pruning and verifying need are imported here; the calibrated conversion (ONNX Runtime and torch),
the cast and fold passes and the recipe table are imported on first use of their names, so ``nmdeploy prune`` and
``nmdeploy inspect`` load neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nmdeploy.imports import lazy_exports
from nmdeploy.passes.base import Pass, PassResult, Sequential
from nmdeploy.passes.permute import PermutePass, permute
from nmdeploy.passes.prune import PrunePass, prune
from nmdeploy.passes.verify import VerifyPass

if TYPE_CHECKING:
    from nmdeploy.conversion.convert import ConvertPass
    from nmdeploy.passes.cast import CastPass
    from nmdeploy.passes.fold import FoldConstantsPass
    from nmdeploy.passes.recipes import PASSES, load_recipe

_LAZY: dict[str, str] = {
    "CastPass": "cast",
    "ConvertPass": "nmdeploy.conversion.convert",
    "FoldConstantsPass": "fold",
    "PASSES": "recipes",
    "load_recipe": "recipes",
}
"""Names whose modules are imported on first use -> that module of nmdeploy.passes. (``prune`` and ``permute``
are imported above: each is also a submodule's name, which a lazy name would lose to the submodule.)"""

__all__ = [
    "PASSES",
    "CastPass",
    "ConvertPass",
    "FoldConstantsPass",
    "Pass",
    "PassResult",
    "PermutePass",
    "PrunePass",
    "Sequential",
    "VerifyPass",
    "load_recipe",
    "permute",
    "prune",
]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
