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
            "nmdeploy.fidelity.comparison",
            "nmdeploy.fidelity.detection",
            "nmdeploy.fidelity.measures",
            "nmdeploy.fidelity.meter",
            "nmdeploy.fidelity.registry",
            "nmdeploy.fidelity.selection",
            "nmdeploy.fidelity.tasks",
            "nmdeploy.imports",
            "nmdeploy.limits",
            "nmdeploy.progress",
            "nmdeploy.registry",
            "nmdeploy.rows",
            "nmdeploy.tables",
        ),
    ),
    ("masks", ("nmdeploy.masks",)),
    ("statistics", ("nmdeploy.statistics",)),
    ("graph", ("nmdeploy.graph",)),
    ("runtimes", ("nmdeploy.runtimes",)),
    ("calibration", ("nmdeploy.calibration",)),
    ("passes", ("nmdeploy.passes",)),
    ("conversion", ("nmdeploy.conversion",)),
    ("evaluation", ("nmdeploy.evaluation",)),
    ("reference", ("nmdeploy.reference",)),
    ("train", ("nmdeploy.train",)),
    ("pipeline", ("nmdeploy.pipeline", "nmdeploy.pytest_plugin")),
    ("cli", ("nmdeploy.cli", "nmdeploy.__main__")),
]
FOUNDATION = LAYERS[0][1]
ONNX_LAYERS = (
    "nmdeploy.graph",
    "nmdeploy.runtimes",
    "nmdeploy.calibration",
    "nmdeploy.conversion",
    "nmdeploy.passes",
    "nmdeploy.evaluation",
)
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
def named_imports(name: str) -> frozenset[str]:
    """The nmdeploy modules ``name``'s import statements name themselves (a package named is its ``__init__``);
    unlike :func:`direct_imports`, the parent packages Python runs on the way are left out, so an import graph of
    these edges has a cycle only where modules really name each other in a loop."""
    named = set()
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            submodules = {f"{base}.{alias.name}" for alias in node.names} & set(MODULES)
            named.update(submodules or {base})
    return frozenset(named & set(MODULES) - {name})


def import_cycles(prefix: str) -> list[list[str]]:
    """Every set of modules under ``prefix`` that import each other in a loop (strongly connected components of
    more than one module, Tarjan's algorithm), each listed from its first module in name order."""
    nodes = sorted(name for name in MODULES if name == prefix or name.startswith(prefix + "."))
    edges = {name: sorted(target for target in named_imports(name) if target in nodes) for name in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in nodes:
        if node not in index:
            visit(node)
    return sorted(cycles)


def _describe(cycle: list[str]) -> str:
    members = set(cycle)
    ties = [f"{name} -> {target}" for name in cycle for target in sorted(named_imports(name) & members)]
    return f"{', '.join(cycle)} import each other: {'; '.join(ties)}"


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


CYCLE_FREE = ("nmdeploy.train",)
"""Packages whose modules must not import each other in a loop (lazy imports inside functions included)."""
TRAIN_PARTS = ("nmdeploy.train.masking",)
"""The trainer's methods and masking: they never import the modules that run a training (loop, configs, tasks,
checkpoints, export, callbacks)."""


@pytest.mark.parametrize("package", CYCLE_FREE)
def test_no_import_cycle_inside(package):
    cycles = import_cycles(package)
    assert not cycles, "\n".join(_describe(cycle) for cycle in cycles)


def test_masking_never_reaches_the_running_modules():
    offenders = []
    for name in sorted(MODULES):
        if not name.startswith(TRAIN_PARTS[0] + "."):
            continue
        reached = {name}
        frontier = [name]
        while frontier:  # named imports only: the parent package nmdeploy.train is a face over both parts
            for target in named_imports(frontier.pop()):
                if target not in reached:
                    reached.add(target)
                    frontier.append(target)
        running = sorted(t for t in reached if t.startswith("nmdeploy.train") and not t.startswith(TRAIN_PARTS[0]))
        if running:
            offenders.append(f"{name} reaches {', '.join(running)}")
    assert not offenders, "\n".join(offenders)


def test_the_cycle_check_sees_a_lazy_loop(tmp_path, monkeypatch):
    # Three modules: a imports b at the top, b imports c, and c imports a inside a function.
    sources = {
        "nmdeploy.train.fake_a": "from nmdeploy.train import fake_b\n",
        "nmdeploy.train.fake_b": "import nmdeploy.train.fake_c\n",
        "nmdeploy.train.fake_c": "def f():\n    from nmdeploy.train.fake_a import g\n",
    }
    for name, source in sources.items():
        path = tmp_path / f"{name.rpartition('.')[2]}.py"
        path.write_text(source)
        monkeypatch.setitem(MODULES, name, path)
    named_imports.cache_clear()
    try:
        assert sorted(sources) in import_cycles("nmdeploy.train")
        with pytest.raises(AssertionError, match="fake_c -> nmdeploy.train.fake_a"):
            test_no_import_cycle_inside("nmdeploy.train")
    finally:
        named_imports.cache_clear()
