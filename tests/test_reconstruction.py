"""Region reconstruction in the sequential fit (``convert --reconstruct``) on the tiny decoder export
(tests/decoder_model.py): where the regions fall, that training lowers the converted model's error against the dense
one on the calibration rows with every mask kept 2:4, and the refusals."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

pytest.importorskip("transformers")

import decoder_model as dm  # noqa: E402

from nmdeploy.cli import main  # noqa: E402

pytestmark = pytest.mark.slow  # the export takes seconds on two cores (once per session)


def _plan(path):
    from nmdeploy.calibration.statistics.segments import SegmentPlan
    from nmdeploy.calibration.statistics.stages import fitting_stages, weight_consumers
    from nmdeploy.calibration.statistics.taps import find_tap
    from nmdeploy.graph.model import OnnxModel
    from nmdeploy.passes.convert import ConvertPass

    model = OnnxModel.load(path)
    _, chosen = ConvertPass(calibration="random").select(model)
    stages = fitting_stages(model, chosen)
    taps = [[find_tap(w, node).activation for w, node in weight_consumers(model, stage).items()] for stage in stages]
    return SegmentPlan(model.index, taps, {w.name for stage in stages for w in stage}), stages


def test_regions_end_where_only_the_next_segment_reads_the_converted_values():
    from nmdeploy.calibration.statistics.reconstruction import clean_cuts, reconstruction_regions

    plan, stages = _plan(dm.exported("plain"))
    regions = reconstruction_regions(plan)
    cuts = clean_cuts(plan)
    assert len(regions) >= 2 * dm.LAYERS - 1  # attention and MLP apart, or finer
    for region in regions:
        assert region.last in cuts
        for name in region.outputs:
            assert name in plan.tainted and plan.last_need[name] == region.last + 1
        # Inputs come from before the region; weights are the fed weights its segments read.
        assert all(plan.made_in[name] < region.first for name in region.inputs)
        assert set(region.weights) <= plan.fed
    trained = [name for region in regions for name in region.weights]
    assert len(trained) == len(set(trained))  # each weight trained in one region
    # Every block linear is trained but the last MLP's three, read after the last segment (where the fit ends).
    assert len(trained) == sum(len(stage) for stage in stages) - 3


def test_a_span_joins_consecutive_regions_into_one():
    from nmdeploy.calibration.statistics.reconstruction import reconstruction_regions

    plan, _ = _plan(dm.exported("plain"))
    single, joined = reconstruction_regions(plan), reconstruction_regions(plan, span=2)
    assert len(joined) == (len(single) + 1) // 2 >= 2
    for k, region in enumerate(joined):
        parts = single[2 * k : 2 * k + 2]
        assert (region.first, region.last) == (parts[0].first, parts[-1].last)
        assert region.weights == [name for part in parts for name in part.weights]
        # What the second part read from the first is made inside the joined region: no longer one of its inputs.
        assert all(plan.made_in[name] < region.first for name in region.inputs)
        assert set(region.inputs) <= {name for part in parts for name in part.inputs}
        assert set(region.outputs) == {name for name in parts[-1].outputs} | {
            name for name in parts[0].outputs if plan.last_need[name] > region.last
        }


def _kl_to_dense(source, converted, data, capsys) -> float:
    assert main(["compare", str(source), str(converted), "--data", str(data), "--metric", "kl", "--json"]) == 0
    (figure,) = json.loads(capsys.readouterr().out)["judged"]
    return figure["details"]["kl"]


def test_reconstruction_lowers_the_error_on_the_calibration_rows(tmp_path, capsys):
    from nmdeploy.graph.weights import find_prunable_weights
    from nmdeploy.masks.check import is_nm

    source = dm.exported("plain")
    calibration = tmp_path / "calib.npz"
    np.savez(calibration, input_ids=dm.token_rows(64, 32, seed=1))
    divergence, summaries, models = {}, {}, {}
    trained = ["--reconstruct", "40", "--reconstruct-lr", "1e-3"]
    runs = (
        ("plain", []),
        ("reconstructed", trained),
        ("spanned", [*trained, "--reconstruct-span", "2"]),
        ("bfloat16", [*trained, "--reconstruct-precision", "bfloat16"]),
    )
    for name, extra in runs:
        out = tmp_path / f"{name}.onnx"
        argv = ["convert", str(source), "-o", str(out), "--calib", str(calibration), "--json", *extra]
        assert main(argv) == 0
        report = json.loads(capsys.readouterr().out)["report"]
        summaries[name] = next(row for row in report if row.get("step") == "summary")
        converted = {row["weight"] for row in report if row.get("method")}
        assert len(converted) == 14
        divergence[name] = _kl_to_dense(source, out, calibration, capsys)
        models[name] = onnx.load(out)
    summary = summaries["reconstructed"]
    assert summary["reconstruction_regions"] >= 3 and summary["reconstructed_regions"] >= 1
    assert summary["reconstruction_error_after"] < summary["reconstruction_error_before"]
    assert "reconstruction_regions" not in summaries["plain"]
    assert divergence["reconstructed"] < 0.9 * divergence["plain"]
    # Two regions trained as one: half as many (rounded up), and the model still closer to dense than without.
    assert summaries["spanned"]["reconstruction_regions"] == (summary["reconstruction_regions"] + 1) // 2
    assert divergence["spanned"] < 0.9 * divergence["plain"]
    # bfloat16 products in the training steps (float32 weights and Adam state) train as well, within rounding.
    assert summaries["bfloat16"]["reconstructed_regions"] >= 1
    assert divergence["bfloat16"] < 0.9 * divergence["plain"]
    assert divergence["bfloat16"] == pytest.approx(divergence["reconstructed"], rel=0.1)
    # Training kept every mask: each converted weight is still 2:4 along its reduction axis, and changed.
    weights = {w.name: w for w in find_prunable_weights(models["reconstructed"]).weights}
    values = {n: {t.name: numpy_helper.to_array(t) for t in m.graph.initializer} for n, m in models.items()}
    for name in converted:
        trained = values["reconstructed"][name]
        assert is_nm(torch.from_numpy(np.array(trained)), "2:4", weights[name].axis) and (trained == 0).mean() >= 0.5
    assert sum(not np.array_equal(values["plain"][n], values["reconstructed"][n]) for n in converted) >= 10


def test_a_cache_export_reconstructs_whole_batches_alike_in_both_runners(tmp_path, capsys):
    # Its Reshape targets are computed from the batch size, so its batches cannot be cut into rows: they train whole.
    source = dm.exported("cache")
    calibration = tmp_path / "calib.npz"
    np.savez(calibration, **dm.cache_feed(dm.token_rows(16, 16, seed=1)))
    errors = []
    for runner in ("onnxruntime", "torch"):
        out = tmp_path / f"{runner}.onnx"
        argv = ["convert", str(source), "-o", str(out), "--calib", str(calibration), "--statistics", runner]
        assert main([*argv, "--reconstruct", "10", "--reconstruct-lr", "1e-3", "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)["report"][-1]
        assert summary["reconstructed_regions"] == summary["reconstruction_regions"] >= 3
        errors.append((summary["reconstruction_error_before"], summary["reconstruction_error_after"]))
    for before, after in errors:
        assert after < 0.9 * before
    assert errors[0] == pytest.approx(errors[1], rel=1e-3)


def _region_errors(path, calibration, target):
    """Magnitude 2:4 at every stage (the same weights whatever the statistics), then each region reconstructed
    toward ``target``: the regions' (error before, error after)."""
    from nmdeploy.calibration.statistics.engine import StageStatistics
    from nmdeploy.calibration.statistics.reconstruction import ReconstructionOptions
    from nmdeploy.calibration.statistics.stages import fitting_stages
    from nmdeploy.graph.model import OnnxModel
    from nmdeploy.masks.select import nm_mask
    from nmdeploy.passes.convert import ConvertPass

    model = OnnxModel.load(path)
    _, chosen = ConvertPass(calibration="random").select(model)
    options = ReconstructionOptions(8, 1e-3, target=target)
    run = StageStatistics(
        model, fitting_stages(model, chosen), [calibration], compare_dense=target == "model", reconstruction=options
    )
    for stage, _stats, _skipped in run:
        for weight in stage:
            values = np.array(model.read(weight.tensor))
            keep = nm_mask(torch.from_numpy(values), "2:4", weight.axis).numpy()
            model.write(weight.tensor, np.where(keep, values, np.float32(0)))
    return [(region.error_before, region.error_after) for region in run.summary.regions]


def test_the_region_target_is_the_region_run_dense_on_its_converted_inputs():
    source = dm.exported("plain")
    calibration = {"input_ids": dm.token_rows(16, 32, seed=1)}
    toward_model = _region_errors(source, calibration, "model")
    toward_region = _region_errors(source, calibration, "region")
    assert len(toward_model) == len(toward_region) >= 3
    # The first region reads the dense model's values: both targets are the same there.
    assert toward_region[0][0] == pytest.approx(toward_model[0][0], rel=1e-4)
    # Later regions: the dense model's values carry the error of every converted region before them, the region's
    # own dense run only its own, so there is less to repair; training still repairs some of it.
    for (region_before, _), (model_before, _) in zip(toward_region[1:], toward_model[1:], strict=True):
        assert region_before < model_before
    assert sum(after < 0.9 * before for before, after in toward_region) >= 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--reconstruct", "10", "--fit", "parallel"], "--fit parallel"),
        (["--reconstruct", "-1"], "number of steps"),
        (["--reconstruct", "10", "--reconstruct-lr", "0"], "--reconstruct-lr"),
        (["--reconstruct", "10", "--method", "magnitude"], "calibration statistics"),
        (["--reconstruct", "10", "--reconstruct-span", "0"], "--reconstruct-span"),
        (["--reconstruct", "10", "--reconstruct-precision", "float16"], "float16 is for CUDA devices"),
        pytest.param(
            ["--reconstruct", "10", "--reconstruct-precision", "float16", "--device", "auto"],
            "float16 is for CUDA devices",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="auto is the CPU only without a GPU"),
        ),
    ],
)
def test_reconstruct_refuses_what_it_cannot_do(tmp_path, capsys, extra, message):
    source = dm.copy_model(dm.exported("plain"), tmp_path / "in")
    before = {path.name: path.read_bytes() for path in source.parent.iterdir()}
    calibration = tmp_path / "calib.npz"
    np.savez(calibration, input_ids=dm.token_rows(4, 16, seed=1))
    out = tmp_path / "out.onnx"
    assert main(["convert", str(source), "-o", str(out), "--calib", str(calibration), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
    assert {path.name: path.read_bytes() for path in source.parent.iterdir()} == before
