"""Resolve the ``package.module:function`` paths users name in flags and config files (metrics, model factories,
data modules) into callables, with one-line errors that say where the path came from; packages' lazy exports; and
optional dependencies, imported where they are used, with one line saying what to install when they are missing."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from nmdeploy.errors import InputError, MissingDependencyError


def import_callable(path: str, source: str, *, allow_classes: bool = True) -> Callable[..., Any]:
    """``path`` -> the callable it names (``attribute`` may be dotted: ``module:Class.method``). ``source`` names
    where the path came from in errors (``--metric 'm:f'``, ``[task] model = 'm:f'``); ``allow_classes=False``
    refuses classes where a plain function is expected."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise InputError(f"{source} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the module is the user's code: any failure while importing it is their input
        raise InputError(f"{source}: cannot import {module_name!r} ({error}); is it on PYTHONPATH?") from None
    target: Any = module
    for part in attribute.split("."):
        target = getattr(target, part, None)
    if not callable(target) or (not allow_classes and isinstance(target, type)):
        kind = "callable" if allow_classes else "function"
        raise InputError(f"{source}: {module_name} has no {kind} {attribute!r}")
    return target


def lazy_exports(package: str, modules: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module-level ``__getattr__`` and ``__dir__`` that import each exported name from its module
    (``modules``: name -> submodule, or a whole ``nmdeploy.`` module path) on first use, so importing the package
    loads none of them (torch stays unloaded until a torch function is asked for)."""

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        path = module if module.startswith("nmdeploy.") else f"{package}.{module}"
        value = getattr(importlib.import_module(path), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted([*vars(sys.modules[package]), *modules])

    return __getattr__, __dir__


def require(module: str, *, purpose: str, package: str | None = None, install: str | None = None) -> ModuleType:
    """The optional dependency ``module`` (``"onnxruntime"``, ``"PIL.Image"``), imported now, or a one-line
    :class:`MissingDependencyError`: ``"{purpose} needs {package}: {install}"``. ``package`` is what users know it
    as (default: the top-level module's name) and ``install`` the command that brings it (default: ``pip install
    PACKAGE``). A native library that fails to load (``OSError``) counts as missing too."""
    try:
        return importlib.import_module(module)
    except (ImportError, OSError) as error:
        package = package or module.partition(".")[0]
        raise MissingDependencyError(f"{purpose} needs {package}: {install or f'pip install {package}'}") from error


def optional(module: str) -> ModuleType | None:
    """The module, or None where it is not installed: for dependencies that only make something better (psutil's
    memory figures), where the caller has a fallback."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
