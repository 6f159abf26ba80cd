"""A model with the tables encoders and decoders index by their integer inputs: tokens, positions, segments."""

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def token_tables_model(token_input="input_ids", vocabulary=256, positions=64, width=64):
    """Token, position and segment tables (as BERT and GPT-2 read them), a tied lm_head over the token table and a
    2-class head: only the token table names the vocabulary."""
    rng = np.random.default_rng(0)
    ints = [token_input, "position_ids", "token_type_ids"]
    tables = {"tokens": vocabulary, "positions": positions, "segments": 2}
    inits = [
        numpy_helper.from_array(rng.standard_normal((rows, width)).astype(np.float32), name)
        for name, rows in tables.items()
    ]
    inits.append(numpy_helper.from_array(rng.standard_normal((width, 2)).astype(np.float32), "head"))
    nodes = [
        helper.make_node("Gather", ["tokens", token_input], ["t"]),
        helper.make_node("Gather", ["positions", "position_ids"], ["p"]),
        helper.make_node("Gather", ["segments", "token_type_ids"], ["s"]),
        helper.make_node("Sum", ["t", "p", "s"], ["hidden"]),
        helper.make_node("Transpose", ["tokens"], ["tokens_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["hidden", "tokens_t"], ["logits"]),
        helper.make_node("ReduceMean", ["hidden"], ["pooled"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["pooled", "head"], ["classes"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tables",
        [helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "seq"]) for name in ints],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocabulary]),
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", width]),
            helper.make_tensor_value_info("classes", TensorProto.FLOAT, ["batch", 2]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
