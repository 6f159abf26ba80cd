"""Loading and saving ONNX models with full fidelity.

A model is loaded without pulling external tensor data into memory. Tensor values are read on demand and
replaced tensor by tensor; saving writes the original protobuf with only those values changed, in the storage
field each tensor already used. External data files are copied and patched in place at the pruned tensors'
offsets (pruning never changes a tensor's byte size), so models over 2 GB keep their layout and are written at
I/O speed. Every output is written to a temporary file first and renamed into place.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from nmdeploy.errors import InputError
from nmdeploy.files import temporary_beside

_EXTERNAL = onnx.TensorProto.EXTERNAL


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


@dataclass
class OnnxModel:
    """An ONNX model as stored on disk: its protobuf (external data left on disk) and the folder it came from."""

    proto: onnx.ModelProto
    base_dir: Path
    path: Path | None = None
    _external_patches: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)

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

    def tensors(self):
        """Every stored tensor: initializers and Constant node values, in all graphs and functions."""
        return _all_tensors(self.proto)

    def read(self, tensor: onnx.TensorProto) -> np.ndarray:
        """The tensor's values (bf16 and fp8 come back as ml_dtypes arrays)."""
        if tensor.data_location == _EXTERNAL:
            info = _external_info(tensor)
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
            count = int(np.prod(tensor.dims, dtype=np.int64))
            data = self._patched_bytes(tensor)
            if data is None:
                with open(self.base_dir / info["location"], "rb") as handle:
                    handle.seek(int(info.get("offset", 0)))
                    data = handle.read(count * dtype.itemsize)
            return np.frombuffer(data, dtype=dtype).reshape(tuple(tensor.dims))
        return numpy_helper.to_array(tensor)

    def _patched_bytes(self, tensor: onnx.TensorProto) -> bytes | None:
        info = _external_info(tensor)
        offset = int(info.get("offset", 0))
        for start, data in self._external_patches.get(info["location"], []):
            if start == offset:
                return data
        return None

    def write(self, tensor: onnx.TensorProto, values: np.ndarray) -> None:
        """Replace the tensor's values (same shape and dtype), keeping the storage field it already uses."""
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
        values = np.ascontiguousarray(values, dtype=dtype)
        if tuple(values.shape) != tuple(tensor.dims):
            raise ValueError(f"new values for '{tensor.name}' have shape {values.shape}, expected {tuple(tensor.dims)}")
        data = values.astype(values.dtype.newbyteorder("<"), copy=False).tobytes()
        if tensor.data_location == _EXTERNAL:
            info = _external_info(tensor)
            patches = self._external_patches.setdefault(info["location"], [])
            offset = int(info.get("offset", 0))
            patches[:] = [(start, old) for start, old in patches if start != offset] + [(offset, data)]
        elif tensor.HasField("raw_data") or not _typed_field(tensor):
            tensor.raw_data = data
        else:
            typed = onnx.helper.make_tensor(tensor.name, tensor.data_type, tensor.dims, values.reshape(-1).tolist())
            field_name = _typed_field(tensor)
            getattr(tensor, field_name)[:] = getattr(typed, field_name)

    def save(self, path: str | Path) -> Path:
        """Write the model (and patched copies of its external data files) to ``path``, atomically."""
        path = Path(path).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        renames = self._external_locations_for(path)
        proto = onnx.ModelProto()
        proto.CopyFrom(self.proto)
        if renames:
            for tensor in _all_tensors(proto):
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
        tmp = temporary_beside(folder / Path(location).name)
        shutil.copyfile(self.base_dir / location, tmp)
        with open(tmp, "r+b") as handle:
            for offset, data in self._external_patches.get(location, []):
                handle.seek(offset)
                handle.write(data)
        return tmp


def _typed_field(tensor: onnx.TensorProto) -> str | None:
    for name in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        if len(getattr(tensor, name)):
            return name
    return None


def _node_tensors(node: onnx.NodeProto):
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.TENSOR:
            yield attribute.t
        elif attribute.type == onnx.AttributeProto.GRAPH:
            yield from _graph_tensors(attribute.g)
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            for graph in attribute.graphs:
                yield from _graph_tensors(graph)


def _graph_tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    for node in graph.node:
        yield from _node_tensors(node)


def _all_tensors(proto: onnx.ModelProto):
    yield from _graph_tensors(proto.graph)
    for function in proto.functions:
        for node in function.node:
            yield from _node_tensors(node)
