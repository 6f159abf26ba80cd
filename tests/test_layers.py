"""Imports point down only: the mask math must not depend on I/O, ONNX, the CLI or training."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nmdeploy"
FORBIDDEN = {
    "masks": (
        "nmdeploy.cli",
        "nmdeploy.statistics",
        "nmdeploy.inspection",
        "nmdeploy.graph",
        "nmdeploy.passes",
        "nmdeploy.runtimes",
        "nmdeploy.train",
        "onnx",
        "onnxruntime",
        "tensorrt",
    ),
    "graph": (
        "nmdeploy.cli",
        "nmdeploy.inspection",
        "nmdeploy.passes",
        "nmdeploy.runtimes",
        "nmdeploy.train",
        "onnxruntime",
        "tensorrt",
    ),
    "passes": ("nmdeploy.cli", "nmdeploy.runtimes", "nmdeploy.train", "tensorrt"),
    "runtimes": ("nmdeploy.cli", "nmdeploy.train"),
    "train": ("nmdeploy.cli", "nmdeploy.graph", "nmdeploy.passes", "nmdeploy.inspection", "nmdeploy.calibration"),
    "reference": ("nmdeploy.cli",),
}


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_imports_point_down_only():
    offenders = []
    for layer, forbidden in FORBIDDEN.items():
        for path in (PACKAGE / layer).rglob("*.py"):
            for name in imported_modules(path):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not offenders, offenders
