"""One .npz archive (name -> .npy array) read as untrusted input: every header checked before anything is allocated,
then the arrays read as streams.

An .npy header names a shape and numpy allocates it before reading a byte, so an archive of a few hundred bytes can
ask for terabytes. :class:`NpzArchive` checks every member's header against what the member can really hold (a
compressed member too: deflate cannot expand a byte into more than about 1032) and refuses pickled objects, so a
hostile or damaged file is one clear error rather than an out-of-memory kill or a traceback. Its arrays are then
read by :class:`ArrayStream`, whole or some rows along the first axis at a time, so a file of any size costs what the
caller reads of it at once. Which arrays a model takes, and in which batches, is :mod:`nmdeploy.runtimes.data`'s.
"""

from __future__ import annotations

import math
import tokenize
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from nmdeploy.errors import InputError, first_line

_MAX_DIM = 1 << 62  # numpy sizes are int64
# deflate cannot expand a compressed byte into more than about 1032 bytes; the zip headers' sizes may lie.
_DEFLATE_RATIO = 1032
_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
_NPZ_HINT = "give an .npz written by numpy.savez (input name -> batched array)"
# What reading a damaged member raises: zipfile's own errors, zlib's for a broken deflate stream, the tokenizer's
# for an .npy header's dict (numpy parses it with Python's tokenizer).
_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)
_HEADER_ERRORS = (*_READ_ERRORS, SyntaxError, tokenize.TokenError, TypeError, RuntimeError)


@dataclass(frozen=True)
class ArrayHeader:
    """What an .npy header declares: the shape, whether the values are in Fortran order, the dtype."""

    shape: tuple[int, ...]
    fortran: bool
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _read_header(handle: IO[bytes], where: str) -> ArrayHeader:
    """The header at the start of ``handle`` (left at the first value), checked: a readable .npy header, numeric
    values, a shape some array can have."""
    try:
        version = np.lib.format.read_magic(handle)
        if version not in _HEADER_READERS:
            raise ValueError(f".npy format version {version[0]}.{version[1]}")
        shape, fortran, dtype = _HEADER_READERS[version](handle)
    except _HEADER_ERRORS as error:
        raise InputError(f"{where} is not a readable .npy array ({first_line(error, 120)}); {_NPZ_HINT}") from None
    if dtype.hasobject:
        raise InputError(f"{where} holds Python objects (pickled data), which nmdeploy never loads; {_NPZ_HINT}")
    if any(not isinstance(d, int) or d < 0 or d > _MAX_DIM for d in shape):
        raise InputError(f"{where} declares shape {list(shape)}, which no array has; the file is damaged")
    return ArrayHeader(tuple(shape), bool(fortran), dtype)


class NpzArchive:
    """An .npz file opened and checked: every member a numeric .npy array whose header declares no more bytes than
    the member holds (read from the headers alone: nothing is allocated). ``arrays`` maps each array's name (the
    member's, less ``.npy``) to its member; :meth:`open` streams one. A context manager: leaving it closes the file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (OSError, ValueError, zipfile.BadZipFile):
            raise InputError(f"{self.path}: not an .npz file (not a zip archive, or truncated); {_NPZ_HINT}") from None
        try:
            for info in self._zip.infolist():
                self._check(info)
        except BaseException:
            self._zip.close()
            raise
        self.arrays = {name.removesuffix(".npy"): name for name in self._zip.namelist()}

    def _check(self, info: zipfile.ZipInfo) -> None:
        where = f"{self.path}: member '{info.filename}'"
        if info.compress_type == zipfile.ZIP_STORED:
            limit = info.compress_size
        elif info.compress_type == zipfile.ZIP_DEFLATED:
            limit = info.compress_size * _DEFLATE_RATIO + 1024
        else:
            raise InputError(f"{where} uses a compression numpy does not write; {_NPZ_HINT}")
        with self._open(info, where) as handle:
            header = _read_header(handle, where)
            start = handle.tell()
        held = min(info.file_size, limit) - start
        if header.nbytes > held:
            raise InputError(
                f"{where} declares shape {list(header.shape)} of {header.dtype.name} ({header.nbytes} bytes) but "
                f"holds {max(held, 0)} bytes; the file is damaged or not what it claims"
            )

    def open(self, name: str) -> ArrayStream:
        """The array ``name`` (a key of ``arrays``) as a stream, its header read."""
        member = self.arrays[name]
        where = f"{self.path}: member '{member}'"
        handle = self._open(self._zip.getinfo(member), where)
        try:
            return ArrayStream(handle, _read_header(handle, where), where)
        except BaseException:
            handle.close()
            raise

    def _open(self, info: zipfile.ZipInfo, where: str) -> IO[bytes]:
        try:
            return self._zip.open(info)
        except _READ_ERRORS as error:  # the zip entry itself is damaged
            raise InputError(f"{where} is not a readable .npy array ({first_line(error, 120)}); {_NPZ_HINT}") from None

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> NpzArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ArrayStream:
    """One array of an archive, read in order: whole, or ``count`` rows along its first axis at a time."""

    def __init__(self, handle: IO[bytes], header: ArrayHeader, where: str):
        self.handle, self.header, self.where = handle, header, where
        self.shape, self.fortran, self.dtype = header.shape, header.fortran, header.dtype
        self.length = self.shape[0] if self.shape else 0
        self.row_items = int(np.prod(self.shape[1:], dtype=np.int64)) if self.shape else 1

    def read_rows(self, count: int) -> np.ndarray:
        """The next ``count`` rows (C order only: a Fortran-ordered array is read whole)."""
        return self._read(count * self.row_items).reshape((count, *self.shape[1:]))

    def read_all(self) -> np.ndarray:
        values = self._read(int(np.prod(self.shape, dtype=np.int64)))
        return values.reshape(self.shape, order="F" if self.fortran else "C")

    def _read(self, items: int) -> np.ndarray:
        values = np.empty(items, dtype=self.dtype)
        buffer = memoryview(values.view(np.uint8))
        filled = 0
        while filled < len(buffer):
            try:
                count = self.handle.readinto(buffer[filled:])
            except _READ_ERRORS as error:  # a bad CRC, a broken deflate stream
                raise InputError(
                    f"{self.where} cannot be read ({first_line(error, 120)}); the file is damaged"
                ) from None
            if not count:
                raise InputError(f"{self.where}: the array ends early; the file is truncated")
            filled += count
        return values

    def close(self) -> None:
        self.handle.close()
