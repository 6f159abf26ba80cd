"""Input shapes on the command line, in trtexec's syntax: ``NAME:DIMS[,NAME:DIMS...]`` with DIMS such as 1x3x224x224.

One parser for every verb: ``bench --shapes input_ids:Bx128`` (``B`` stands for each batch size), ``build --shapes``
for a fixed profile, and ``build --min-shapes/--opt-shapes/--max-shapes`` for a dynamic one, as trtexec's
``--minShapes/--optShapes/--maxShapes``. Input names may hold colons; the last one separates the dimensions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from nmdeploy.errors import InputError

BATCH_DIM = "B"
Dims = tuple[int | str, ...]  # an int per dimension, or BATCH_DIM
Shape = tuple[int, ...]
ShapeRange = tuple[Shape, Shape, Shape]  # min, opt, max

_DIMS = re.compile(r"\d+(x\d+)*")
_DIMS_WITH_BATCH = re.compile(rf"(\d+|{BATCH_DIM})(x(\d+|{BATCH_DIM}))*")


def parse_dims(text: str, *, where: str, batch: bool = False) -> Dims:
    """``"Bx128"`` -> ("B", 128); ``B`` only where ``batch`` allows it. ``where`` names the source in errors."""
    pattern, example = (_DIMS_WITH_BATCH, "Bx128 (B: each batch size)") if batch else (_DIMS, "1x3x224x224")
    if not pattern.fullmatch(text.strip()):
        raise InputError(f"{where}: dimensions must be integers joined by x, such as {example}")
    return tuple(BATCH_DIM if d == BATCH_DIM else int(d) for d in text.strip().split("x"))


def parse_shapes(text: str, *, flag: str = "--shapes", batch: bool = False) -> dict[str, Dims]:
    """``"input_ids:Bx128,attention_mask:Bx128"`` -> {name: dims}; every input named once."""
    shapes: dict[str, Dims] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, dims = item.rpartition(":")
        if not name:
            example = "input_ids:Bx128" if batch else "input:1x3x224x224"
            raise InputError(f"{flag} {item!r}: expected NAME:DIMS such as {example}, comma-separated")
        if name in shapes:
            raise InputError(f"{flag}: input {name!r} is given twice")
        shapes[name] = parse_dims(dims, where=f"{flag} {item!r}", batch=batch)
    if not shapes:
        raise InputError(f"{flag} {text!r}: expected NAME:DIMS, comma-separated")
    return shapes


def shape_ranges(
    fixed: Mapping[str, Dims] | None = None,
    low: Mapping[str, Dims] | None = None,
    opt: Mapping[str, Dims] | None = None,
    high: Mapping[str, Dims] | None = None,
) -> dict[str, ShapeRange]:
    """One optimisation profile from fixed shapes and/or min/opt/max shapes, checked for rank and MIN <= OPT <= MAX.

    An input given in ``fixed`` has min = opt = max; otherwise it needs all three of min, opt and max.
    """
    fixed, low, opt, high = dict(fixed or {}), dict(low or {}), dict(opt or {}), dict(high or {})
    ranges: dict[str, ShapeRange] = {}
    for name in [*fixed, *(n for n in [*low, *opt, *high] if n not in fixed)]:
        if name in ranges:
            continue
        if name in fixed:
            if name in low or name in opt or name in high:
                raise InputError(f"input {name!r} has a fixed --shapes and --min/--opt/--max-shapes; give one")
            bounds = (fixed[name],) * 3
        else:
            given = (("--min-shapes", low), ("--opt-shapes", opt), ("--max-shapes", high))
            missing = [flag for flag, shapes in given if name not in shapes]
            if missing:
                raise InputError(f"input {name!r} needs {', '.join(missing)} too (or one fixed --shapes)")
            bounds = (low[name], opt[name], high[name])
        if len({len(b) for b in bounds}) != 1:
            raise InputError(f"input {name!r}: min, opt and max shapes need the same rank")
        if not all(a <= b <= c for a, b, c in zip(*bounds, strict=True)):
            raise InputError(f"input {name!r}: every dimension needs MIN <= OPT <= MAX")
        ranges[name] = tuple(tuple(int(d) for d in b) for b in bounds)  # type: ignore[assignment]
    return ranges


def format_dims(dims: Dims) -> str:
    return "x".join(str(d) for d in dims)
