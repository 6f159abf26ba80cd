"""Graph passes: small classes with one ``call(model) -> PassResult``; recipes in the top-level passes/ folder."""

from nmdeploy.passes.base import Pass, PassResult, Sequential
from nmdeploy.passes.fold import FoldConstantsPass
from nmdeploy.passes.prune import PrunePass, prune
from nmdeploy.passes.recipes import PASSES, load_recipe
from nmdeploy.passes.verify import VerifyPass

__all__ = [
    "PASSES",
    "FoldConstantsPass",
    "Pass",
    "PassResult",
    "PrunePass",
    "Sequential",
    "VerifyPass",
    "load_recipe",
    "prune",
]
