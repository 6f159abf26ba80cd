"""New values of external tensors kept on disk until the model is saved.

A pass that replaces every weight of a model larger than memory (converting a decoder block by block, pruning a
7 GB export) would otherwise hold all the new values until the save. Past a small amount held in memory, each new
value is appended once to an unnamed temporary file (the system's, which the kernel removes when the process ends,
killed or not) and read back by offset: a read makes a fresh array, a save copies the bytes file to file, so neither
maps the whole file into the process.
"""

from __future__ import annotations

import os
import tempfile
import threading
from dataclasses import dataclass

import numpy as np

# Bytes of replaced external values a model keeps in memory before writing new ones to its scratch file.
PATCH_MEMORY_LIMIT = 1 << 26


class ScratchFile:
    """An append-only unnamed temporary file, opened on the first write; copies of a model share it (nothing in it
    is ever overwritten, so a value written for one copy stays valid for every other). Passes write weights from
    several threads (prune), so each append reserves its range under a lock before writing it."""

    def __init__(self) -> None:
        self._handle = None
        self.size = 0
        self._lock = threading.Lock()
        self.lock = threading.Lock()  # the owning models' patch tables, changed from several threads

    def __deepcopy__(self, memo: dict) -> ScratchFile:
        return self

    @property
    def fd(self) -> int:
        return self._handle.fileno()

    def append(self, values: np.ndarray) -> SpilledValues:
        data = memoryview(np.ascontiguousarray(values).reshape(-1).view(np.uint8))
        with self._lock:
            if self._handle is None:
                # Closed by close(): it lives as long as the values it holds, beyond any one block.
                self._handle = tempfile.TemporaryFile(prefix="nmdeploy-weights-")  # noqa: SIM115
            offset = self.size
            self.size += len(data)
        at = offset
        while len(data):
            written = os.pwrite(self.fd, data, at)
            data, at = data[written:], at + written
        return SpilledValues(self, offset, values.dtype, tuple(values.shape))


@dataclass(frozen=True)
class SpilledValues:
    """One tensor's new values in a :class:`ScratchFile`: where they start, their dtype and shape."""

    scratch: ScratchFile
    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    def __deepcopy__(self, memo: dict) -> SpilledValues:
        return self

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def load(self) -> np.ndarray:
        """The values, read into a new array."""
        values = np.empty(self.shape, dtype=self.dtype)
        buffer, at = memoryview(values.reshape(-1).view(np.uint8)), self.offset
        while len(buffer):
            count = os.preadv(self.scratch.fd, [buffer], at)
            if not count:
                raise OSError("the scratch file of replaced weights shrank")
            buffer, at = buffer[count:], at + count
        return values
