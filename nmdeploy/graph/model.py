"""Loading and saving ONNX models with full fidelity.

A model is loaded without pulling external tensor data into memory. Tensor values are read on demand and
replaced tensor by tensor; saving writes the original protobuf with only those values changed, in the storage
field each tensor already used. External data files are written in one sequential pass: unchanged ranges are
copied by the kernel (copy_file_range), replaced tensors are written from memory at their offsets (pruning never
changes a tensor's byte size), so models over 2 GB keep their layout and are written at I/O speed. Every new file is
written under a temporary name first and all of them are switched in one commit (nmdeploy.files.commit).

A model file is untrusted input: loading checks every external-data location (a regular file inside the model's
folder, symlinks resolved), offset, length and dims, and refuses cycles, before anything is read.
"""

from __future__ import annotations

import copy
import errno
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
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
from nmdeploy.graph.dtypes import ARITHMETIC_FLOAT_TYPES
from nmdeploy.graph.index import GraphCycleError, GraphIndex, model_tensors
from nmdeploy.graph.scratch import PATCH_MEMORY_LIMIT, ScratchFile, SpilledValues

_EXTERNAL = onnx.TensorProto.EXTERNAL
# copy_file_range fails with these where the kernel or filesystem cannot do it; a buffered copy is used then.
_NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def _is_hub_cache_blob(base_dir: Path, resolved: Path) -> bool:
    """Whether ``resolved`` is a file of the Hugging Face cache repository whose snapshot holds the model.

    The hub cache keeps every file once under ``models--ORG--NAME/blobs/`` and links to it from
    ``models--ORG--NAME/snapshots/REVISION/...``: a model loaded from a snapshot reads its data through such links.
    Only that one layout is followed out of the model's folder, and only into its own repository's blobs folder."""
    for snapshot in (base_dir, *base_dir.parents):
        if snapshot.parent.name == "snapshots":
            repository = snapshot.parent.parent
            return repository.name.startswith("models--") and resolved.parent == repository / "blobs"
    return False


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


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
        _check_text_fields(proto, path)
        _check_opset_imports(proto, path)
        _check_defined_inputs(proto.graph, path)
        model = cls(proto, path.parent.resolve(), path.resolve())
        try:  # the index is built here once for the passes that follow; a cycle is refused before any work
            model.index.topological_order()
        except GraphCycleError as error:
            raise GraphCycleError(f"{path}: {error}") from None
        model._check_external_data()
        model._check_declared_shapes()
        for folder in {file.parent for file in model.input_files()} - {model.base_dir}:
            clean_folder(folder)
        return model

    def _check_external_data(self) -> None:
        """Every stored tensor's size and, for external ones, its location, offset and length, checked before anything
        is read: a location must name a regular file inside the model's folder (symlinks resolved), as onnx's checker
        requires, so a downloaded model can never make nmdeploy read or overwrite a file elsewhere. The one exception
        is the Hugging Face cache, whose snapshot folders link into their repository's blobs folder."""
        for tensor in self.tensors():
            size = _byte_size(tensor, self.path)
            if tensor.data_location != _EXTERNAL:
                if tensor.HasField("raw_data") and size is not None and len(tensor.raw_data) != size:
                    raise InputError(
                        f"{self.path}: tensor '{tensor.name}' holds {len(tensor.raw_data)} bytes but its dims "
                        f"{list(tensor.dims)} need {size}; the model file is damaged, export it again"
                    )
                if not tensor.HasField("raw_data"):
                    _check_typed_values(tensor, self.path)
                continue
            info = _external_info(tensor)
            location = info.get("location", "")
            self._data_file(tensor.name, location)
            offset = _external_integer(info, "offset", tensor.name, location)
            length = _external_integer(info, "length", tensor.name, location)
            if size is None:
                raise InputError(
                    f"tensor '{tensor.name}' stores {onnx.TensorProto.DataType.Name(tensor.data_type)} values in "
                    f"external data '{location}', which nmdeploy cannot read; keep such tensors inside the model"
                )
            if length is not None and length != size:
                raise InputError(
                    f"tensor '{tensor.name}' has dims {list(tensor.dims)} ({size} bytes) but its external data "
                    f"'{location}' gives length {length}; the model is damaged, export it again"
                )
            end = (offset or 0) + size
            if end > os.fstat(self._handles[location].fd).st_size:
                raise InputError(
                    f"external data file '{location}' is shorter than tensor '{tensor.name}' needs "
                    f"({end} bytes at offset {offset or 0}); it is truncated or does not belong to this model"
                )

    def _check_declared_shapes(self) -> None:
        """The shapes graphs declare for their inputs, outputs and intermediate values, in every graph, checked against
        what any machine could hold, so that nothing later allocates by a hostile declaration."""
        opset = next((entry.version for entry in self.proto.opset_import if entry.domain in ("", "ai.onnx")), None)
        for scope in self.index.scopes:
            for node in scope.nodes:
                _check_arity(node, opset, self.path)
            if scope.graph is None:
                continue
            _check_unique_names(scope.graph, self.path)
            for value in (*scope.graph.input, *scope.graph.output, *scope.graph.value_info):
                if not value.type.HasField("tensor_type"):
                    continue
                tensor_type = value.type.tensor_type
                dims = [d.dim_value for d in tensor_type.shape.dim if d.HasField("dim_value") and d.dim_value > 0]
                size = math.prod(dims) * _item_size(tensor_type.elem_type)
                if size > MAX_DECLARED_BYTES:
                    raise InputError(
                        f"{self.path}: value '{value.name}' declares shape {dims} ({size} bytes), more than "
                        f"{MAX_DECLARED_BYTES >> 30} GiB any run could hold; the model is damaged or hostile"
                    )

    def _data_file(self, tensor_name: str, location: str) -> Path:
        """The resolved path of an external data location, or an InputError when it points outside the folder."""
        if location in self._data_files:
            return self._data_files[location]
        where = f"tensor '{tensor_name}' has external data location '{location}'"
        if not location or "\0" in location or os.path.isabs(location) or location.startswith(("/", "\\")):
            raise InputError(f"{where}, which is not a relative file name; only files beside the model are read")
        if ".." in Path(location).parts or ".." in location.split("\\"):
            raise InputError(f"{where}, which escapes the model's folder; only files beside the model are read")
        candidate = self.base_dir / location
        try:
            os.lstat(candidate)
        except FileNotFoundError:
            pass
        except OSError as error:  # a name too long, a loop of links, a file where a folder should be
            raise InputError(f"{where}, which cannot be looked up ({error.strerror}); the model is damaged") from None
        if not candidate.exists() and not candidate.is_symlink():
            raise InputError(
                f"external data file '{location}' of tensor '{tensor_name}' is missing; "
                f"keep it next to the model (looked in {self.base_dir})"
            )
        resolved = candidate.resolve()
        if not resolved.is_relative_to(self.base_dir) and not _is_hub_cache_blob(self.base_dir, resolved):
            raise InputError(f"{where}, a link that leaves the model's folder; only files beside the model are read")
        if not resolved.is_file():
            raise InputError(f"{where}, which is not a regular file; keep the model's data files next to it")
        if self.path is not None and resolved == self.path:
            raise InputError(f"{where}, which is the model file itself; the model is damaged, export it again")
        try:
            self._handles[location] = OpenFile(resolved)
        except OSError as error:
            raise InputError(f"{where}, which cannot be read ({error.strerror})") from None
        self._data_files[location] = resolved
        return resolved

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
            info = _external_info(tensor)
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

    def check_finite(self, tensors, *, allow_infinite: bool = False) -> None:
        """Refuse float tensors holding NaN or infinity: no pass can rank, fit or cast them meaningfully, and the
        outputs would compare as NaN. ``allow_infinite`` accepts infinities (attention-mask constants hold -inf on
        purpose) and refuses NaN only. Reads one tensor at a time."""
        for tensor in tensors:
            if tensor.data_type not in ARITHMETIC_FLOAT_TYPES:
                continue
            values = self.read(tensor).astype(np.float64, copy=False)
            if not values.size:
                continue
            # Without infinities allowed, a sum is finite only when every element is (an overflow is refused too).
            bad = bool(np.isnan(values).any()) if allow_infinite else not np.isfinite(np.abs(values).sum())
            if bad:
                what = "NaN" if allow_infinite else "NaN or infinite values"
                name = tensor.name or "(an unnamed constant)"
                raise InputError(f"weight '{name}' contains {what}; fix the model first")

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
            info = _external_info(tensor)
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
        return {_external_info(t)["location"] for t in self.tensors() if t.data_location == _EXTERNAL}

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


_PACKED_4BIT = {
    getattr(onnx.TensorProto, name)
    for name in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(onnx.TensorProto, name)
}
# A tensor larger than this is a damaged or hostile file, not a model (numpy sizes are int64).
_MAX_BYTES = 1 << 62
# A value a graph declares larger than this (256 GiB) cannot be computed on any machine a model is deployed to.
MAX_DECLARED_BYTES = 1 << 38
_TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")
_COMPLEX = {onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128}
_PACKED_2BIT = {getattr(onnx.TensorProto, name) for name in ("INT2", "UINT2") if hasattr(onnx.TensorProto, name)}


def _check_text_fields(message: Message, path: Path) -> None:
    """Every string field of ``message`` and the messages inside it is text: protobuf hands invalid UTF-8 in an
    ONNX (proto2) string back as bytes, which no later name comparison or lookup expects."""
    for descriptor, value in message.ListFields():
        if descriptor.type == FieldDescriptor.TYPE_MESSAGE:
            for item in value if _is_repeated(descriptor) else (value,):
                _check_text_fields(item, path)
        elif descriptor.type == FieldDescriptor.TYPE_STRING:
            for item in value if _is_repeated(descriptor) else (value,):
                if not isinstance(item, str):
                    raise InputError(
                        f"{path}: the {descriptor.full_name} field holds {bytes(item)[:40]!r}, not UTF-8 text; "
                        "the model file is damaged, export it again"
                    )


def _is_repeated(descriptor: FieldDescriptor) -> bool:
    repeated = getattr(descriptor, "is_repeated", None)  # protobuf 6 has the property and dropped ``label``
    return repeated if repeated is not None else descriptor.label == FieldDescriptor.LABEL_REPEATED


def _check_arity(node: onnx.NodeProto, opset: int | None, model: Path | None) -> None:
    """A standard op with fewer or more inputs or outputs than its schema allows at the model's opset (a MatMul
    of one input) is refused before a pass indexes the missing one."""
    if node.domain not in ("", "ai.onnx") or opset is None or opset < 1:
        return
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return  # not a standard op at this opset: left to the runtime, which names it
    inputs = len(node.input)
    outputs = len(node.output)
    if not schema.min_input <= inputs <= schema.max_input or not schema.min_output <= outputs <= schema.max_output:
        raise InputError(
            f"{model}: node '{node.name or node.op_type}' ({node.op_type}) has {inputs} inputs and {outputs} outputs; "
            f"opset {opset} allows {schema.min_input}-{schema.max_input} and {schema.min_output}-{schema.max_output}; "
            f"the model is damaged, export it again"
        )


def _check_defined_inputs(graph: onnx.GraphProto, path: Path) -> None:
    """Every value the main graph's nodes read is defined: a graph input, a stored tensor or a node output. A name
    defined nowhere would leave passes writing models that no runtime loads."""
    defined = {value.name for value in graph.input}
    defined.update(tensor.name for tensor in graph.initializer)
    defined.update(tensor.values.name for tensor in graph.sparse_initializer)
    defined.update(name for node in graph.node for name in node.output)
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                raise InputError(
                    f"{path}: node '{node.name or node.op_type}' reads '{name}', which is neither a graph input, a "
                    "stored tensor nor a node output; the model is damaged, export it again"
                )


def _check_opset_imports(proto: onnx.ModelProto, path: Path) -> None:
    """Each operator domain imported once: with two versions of one domain, the checker, ONNX Runtime and a pass
    would each pick one, and a pass's output could then fail the rules of the version it did not pick."""
    versions: dict[str, int] = {}
    for entry in proto.opset_import:
        domain = "" if entry.domain == "ai.onnx" else entry.domain
        if domain in versions:
            raise InputError(
                f"{path}: the model imports operator domain '{domain or 'ai.onnx'}' twice (versions "
                f"{versions[domain]} and {entry.version}); the model is damaged, export it again"
            )
        versions[domain] = entry.version


def _check_unique_names(graph: onnx.GraphProto, model: Path | None) -> None:
    """A graph names each stored tensor and each node output once (ONNX's single assignment); a second definition
    would leave every reader to pick one, and passes to change only one of them."""
    seen: set[str] = set()
    for what, names in (
        ("initializer", [t.name for t in graph.initializer] + [t.values.name for t in graph.sparse_initializer]),
        ("node output", [name for node in graph.node for name in node.output if name]),
    ):
        for name in names:
            if name in seen:  # a node output named like an initializer counts as a second definition too
                raise InputError(
                    f"{model}: {what} '{name}' is defined twice in graph '{graph.name}'; the model is damaged, "
                    f"export it again"
                )
            seen.add(name)


def _item_size(data_type: int) -> int:
    """Bytes per element of a declared element type (1 for types without a fixed size, or unknown ones)."""
    try:
        return max(1, onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize)
    except (KeyError, TypeError, ValueError):
        return 1


def _check_typed_values(tensor: onnx.TensorProto, model: Path | None) -> None:
    """An inline tensor without raw bytes must store at least as many typed values as its dims declare: a tensor
    declaring 2^40 elements with nothing behind them is refused here, before any reader sizes an array by it."""
    count = math.prod(tensor.dims)
    if tensor.data_type in _COMPLEX:
        needed = 2 * count
    elif tensor.data_type in _PACKED_2BIT:
        needed = -(-count // 4)
    elif tensor.data_type in _PACKED_4BIT:
        needed = -(-count // 2)
    else:
        needed = count
    stored = sum(len(getattr(tensor, name)) for name in _TYPED_FIELDS)
    if stored < needed:
        where = f"{model}: tensor '{tensor.name}'" if model else f"tensor '{tensor.name}'"
        raise InputError(
            f"{where} has dims {list(tensor.dims)} ({count} elements) but stores {stored} values; "
            f"the model file is damaged, export it again"
        )


def _byte_size(tensor: onnx.TensorProto, model: Path | None) -> int | None:
    """The bytes the tensor's dims need (None for strings), or an InputError for dims no real tensor has."""
    where = f"{model}: tensor '{tensor.name}'" if model else f"tensor '{tensor.name}'"
    count = 1
    for dim in tensor.dims:
        if dim < 0:
            raise InputError(f"{where} has negative dims {list(tensor.dims)}; the model is damaged, export it again")
        count *= dim
    if tensor.data_type == onnx.TensorProto.UNDEFINED:
        raise InputError(f"{where} has no element type (UNDEFINED); the model is damaged, export it again")
    if tensor.data_type == onnx.TensorProto.STRING:
        if tensor.HasField("raw_data"):
            raise InputError(
                f"{where} is a STRING tensor with raw bytes, which strings never use; the model is damaged"
            )
        return None
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError) as error:
        raise InputError(f"{where} has unknown data type {tensor.data_type}; the model is damaged") from error
    if tensor.data_type in _PACKED_2BIT:
        size = -(-count // 4)
    else:
        size = (count + 1) // 2 if tensor.data_type in _PACKED_4BIT else count * itemsize
    if size > _MAX_BYTES:
        raise InputError(f"{where} has dims {list(tensor.dims)} ({size} bytes), more than any real model holds")
    return size


def _external_integer(info: dict[str, str], key: str, tensor: str, location: str) -> int | None:
    text = info.get(key)
    if text is None:
        return None
    if not text.isascii() or not text.isdigit() or int(text) > _MAX_BYTES:
        raise InputError(
            f"tensor '{tensor}' in external data '{location}' has {key} {text!r}, which is not a byte count; "
            f"the model is damaged, export it again"
        )
    return int(text)


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
    for name in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        if len(getattr(tensor, name)):
            return name
    return None
