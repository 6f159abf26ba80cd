"""Loading and saving ONNX models with full fidelity.

A model is loaded without pulling external tensor data into memory. Tensor values are read on demand and
replaced tensor by tensor; saving writes the original protobuf with only those values changed, in the storage
field each tensor already used. External data files are written in one sequential pass: unchanged ranges are
copied by the kernel (copy_file_range), replaced tensors are written from memory at their offsets (pruning never
changes a tensor's byte size), so models over 2 GB keep their layout and are written at I/O speed. Every new file is
written under a temporary name first and all of them are switched in one commit (nmdeploy.files.commit).

A model file is untrusted input: loading checks every external-data location (a regular file inside the model's
folder, symlinks resolved), offset, length and dims, and refuses cycles, before anything is read
(nmdeploy.graph.model_checks).
"""

from __future__ import annotations

import copy
import errno
import mmap
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from nmdeploy.errors import InputError
from nmdeploy.files import (
    OpenFile,
    check_input_file,
    check_output_path,
    clean_folder,
    commit,
    folder_lock,
    kill_point,
    temporary_beside,
)
from nmdeploy.graph.attributes import model_tensors
from nmdeploy.graph.dtypes import ARITHMETIC_FLOAT_TYPES
from nmdeploy.graph.index import GraphIndex
from nmdeploy.graph.model_checks import (
    TYPED_FIELDS,
    check_declared_shapes,
    check_proto,
    check_stored_tensors,
    external_info,
    resolve_data_location,
)
from nmdeploy.graph.order import GraphCycleError
from nmdeploy.graph.scratch import PATCH_MEMORY_LIMIT, ScratchFile, SpilledValues

_EXTERNAL = onnx.TensorProto.EXTERNAL
# copy_file_range fails with these where the kernel or filesystem cannot do it; a buffered copy is used then.
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}
# Elements widened to float64 at a time by check_finite: 8 MB of working copy, whatever the tensor's size (a decoder's
# 151936 x 896 lm_head read whole is 545 MB; widened whole, with its absolute values, it cost 2.2 GB more).
FINITE_CHECK_PIECE = 1 << 20
READ_PIECE = 1 << 24  # values per piece of read_pieces: 64 MB of float32


@dataclass
class OnnxModel:
    """An ONNX model as stored on disk: its protobuf (external data left on disk) and the folder it came from."""

    proto: onnx.ModelProto
    base_dir: Path
    path: Path | None = None
    # New values of external tensors, by data file and byte offset (in memory, or past PATCH_MEMORY_LIMIT in the
    # scratch file); written out by save().
    _external_patches: dict[str, dict[int, np.ndarray | SpilledValues]] = field(default_factory=dict)
    # Checked external data locations and the files they resolve to.
    _data_files: dict[str, Path] = field(default_factory=dict)
    # The data files opened at load, read through these descriptors: a commit renaming new files over them later
    # leaves this model reading the version it loaded, never a mix.
    _handles: dict[str, OpenFile] = field(default_factory=dict, repr=False, compare=False)
    _index: GraphIndex | None = field(default=None, repr=False, compare=False)
    _scratch: ScratchFile = field(default_factory=ScratchFile, repr=False, compare=False)

    @classmethod
    def load(cls, path: str | Path) -> OnnxModel:
        """Read ``path``; a missing, truncated, cyclic or non-ONNX file, or external data that is missing, escapes the
        model's folder or does not fit its tensors, is an InputError."""
        path = Path(path)
        # A write killed after its commit point is finished first, so this load sees one whole version.
        clean_folder(path.parent)
        check_input_file(path, "an ONNX model")
        # A shared lock on the folder while the model file is read and its data files are opened: a commit (which
        # takes it exclusively) happens wholly before or wholly after, so the version loaded is one version.
        with folder_lock(path.parent, shared=True):
            return cls._load(path)

    @classmethod
    def _load(cls, path: Path) -> OnnxModel:
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as error:  # protobuf raises DecodeError, RuntimeError or ValueError depending on the damage
            if "MaxDepth" in str(error):
                raise InputError(
                    f"{path}: graphs nested deeper than protobuf reads (100 message levels, about 30 nested "
                    f"subgraphs); no exporter writes such a model, so the file is damaged or hostile"
                ) from None
            raise InputError(
                f"{path}: not a readable ONNX model ({type(error).__name__}); is the file truncated?"
            ) from error
        if not proto.graph.node and not proto.graph.input and not proto.graph.output:
            raise InputError(f"{path}: not an ONNX model (no graph); check that the file is a .onnx export")
        check_proto(proto, path)
        model = cls(proto, path.parent.resolve(), path.resolve())
        try:  # the index is built here once for the passes that follow; a cycle is refused before any work
            model.index.topological_order()
        except GraphCycleError as error:
            raise GraphCycleError(f"{path}: {error}") from None
        check_stored_tensors(model.tensors(), model.path, model._data_file_size)
        check_declared_shapes(model.proto, model.index, model.path)
        for folder in {file.parent for file in model.input_files()} - {model.base_dir}:
            clean_folder(folder)
        return model

    def _data_file(self, tensor_name: str, location: str) -> Path:
        """The resolved path of an external data location, opened for reading, or an InputError when it points
        outside the folder or cannot be read."""
        if location in self._data_files:
            return self._data_files[location]
        resolved = resolve_data_location(self.base_dir, self.path, tensor_name, location)
        try:
            self._handles[location] = OpenFile(resolved)
        except OSError as error:
            raise InputError(
                f"tensor '{tensor_name}' has external data location '{location}', which cannot be read "
                f"({error.strerror})"
            ) from None
        self._data_files[location] = resolved
        return resolved

    def _data_file_size(self, tensor_name: str, location: str) -> int:
        """The size of an external data file as it was opened at load."""
        self._data_file(tensor_name, location)
        return os.fstat(self._handles[location].fd).st_size

    def input_files(self) -> list[Path]:
        """Every file this model was read from: the model file and its external data files."""
        return [p for p in [self.path, *self._data_files.values()] if p is not None]

    def __deepcopy__(self, memo: dict) -> OnnxModel:
        # The graph index keys nodes by object identity; a copy's nodes are new objects, so it builds its own index.
        return OnnxModel(
            copy.deepcopy(self.proto, memo),
            self.base_dir,
            self.path,
            copy.deepcopy(self._external_patches, memo),
            dict(self._data_files),
            dict(self._handles),
            _scratch=self._scratch,
        )

    @property
    def index(self) -> GraphIndex:
        """The graph index of this model, built on first use; structural edits go through it and keep it current."""
        if self._index is None or self._index.model is not self.proto:
            self._index = GraphIndex(self.proto)
        return self._index

    def tensors(self):
        """Every stored tensor: initializers and node attribute values, in all graphs and functions."""
        return model_tensors(self.proto)

    def read(self, tensor: onnx.TensorProto) -> np.ndarray:
        """The tensor's values (bf16 and fp8 come back as ml_dtypes arrays).

        A writable result is the caller's own copy; values the model keeps (a replaced external tensor) come back
        read-only, so changing a result in place never changes the model.
        """
        if tensor.data_location == _EXTERNAL:
            info = external_info(tensor)
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).newbyteorder("<")
            patched = self._external_patches.get(info["location"], {}).get(int(info.get("offset", 0)))
            if isinstance(patched, SpilledValues):
                patched = patched.load()
            if patched is not None:
                view = patched.view(dtype).reshape(tuple(tensor.dims))
                view.flags.writeable = False
                return view
            count = int(np.prod(tensor.dims, dtype=np.int64))
            self._data_file(tensor.name, info["location"])
            values = np.empty(count, dtype=dtype)
            # One read straight into the array's own memory, from the file as it was loaded.
            _read_into(
                self._handles[info["location"]].fd, memoryview(values.view(np.uint8)), int(info.get("offset", 0))
            )
            return values.reshape(tuple(tensor.dims))
        return numpy_helper.to_array(tensor)

    def read_pieces(self, tensor: onnx.TensorProto, elements: int = READ_PIECE) -> Iterator[np.ndarray]:
        """The tensor's values in pieces of whole rows along its first axis, about ``elements`` values each, every
        piece read on its own from an external tensor the model has not replaced (others: one piece, :meth:`read`),
        so that a caller reducing a vocabulary-sized weight piece by piece never holds all of it."""
        dims = tuple(tensor.dims)
        if tensor.data_location != _EXTERNAL or self.is_modified(tensor) or not dims or not dims[0]:
            yield self.read(tensor)
            return
        info = external_info(tensor)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).newbyteorder("<")
        self._data_file(tensor.name, info["location"])
        fd, offset = self._handles[info["location"]].fd, int(info.get("offset", 0))
        row = int(np.prod(dims[1:], dtype=np.int64))
        step = max(1, elements // max(1, row))
        for start in range(0, dims[0], step):
            rows = min(step, dims[0] - start)
            values = np.empty(rows * row, dtype=dtype)
            _read_into(fd, memoryview(values.view(np.uint8)), offset + start * row * dtype.itemsize)
            yield values.reshape((rows, *dims[1:]))

    def mapped(self, tensor: onnx.TensorProto) -> np.ndarray:
        """The tensor's values, read-only; an external tensor the model has not replaced is mapped from its data file
        (as it was loaded) rather than read, so only the pages a consumer touches become resident (with the page
        cache's folios around them, up to 2 MB each on Linux 6.x): a Gather of a few tokens' rows of a 545 MB token
        embedding does not read the table, and pages of a mapped weight are the page cache's, which the kernel can take
        back. Other tensors come from :meth:`read`.

        A data file truncated by another process while a mapping is used ends the process with SIGBUS rather than an
        error (load checked every tensor against the file's size).
        """
        if tensor.data_location != _EXTERNAL or self.is_modified(tensor):
            values = self.read(tensor)
            values.flags.writeable = False
            return values
        info = external_info(tensor)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).newbyteorder("<")
        count = int(np.prod(tensor.dims, dtype=np.int64))
        if count == 0:
            return self.read(tensor)
        self._data_file(tensor.name, info["location"])
        offset = int(info.get("offset", 0))
        start = offset - offset % mmap.ALLOCATIONGRANULARITY  # mappings begin on a granule
        mapping = mmap.mmap(
            self._handles[info["location"]].fd,
            offset - start + count * dtype.itemsize,
            flags=mmap.MAP_SHARED,
            prot=mmap.PROT_READ,
            offset=start,
        )
        mapping.madvise(mmap.MADV_RANDOM)
        # The array keeps the mapping open; it is unmapped when the last array over it is gone.
        return np.frombuffer(mapping, dtype=dtype, count=count, offset=offset - start).reshape(tuple(tensor.dims))

    def check_finite(self, tensors, *, allow_infinite: bool = False) -> None:
        """Refuse float tensors holding NaN or infinity: no pass can rank, fit or cast them meaningfully, and the
        outputs would compare as NaN. ``allow_infinite`` accepts infinities (attention-mask constants hold -inf on
        purpose) and refuses NaN only. Reads one tensor at a time and widens it a piece at a time."""
        for tensor in tensors:
            if tensor.data_type not in ARITHMETIC_FLOAT_TYPES:
                continue
            if _holds_bad_values(self.read(tensor).reshape(-1), allow_infinite):
                what = "NaN" if allow_infinite else "NaN or infinite values"
                name = tensor.name or "(an unnamed constant)"
                raise InputError(f"weight '{name}' contains {what}; fix the model first")

    def is_modified(self, tensor: onnx.TensorProto) -> bool:
        """Whether an external tensor's values were replaced in memory (its data file still holds the old ones)."""
        if tensor.data_location != _EXTERNAL:
            return False
        info = external_info(tensor)
        return int(info.get("offset", 0)) in self._external_patches.get(info["location"], {})

    def write(self, tensor: onnx.TensorProto, values: np.ndarray, *, copy: bool = True) -> None:
        """Replace the tensor's values (same shape and dtype), keeping the storage field it already uses.

        ``copy=False`` hands ``values`` over to the model instead of copying it (no copy for external tensors);
        the caller must not change the array afterwards.
        """
        given = values
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
        values = np.ascontiguousarray(values, dtype=dtype)
        if tuple(values.shape) != tuple(tensor.dims):
            raise ValueError(f"new values for '{tensor.name}' have shape {values.shape}, expected {tuple(tensor.dims)}")
        stored = values.astype(values.dtype.newbyteorder("<"), copy=False)
        if tensor.data_location == _EXTERNAL:
            info = external_info(tensor)
            patches = self._external_patches.setdefault(info["location"], {})
            offset = int(info.get("offset", 0))
            with self._scratch.lock:  # passes write from several threads (prune)
                patches.pop(offset, None)
                spill = self._patches_in_memory() + stored.nbytes > PATCH_MEMORY_LIMIT
                if not spill:
                    patches[offset] = stored if not (copy and np.may_share_memory(stored, given)) else stored.copy()
            if spill:
                # A model larger than memory never holds all its new weights: these wait on disk for the save.
                spilled = self._scratch.append(stored)
                with self._scratch.lock:
                    patches[offset] = spilled
        elif tensor.HasField("raw_data") or not _typed_field(tensor):
            tensor.raw_data = stored.tobytes()
        else:
            typed = onnx.helper.make_tensor(tensor.name, tensor.data_type, tensor.dims, values.reshape(-1).tolist())
            field_name = _typed_field(tensor)
            getattr(tensor, field_name)[:] = getattr(typed, field_name)

    def _patches_in_memory(self) -> int:
        return sum(
            values.nbytes
            for patches in self._external_patches.values()
            for values in patches.values()
            if isinstance(values, np.ndarray)
        )

    def write_as(self, tensor: onnx.TensorProto, values: np.ndarray, data_type: int) -> None:
        """Replace the tensor's values with ``values`` of element type ``data_type`` (same shape), stored inline:
        its external slot, if any, holds bytes of the old type and size, so it is let go."""
        # ascontiguousarray alone would make a 0-d array 1-d
        array = np.ascontiguousarray(values, dtype=onnx.helper.tensor_dtype_to_np_dtype(data_type)).reshape(
            np.shape(values)
        )
        if tuple(array.shape) != tuple(tensor.dims):
            raise ValueError(f"new values for '{tensor.name}' have shape {array.shape}, expected {tuple(tensor.dims)}")
        if tensor.data_location == _EXTERNAL:
            info = external_info(tensor)
            self._external_patches.get(info["location"], {}).pop(int(info.get("offset", 0)), None)
        for name in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "external_data"):
            tensor.ClearField(name)
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.data_type = data_type
        tensor.raw_data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()

    def save(self, path: str | Path) -> Path:
        """Write the model (and patched copies of its external data files) to ``path`` with one commit point.

        Every new file is written under a temporary name first; :func:`nmdeploy.files.commit` then switches them all
        in one step, so a kill at any moment leaves the old version or the new one once the next nmdeploy command has
        touched the folder. Files keep the modes of the files they replace (or come from).
        """
        path = Path(path).resolve()
        self.check_save_target(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise InputError(f"cannot create folder {path.parent} for {path} ({error.strerror})") from error
        renames = self._external_locations_for(path)
        proto = self.proto
        if renames:
            # Only the copy is renamed; the model in memory keeps pointing at its own files.
            proto = onnx.ModelProto()
            proto.CopyFrom(self.proto)
            for tensor in model_tensors(proto):
                for entry in tensor.external_data:
                    if entry.key == "location" and entry.value in renames:
                        entry.value = renames[entry.value]
        staged: list[tuple[Path, Path]] = []
        try:
            for old in sorted(self._referenced_locations()):
                final = path.parent / renames.get(old, old)
                staged.append((self._stage_data_file(old, final), final))
            model_mode = _mode_of(path, self.path)
            model_tmp = temporary_beside(path, mode=model_mode)
            staged.append((model_tmp, path))
            with open(model_tmp, "wb") as handle:
                handle.write(proto.SerializeToString())
            kill_point("staged")
            commit(path.parent, staged)
        except BaseException as error:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)
            if isinstance(error, OSError) and not isinstance(error, InputError):
                raise InputError(f"cannot write {path} ({error.strerror or error}); nothing was changed") from error
            raise
        return path

    def check_save_target(self, path: str | Path) -> None:
        """Refuse, before anything is written, a save whose output or derived data-file names would land on a file
        this model is read from (unless it is the in-place save of the model itself), or that cannot be written."""
        path = Path(path).resolve()
        inputs = self.input_files()
        if self.path is not None and path == self.path:
            check_output_path(path)
            return
        check_output_path(path, inputs=inputs)
        for name in self._external_locations_for(path).values():
            check_output_path(path.parent / name, inputs=inputs)

    def _referenced_locations(self) -> set[str]:
        return {external_info(t)["location"] for t in self.tensors() if t.data_location == _EXTERNAL}

    def _external_locations_for(self, path: Path) -> dict[str, str]:
        """New names for the external data files: derived from the output, so a save never overwrites another
        model's data; an in-place save keeps the names it has."""
        if self.path is not None and path == self.path:
            return {}
        locations = sorted(self._referenced_locations())
        return {old: f"{path.name}.data" if k == 0 else f"{path.name}.{k}.data" for k, old in enumerate(locations)}

    def _stage_data_file(self, location: str, final: Path) -> Path:
        """A temporary copy of an external data file, beside ``final``, with the replaced tensors written in, in one
        sequential pass."""
        source = self._data_file("", location)
        tmp = temporary_beside(final, mode=_mode_of(final, source))
        src = self._handles[location].fd  # the version loaded, even if another commit has replaced the file since
        with open(tmp, "wb", buffering=0) as dst:
            position = 0
            for offset, values in sorted(self._external_patches.get(location, {}).items()):
                if offset < position:  # tensors sharing bytes: write this one over the previous one
                    dst.seek(offset)
                else:
                    _copy_range(src, dst.fileno(), position, offset - position)
                if isinstance(values, SpilledValues):
                    _copy_range(values.scratch.fd, dst.fileno(), values.offset, values.nbytes)
                    position = max(position, offset + values.nbytes)
                    continue
                data = memoryview(values.reshape(-1).view(np.uint8))  # bytes, whatever the dtype (ml_dtypes too)
                _write_all(dst.fileno(), data)
                position = max(position, offset + len(data))
            dst.seek(position)
            _copy_range(src, dst.fileno(), position, os.fstat(src).st_size - position)
        return tmp


def _mode_of(target: Path, source: Path | None) -> int | None:
    """The mode a new version of ``target`` gets: the mode it has, else the mode of the file it is made from (a
    private input stays private in its outputs)."""
    for candidate in (target, source):
        try:
            return stat.S_IMODE(candidate.stat().st_mode) if candidate is not None else None
        except OSError:
            continue
    return None


def _copy_range(source: int, target: int, offset: int, length: int) -> None:
    """Append ``length`` bytes of ``source`` from ``offset`` to ``target`` (at its current position), in the kernel
    where it can (copy_file_range shares blocks on filesystems that support it), else through a buffer."""
    end = offset + length
    try:
        while offset < end:
            copied = os.copy_file_range(source, target, end - offset, offset)
            if copied == 0:
                raise InputError("an external data file shrank while it was being copied")
            offset += copied
        return
    except (AttributeError, OSError) as error:
        if isinstance(error, OSError) and error.errno not in _NO_COPY_FILE_RANGE:
            raise
    while offset < end:
        chunk = os.pread(source, min(end - offset, 1 << 24), offset)
        if not chunk:
            raise InputError("an external data file shrank while it was being copied")
        _write_all(target, memoryview(chunk))
        offset += len(chunk)


def _read_into(source: int, buffer: memoryview, offset: int) -> None:
    while len(buffer):
        count = os.preadv(source, [buffer], offset)
        if not count:
            raise InputError("an external data file shrank while it was being read")
        buffer, offset = buffer[count:], offset + count


def _write_all(target: int, data: memoryview) -> None:
    while len(data):
        written = os.write(target, data)
        data = data[written:]


def _typed_field(tensor: onnx.TensorProto) -> str | None:
    for name in TYPED_FIELDS:
        if len(getattr(tensor, name)):
            return name
    return None


def _holds_bad_values(values: np.ndarray, allow_infinite: bool) -> bool:
    """Whether the flat ``values`` hold NaN (``allow_infinite``) or NaN or infinities, widened to float64 one
    FINITE_CHECK_PIECE at a time (bf16 and fp8 arrays have no isnan of their own)."""
    total = 0.0
    for start in range(0, values.size, FINITE_CHECK_PIECE):
        piece = values[start : start + FINITE_CHECK_PIECE].astype(np.float64)
        if allow_infinite:
            if np.isnan(piece).any():
                return True
        else:
            with np.errstate(over="ignore"):  # an overflowing sum is a finding, not a warning
                total += float(np.abs(piece, out=piece).sum())
    # Without infinities allowed, a sum is finite only when every element is (an overflow is refused too).
    return not allow_infinite and not np.isfinite(total)
