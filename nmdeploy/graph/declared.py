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


def node_attribute(node: onnx.NodeProto, name: str, default):
    """The value of the node's attribute ``name`` (onnx's own decoding), or ``default`` when the node has none."""
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return default
