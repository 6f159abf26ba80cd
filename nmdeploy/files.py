"""Atomic output: write to a temporary file beside the target, then rename it into place."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def temporary_beside(target: Path, suffix: str = ".tmp") -> Path:
    """An empty temporary file in ``target``'s folder, with the permissions a normally created file would get."""
    handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.close(handle)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(name, 0o666 & ~umask)
    return Path(name)


def write_atomically(path: Path, data: str | bytes) -> Path:
    """Write ``data`` (text or bytes) to ``path`` through a temporary file beside it, so no reader sees half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_beside(path)
    try:
        if isinstance(data, bytes):
            temporary.write_bytes(data)
        else:
            temporary.write_text(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path
