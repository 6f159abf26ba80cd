"""A tiny sentence encoder exported the way sentence-transformers' ONNX exports are: token and sentence embeddings
beside pass-through outputs of the int64 inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VOCABULARY, WIDTH, HIDDEN, TOKENS = 200, 64, 128, 12
OUTPUTS = ("input_ids", "attention_mask_out", "token_embeddings", "sentence_embedding")


def save_encoder(path: Path, seed: int = 0, vocabulary: int = VOCABULARY) -> Path:
    """ids -> embedding -> MatMul/Relu/MatMul with a residual -> LayerNorm (token embeddings) -> masked mean ->
    L2 normalisation (sentence embedding); ``input_ids`` is also an output as it is, ``attention_mask`` through an
    Identity. ``vocabulary`` rows of token embeddings (a real tokenizer's ids need its size)."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["e"]),
        helper.make_node("MatMul", ["e", "W1"], ["h1"], name="/encoder/intermediate/dense/MatMul"),
        helper.make_node("Add", ["h1", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "W2"], ["h2"], name="/encoder/output/dense/MatMul"),
        helper.make_node("Add", ["e", "h2"], ["res"]),
        helper.make_node("LayerNormalization", ["res", "gamma", "beta"], ["token_embeddings"], axis=-1),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["m", "axis2"], ["m3"]),
        helper.make_node("Mul", ["token_embeddings", "m3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axis1"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["m3", "axis1"], ["count"], keepdims=0),
        helper.make_node("Div", ["summed", "count"], ["pooled"]),
        helper.make_node("ReduceL2", ["pooled", "axis1"], ["norm"], keepdims=1),
        helper.make_node("Div", ["pooled", "norm"], ["sentence_embedding"]),
        helper.make_node("Identity", ["attention_mask"], ["attention_mask_out"]),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((vocabulary, WIDTH)).astype(np.float32), "table"),
        numpy_helper.from_array((rng.standard_normal((WIDTH, HIDDEN)) / 8).astype(np.float32), "W1"),
        numpy_helper.from_array((rng.standard_normal(HIDDEN) / 4).astype(np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((HIDDEN, WIDTH)) / 11).astype(np.float32), "W2"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, WIDTH).astype(np.float32), "gamma"),
        numpy_helper.from_array((rng.standard_normal(WIDTH) / 4).astype(np.float32), "beta"),
        numpy_helper.from_array(np.array([2], np.int64), "axis2"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
    ]
    ids = [helper.make_tensor_value_info(name, TensorProto.INT64, [None, TOKENS]) for name in OUTPUTS[:2]]
    graph = helper.make_graph(
        nodes,
        "encoder",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, [None, TOKENS]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [None, TOKENS]),
        ],
        [
            *ids,
            helper.make_tensor_value_info("token_embeddings", TensorProto.FLOAT, [None, TOKENS, WIDTH]),
            helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, [None, WIDTH]),
        ],
        inits,
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def token_batch(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    """Sentences of 4 to 12 tokens drawn from the common part of the vocabulary, padded with id 0."""
    lengths = rng.integers(4, TOKENS + 1, rows)
    mask = (np.arange(TOKENS)[None, :] < lengths[:, None]).astype(np.int64)
    ids = np.where(mask == 1, rng.integers(5, VOCABULARY // 2, (rows, TOKENS)), 0).astype(np.int64)
    return {"input_ids": ids, "attention_mask": mask}


def write_batches(folder: Path, seed: int, batches: int, rows: int = 32) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for index in range(batches):
        np.savez(folder / f"batch-{index}.npz", **token_batch(rng, rows))
    return folder
