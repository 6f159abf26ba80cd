"""Loading and saving ONNX models with full fidelity.

A model is loaded without pulling external tensor data into memory. Tensor values are read on demand and
replaced tensor by tensor; saving writes the original protobuf with only those values changed, in the storage
field each tensor already used. External data files are written in one sequential pass: unchanged ranges are
copied by the kernel (copy_file_range), replaced tensors are written from memory at their offsets (pruning never
changes a tensor's byte size), so models over 2 GB keep their layout and are written at I/O speed. Every output is
written to a temporary file first and renamed into place.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from nmdeploy.errors import InputError
from nmdeploy.files import temporary_beside
from nmdeploy.graph.index import GraphIndex, model_tensors

_EXTERNAL = onnx.TensorProto.EXTERNAL
# copy_file_range fails with these where the kernel or filesystem cannot do it; a buffered copy is used then.
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


@dataclass
class OnnxModel:
    """An ONNX model as stored on disk: its protobuf (external data left on disk) and the folder it came from."""

    proto: onnx.ModelProto
    base_dir: Path
    path: Path | None = None
    # New values of external tensors, by data file and byte offset; written out by save().
    _external_patches: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    _index: GraphIndex | None = field(default=None, repr=False, compare=False)

    @classmethod
    def load(cls, path: str | Path) -> OnnxModel:
        """Read ``path``; a missing, truncated or non-ONNX file, or missing external data, is an InputError."""
        path = Path(path)
        if not path.is_file():
            raise InputError(f"{path}: no such file")
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as error:  # protobuf raises DecodeError, RuntimeError or ValueError depending on the damage
            raise InputError(
                f"{path}: not a readable ONNX model ({type(error).__name__}); is the file truncated?"
            ) from error
        if not proto.graph.node and not proto.graph.input and not proto.graph.output:
            raise InputError(f"{path}: not an ONNX model (no graph); check that the file is a .onnx export")
        model = cls(proto, path.parent.resolve(), path.resolve())
        model._check_external_data()
        return model

    def _check_external_data(self) -> None:
        for tensor in self.tensors():
            if tensor.data_location != _EXTERNAL:
                continue
            info = _external_info(tensor)
            location = self.base_dir / info.get("location", "")
            if not location.is_file():
                raise InputError(
                    f"external data file '{info.get('location')}' of tensor '{tensor.name}' is missing; "
                    f"keep it next to the model (looked in {self.base_dir})"
                )
            end = int(info.get("offset", 0)) + int(info.get("length", 0))
            if end > location.stat().st_size:
                raise InputError(
                    f"external data file '{info['location']}' is shorter than tensor '{tensor.name}' "
                    f"needs ({end} bytes); it is truncated"
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
            info = _external_info(tensor)
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).newbyteorder("<")
            patched = self._external_patches.get(info["location"], {}).get(int(info.get("offset", 0)))
            if patched is not None:
                view = patched.view(dtype).reshape(tuple(tensor.dims))
                view.flags.writeable = False
                return view
            count = int(np.prod(tensor.dims, dtype=np.int64))
            # One read straight into the array's own memory: no intermediate bytes object.
            values = np.fromfile(
                self.base_dir / info["location"], dtype=dtype, count=count, offset=int(info.get("offset", 0))
            )
            return values.reshape(tuple(tensor.dims))
        return numpy_helper.to_array(tensor)

    def is_modified(self, tensor: onnx.TensorProto) -> bool:
        """Whether an external tensor's values were replaced in memory (its data file still holds the old ones)."""
        if tensor.data_location != _EXTERNAL:
            return False
        info = _external_info(tensor)
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
            info = _external_info(tensor)
            if copy and np.may_share_memory(stored, given):
                stored = stored.copy()
            self._external_patches.setdefault(info["location"], {})[int(info.get("offset", 0))] = stored
        elif tensor.HasField("raw_data") or not _typed_field(tensor):
            tensor.raw_data = stored.tobytes()
        else:
            typed = onnx.helper.make_tensor(tensor.name, tensor.data_type, tensor.dims, values.reshape(-1).tolist())
            field_name = _typed_field(tensor)
            getattr(tensor, field_name)[:] = getattr(typed, field_name)

    def write_as(self, tensor: onnx.TensorProto, values: np.ndarray, data_type: int) -> None:
        """Replace the tensor's values with ``values`` of element type ``data_type`` (same shape), stored inline:
        its external slot, if any, holds bytes of the old type and size, so it is let go."""
        array = np.ascontiguousarray(values, dtype=onnx.helper.tensor_dtype_to_np_dtype(data_type))
        if tuple(array.shape) != tuple(tensor.dims):
            raise ValueError(f"new values for '{tensor.name}' have shape {array.shape}, expected {tuple(tensor.dims)}")
        if tensor.data_location == _EXTERNAL:
            info = _external_info(tensor)
            self._external_patches.get(info["location"], {}).pop(int(info.get("offset", 0)), None)
        for name in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "external_data"):
            tensor.ClearField(name)
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.data_type = data_type
        tensor.raw_data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()

    def save(self, path: str | Path) -> Path:
        """Write the model (and patched copies of its external data files) to ``path``, atomically."""
        path = Path(path).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
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
            for old, new in renames.items():
                staged.append((self._stage_data_file(old, path.parent), path.parent / new))
            for old in self._referenced_locations() - set(renames):
                staged.append((self._stage_data_file(old, path.parent), path.parent / old))  # in place
            model_tmp = temporary_beside(path)
            with open(model_tmp, "wb") as handle:
                handle.write(proto.SerializeToString())
            staged.append((model_tmp, path))
            # Data files first, the model last: an interrupted save never leaves a model pointing at partial data.
            for tmp, final in staged:
                os.replace(tmp, final)
        except BaseException:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)
            raise
        return path

    def _referenced_locations(self) -> set[str]:
        return {_external_info(t)["location"] for t in self.tensors() if t.data_location == _EXTERNAL}

    def _external_locations_for(self, path: Path) -> dict[str, str]:
        """New names for the external data files: derived from the output, so a save never overwrites another
        model's data; an in-place save keeps the names it has."""
        if self.path is not None and path == self.path:
            return {}
        locations = sorted(self._referenced_locations())
        return {old: f"{path.name}.data" if k == 0 else f"{path.name}.{k}.data" for k, old in enumerate(locations)}

    def _stage_data_file(self, location: str, folder: Path) -> Path:
        """A temporary copy of an external data file with the replaced tensors written in, in one sequential pass."""
        tmp = temporary_beside(folder / Path(location).name)
        source = self.base_dir / location
        with open(source, "rb", buffering=0) as src, open(tmp, "wb", buffering=0) as dst:
            position = 0
            for offset, values in sorted(self._external_patches.get(location, {}).items()):
                if offset < position:  # tensors sharing bytes: write this one over the previous one
                    dst.seek(offset)
                else:
                    _copy_range(src.fileno(), dst.fileno(), position, offset - position)
                data = memoryview(values.reshape(-1).view(np.uint8))  # bytes, whatever the dtype (ml_dtypes too)
                _write_all(dst.fileno(), data)
                position = max(position, offset + len(data))
            dst.seek(position)
            _copy_range(src.fileno(), dst.fileno(), position, os.fstat(src.fileno()).st_size - position)
        return tmp


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


def _write_all(target: int, data: memoryview) -> None:
    while len(data):
        written = os.write(target, data)
        data = data[written:]


def _typed_field(tensor: onnx.TensorProto) -> str | None:
    for name in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        if len(getattr(tensor, name)):
            return name
    return None
