"""Imports point down only, transitively: every nmdeploy module, with everything it imports (at the top or inside a
function), stays within its own layer and the layers below it, as ARCHITECTURE.md draws them."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nmdeploy"

# Bottom to top; a module belongs to the layer of its longest matching name (the foundation names match exactly).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "nmdeploy",
            "nmdeploy.errors",
            "nmdeploy.files",
            "nmdeploy.fidelity",
            "nmdeploy.imports",
            "nmdeploy.rows",
            "nmdeploy.tables",
        ),
    ),
    ("masks", ("nmdeploy.masks",)),
    ("statistics", ("nmdeploy.statistics",)),
    ("graph", ("nmdeploy.graph",)),
    ("runtimes", ("nmdeploy.runtimes",)),
    ("passes", ("nmdeploy.conversion", "nmdeploy.passes")),
    ("evaluation", ("nmdeploy.evaluation",)),
    ("reference", ("nmdeploy.reference",)),
    ("train", ("nmdeploy.train",)),
    ("pipeline", ("nmdeploy.pipeline", "nmdeploy.pytest_plugin")),
    ("cli", ("nmdeploy.cli", "nmdeploy.__main__")),
]
FOUNDATION = LAYERS[0][1]
ONNX_LAYERS = ("nmdeploy.graph", "nmdeploy.runtimes", "nmdeploy.conversion", "nmdeploy.passes", "nmdeploy.evaluation")
# Third-party packages a layer must not reach, even through the nmdeploy modules it imports.
FORBIDDEN_EXTERNAL = {
    "masks": ("onnx", "onnxruntime", "tensorrt"),
    "graph": ("onnxruntime", "tensorrt"),
    "train": ("onnxruntime", "tensorrt"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def layer_of(name: str) -> int:
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            exact_only = prefix in FOUNDATION
            matches = name == prefix or (not exact_only and name.startswith(prefix + "."))
            if matches and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{name} is in no layer: add it to LAYERS (and to ARCHITECTURE.md)"
    return best


def _with_parents(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


@cache
def direct_imports(name: str) -> tuple[frozenset[str], frozenset[str]]:
    """(nmdeploy modules, top-level third-party packages) that ``name`` imports anywhere in its source."""
    ours, theirs = set(), set()
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            if target.split(".")[0] == "nmdeploy":
                ours.update(n for n in _with_parents(target) if n in MODULES)
            elif target:
                theirs.add(target.split(".")[0])
    ours.discard(name)
    return frozenset(ours), frozenset(theirs)


@cache
def closure(name: str) -> dict[str, tuple[str, ...]]:
    """Every nmdeploy module ``name`` reaches, with one import chain leading there."""
    chains: dict[str, tuple[str, ...]] = {name: (name,)}
    stack = [name]
    while stack:
        current = stack.pop()
        for target in direct_imports(current)[0]:
            if target not in chains:
                chains[target] = (*chains[current], target)
                stack.append(target)
    return chains


def test_every_module_has_a_layer():
    for name in MODULES:
        layer_of(name)


def test_imports_point_down_only_transitively():
    offenders = []
    for name in sorted(MODULES):
        own = layer_of(name)
        for target, chain in closure(name).items():
            if layer_of(target) > own:
                offenders.append(
                    f"{name} ({LAYERS[own][0]}) reaches {LAYERS[layer_of(target)][0]}: {' -> '.join(chain)}"
                )
    assert not offenders, "\n".join(offenders)


def test_the_trainer_never_reaches_the_onnx_layers():
    offenders = [
        " -> ".join(chain)
        for name in MODULES
        if name.startswith("nmdeploy.train")
        for target, chain in closure(name).items()
        if any(target == layer or target.startswith(layer + ".") for layer in ONNX_LAYERS)
    ]
    assert not offenders, "\n".join(offenders)


def test_low_layers_never_reach_forbidden_packages():
    offenders = []
    for name in MODULES:
        forbidden = FORBIDDEN_EXTERNAL.get(LAYERS[layer_of(name)][0], ())
        for target, chain in closure(name).items():
            for package in direct_imports(target)[1] & set(forbidden):
                offenders.append(f"{' -> '.join(chain)} imports {package}")
    assert not offenders, "\n".join(offenders)


def test_the_checker_sees_an_indirect_violation(tmp_path, monkeypatch):
    # A graph module importing a harmless-looking runtimes module that itself imports the CLI lazily.
    low, middle = tmp_path / "low.py", tmp_path / "middle.py"
    low.write_text("from nmdeploy.runtimes import fake_middle\n")
    middle.write_text("def f():\n    from nmdeploy.cli import main\n")
    monkeypatch.setitem(MODULES, "nmdeploy.graph.fake_low", low)
    monkeypatch.setitem(MODULES, "nmdeploy.runtimes.fake_middle", middle)
    direct_imports.cache_clear()
    closure.cache_clear()
    try:
        chain = closure("nmdeploy.graph.fake_low")["nmdeploy.cli"]
        assert chain == ("nmdeploy.graph.fake_low", "nmdeploy.runtimes.fake_middle", "nmdeploy.cli")
        with pytest.raises(AssertionError, match="fake_low \\(graph\\) reaches cli"):
            test_imports_point_down_only_transitively()
    finally:
        direct_imports.cache_clear()
        closure.cache_clear()
