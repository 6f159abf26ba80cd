"""Calibration statistics across processes: two gloo ranks, each running half of every batch's rows, write the model
one process writes; the launch is torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)."""

import os
import socket

import numpy as np
import onnx
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
WORLD = 2


def mlp(path, seed=0):
    """x [batch, 6, 32] -> MatMul 32x64 -> Relu -> MatMul 64x64 -> Relu -> MatMul 64x16: three fitting stages."""
    rng = np.random.default_rng(seed)
    widths = [32, 64, 64, 16]
    nodes, weights, value = [], [], "x"
    for layer, (k, out) in enumerate(zip(widths, widths[1:], strict=False)):
        name = f"w{layer}"
        weights.append(numpy_helper.from_array((rng.standard_normal((k, out)) / np.sqrt(k)).astype(np.float32), name))
        nodes.append(helper.make_node("MatMul", [value, name], [f"h{layer}"]))
        value = f"h{layer}"
        if layer < 2:
            nodes.append(helper.make_node("Relu", [value], [f"r{layer}"]))
            value = f"r{layer}"
    nodes.append(helper.make_node("Identity", [value], ["y"]))
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 6, 16])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    # Correlated inputs (a random mixing of the channels), as activations are: H is far from diagonal.
    x = rng.standard_normal((24, 6, 32)).astype(np.float32) @ rng.standard_normal((32, 32)).astype(np.float32)
    np.savez(path.parent / "calib.npz", x=x)
    return path, path.parent / "calib.npz"


def convert_argv(model, calibration, output, *extra):
    # Batches of 7 rows: 24 rows make batches of 7, 7, 7 and 3, so the ranks' shares differ in size.
    return [
        "convert",
        str(model),
        "-o",
        str(output),
        "--calib",
        str(calibration),
        "--calib-batch",
        "7",
        "--max-memory",
        "2048",
        *extra,
    ]


def rank_main(rank, port, argv):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(LOCAL_RANK=str(rank))
    code = main(argv)
    if code != 0:
        raise SystemExit(code)


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def weights(path):
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def test_two_ranks_write_the_model_one_process_writes(tmp_path):
    model, calibration = mlp(tmp_path / "mlp.onnx")
    assert main(convert_argv(model, calibration, tmp_path / "one.onnx")) == 0
    argv = convert_argv(model, calibration, tmp_path / "two.onnx", "--distributed", "--json")
    mp.spawn(rank_main, args=(free_port(), argv), nprocs=WORLD, join=True)

    one, two = weights(tmp_path / "one.onnx"), weights(tmp_path / "two.onnx")
    assert set(one) == set(two) == {"w0", "w1", "w2"}
    for name in one:
        # The same masks, and values equal to float32 rounding (weights ~0.3; measured: 59-76 % bitwise equal, the
        # rest at most 2e-7 apart): the ranks' float64 sums of X^T X add the same rows in another order, and ONNX
        # Runtime's float32 products ran on batches of other sizes.
        np.testing.assert_array_equal(one[name] == 0, two[name] == 0)
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, atol=1e-6)
    # The fit changed the weights (not a copy of the input): each layer 2:4 along its reduction axis.
    dense = weights(model)
    for name in one:
        assert not np.array_equal(one[name], dense[name])
        assert ((one[name].T.reshape(-1, 4) != 0).sum(axis=1) <= 2).all()


def test_distributed_needs_the_launcher(tmp_path, monkeypatch, capsys):
    model, calibration = mlp(tmp_path / "mlp.onnx")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(convert_argv(model, calibration, tmp_path / "out.onnx", "--distributed")) == 2
    assert "torchrun --nproc-per-node" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(convert_argv(model, calibration, tmp_path / "out.onnx")) == 2
    assert "add --distributed" in capsys.readouterr().err
    assert not (tmp_path / "out.onnx").exists()
