"""nmdeploy: make N:M structured sparsity pay off, from PyTorch training to ONNX and TensorRT deployment."""

from nmdeploy.errors import (
    ComplianceError,
    Error,
    InputError,
    IntractableCountError,
    MissingDependencyError,
    PatternError,
    ShapeError,
)

__version__ = "0.1.0"

__all__ = [
    "ComplianceError",
    "Error",
    "InputError",
    "IntractableCountError",
    "MissingDependencyError",
    "PatternError",
    "ShapeError",
    "__version__",
]
