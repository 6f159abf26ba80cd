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
