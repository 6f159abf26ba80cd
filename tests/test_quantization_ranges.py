"""Quantization math against numpy brute force: scales, quantized values, streamed histograms and clipping ranges."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nmdeploy.errors import InputError
from nmdeploy.passes.quantization_ranges import (
    AbsHistogram,
    activation_amax,
    channel_amax,
    clipping_divergence,
    entropy_amax,
    fake_quantize,
    mse_amax,
    percentile_amax,
    quantize,
    scales_for,
)


def _samples(seed: int = 0, size: int = 200_000) -> np.ndarray:
    """Gaussian activations with a few large outliers, as transformer activations have."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0.0, 1.0, size).astype(np.float32)
    values[rng.choice(size, 20, replace=False)] = rng.uniform(20.0, 40.0, 20).astype(np.float32)
    return values


def test_int8_quantize_rounds_clips_and_keeps_zero():
    values = np.array([0.0, -0.0, 0.26, -0.26, 1.0, 5.0, -5.0, 0.049, 0.051], dtype=np.float32)
    quantized = quantize(values, np.float32(0.1), "int8")
    assert quantized.dtype == np.int8
    assert quantized.tolist() == [0, 0, 3, -3, 10, 50, -50, 0, 1]
    assert quantize(np.array([100.0, -100.0], np.float32), 0.1, "int8").tolist() == [127, -127]


def test_fp8_quantize_matches_ml_dtypes_rounding_and_saturates():
    rng = np.random.default_rng(1)
    values = rng.normal(0, 3, 1000).astype(np.float32)
    values[:3] = [0.0, 1e6, -1e6]
    quantized = quantize(values, np.float32(0.5), "fp8")
    assert quantized.dtype == ml_dtypes.float8_e4m3fn
    expected = np.clip(values / np.float32(0.5), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    assert np.array_equal(quantized.astype(np.float32), expected.astype(np.float32))
    assert quantized[0] == 0 and float(quantized[1]) == 448.0 and float(quantized[2]) == -448.0
    assert np.isfinite(quantized.astype(np.float32)).all()


def test_per_channel_scales_and_all_zero_channel():
    weight = np.array([[1.0, -2.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.25, -0.127]], dtype=np.float32)
    amax = channel_amax(weight, axis=0)
    assert amax.tolist() == pytest.approx([2.0, 0.0, 0.5])
    scales = scales_for(amax, "int8")
    assert scales[1] == 1.0 and scales[0] == pytest.approx(2.0 / 127)
    columns = channel_amax(weight, axis=1)
    assert columns.tolist() == pytest.approx([1.0, 2.0, 0.127])


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_channel_too_small_for_a_normal_scale_gets_the_zero_channels_scale(precision):
    # amax / 448 (or / 127) of a denormal channel underflows to 0 or a denormal in float32: TensorRT takes neither.
    tiny = np.finfo(np.float32).tiny
    amax = np.array([1e-44, 1e-40, tiny, 0.0, 2.0], dtype=np.float32)
    scales = scales_for(amax, precision)
    assert scales.dtype == np.float32 and scales[:4].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert scales[4] == np.float32(2.0) / np.float32(127.0 if precision == "int8" else 448.0)
    assert np.all(quantize(amax[:4], scales[:4], precision).astype(np.float32) == 0)  # a zero stays a zero: N:M kept


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantize_stores_a_positive_normal_scale_for_a_denormal_channel(tmp_path, capsys, precision):
    import onnx
    from onnx import numpy_helper
    from test_quantize import mlp, run_model, save

    from nmdeploy.cli import main

    path, calibration, initializers = mlp(tmp_path)
    initializers["W2"][:, 0] = np.where(initializers["W2"][:, 0] != 0, np.float32(1e-44), np.float32(0))
    proto = onnx.load(str(path))
    path = save(tmp_path, list(proto.graph.node), initializers, list(proto.graph.input), list(proto.graph.output))
    out = tmp_path / "q.onnx"
    assert main(["quantize", str(path), "-o", str(out), "--calib", str(calibration), "--precision", precision]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("written | ")
    stored = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    scales = [value for name, value in stored.items() if name.endswith("_scale")]
    assert scales and all(np.all(np.isfinite(s) & (s >= np.finfo(np.float32).tiny)) for s in scales)
    assert np.all(stored["W2"][:, 0].astype(np.float32) == 0)
    assert np.isfinite(run_model(out, {"x": np.ones((2, 16), np.float32)})).all()


def test_histogram_streamed_with_growing_range_equals_one_pass_binning():
    values = _samples()
    streamed = AbsHistogram(bins=256)
    # Small values first, so the range doubles several times while streaming.
    ordered = values[np.argsort(np.abs(values))]
    for chunk in np.array_split(ordered, 17):
        streamed.update(chunk)
    assert streamed.total == values.size
    assert streamed.max_abs == pytest.approx(float(np.abs(values).max()))
    assert streamed.upper >= streamed.max_abs
    direct = np.minimum((np.abs(values) / streamed.width).astype(np.int64), 255)
    expected = np.bincount(direct, minlength=256)
    # Binning at the final range by hand gives the same counts (at most a value on a bin edge may differ).
    assert np.abs(streamed.counts - expected).sum() <= 4
    assert streamed.counts.sum() == values.size


def test_histogram_refuses_nan_and_counts_zeros():
    histogram = AbsHistogram(bins=16)
    histogram.update(np.zeros(10, np.float32))
    assert histogram.counts[0] == 10 and histogram.max_abs == 0.0
    assert activation_amax(histogram, "mse", "int8") == 0.0
    histogram.update(np.array([1.0, 2.0], np.float32))
    assert histogram.counts[0] == 10 and histogram.total == 12
    with pytest.raises(InputError, match="NaN"):
        histogram.update(np.array([np.nan], np.float32), "x")


def test_percentile_within_one_bin_of_numpy():
    values = _samples(2)
    histogram = AbsHistogram()
    for chunk in np.array_split(values, 5):
        histogram.update(chunk)
    for percentile in (99.0, 99.9, 99.99):
        exact = float(np.percentile(np.abs(values), percentile))
        assert abs(percentile_amax(histogram, percentile) - exact) <= histogram.width + 1e-6
    assert percentile_amax(histogram, 100.0) == pytest.approx(histogram.max_abs)
    with pytest.raises(InputError):
        percentile_amax(histogram, 0.0)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_mse_choice_is_near_the_brute_force_best_on_the_raw_values(precision):
    values = _samples(3, 50_000)
    histogram = AbsHistogram()
    histogram.update(values)
    chosen = mse_amax(histogram, precision)
    grid = histogram.max_abs * np.arange(1, 129) / 128
    errors = np.array([np.mean((values - fake_quantize(values, amax, precision)) ** 2) for amax in grid])
    chosen_error = np.mean((values - fake_quantize(values, chosen, precision)) ** 2)
    assert chosen_error <= errors.min() * 1.05
    max_error = np.mean((values - fake_quantize(values, histogram.max_abs, precision)) ** 2)
    assert chosen_error < max_error


def _divergence_by_loops(counts: np.ndarray, clip: int, levels: int) -> float:
    """The same KL divergence written as plain loops, as TensorRT's calibration guide describes it."""
    p = [float(c) for c in counts[:clip]]
    p[-1] += float(counts[clip:].sum())
    q = [0.0] * clip
    for j in range(levels):
        start, end = (j * clip) // levels, ((j + 1) * clip) // levels
        chunk = counts[start:end]
        nonempty = sum(1 for c in chunk if c > 0)
        for k in range(start, end):
            q[k] = float(chunk.sum()) / nonempty if counts[k] > 0 else 0.0
    sp, sq = sum(p), sum(q)
    return sum((a / sp) * np.log((a / sp) / max(b / sq, 1e-12)) for a, b in zip(p, q, strict=True) if a > 0)


def test_entropy_divergence_matches_loops_and_clips_outliers():
    values = _samples(4)
    histogram = AbsHistogram()
    histogram.update(values)
    counts = histogram.counts.astype(np.float64)
    for clip in (128, 200, 777, 2048):
        assert clipping_divergence(counts, clip, 128) == pytest.approx(_divergence_by_loops(counts, clip, 128))
    amax = entropy_amax(histogram)
    assert 3.0 < amax < 0.5 * histogram.max_abs
    with pytest.raises(InputError, match="entropy"):
        activation_amax(histogram, "entropy", "fp8")
    assert activation_amax(histogram, "max", "fp8") == histogram.max_abs
    with pytest.raises(InputError, match="unknown range method"):
        activation_amax(histogram, "minmax", "int8")


def test_entropy_ignores_exact_zeros_such_as_relu_outputs():
    positive = np.abs(_samples(5, 50_000))
    with_zeros = np.concatenate([np.zeros(150_000, np.float32), positive])
    plain, relu = AbsHistogram(), AbsHistogram()
    plain.update(positive)
    relu.update(with_zeros)
    assert relu.zeros == 150_000 and plain.zeros == 0
    assert relu.counts[0] == plain.counts[0] + 150_000
    assert entropy_amax(relu) == entropy_amax(plain)


def test_relative_error_is_the_lost_share_of_energy():
    from nmdeploy.passes.quantization_ranges import relative_error

    values = _samples(3, 20_000)
    histogram = AbsHistogram()
    histogram.update(values)
    centres, counts = histogram.centres(), histogram.counts
    for amax in (histogram.max_abs, histogram.max_abs / 8):
        lost = np.sum(counts * (centres - fake_quantize(centres, amax, "int8")) ** 2) / np.sum(counts * centres**2)
        assert relative_error(histogram, amax, "int8") == pytest.approx(lost)
    assert relative_error(histogram, histogram.max_abs / 8, "int8") > 10 * relative_error(
        histogram, histogram.max_abs, "int8"
    )
    assert relative_error(AbsHistogram(), 1.0, "int8") == 0.0


def test_auto_range_takes_the_candidate_with_the_least_layer_output_error():
    from nmdeploy.calibration.observers import RowSample
    from nmdeploy.passes.quantization_ranges import choose_range

    rng = np.random.default_rng(4)
    rows = rng.normal(0, 1, (512, 16)).astype(np.float32)
    rows[:, 3] *= 40.0  # an outlier channel the layer's weight reads strongly: clipping it costs the output
    weight = rng.normal(0, 1, (16, 8)).astype(np.float32)
    histogram, sample = AbsHistogram(), RowSample(rows=128)
    for batch in np.split(rows, 8):
        histogram.update(batch)
        sample.update(batch)
    assert sample.values.shape == (128, 16)

    def output_error(amax):
        return float(np.sum(((fake_quantize(sample.values, amax, "int8") - sample.values) @ weight) ** 2))

    method, amax = choose_range(histogram, sample.values, [weight], "int8")
    candidates = {m: activation_amax(histogram, m, "int8") for m in ("max", "percentile", "mse", "entropy")}
    assert amax == candidates[method]
    assert output_error(amax) == min(output_error(value) for value in candidates.values())
    assert output_error(amax) < output_error(candidates["entropy"])  # entropy clips the channel the layer needs
    with pytest.raises(InputError, match="auto"):
        activation_amax(histogram, "auto", "int8")


def test_a_range_method_is_one_registered_function_the_cli_offers(tmp_path, capsys):
    import json

    from test_quantize import mlp

    from nmdeploy.cli import main
    from nmdeploy.passes import quantization_ranges as ranges

    @ranges.range_method("half-max", help="half of max |x|, a toy", precisions=("int8",), why="is a toy for int8")
    def half_max(histogram, precision, percentile):
        return histogram.max_abs / 2

    path, calibration, _ = mlp(tmp_path)
    base = ["quantize", str(path), "--calib", str(calibration), "--no-smooth", "--json"]
    try:
        with pytest.raises(SystemExit):
            main(["quantize", "--help"])
        assert "half-max (half of max |x|, a toy)" in " ".join(capsys.readouterr().out.split())
        found = {}
        for method in ("max", "half-max"):
            assert main([*base, "-o", str(tmp_path / f"{method}.onnx"), "--range-method", method]) == 0
            report = json.loads(capsys.readouterr().out)["report"]
            found[method] = {row["tensor"]: row for row in report if row.get("item") == "activation"}
        assert found["max"] and set(found["max"]) == set(found["half-max"])
        for tensor, row in found["half-max"].items():
            assert row["method"] == "half-max" and row["amax"] == pytest.approx(found["max"][tensor]["amax"] / 2)
        out = tmp_path / "fp8.onnx"
        assert main([*base, "-o", str(out), "--range-method", "half-max", "--precision", "fp8"]) == 2
        assert "the half-max method is a toy for int8; use max, percentile or mse for fp8" in capsys.readouterr().err
        assert not out.exists()
    finally:
        ranges.RANGE_METHODS.unregister("half-max")
    with pytest.raises(InputError, match="unknown range method 'half-max'; choose one of max, percentile"):
        ranges.check_range_method("half-max", "int8")
