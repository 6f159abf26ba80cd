"""Recipes: TOML files listing passes and their options, mapped to pass classes through one name table.

The table names the leaf passes and, for ``convert``, the whole calibrated conversion (recovery, the fidelity budget
and the precision budget, with or without recovery, reachable from a recipe as from the verb: ``recover`` is a number
of steps or a table of recovery options, ``quantize`` a table of quantization options), so it sits above both.
"""

from __future__ import annotations

import dataclasses
import inspect
import tomllib
import types
import typing
from importlib.resources import files
from pathlib import Path
from typing import Any

from nmdeploy.conversion.controller import Conversion
from nmdeploy.errors import InputError
from nmdeploy.limits import read_toml
from nmdeploy.passes.base import Pass, Sequential
from nmdeploy.passes.cast import CastPass
from nmdeploy.passes.fold import FoldConstantsPass
from nmdeploy.passes.permute import PermutePass
from nmdeploy.passes.prune import PrunePass
from nmdeploy.passes.quantize import QuantizePass
from nmdeploy.passes.verify import VerifyPass

PASSES: dict[str, type[Pass]] = {
    "cast": CastPass,
    "convert": Conversion,
    "fold-constants": FoldConstantsPass,
    "permute": PermutePass,
    "prune": PrunePass,
    "quantize": QuantizePass,
    "verify": VerifyPass,
}

# The top-level passes/ folder, installed as package data (setup.py); always a folder on disk, in a wheel too.
RECIPE_DIR = Path(str(files("nmdeploy.recipes")))


def find_recipe(name_or_path: str) -> Path:
    """A recipe file by path, or by name from the bundled recipes (passes/) (``tensorrt-2of4``)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = RECIPE_DIR / f"{name_or_path.removesuffix('.toml')}.toml"
    if bundled.is_file():
        return bundled
    known = sorted(p.stem for p in RECIPE_DIR.glob("*.toml")) if RECIPE_DIR.is_dir() else []
    raise InputError(
        f"no recipe {name_or_path!r}: not a file, and not one of {', '.join(known) or 'no bundled recipes'}"
    )


def load_recipe(name_or_path: str, *, calibration: str | None = None) -> Sequential:
    """Build the pipeline a recipe describes; unknown pass names or options are errors that list the valid ones.

    ``calibration`` (``nmdeploy run --calib``) is given to every pass that takes calibration data (convert,
    quantize), in place of what the recipe names."""
    path, steps = _read(name_or_path)
    return Sequential([_build(path, index, step, calibration) for index, step in enumerate(steps, 1)])


def step_options(name_or_path: str, pass_name: str, *, calibration: str) -> dict[str, Any]:
    """The options a recipe gives its first ``pass_name`` step, checked as :func:`load_recipe` checks them (the
    whole recipe is built, on ``calibration``), without ``pass`` and ``calibration``: how the pipeline hands the
    quantize step's options of ``tensorrt-2of4-int8`` to the precision budget."""
    path, steps = _read(name_or_path)
    load_recipe(str(path), calibration=calibration)
    found = next((step for step in steps if step.get("pass") == pass_name), None)
    if found is None:
        raise InputError(f"{path}: the recipe has no {pass_name} pass")
    return {key: value for key, value in found.items() if key not in ("pass", "calibration")}


def _read(name_or_path: str) -> tuple[Path, list[Any]]:
    """The recipe's path and its [[passes]] tables as written (each checked when built)."""
    path = find_recipe(name_or_path)
    try:
        data = read_toml(path, "recipe")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: not valid TOML ({error})") from error
    steps = data.get("passes")
    if not isinstance(steps, list) or not steps:
        raise InputError(f"{path}: a recipe needs a non-empty [[passes]] list")
    unknown_top = set(data) - {"description", "passes"}
    if unknown_top:
        raise InputError(f"{path}: unknown top-level keys {sorted(unknown_top)}; expected description and passes")
    return path, steps


def _build(path: Path, index: int, step: object, calibration: str | None = None) -> Pass:
    if not isinstance(step, dict):
        raise InputError(f"{path}: pass #{index} is {step!r}, not a table; write each pass as [[passes]] pass = NAME")
    options = dict(step)
    name = options.pop("pass", None)
    if not isinstance(name, str) or name not in PASSES:
        raise InputError(f"{path}: pass #{index} names {name!r}; known passes: {', '.join(sorted(PASSES))}")
    cls = PASSES[name]
    # A pass configured by an options dataclass (``options_type``) takes that dataclass's fields as its options.
    configured = getattr(cls, "options_type", None) or cls.__init__
    if dataclasses.is_dataclass(configured):
        allowed = [item.name for item in dataclasses.fields(configured)]
    else:
        allowed = [p for p in inspect.signature(configured).parameters if p != "self"]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise InputError(f"{path}: pass #{index} ({name}) has unknown options {unknown}; valid: {', '.join(allowed)}")
    if "calibration" in allowed:
        if calibration is not None:
            options["calibration"] = calibration
        elif "calibration" not in options:
            raise InputError(
                f"{path}: pass #{index} ({name}) needs calibration data: pass --calib DATA to nmdeploy run, or set "
                f"calibration in the recipe"
            )
    try:
        hints = typing.get_type_hints(configured)
    except (NameError, TypeError):
        hints = {}
    for key, value in options.items():
        expected = _scalar_type(hints.get(key))
        wrong_bool = isinstance(value, bool) and expected is not None and bool not in expected
        if expected is not None and (not isinstance(value, expected) or wrong_bool):
            raise InputError(f"{path}: pass #{index} ({name}) option {key} = {value!r} must be {expected[0].__name__}")
    return cls(**options)


def _scalar_type(hint: object) -> tuple[type, ...] | None:
    """The plain type an option annotated ``hint`` must have (``X | None`` counts as X), or None to leave it."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        others = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = others[0] if len(others) == 1 else None
    return _SCALAR_TYPES.get(hint)


# Options of these types are checked before the pass is built; others (patterns, lists) are checked by the pass.
_SCALAR_TYPES: dict[object, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (float, int), str: (str,)}
