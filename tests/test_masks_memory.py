"""Bounded-memory conversion math: float32 fits against float64 ones on a real layer, in-place factorisation,
block-diagonal statistics (exact at B = K, their cost measured on a real layer) and the memory plan."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nmdeploy.masks.blockwise import (
    BlockDiagonal,
    block_diagonal_cost,
    refit_blockwise,
    saliency_blockwise,
    shifted_target_blockwise,
    sparsegpt_blockwise,
)
from nmdeploy.masks.memory import LayerShape, default_budget, layer_bytes, plan_statistics
from nmdeploy.masks.reconstruct import (
    FactorisationError,
    reconstruction_error,
    refit,
    saliency,
    shifted_target,
    sparsegpt_fit,
)


@pytest.fixture(scope="module")
def ffn_layer():
    """MiniLM's first FFN output projection (K = 1536) and its input moments on the calibration sentences, float64;
    the first 32 output rows, to keep the fits short."""
    minilm = pytest.importorskip("nmdeploy.reference.minilm")
    try:
        bert = minilm.load_minilm()
        feeds = minilm.sentence_feeds(minilm.sentences("calibration")[:64], batch=32, max_length=48)
    except Exception as error:  # the optional model packages are not installed
        pytest.skip(f"MiniLM unavailable: {error}")
    layer = bert.encoder.layer[0].output.dense
    moments = []

    def record(module, inputs, output):
        rows = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
        moments.append(rows.T @ rows)

    layer.register_forward_hook(record)
    with torch.no_grad():
        for feed in feeds:
            bert(**{name: torch.from_numpy(array) for name, array in feed.items()})
    return layer.weight.detach().double()[:32].clone(), sum(moments)


def test_float32_fit_matches_the_float64_fit_on_a_real_layer(ffn_layer):
    weight, hessian = ffn_layer
    exact = sparsegpt_fit(weight, hessian, 2, 4, damping=0.1)
    single = sparsegpt_fit(weight.float(), hessian.float(), 2, 4, damping=0.1)
    assert exact.precision == torch.float64 and single.precision == torch.float32
    assert single.weight.dtype == torch.float32
    error = reconstruction_error(weight, single.weight, hessian)
    # Measured: the output errors differ by about 1e-5 relative, masks agree on 99.99 % of the weights.
    assert error == pytest.approx(exact.error_converted, rel=1e-3)
    assert (single.weight != 0).eq(exact.weight != 0).float().mean() > 0.999
    # The errors a fit reports (from its factor) are the errors on the statistics.
    assert single.error_converted == pytest.approx(error, rel=1e-3)
    assert exact.error_converted == pytest.approx(reconstruction_error(weight, exact.weight, hessian), rel=1e-9)
    masked = weight * (exact.weight != 0)
    assert exact.error_masked == pytest.approx(reconstruction_error(weight, masked, hessian), rel=1e-9)


@pytest.mark.slow
def test_overwrite_factorises_the_statistics_themselves(ffn_layer):
    weight, hessian = ffn_layer
    statistics = hessian.float()
    copied = sparsegpt_fit(weight.float(), statistics, 2, 4, damping=0.1)
    address = statistics.data_ptr()
    in_place = sparsegpt_fit(weight.float(), statistics, 2, 4, damping=0.1, overwrite=True)
    assert torch.equal(in_place.weight, copied.weight) and in_place.error_converted == copied.error_converted
    assert statistics.data_ptr() == address and not torch.allclose(statistics, hessian.float())  # used up


def test_shifted_target_in_place_restores_the_statistics(ffn_layer):
    weight, hessian = ffn_layer
    statistics = hessian.float()
    dense_outputs = (hessian @ weight.T * 1.05).float()  # C W^T of slightly shifted inputs
    copied = shifted_target(weight.float(), statistics, None, 1.0, cross_outputs=dense_outputs)
    before = statistics.clone()
    in_place = shifted_target(weight.float(), statistics, None, 1.0, cross_outputs=dense_outputs, overwrite=True)
    torch.testing.assert_close(in_place, copied)
    assert (statistics - before).abs().max() <= 1e-5 * before.abs().max()
    assert not torch.allclose(copied, weight.float(), rtol=1e-3, atol=1e-4)


def test_float32_factorisation_failure_falls_back_to_float64():
    # The 9 x 9 Hilbert matrix rounded to float32 is positive definite, but its float32 Cholesky breaks down; one
    # copy in each order, so that it does whichever end the factorisation starts from.
    index = torch.arange(9, dtype=torch.float64)
    hilbert = (1 / (index[:, None] + index[None, :] + 1)).float()
    hessian = torch.block_diag(hilbert, torch.eye(2), hilbert.flip(0, 1))
    assert int(torch.linalg.cholesky_ex(hessian).info) and not int(torch.linalg.cholesky_ex(hessian.double()).info)
    weight = torch.randn(5, 20, generator=torch.Generator().manual_seed(0))
    fit = sparsegpt_fit(weight, hessian, 2, 4, damping=0.0)
    assert fit.precision == torch.float64 and fit.weight.dtype == torch.float32
    assert torch.equal((fit.weight != 0).sum(dim=1), torch.full((5,), 10))
    assert fit.error_converted < fit.error_masked
    with pytest.raises(FactorisationError, match="not positive definite in float32"):
        sparsegpt_fit(weight, hessian.clone(), 2, 4, damping=0.0, overwrite=True)


def test_errors_from_the_factor_leave_out_the_damping_and_dead_inputs():
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(200, 48, generator=generator, dtype=torch.float64)
    inputs[:, [5, 17]] = 0  # inputs that never fire
    weight = torch.randn(10, 48, generator=generator, dtype=torch.float64)
    hessian = inputs.T @ inputs
    fit = sparsegpt_fit(weight, hessian, 2, 4, damping=0.5)
    direct = ((inputs @ weight.T - inputs @ fit.weight.T) ** 2).sum().item()
    assert fit.error_converted == pytest.approx(direct, rel=1e-9)
    assert fit.error_masked == pytest.approx(reconstruction_error(weight, weight * (fit.weight != 0), hessian))


def test_block_diagonal_statistics_accumulate_the_diagonal_blocks():
    generator = torch.Generator().manual_seed(2)
    rows = torch.randn(300, 40, generator=generator)
    stats = BlockDiagonal(40, 16)
    stats.add(rows[:100])
    stats.add(rows[100:])
    full = rows.T @ rows
    assert [span for span in stats.spans()] == [(0, 16), (16, 32), (32, 40)]
    for index, (start, end) in enumerate(stats.spans()):
        torch.testing.assert_close(stats.matrix(index), full[start:end, start:end], rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(stats.diagonal(), full.diagonal(), rtol=1e-5, atol=1e-3)
    assert stats.nbytes == (2 * 16 * 16 + 8 * 8) * 4


@pytest.mark.slow
def test_one_block_of_k_columns_is_the_full_fit_exactly(ffn_layer):
    weight, hessian = ffn_layer
    weight, hessian = weight[:, :512], hessian[:512, :512]  # K = 512: a full-width block is the full matrix
    whole = BlockDiagonal.from_full(hessian, 512)
    full = sparsegpt_fit(weight, hessian, 2, 4, damping=0.1)
    blockwise = sparsegpt_blockwise(weight, whole, 2, 4, damping=0.1)

    def same_fit(a: torch.Tensor, b: torch.Tensor) -> None:
        # the same masks exactly; the values to float64 rounding (BLAS kernels order sums by CPU: AVX2 vs AVX-512)
        assert torch.equal(a != 0, b != 0)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)

    same_fit(blockwise.weight, full.weight)
    same_fit(sparsegpt_blockwise(weight, hessian, 2, 4, damping=0.1).weight, full.weight)  # H: one block
    assert blockwise.error_masked == pytest.approx(full.error_masked, rel=1e-12)
    assert blockwise.error_converted == pytest.approx(full.error_converted, rel=1e-12)
    keep = full.weight != 0
    same_fit(refit_blockwise(weight, keep, whole, 0.1), refit(weight, keep, hessian, 0.1))
    same_fit(saliency_blockwise(weight, whole), saliency(weight, hessian))
    outputs = hessian @ weight.T
    same_fit(
        shifted_target_blockwise(weight, whole, outputs, 1.0),
        shifted_target(weight, hessian, None, 1.0, cross_outputs=outputs),
    )


@pytest.mark.slow
def test_block_diagonal_cost_on_a_real_layer(ffn_layer):
    weight, hessian = ffn_layer
    half = block_diagonal_cost(weight, hessian, 2, 4, block=768)
    quarter = block_diagonal_cost(weight, hessian, 2, 4, block=384)
    # Measured on all 384 rows: +37 % output error at B = K/2 and +75 % at B = K/4 (78 % and 56 % of the fit's gain
    # over the plain mask kept). The approximation costs, more as blocks shrink, and still beats no fit at all.
    assert 0 < half.increase < quarter.increase
    assert half.error_blockwise < quarter.error_blockwise < half.error_masked
    assert 0.5 < half.share_of_fit_gain <= 1


@pytest.mark.slow
def test_refit_on_float32_statistics_matches_float64(ffn_layer):
    weight, hessian = ffn_layer
    keep = sparsegpt_fit(weight, hessian, 2, 4, damping=0.1).weight != 0
    exact = refit(weight, keep, hessian, 0.1)
    single = refit(weight.float(), keep, hessian.float(), 0.1)
    assert reconstruction_error(weight, single, hessian) == pytest.approx(
        reconstruction_error(weight, exact, hessian), rel=1e-3
    )


def test_a_wide_layer_is_never_planned_full_under_a_small_budget():
    dense = LayerShape("flatten_dense", k=25088, out=64, shifted=True)
    assert layer_bytes(dense) > 2.5e9  # K^2 float32 alone: 2.5 GB
    (plan,) = plan_statistics([dense], budget=500 << 20, m=4)
    assert plan.kind == "block-diagonal" and plan.block % 4 == 0 and plan.bytes <= 500 << 20
    assert plan.block > 1000 and "blocks of" in plan.describe()
    (plan,) = plan_statistics([dense], budget=3 << 30, m=4)
    assert plan.kind == "full"
    (plan,) = plan_statistics([dense], budget=10 << 20, m=4)
    assert plan.kind == "skip" and "--max-memory" in plan.reason


def test_a_stage_gives_the_approximation_to_its_widest_layer():
    layers = [LayerShape(f"q{i}", 384, 384) for i in range(3)] + [LayerShape("wide", 8192, 64)]
    plans = plan_statistics(layers, budget=200 << 20, m=4)
    assert [plan.kind for plan in plans] == ["full", "full", "full", "block-diagonal"]
    assert sum(plan.bytes for plan in plans) <= 200 << 20


def test_default_budget_is_part_of_the_available_memory():
    psutil = pytest.importorskip("psutil")
    budget = default_budget()
    assert 0 < budget <= psutil.virtual_memory().available


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak from /proc/self/status")
@pytest.mark.parametrize("block", [None, 512])
def test_memory_estimate_is_within_a_factor_of_two_of_the_measured_peak(block):
    # In a fresh interpreter, the peak resident memory reset just before: what the statistics and the fit add.
    script = textwrap.dedent(
        f"""
        import re, torch
        from nmdeploy.masks.blockwise import BlockDiagonal, sparsegpt_blockwise
        from nmdeploy.masks.memory import LayerShape, layer_bytes
        from nmdeploy.masks.reconstruct import sparsegpt_fit

        def status(field):
            return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

        torch.set_num_threads(1)
        k, out, block = 4096, 256, {block}
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(out, k, generator=generator)
        chunk = torch.randn(512, k, generator=generator)
        sparsegpt_fit(weight[:8, :256], chunk.T[:256] @ chunk[:, :256], 2, 4)  # warm up the kernels
        open("/proc/self/clear_refs", "w").write("5")  # resets the peak (VmHWM) to the current size
        before = status("VmRSS")
        if block is None:
            stats = torch.zeros(k, k)
            stats.addmm_(chunk.T, chunk)
            sparsegpt_fit(weight, stats, 2, 4, 0.1, overwrite=True)
        else:
            stats = BlockDiagonal(k, block)
            stats.add(chunk)
            sparsegpt_blockwise(weight, stats, 2, 4, 0.1, overwrite=True)
        print(status("VmHWM") - before, layer_bytes(LayerShape("x", k, out), block))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1]
    )
    measured, estimated = map(int, result.stdout.split())
    assert estimated / 2 <= measured <= estimated * 1.25, (measured, estimated)


def test_available_memory_counts_reclaimable_cache_without_psutil(tmp_path, monkeypatch):
    """Free pages alone undercount what a conversion can have: most of a busy machine's memory is page cache."""
    from nmdeploy.masks import memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          300000 kB\nMemAvailable:   12000000 kB\n")
    monkeypatch.setattr(memory, "optional", lambda name: None)
    monkeypatch.setattr(memory, "MEMINFO", str(meminfo))
    assert memory.available_memory() == 12000000 * 1024
    assert memory.default_budget() == 6000000 * 1024


def test_the_default_budget_rises_to_what_the_conversion_needs_within_most_of_the_available(monkeypatch):
    from nmdeploy.masks import memory

    monkeypatch.setattr(memory, "available_memory", lambda: 1740 << 20)  # a loaded machine: 1.74 GB to hand
    assert memory.default_budget() == 870 << 20  # half: below the ~1 GB any conversion holds
    assert memory.default_budget(needed=1365 << 20) == 1365 << 20  # raised to what it needs, within 80 %
    assert memory.default_budget(needed=1600 << 20) == int((1740 << 20) * 0.8)  # never past 80 %
    monkeypatch.setattr(memory, "available_memory", lambda: 20 << 30)
    assert memory.default_budget(needed=1365 << 20) == 10 << 30  # half, where half is more


def test_convert_on_a_loaded_machine_runs_within_the_raised_default(tmp_path, monkeypatch, capsys):
    """Half of 1.74 GB (870 MB) is below the fixed cost of a conversion (about 1 GB): the default once refused."""
    from test_pipeline_user import build_mlp, write_data

    from nmdeploy.calibration.statistics.engine import DEFAULT_RUN_LIMIT
    from nmdeploy.cli import main
    from nmdeploy.graph.model import OnnxModel
    from nmdeploy.masks import memory
    from nmdeploy.passes.convert import BASELINE_BYTES, MIN_STATISTICS_BYTES

    model, calib = build_mlp(tmp_path / "mlp.onnx"), write_data(tmp_path / "calib.npz", 64, seed=1)
    model_bytes = 2 * OnnxModel.load(model).proto.ByteSize()
    needed = (BASELINE_BYTES + DEFAULT_RUN_LIMIT + model_bytes + MIN_STATISTICS_BYTES) * 4 // 3
    monkeypatch.setattr(memory, "available_memory", lambda: 1740 << 20)
    assert needed > (1740 << 20) // 2  # half of what is available would not do
    assert main(["convert", str(model), "--calib", str(calib), "-o", str(tmp_path / "out.onnx")]) == 0
    assert f"(memory budget {needed / 2**20:.0f} MB)" in capsys.readouterr().out
    # Where even 80 % of what is available is below the fixed cost (the cache a quarter of the budget), it refuses.
    available = int((BASELINE_BYTES + DEFAULT_RUN_LIMIT + model_bytes) / (0.8 - 0.8 / 4) * 0.95)
    monkeypatch.setattr(memory, "available_memory", lambda: available)
    assert main(["convert", str(model), "--calib", str(calib), "-o", str(tmp_path / "again.onnx")]) == 2
    assert "the conversion holds about" in capsys.readouterr().err and not (tmp_path / "again.onnx").exists()
