"""A small stateful streaming model made with onnx.helper, shaped like a voice-activity detector: a frame of
features, a scalar sample-rate input and a [2, B, H] state in and out, and one probability per row."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FEATURES, HIDDEN, STATE = 64, 64, 16
RATE = 16000


def save_stateful(path: Path, seed: int = 0) -> Path:
    """frame -> MatMul/Relu scaled by sr / 16000; state' = tanh(state + frame @ Ws) (broadcast over the state's
    two layers); prob = sigmoid([hidden, state'[0] + state'[1]] @ Wo). The batch is axis 0 of ``input`` and
    axis 1 of ``state`` (the same symbolic dimension ``batch``); ``sr`` is a scalar."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("Cast", ["sr"], ["sr_float"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["sr_float", "rate"], ["scale"]),
        helper.make_node("MatMul", ["input", "W1"], ["h1"], name="encoder/MatMul"),
        helper.make_node("Mul", ["h1", "scale"], ["h1s"]),
        helper.make_node("Relu", ["h1s"], ["hidden"]),
        helper.make_node("MatMul", ["input", "Ws"], ["drive"], name="state/MatMul"),
        helper.make_node("Add", ["state", "drive"], ["pre_state"]),
        helper.make_node("Tanh", ["pre_state"], ["stateN"]),
        helper.make_node("ReduceSum", ["stateN", "axis0"], ["summed"], keepdims=0),
        helper.make_node("Concat", ["hidden", "summed"], ["joined"], axis=1),
        helper.make_node("MatMul", ["joined", "Wo"], ["logit"], name="head/MatMul"),
        helper.make_node("Sigmoid", ["logit"], ["output"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(RATE, np.float32), "rate"),
        numpy_helper.from_array((rng.standard_normal((FEATURES, HIDDEN)) / 8).astype(np.float32), "W1"),
        numpy_helper.from_array((rng.standard_normal((FEATURES, STATE)) / 8).astype(np.float32), "Ws"),
        numpy_helper.from_array((rng.standard_normal((HIDDEN + STATE, 1)) / 6).astype(np.float32), "Wo"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
    ]
    graph = helper.make_graph(
        nodes,
        "stateful",
        [
            helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", FEATURES]),
            helper.make_tensor_value_info("sr", TensorProto.INT64, []),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "batch", STATE]),
        ],
        [
            helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, "batch", STATE]),
        ],
        inits,
    )
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def stateful_batch(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    return {
        "input": rng.standard_normal((rows, FEATURES)).astype(np.float32),
        "sr": np.array(RATE, np.int64),
        "state": (rng.standard_normal((2, rows, STATE)) / 2).astype(np.float32),
    }


def write_stateful_batches(folder: Path, seed: int, batches: int, rows: int = 32) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for index in range(batches):
        np.savez(folder / f"batch-{index}.npz", **stateful_batch(rng, rows))
    return folder
