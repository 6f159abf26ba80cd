"""Wanda, SparseGPT + refit and ALPS as fitting methods: each against an oracle, and their output errors in order."""

import itertools

import pytest
import torch

from nmdeploy.masks import Pattern, is_nm, nm_mask
from nmdeploy.masks.alps import alps
from nmdeploy.masks.blockwise import BlockDiagonal
from nmdeploy.masks.fitting import LayerFit, fitting_method, method_names
from nmdeploy.masks.reconstruct import reconstruction_error, refit, sparsegpt


@pytest.fixture(scope="module")
def layer():
    """A seeded layer with LLM-like inputs: correlated channels and a few loud outlier channels."""
    generator = torch.Generator().manual_seed(0)
    latent = torch.randn(1024, 16, generator=generator, dtype=torch.float64)
    inputs = latent @ torch.randn(16, 64, generator=generator, dtype=torch.float64)
    inputs += 0.3 * torch.randn(1024, 64, generator=generator, dtype=torch.float64)
    inputs[:, ::9] *= 8
    weight = torch.randn(24, 64, generator=generator, dtype=torch.float64)
    return inputs, weight, inputs.T @ inputs


def _fit(name, weight, hessian, damping=0.01):
    """One layer through the registered method as the conversion pass runs it (the pass selects the mask of a
    method that does not choose its own from the method's scores)."""
    method = fitting_method(name)
    pattern = Pattern.parse("2:4")
    support = weight != 0
    if not method.chooses_mask:
        support = support & nm_mask(weight, pattern, 1, score=method.score(weight, hessian))
    statistics = hessian.clone() if isinstance(hessian, torch.Tensor) else hessian
    return method.fit(LayerFit(weight.clone(), support, statistics, pattern, damping))


def test_the_new_methods_are_registered():
    assert {"wanda", "sparsegpt-refit", "alps"} <= set(method_names())


def test_wanda_keeps_the_top_two_scores_of_every_group_of_four_per_row(layer):
    inputs, weight, hessian = layer
    fitted = _fit("wanda", weight, hessian)
    norms = inputs.norm(dim=0)  # ||X_j||_2 straight from the inputs, not from H
    for row, start in itertools.product(range(weight.shape[0]), range(0, weight.shape[1], 4)):
        scores = [abs(float(weight[row, j])) * float(norms[j]) for j in range(start, start + 4)]
        best = sorted(range(4), key=lambda i: scores[i], reverse=True)[:2]
        for i in range(4):
            expected = float(weight[row, start + i]) if i in best else 0.0
            assert float(fitted[row, start + i]) == expected  # kept weights are not updated


def test_wanda_needs_only_the_diagonal_of_h(layer):
    _, weight, hessian = layer
    diagonal_only = torch.diag(hessian.diagonal())
    torch.testing.assert_close(_fit("wanda", weight, hessian), _fit("wanda", weight, diagonal_only))


def test_sparsegpt_refit_is_least_squares_on_sparsegpt_s_mask(layer):
    inputs, weight, hessian = layer
    fitted = _fit("sparsegpt-refit", weight, hessian, damping=0.0)
    swept = sparsegpt(weight, hessian, 2, 4, damping=0.0)
    keep = swept != 0
    assert torch.equal(fitted != 0, keep)
    for row in range(weight.shape[0]):
        support = keep[row].nonzero().squeeze(1)
        expected = torch.linalg.lstsq(inputs[:, support], (inputs @ weight[row])[:, None]).solution.squeeze(1)
        torch.testing.assert_close(fitted[row, support], expected, rtol=1e-7, atol=1e-7)


def test_alps_values_are_least_squares_on_its_mask_and_its_mask_is_n_m(layer):
    inputs, weight, hessian = layer
    fit = alps(weight, hessian, 2, 4, damping=0.0)
    assert is_nm(fit.weight, "2:4", 1)
    assert fit.steps > 1
    for row in range(weight.shape[0]):
        support = fit.keep[row].nonzero().squeeze(1)
        expected = torch.linalg.lstsq(inputs[:, support], (inputs @ weight[row])[:, None]).solution.squeeze(1)
        torch.testing.assert_close(fit.weight[row, support], expected, rtol=1e-7, atol=1e-7)


def test_alps_finds_the_best_mask_of_a_tiny_layer(layer):
    """On 1 row x 8 inputs there are 36 2:4 masks: ALPS's output error is the brute-force optimum's."""
    inputs, weight, _ = layer
    columns = inputs[:256, :8]
    hessian = columns.T @ columns
    row = weight[:1, :8]
    best = min(
        reconstruction_error(row, refit(row, torch.tensor([mask]), hessian, damping=0.0), hessian)
        for mask in (
            [i in first or i - 4 in second for i in range(8)]
            for first in itertools.combinations(range(4), 2)
            for second in itertools.combinations(range(4), 2)
        )
    )
    found = reconstruction_error(row, alps(row, hessian, 2, 4, damping=0.0).weight, hessian)
    assert found == pytest.approx(best, rel=1e-6)


def test_output_errors_in_order_on_a_seeded_layer(layer):
    """magnitude > wanda > wanda + refit; sparsegpt > sparsegpt-refit; alps below wanda + refit and sparsegpt."""
    _, weight, hessian = layer
    error = {name: reconstruction_error(weight, _fit(name, weight, hessian), hessian) for name in method_names()}
    assert error["magnitude"] > error["wanda"] > error["refit"]
    assert error["sparsegpt"] > error["sparsegpt-refit"]
    assert error["alps"] < min(error["refit"], error["sparsegpt"])
    assert error["alps"] < 0.5 * error["magnitude"]


def test_alps_keeps_existing_zeros_and_a_given_support(layer):
    _, weight, hessian = layer
    sparse = weight.clone()
    sparse[:, ::4] = 0.0  # one zero in every group: it must stay one of the two pruned
    fitted = _fit("alps", sparse, hessian)
    assert is_nm(fitted, "2:4", 1)
    assert torch.equal(fitted[:, ::4], torch.zeros_like(fitted[:, ::4]))


def test_block_diagonal_statistics_fit_each_block_on_its_own(layer):
    """With blocks as wide as the layer the blockwise fit is the full one; with narrower blocks it stays N:M."""
    _, weight, hessian = layer
    full = _fit("alps", weight, hessian)
    torch.testing.assert_close(_fit("alps", weight, BlockDiagonal.from_full(hessian, 64)), full)
    blocked = _fit("alps", weight, BlockDiagonal.from_full(hessian, 16))
    assert is_nm(blocked, "2:4", 1)
    assert reconstruction_error(weight, blocked, hessian) < reconstruction_error(
        weight, _fit("magnitude", weight, hessian), hessian
    )


def test_alps_refuses_a_reduction_axis_that_m_does_not_divide(layer):
    from nmdeploy import ShapeError

    _, weight, hessian = layer
    with pytest.raises(ShapeError, match="multiple of 4"):
        alps(weight[:, :62], hessian[:62, :62], 2, 4)


@pytest.fixture
def two_layer_model(tmp_path):
    """MatMul -> Relu -> Gemm(transB) with correlated, loud-channel inputs: calibration and held-out rows."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)

    def inputs(rows):
        x = rng.standard_normal((rows, 6)) @ rng.standard_normal((6, 32)) + 0.1 * rng.standard_normal((rows, 32))
        x[:, ::2] *= 4
        return x.astype(np.float32)

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("Gemm", ["r", "W2"], ["y"], transB=1),
        ],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 16])],
        [
            numpy_helper.from_array(rng.standard_normal((32, 64)).astype(np.float32) / 6, "W1"),
            numpy_helper.from_array(rng.standard_normal((16, 64)).astype(np.float32) / 8, "W2"),
        ],
    )
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), model)
    np.savez(tmp_path / "calib.npz", x=inputs(256))
    np.savez(tmp_path / "eval.npz", x=inputs(256))
    return model, tmp_path / "calib.npz", tmp_path / "eval.npz"


def test_every_new_method_converts_through_the_cli_and_beats_magnitude(two_layer_model, tmp_path):
    import onnx
    from onnx import numpy_helper

    from nmdeploy.cli import main
    from nmdeploy.evaluation.compare import compare_models

    model, calibration, evaluation = two_layer_model
    cosine = {}
    for method in ("magnitude", "wanda", "sparsegpt-refit", "alps"):
        out = tmp_path / f"{method}.onnx"
        assert main(["convert", str(model), "-o", str(out), "--calib", str(calibration), "--method", method]) == 0
        stored = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in onnx.load(out).graph.initializer}
        assert is_nm(stored["W1"], "2:4", 0) and is_nm(stored["W2"], "2:4", 1)
        cosine[method] = compare_models(model, out, evaluation).outputs[0].mean_cosine
    assert min(cosine["wanda"], cosine["sparsegpt-refit"], cosine["alps"]) > cosine["magnitude"]
    assert max(cosine["sparsegpt-refit"], cosine["alps"]) > cosine["wanda"]
