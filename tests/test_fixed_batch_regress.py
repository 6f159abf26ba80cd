"""``regress --init`` on a model exported with a fixed batch of one (a captcha reader [1, 1, 64, W]): it once timed
its default batch 8, which ONNX Runtime refuses, and wrote nothing ("check the data")."""

from __future__ import annotations

import tomllib

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main


def _fixed_batch_model(path, seed: int):
    weight = np.random.default_rng(seed).normal(size=(16, 12)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="head")],
        "one_row",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 12])],
        [numpy_helper.from_array(weight, "w")],
    )
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_regress_init_times_the_model_s_fixed_batch(tmp_path, capsys):
    reference = _fixed_batch_model(tmp_path / "ref.onnx", 0)
    candidate = _fixed_batch_model(tmp_path / "cand.onnx", 0)
    data = tmp_path / "eval"
    data.mkdir()
    rng = np.random.default_rng(1)
    for index in range(6):
        np.savez(data / f"{index}.npz", x=rng.normal(size=(1, 16)).astype(np.float32))
    baselines = tmp_path / "baselines.toml"
    argv = ["regress", "--init", str(baselines), "--reference", str(reference), "--candidate", str(candidate)]
    assert main([*argv, "--data", str(data)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert tomllib.loads(baselines.read_text())["model"][0]["latency"]["batch"] == [1]
    assert main(["regress", str(baselines)]) == 0
