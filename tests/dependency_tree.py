"""The distributions that nmdeploy's declared requirements reach in an environment, read from the installed metadata
(importlib.metadata), markers and extras evaluated as pip evaluates them. Used by the dependency audit
(tests/test_dependencies.py) and by the install-size measurement (.ci/install_sizes.py)."""

from __future__ import annotations

import sysconfig
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.metadata import Distribution, distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
PROJECT = "nmdeploy"
# Installed into every virtual environment by venv itself, not by any requirement.
INSTALLER = frozenset({"pip"})


def declared(extras: Iterable[str] = (), pyproject: Path = PYPROJECT) -> list[Requirement]:
    """nmdeploy's own requirements as pyproject.toml declares them: the runtime ones and those of ``extras``."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    texts = list(project["dependencies"])
    for extra in extras:
        texts += project["optional-dependencies"][extra]
    return [Requirement(text) for text in texts]


def extras_of(pyproject: Path = PYPROJECT) -> list[str]:
    return list(tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["optional-dependencies"])


def installed(paths: Iterable[str] | None = None) -> dict[str, Distribution]:
    """The distributions installed in this interpreter's environment (its site-packages, not PYTHONPATH), by
    canonical name."""
    if paths is None:
        paths = list(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))
    return {canonicalize_name(dist.metadata["Name"]): dist for dist in distributions(path=list(paths))}


@dataclass
class Tree:
    """What a walk found: the distributions reached (by canonical name), requirements whose distribution is not
    installed, and installed versions outside what a requirement asks for."""

    reached: dict[str, Distribution] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


def _wanted(requirement: Requirement, extras: frozenset[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({"extra": extra}) for extra in (extras or {""}))


def walk(requirements: Iterable[Requirement], available: dict[str, Distribution]) -> Tree:
    """Follow ``requirements`` through the installed metadata in ``available``; a requirement on nmdeploy itself
    (``nmdeploy[models]`` inside the test extra) is followed through pyproject.toml."""
    tree = Tree()
    pending = [(requirement, frozenset()) for requirement in requirements]
    done: set[tuple[str, frozenset[str]]] = set()
    while pending:
        requirement, parent_extras = pending.pop()
        if not _wanted(requirement, parent_extras):
            continue
        name, extras = canonicalize_name(requirement.name), frozenset(requirement.extras)
        if (name, extras) in done:
            continue
        done.add((name, extras))
        if name == PROJECT:
            pending += [(inner, frozenset()) for inner in declared(extras)]
            continue
        dist = available.get(name)
        if dist is None:
            tree.missing.append(str(requirement))
            continue
        if not requirement.specifier.contains(dist.version, prereleases=True):
            tree.mismatched.append(f"{dist.metadata['Name']} {dist.version} (asked: {requirement})")
        tree.reached[name] = dist
        pending += [(Requirement(text), extras) for text in dist.requires or ()]
    return tree


def installed_size(dist: Distribution) -> int:
    """Bytes of the files a distribution installed, as its RECORD lists them (its own files only)."""
    total = 0
    for file in dist.files or ():
        path = Path(dist.locate_file(file))
        if path.is_file():
            total += path.stat().st_size
    return total
