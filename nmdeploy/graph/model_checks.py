"""Load-time checks of an untrusted ONNX model file, run before any tensor value is read.

Every external-data location must name a regular file inside the model's folder (symlinks resolved); every stored
tensor's dims, type, offset and length must describe bytes that are there; text fields, opset imports, node arity,
defined inputs, single assignment and declared shapes must be what any exporter writes. A failure is one InputError
line naming the tensor, node or value and what to do.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from nmdeploy.errors import InputError
from nmdeploy.graph.declared import opset_version
from nmdeploy.graph.index import GraphIndex

_EXTERNAL = onnx.TensorProto.EXTERNAL

_PACKED_4BIT = {
    getattr(onnx.TensorProto, name)
    for name in ("INT4", "UINT4", "FLOAT4E2M1", "INT2", "UINT2")
    if hasattr(onnx.TensorProto, name)
}
# A tensor larger than this is a damaged or hostile file, not a model (numpy sizes are int64).
_MAX_BYTES = 1 << 62
# A value a graph declares larger than this (256 GiB) cannot be computed on any machine a model is deployed to.
MAX_DECLARED_BYTES = 1 << 38
# The fields an inline tensor stores typed values in (not raw bytes).
TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")
_COMPLEX = {onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128}
_PACKED_2BIT = {getattr(onnx.TensorProto, name) for name in ("INT2", "UINT2") if hasattr(onnx.TensorProto, name)}


# The keys ONNX defines for a tensor's external data (docs/ExternalData.md). ONNX Runtime refuses a model with any
# other key or a repeated location, and a repeated key leaves which value counts to each reader.
EXTERNAL_DATA_KEYS = ("location", "offset", "length", "checksum")


def external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def _check_external_keys(tensor: onnx.TensorProto) -> None:
    """Each of the tensor's external-data keys is one ONNX defines, given once."""
    seen: set[str] = set()
    for entry in tensor.external_data:
        if entry.key not in EXTERNAL_DATA_KEYS:
            raise InputError(
                f"tensor '{tensor.name}' has external data key {entry.key!r}, which ONNX does not define (only "
                f"{', '.join(EXTERNAL_DATA_KEYS)}); the model is damaged, export it again"
            )
        if entry.key in seen:
            raise InputError(
                f"tensor '{tensor.name}' gives external data key {entry.key!r} more than once; the model is damaged, "
                "export it again"
            )
        seen.add(entry.key)


def check_proto(proto: onnx.ModelProto, path: Path) -> None:
    """The checks that need only the protobuf: text fields, opset imports, and inputs defined in the main graph."""
    _check_text_fields(proto, path)
    _check_opset_imports(proto, path)
    _check_defined_inputs(proto.graph, path)


def check_stored_tensors(
    tensors: Iterable[onnx.TensorProto], path: Path | None, data_file_size: Callable[[str, str], int]
) -> None:
    """Every stored tensor's size and, for external ones, its keys, location, offset and length, checked before
    anything is read: a location must name a regular file inside the model's folder (symlinks resolved), as onnx's
    checker requires, so a downloaded model can never make nmdeploy read or overwrite a file elsewhere. The one
    exception is the Hugging Face cache, whose snapshot folders link into their repository's blobs folder."""
    for tensor in tensors:
        size = _byte_size(tensor, path)
        if tensor.data_location != _EXTERNAL:
            if tensor.HasField("raw_data") and size is not None and len(tensor.raw_data) != size:
                raise InputError(
                    f"{path}: tensor '{tensor.name}' holds {len(tensor.raw_data)} bytes but its dims "
                    f"{list(tensor.dims)} need {size}; the model file is damaged, export it again"
                )
            if not tensor.HasField("raw_data"):
                _check_typed_values(tensor, path)
            continue
        _check_external_keys(tensor)
        info = external_info(tensor)
        location = info.get("location", "")
        file_size = data_file_size(tensor.name, location)
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
        if end > file_size:
            raise InputError(
                f"external data file '{location}' is shorter than tensor '{tensor.name}' needs "
                f"({end} bytes at offset {offset or 0}); it is truncated or does not belong to this model"
            )


def check_declared_shapes(proto: onnx.ModelProto, index: GraphIndex, path: Path | None) -> None:
    """The shapes graphs declare for their inputs, outputs and intermediate values, in every graph, checked against
    what any machine could hold, so that nothing later allocates by a hostile declaration."""
    opset = opset_version(proto)
    for scope in index.scopes:
        for node in scope.nodes:
            _check_arity(node, opset, path)
        if scope.graph is None:
            continue
        _check_unique_names(scope.graph, path)
        for value in (*scope.graph.input, *scope.graph.output, *scope.graph.value_info):
            if not value.type.HasField("tensor_type"):
                continue
            tensor_type = value.type.tensor_type
            dims = [d.dim_value for d in tensor_type.shape.dim if d.HasField("dim_value") and d.dim_value > 0]
            size = math.prod(dims) * _item_size(tensor_type.elem_type)
            if size > MAX_DECLARED_BYTES:
                raise InputError(
                    f"{path}: value '{value.name}' declares shape {dims} ({size} bytes), more than "
                    f"{MAX_DECLARED_BYTES >> 30} GiB any run could hold; the model is damaged or hostile"
                )


def resolve_data_location(base_dir: Path, model_path: Path | None, tensor_name: str, location: str) -> Path:
    """The resolved path of an external data location, or an InputError when it points outside the folder."""
    where = f"tensor '{tensor_name}' has external data location '{location}'"
    if not location or "\0" in location or os.path.isabs(location) or location.startswith(("/", "\\")):
        raise InputError(f"{where}, which is not a relative file name; only files beside the model are read")
    if ".." in Path(location).parts or ".." in location.split("\\"):
        raise InputError(f"{where}, which escapes the model's folder; only files beside the model are read")
    candidate = base_dir / location
    try:
        os.lstat(candidate)
    except FileNotFoundError:
        pass
    except OSError as error:  # a name too long, a loop of links, a file where a folder should be
        raise InputError(f"{where}, which cannot be looked up ({error.strerror}); the model is damaged") from None
    if not candidate.exists() and not candidate.is_symlink():
        raise InputError(
            f"external data file '{location}' of tensor '{tensor_name}' is missing; "
            f"keep it next to the model (looked in {base_dir})"
        )
    resolved = candidate.resolve()
    if not resolved.is_relative_to(base_dir) and not _is_hub_cache_blob(base_dir, resolved):
        raise InputError(f"{where}, a link that leaves the model's folder; only files beside the model are read")
    if not resolved.is_file():
        raise InputError(f"{where}, which is not a regular file; keep the model's data files next to it")
    if model_path is not None and resolved == model_path:
        raise InputError(f"{where}, which is the model file itself; the model is damaged, export it again")
    return resolved


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
    stored = sum(len(getattr(tensor, name)) for name in TYPED_FIELDS)
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


def check_structure(proto: onnx.ModelProto) -> None:
    """The ONNX checker on what a pass builds: nodes, their types and opsets, every graph's topology and names.

    The checker looks an external tensor's file up relative to the working folder (an in-memory model has no folder
    of its own), so it is given a skeleton of ``proto`` in which every stored tensor (the initializers of the main
    graph and of every subgraph, and tensor attributes) stands as an empty tensor of its name and type: no tensor
    payload is copied or read (the load checks have checked the stored bytes already), and each name stays in the
    scope that defines it."""
    skeleton = onnx.ModelProto()
    _copy_fields(proto, skeleton, skip=("graph", "functions"))
    skeleton.graph.CopyFrom(_graph_skeleton(proto.graph))
    for function in proto.functions:
        copy = skeleton.functions.add()
        _copy_fields(function, copy, skip=("node",))
        copy.node.extend(_node_skeleton(node) for node in function.node)
    onnx.checker.check_model(skeleton, full_check=False)


def _graph_skeleton(graph: onnx.GraphProto) -> onnx.GraphProto:
    skeleton = onnx.GraphProto()
    _copy_fields(graph, skeleton, skip=("node", "initializer", "sparse_initializer"))
    skeleton.node.extend(_node_skeleton(node) for node in graph.node)
    skeleton.initializer.extend(_empty_tensor(tensor) for tensor in graph.initializer)
    skeleton.sparse_initializer.extend(_empty_sparse_tensor(tensor) for tensor in graph.sparse_initializer)
    return skeleton


def _node_skeleton(node: onnx.NodeProto) -> onnx.NodeProto:
    skeleton = onnx.NodeProto()
    _copy_fields(node, skeleton, skip=("attribute",))
    for attribute in node.attribute:
        copy = skeleton.attribute.add()
        _copy_fields(attribute, copy, skip=("t", "tensors", "sparse_tensor", "sparse_tensors", "g", "graphs"))
        if attribute.HasField("t"):
            copy.t.CopyFrom(_empty_tensor(attribute.t))
        if attribute.HasField("sparse_tensor"):
            copy.sparse_tensor.CopyFrom(_empty_sparse_tensor(attribute.sparse_tensor))
        if attribute.HasField("g"):
            copy.g.CopyFrom(_graph_skeleton(attribute.g))
        copy.tensors.extend(_empty_tensor(tensor) for tensor in attribute.tensors)
        copy.sparse_tensors.extend(_empty_sparse_tensor(tensor) for tensor in attribute.sparse_tensors)
        copy.graphs.extend(_graph_skeleton(graph) for graph in attribute.graphs)
    return skeleton


def _empty_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """A tensor of ``tensor``'s name and type holding no values (dims [0]), which the checker accepts as it is."""
    return onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=[0])


def _empty_sparse_tensor(tensor: onnx.SparseTensorProto) -> onnx.SparseTensorProto:
    return onnx.SparseTensorProto(values=_empty_tensor(tensor.values), dims=tensor.dims)


def _copy_fields(source: Message, target: Message, skip: tuple[str, ...]) -> None:
    """Every set field of ``source`` but those named in ``skip``, copied onto ``target``."""
    for field, value in source.ListFields():
        if field.name in skip:
            continue
        if _is_repeated(field):
            getattr(target, field.name).extend(value)
        elif field.message_type is not None:
            getattr(target, field.name).CopyFrom(value)
        else:
            setattr(target, field.name, value)
