"""The ONNX graph model: one index of the graph (producers, consumers, order, stored tensors), which tensors are
prunable weights, along which axis, and how they were reached."""

from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.order import GraphCycleError
from nmdeploy.graph.prunable import PrunableWeight, UntracedWeight, WeightReport, WeightUse
from nmdeploy.graph.scope import StoredTensor, Use
from nmdeploy.graph.weights import find_prunable_weights

__all__ = [
    "GraphCycleError",
    "GraphIndex",
    "PrunableWeight",
    "StoredTensor",
    "UntracedWeight",
    "Use",
    "WeightReport",
    "WeightUse",
    "find_prunable_weights",
]
