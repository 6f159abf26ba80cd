"""The ONNX graph model: which tensors are prunable weights, along which axis, and how they were reached."""

from nmdeploy.graph.weights import PrunableWeight, UntracedWeight, WeightReport, WeightUse, find_prunable_weights

__all__ = ["PrunableWeight", "UntracedWeight", "WeightReport", "WeightUse", "find_prunable_weights"]
