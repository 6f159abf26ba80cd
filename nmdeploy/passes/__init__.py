"""Graph passes: small classes with one ``call(model) -> PassResult``; recipes in the top-level passes/ folder."""

from nmdeploy.passes.base import Pass, PassResult, Sequential
from nmdeploy.passes.cast import CastPass
from nmdeploy.passes.convert import ConvertPass
from nmdeploy.passes.fold import FoldConstantsPass
from nmdeploy.passes.permute import PermutePass, permute
from nmdeploy.passes.prune import PrunePass, prune
from nmdeploy.passes.recipes import PASSES, load_recipe
from nmdeploy.passes.verify import VerifyPass

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
