"""What an untrusted settings file may declare, checked before it is parsed or acted on.

A TOML parser recurses once per nesting level: files are held to a size and their nesting to what Python can parse,
so a hostile or damaged file is one clear error rather than a traceback. A training config's epoch count is held to
:data:`MAX_EPOCHS` for the same reason: a value no real schedule uses would otherwise run for days. (The .npy headers
of data files are checked where data files are read, :mod:`nmdeploy.runtimes.npz`.)
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from nmdeploy.errors import InputError

MAX_TOML_BYTES = 16 << 20  # recipes, training configs and baselines files are a few kilobytes
# A training config's [train] epochs: long schedules on small data sets run a few thousand; a count past this is a
# typo or a damaged file, and would keep the process busy for days before anyone noticed.
MAX_EPOCHS = 100_000


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """``tomllib.loads`` of a file no larger than MAX_TOML_BYTES, nested no deeper than Python can parse (``what``
    names the file in errors). A missing file, undecodable text and TOML errors propagate as the callers expect."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_TOML_BYTES:
        raise InputError(f"{path}: {size} bytes, more than a {what} holds (at most {MAX_TOML_BYTES >> 20} MiB)")
    text = path.read_text()
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise InputError(f"{path}: arrays or tables nested too deeply to be a {what}; fix the file") from None
