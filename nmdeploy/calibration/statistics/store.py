"""Arrays kept between calibration runs, in memory (or on the statistics' device) up to a limit and on disk past it.

Segment-by-segment calibration keeps, for every batch, the values that cross the current cut (residual streams,
attention masks, shapes) and the dense values of converted weights. Past ``memory_limit`` bytes held in memory, new
arrays are written to .npy files in a private temporary folder and read back as read-only memory maps; every file
is deleted as soon as its array is dropped, and the folder when the store closes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable
from pathlib import Path

import numpy as np

from nmdeploy.files import private_temporary_folder


class SpillStore:
    """Key -> array, with at most ``memory_limit`` bytes in memory; the rest is spilled to disk."""

    def __init__(self, memory_limit: int):
        self.memory_limit = max(0, int(memory_limit))
        self._arrays: dict[Hashable, np.ndarray] = {}
        self._files: dict[Hashable, Path] = {}
        self._folder: Path | None = None
        # Owns the spill folder: removed on close, or by the next run if this process is killed.
        self._cleanup = contextlib.ExitStack()
        self._counter = 0
        self.in_memory = 0
        self.peak_in_memory = 0
        self.spilled_bytes = 0  # written to disk over the store's life
        self.spilled_arrays = 0

    def __enter__(self) -> SpillStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._arrays

    def put(self, key: Hashable, array: np.ndarray) -> None:
        """Keep ``array`` (a numpy array, or a torch tensor on any device: kept there while within the limit, else
        copied to the host and spilled like an array)."""
        self.drop(key)
        if type(array).__module__.startswith("torch"):
            if self.in_memory + array.nbytes <= self.memory_limit or array.nbytes == 0:
                self._keep(key, array)
                return
            array = array.detach().cpu().numpy()
        array = np.asarray(array)
        if array.dtype.hasobject:
            raise TypeError(f"cannot keep an object array for {key!r}")
        if self.in_memory + array.nbytes <= self.memory_limit or array.nbytes == 0:
            self._keep(key, array)
            return
        if self._folder is None:
            self._folder = self._cleanup.enter_context(private_temporary_folder("calibration"))
        self._counter += 1
        path = self._folder / f"{self._counter}.npy"
        spilled = np.lib.format.open_memmap(path, mode="w+", dtype=array.dtype, shape=array.shape)
        spilled[...] = array
        spilled.flush()
        del spilled
        self._files[key] = path
        self._arrays[key] = np.load(path, mmap_mode="r")
        self.spilled_bytes += array.nbytes
        self.spilled_arrays += 1

    def _keep(self, key: Hashable, array) -> None:
        self._arrays[key] = array
        self.in_memory += array.nbytes
        self.peak_in_memory = max(self.peak_in_memory, self.in_memory)

    def get(self, key: Hashable) -> np.ndarray:
        return self._arrays[key]

    def drop(self, key: Hashable) -> None:
        array = self._arrays.pop(key, None)
        if array is None:
            return
        path = self._files.pop(key, None)
        if path is None:
            self.in_memory -= array.nbytes
        else:
            del array
            path.unlink(missing_ok=True)

    def keys(self) -> list[Hashable]:
        return list(self._arrays)

    @property
    def spilled(self) -> bool:
        return self.spilled_arrays > 0

    def close(self) -> None:
        self._arrays.clear()
        self._files.clear()
        self.in_memory = 0
        self._cleanup.close()
        self._folder = None
