"""Sparse training: N:M masks on Linear/Conv layers as parametrisations, with masked backward passes.

Uses :mod:`nmdeploy.masks` for every mask and never the ONNX layers::

    sparsifier = sparsify(model, "2:4", method="srste", backward=("transposable", "mvue"))
    for batch in data:
        ...; optimizer.step(); sparsifier.step()
    finalize(model)  # plain modules whose weights are N:M along input channels
"""

from nmdeploy.train.backward import BACKWARD_CHOICES, BackwardOptions
from nmdeploy.train.methods import METHODS, NMParametrization
from nmdeploy.train.sparsify import Sparsifier, finalize, sparsify

__all__ = ["BACKWARD_CHOICES", "METHODS", "BackwardOptions", "NMParametrization", "Sparsifier", "finalize", "sparsify"]
