"""The numpy core of the 1-D selection and the checks (nmdeploy.masks.arrays) and the torch functions agree bit for
bit, with each other and with the plain definitions: a stable descending sort, and counts per group or tile."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import nmdeploy.masks as masks
from nmdeploy.errors import InputError, ShapeError
from nmdeploy.masks import is_nm, is_transposable, nm_mask
from nmdeploy.masks.arrays import nm_compliance, nm_keep, transposable_compliance

SHAPES = [(8, 12), (3, 5, 8), (16,), (4, 1, 2, 8), (0, 8), (32, 40)]
PATTERNS = ["1:2", "2:4", "3:4", "1:3", "2:3", "4:8", "3:5", "16:32"]


def _sorted_topn(scores: torch.Tensor, n: int, m: int, axis: int) -> torch.Tensor:
    """The definition: groups of M along ``axis``, a stable descending sort in each, the first N kept."""
    moved = scores.movedim(axis, -1)
    grouped = moved.reshape(*moved.shape[:-1], moved.shape[-1] // m, m)
    order = torch.sort(grouped, dim=-1, descending=True, stable=True).indices
    keep = torch.zeros_like(grouped, dtype=torch.bool).scatter_(-1, order[..., :n], True)
    return keep.reshape(moved.shape).movedim(-1, axis)


def _without_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the torch functions take the path of tensors numpy cannot share (other devices, bfloat16)."""
    monkeypatch.setattr("nmdeploy.masks.select.cpu_array", lambda tensor: None)
    monkeypatch.setattr("nmdeploy.masks.check.cpu_array", lambda tensor: None)


def _scores(shape: tuple[int, ...], seed: int, dtype: np.dtype) -> np.ndarray:
    """Random signed values with many ties: small integers (equal magnitudes of both signs, zeros, -0.0)."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-3, 4, size=shape).astype(dtype)
    values[rng.random(shape) < 0.1] = -0.0
    return values


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_numpy_and_torch_masks_are_identical_along_every_axis(pattern, shape, dtype, monkeypatch):
    n, m = map(int, pattern.split(":"))
    values = _scores(shape, seed=len(shape) * 31 + m, dtype=dtype)
    tensor = torch.from_numpy(values.copy())
    for axis in range(len(shape)):
        if shape[axis] % m:
            with pytest.raises(ShapeError, match=f"multiple of {m}"):
                nm_keep(values, pattern, axis, absolute=True)
            continue
        ours = nm_keep(values, pattern, axis, absolute=True)
        assert ours.dtype == np.bool_ and ours.shape == values.shape and ours.flags.c_contiguous
        expected = _sorted_topn(tensor.float().abs(), n, m, axis)
        assert np.array_equal(ours, expected.numpy()), (pattern, shape, axis)
        assert np.array_equal(nm_keep(np.abs(values), pattern, axis), ours)
        assert np.array_equal(nm_mask(tensor, pattern, axis).numpy(), ours)
        assert np.array_equal(nm_mask(tensor, pattern, axis, score=tensor.abs()).numpy(), ours)
        with monkeypatch.context() as patched:
            _without_numpy(patched)
            assert np.array_equal(nm_mask(tensor, pattern, axis).numpy(), ours)


def test_strided_views_and_negative_axes_give_the_mask_of_their_values():
    values = _scores((12, 16), seed=5, dtype=np.float32)
    for view in (values.T, values[:, ::2], values[::-1]):
        for axis in (-1, -2):
            if view.shape[axis] % 4:
                continue
            expected = _sorted_topn(torch.from_numpy(np.abs(view).copy()), 2, 4, axis % 2).numpy()
            assert np.array_equal(nm_keep(view, "2:4", axis, absolute=True), expected)
            assert nm_compliance(view * expected, "2:4", axis).fraction == 1.0


def test_bfloat16_arrays_rank_like_their_float32_values():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = _scores((16, 32), seed=3, dtype=np.float32)
    for pattern in ("2:4", "4:8"):
        expected = nm_keep(values, pattern, 0, absolute=True)
        assert np.array_equal(nm_keep(values.astype(ml_dtypes.bfloat16), pattern, 0, absolute=True), expected)
        tensor = torch.from_numpy(values).to(torch.bfloat16)  # torch's own path: numpy cannot share bfloat16
        assert np.array_equal(nm_mask(tensor, pattern, 0).numpy(), expected)


def test_infinities_rank_and_nan_is_refused_in_every_block(monkeypatch):
    values = np.array([[np.inf, 1.0, -np.inf, 0.0], [2.0, 2.0, -2.0, 5.0]], np.float32)
    assert nm_keep(values, "2:4", absolute=True).tolist() == [[True, False, True, False], [True, False, False, True]]
    assert nm_keep(values, "1:4").tolist() == [[True, False, False, False], [False, False, False, True]]
    monkeypatch.setattr("nmdeploy.masks.groups.CACHE_BLOCK_ELEMENTS", 8)  # one row per block: NaN in the last one
    big = np.ones((6, 8), np.float32)
    big[5, 3] = np.nan
    for pattern in ("2:4", "4:8"):
        with pytest.raises(InputError, match="NaN"):
            nm_keep(big, pattern)
        with pytest.raises(InputError, match="NaN"):
            nm_mask(torch.from_numpy(big), pattern)


def test_bad_shapes_and_patterns_give_the_torch_functions_errors():
    with pytest.raises(ShapeError, match="scalar"):
        nm_keep(np.float32(1.0).reshape(()), "2:4")
    with pytest.raises(ShapeError, match="out of range"):
        nm_keep(np.ones((4, 4), np.float32), "2:4", axis=2)
    with pytest.raises(ShapeError, match="pattern 2:4 needs the length of axis 1 to be a multiple of 4, got 6"):
        nm_keep(np.ones((4, 6), np.float32), "2:4")
    with pytest.raises(ShapeError, match="must differ"):
        transposable_compliance(np.ones((4, 4)), "2:4", axis=1, out_axis=-1)
    with pytest.raises(ShapeError, match="needs a matrix"):
        transposable_compliance(np.ones(8), "2:4")


@pytest.mark.parametrize("pattern", ["2:4", "1:2", "3:8", "2:3"])
@pytest.mark.parametrize("shape", [(8, 24), (2, 12, 6), (24,), (0, 24)])
def test_compliance_counts_match_torch_and_a_loop(pattern, shape, monkeypatch):
    n, m = map(int, pattern.split(":"))
    rng = np.random.default_rng(m * 7 + len(shape))
    values = rng.standard_normal(shape).astype(np.float32) * (rng.random(shape) < 0.55)
    values[rng.random(shape) < 0.02] = np.nan  # NaN counts as non-zero
    tensor = torch.from_numpy(values)
    for axis in range(len(shape)):
        if shape[axis] % m:
            continue
        groups = np.moveaxis(values != 0, axis, -1).reshape(-1, m)
        expected = (int((groups.sum(axis=1) <= n).sum()), len(groups))
        ours = nm_compliance(values, pattern, axis)
        assert (ours.compliant, ours.total) == expected
        assert nm_compliance(values != 0, pattern, axis) == ours
        assert is_nm(tensor, pattern, axis) == ours
        with monkeypatch.context() as patched:
            _without_numpy(patched)
            assert is_nm(tensor, pattern, axis) == ours


@pytest.mark.parametrize("pattern", ["2:4", "1:2", "4:8"])
def test_transposable_counts_match_torch_and_a_loop(pattern, monkeypatch):
    n, m = map(int, pattern.split(":"))
    rng = np.random.default_rng(m)
    values = rng.standard_normal((2, 16, 24)) * (rng.random((2, 16, 24)) < 0.4)
    values[0, :m, :m] = np.eye(m)  # a tile that passes for certain
    tensor = torch.from_numpy(values)
    for axis, out_axis in [(-1, -2), (1, 2), (0, 1)]:
        matrix = np.moveaxis(values != 0, (out_axis, axis), (-2, -1))
        ok = []
        for batch in np.ndindex(matrix.shape[:-2]):
            for r in range(0, matrix.shape[-2], m):
                for c in range(0, matrix.shape[-1], m):
                    tile = matrix[batch][r : r + m, c : c + m]
                    ok.append((tile.sum(axis=0) <= n).all() and (tile.sum(axis=1) <= n).all())
        if matrix.shape[-2] % m or matrix.shape[-1] % m:
            continue
        ours = transposable_compliance(values, pattern, axis=axis, out_axis=out_axis)
        assert (ours.compliant, ours.total) == (sum(ok), len(ok)) and ours.compliant > 0
        assert is_transposable(tensor, pattern, axis=axis, out_axis=out_axis) == ours
        with monkeypatch.context() as patched:
            _without_numpy(patched)
            assert is_transposable(tensor, pattern, axis=axis, out_axis=out_axis) == ours


def test_every_public_name_resolves_and_importing_the_core_loads_no_torch():
    assert sorted(masks.__all__) == sorted(masks._MODULES) and set(masks.__all__) <= set(dir(masks))
    for name in masks.__all__:
        assert getattr(masks, name).__module__.startswith("nmdeploy.masks."), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        masks.nope  # noqa: B018
    script = (
        "import sys\n"
        "import nmdeploy.masks, nmdeploy.masks.arrays, nmdeploy.graph.tensors, nmdeploy.passes\n"
        "from nmdeploy.masks import Pattern, Compliance, nm_keep\n"
        "assert 'torch' not in sys.modules\n"
        "from nmdeploy.masks import nm_mask\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
