"""What a model declares, as passes ask it: the version of the default operator domain it imports, the element type
of every main-graph value (declared, stored or inferred), and a node's attribute values."""

from __future__ import annotations

import onnx

from nmdeploy.errors import InputError
from nmdeploy.graph.index import GraphIndex


def opset_version(proto: onnx.ModelProto) -> int | None:
    """The version of the default domain (``""`` / ``ai.onnx``) the model imports, None when it imports none."""
    return next((entry.version for entry in proto.opset_import if entry.domain in ("", "ai.onnx")), None)


def default_opset(proto: onnx.ModelProto) -> int:
    """The version of the default domain the model imports; a model importing none is an InputError."""
    version = opset_version(proto)
    if version is not None:
        return version
    raise InputError("the model imports no default-domain opset; it is not a valid ONNX model")


def tensor_types(proto: onnx.ModelProto) -> dict[str, int]:
    """Element type of every main-graph tensor whose type is known or can be inferred."""
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # inference fails on some custom ops; what the model declares still helps
        inferred = proto
    graph = inferred.graph
    index = GraphIndex(inferred)
    stored = [entry for entry in index.stored_tensors() if entry.scope is index.main]
    types = {entry.name: entry.tensor.data_type for entry in stored if entry.storage != "constant"}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    types.update({entry.name: entry.tensor.data_type for entry in stored if entry.storage == "constant"})
    return types


def value_shapes(proto: onnx.ModelProto, names: set[str]) -> dict[str, tuple[int, tuple[int | None, ...] | None]]:
    """Element type and shape (None where unknown; a dim None where symbolic) of the main-graph values ``names``,
    stored, declared or inferred by ONNX shape inference; a value whose type is known nowhere is left out."""
    found: dict[str, tuple[int, tuple[int | None, ...] | None]] = {
        tensor.name: (tensor.data_type, tuple(int(d) for d in tensor.dims))
        for tensor in proto.graph.initializer
        if tensor.name in names
    }
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # inference fails on some custom ops and on protos past 2 GB; what the model declares helps
        inferred = proto
    graph = inferred.graph
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.name not in names or value.name in found or not value.type.HasField("tensor_type"):
            continue
        tensor = value.type.tensor_type
        if not tensor.elem_type:
            continue
        shape = (
            tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
            if tensor.HasField("shape")
            else None
        )
        found[value.name] = (tensor.elem_type, shape)
    return found


def node_attribute(node: onnx.NodeProto, name: str, default):
    """The value of the node's attribute ``name`` (onnx's own decoding), or ``default`` when the node has none."""
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default
