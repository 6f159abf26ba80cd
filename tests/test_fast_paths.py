"""The fast paths of pruning agree exactly with the plain definitions they replace."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.tensors import keep_only_
from nmdeploy.masks import nm_mask
from nmdeploy.masks.groups import split_groups
from nmdeploy.masks.select import topn_in_groups


def _sorted_topn(scores: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """The definition: a stable descending sort, the first N kept (ties to the lower index)."""
    order = torch.sort(scores, dim=dim, descending=True, stable=True).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(dim, order.narrow(dim, 0, n), True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64])
def test_rank_by_comparison_matches_a_stable_sort_on_every_tie_pattern(dtype):
    # Every assignment of 4 values from {0, 1, 2, 3} to a group: all orderings with every kind of tie.
    groups = torch.tensor(list(itertools.product(range(4), repeat=4))).to(dtype)
    for m in (2, 3, 4):
        for n in range(1, m + 1):
            scores = groups[:, :m]
            assert torch.equal(topn_in_groups(scores, n), _sorted_topn(scores, n, -1)), (n, m)
            assert torch.equal(topn_in_groups(scores.T, n, dim=0), _sorted_topn(scores.T, n, 0)), (n, m)


@pytest.mark.parametrize("block_elements", [1 << 18, 100, 1])
def test_nm_mask_on_a_split_axis_matches_the_sort_along_every_axis(block_elements, monkeypatch):
    # Small blocks: the CPU path selects block by block, uneven last block included; one block: the whole tensor.
    monkeypatch.setattr("nmdeploy.masks.groups.CACHE_BLOCK_ELEMENTS", block_elements)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-3, 4, (8, 12, 4, 8), generator=generator).float()
    for axis in range(weight.ndim):
        moved = weight.abs().movedim(axis, -1)
        grouped = moved.reshape(*moved.shape[:-1], -1, 4)
        expected = _sorted_topn(grouped, 2, -1).reshape(moved.shape).movedim(-1, axis)
        assert torch.equal(nm_mask(weight, "2:4", axis), expected), axis


def test_split_groups_is_a_view_and_refuses_a_remainder():
    tensor = torch.arange(24.0).reshape(2, 12)
    view, dim = split_groups(tensor, 4, 1)
    assert view.shape == (2, 3, 4) and dim == 2 and view.data_ptr() == tensor.data_ptr()
    assert split_groups(tensor, 5, 1) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_keep_only_zeroes_pruned_bits_and_keeps_the_rest_bit_for_bit(dtype):
    values = torch.tensor([-1.5, -0.0, 2.0, -3.0, 0.0, 7.0], dtype=dtype)
    keep = torch.tensor([False, True, True, False, False, True])
    original = values.clone()
    keep_only_(values, keep)
    assert torch.equal(values[keep], original[keep]) and bool(torch.signbit(values[1]))  # kept -0.0 stays -0.0
    assert not bool(torch.signbit(values[~keep]).any()) and not bool(values[~keep].any())  # pruned: +0.0


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_external_save_streams_unchanged_bytes_and_patches_only_the_written_tensors(tmp_path, dtype):
    rng = np.random.default_rng(0)
    # w1 sits between the two replaced tensors in the data file and must come through byte for byte.
    weights = {
        name: rng.standard_normal(shape).astype(dtype)
        for name, shape in [("w0", (16, 8)), ("w1", (8, 8)), ("w2", (8, 8))]
    }
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w0"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        [numpy_helper.from_array(value, name) for name, value in weights.items()],
    )
    source = tmp_path / "in.onnx"
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(proto, source, save_as_external_data=True, location="in.onnx.data", size_threshold=0)
    data_before = (tmp_path / "in.onnx.data").read_bytes()

    model = OnnxModel.load(source)
    stored = {t.name: t for t in model.proto.graph.initializer}
    replaced = {"w0": -weights["w0"], "w2": np.zeros((8, 8), dtype)}
    for name, value in replaced.items():
        model.write(stored[name], value)
    assert not model.read(stored["w0"]).flags.writeable  # the model's own buffer is handed out read-only
    out = model.save(tmp_path / "out" / "pruned.onnx")

    assert (tmp_path / "in.onnx.data").read_bytes() == data_before  # the input is never modified
    saved = {t.name: numpy_helper.to_array(t, base_dir=str(out.parent)) for t in onnx.load(str(out)).graph.initializer}
    for name, value in weights.items():
        np.testing.assert_array_equal(saved[name], replaced.get(name, value))
    data_after = (out.parent / "pruned.onnx.data").read_bytes()
    assert len(data_after) == len(data_before)
    untouched = _external_range(stored["w1"])
    assert data_after[untouched] == data_before[untouched]


def _external_range(tensor: onnx.TensorProto) -> slice:
    info = {entry.key: entry.value for entry in tensor.external_data}
    start = int(info.get("offset", 0))
    return slice(start, start + int(info["length"]))
