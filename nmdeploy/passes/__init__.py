"""Graph passes: small classes with one ``call(model) -> PassResult``; recipes in the top-level passes/ folder."""

from nmdeploy.passes.base import Pass, PassResult, Sequential
from nmdeploy.passes.prune import PrunePass, prune

__all__ = ["Pass", "PassResult", "PrunePass", "Sequential", "prune"]
