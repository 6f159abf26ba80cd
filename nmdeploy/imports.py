"""Resolve the ``package.module:function`` paths users name in flags and config files (metrics, model factories,
data modules) into callables, with one-line errors that say where the path came from."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from nmdeploy.errors import InputError


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
