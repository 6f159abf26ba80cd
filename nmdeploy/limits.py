"""What an untrusted data or settings file may declare, checked before anything is allocated for it.

An .npy header names a shape and numpy allocates it before reading a byte, so an archive of a few hundred bytes can
ask for terabytes; a TOML parser recurses once per nesting level. Both are checked here against what the file can
really hold, so a hostile or damaged file is one clear error rather than an out-of-memory kill or a traceback. A
training config's epoch count is held to :data:`MAX_EPOCHS` for the same reason: a value no real schedule uses
would otherwise run for days.
"""

from __future__ import annotations

import math
import tokenize
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from nmdeploy.errors import InputError

_MAX_DIM = 1 << 62  # numpy sizes are int64
MAX_TOML_BYTES = 16 << 20  # recipes, training configs and baselines files are a few kilobytes
# A training config's [train] epochs: long schedules on small data sets run a few thousand; a count past this is a
# typo or a damaged file, and would keep the process busy for days before anyone noticed.
MAX_EPOCHS = 100_000
# deflate cannot expand a compressed byte into more than about 1032 bytes; the zip headers' sizes may lie.
_DEFLATE_RATIO = 1032
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
_NPZ_HINT = "give an .npz written by numpy.savez (input name -> batched array)"


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


def check_npz_archive(path: str | Path) -> None:
    """Refuse an .npz that is not a zip of numeric .npy arrays, or whose array headers declare more bytes than its
    members hold (checked from the headers alone: nothing is allocated)."""
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, ValueError, zipfile.BadZipFile):
        raise InputError(f"{path}: not an .npz file (not a zip archive, or truncated); {_NPZ_HINT}") from None
    with archive:
        for info in archive.infolist():
            _check_member(path, archive, info)


def _check_member(path: Path, archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
    where = f"{path}: member '{info.filename}'"
    if info.compress_type == zipfile.ZIP_STORED:
        limit = info.compress_size
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        limit = info.compress_size * _DEFLATE_RATIO + 1024
    else:
        raise InputError(f"{where} uses a compression numpy does not write; {_NPZ_HINT}")
    try:
        with archive.open(info) as handle:
            version = np.lib.format.read_magic(handle)
            if version not in _HEADER_READERS:
                raise ValueError(f".npy format version {version[0]}.{version[1]}")
            shape, _, dtype = _HEADER_READERS[version](handle)
            header = handle.tell()
    except (
        OSError,
        ValueError,
        EOFError,
        SyntaxError,
        tokenize.TokenError,
        TypeError,
        zipfile.BadZipFile,
        RuntimeError,
    ) as error:
        reason = str(error).splitlines()[0][:120] if str(error) else type(error).__name__
        raise InputError(f"{where} is not a readable .npy array ({reason}); {_NPZ_HINT}") from None
    if dtype.hasobject:
        raise InputError(f"{where} holds Python objects (pickled data), which nmdeploy never loads; {_NPZ_HINT}")
    if any(not isinstance(d, int) or d < 0 or d > _MAX_DIM for d in shape):
        raise InputError(f"{where} declares shape {list(shape)}, which no array has; the file is damaged")
    declared = math.prod(shape) * dtype.itemsize
    held = min(info.file_size, limit) - header
    if declared > held:
        raise InputError(
            f"{where} declares shape {list(shape)} of {dtype.name} ({declared} bytes) but holds {max(held, 0)} "
            f"bytes; the file is damaged or not what it claims"
        )
