"""``pipeline --precision int8|fp8``: the 2:4 digits model quantized by the recipe's quantize step after the
conversion, judged against the dense model in ONNX Runtime on the CPU, and the engine step pointed at the Q/DQ model;
a precision the pipeline does not know is one line and writes nothing."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from nmdeploy import pipeline
from nmdeploy.errors import InputError
from nmdeploy.graph.model import OnnxModel
from nmdeploy.pipeline.models import user_model
from nmdeploy.pipeline.steps import quantize
from nmdeploy.runtimes.engine_report import quantized_types

pytest.importorskip("sklearn")


def test_unknown_precision_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(InputError, match=r"--precision 'int4': choose one of fp16, int8, fp8") as raised:
        pipeline.run_pipeline(out, models=("digits",), precision="int4")
    assert "\n" not in str(raised.value) and not out.exists()
    with pytest.raises(InputError, match="--precision 'bf16'"):
        pipeline.run_user_pipeline(
            tmp_path / "missing.onnx", calibration="random", evaluation="random", out_dir=out, precision="bf16"
        )
    assert not out.exists()


@pytest.fixture(scope="module")
def int8_run(tmp_path_factory) -> pipeline.PipelineReport:
    lines: list[str] = []
    report = pipeline.run_pipeline(
        tmp_path_factory.mktemp("out"), models=("digits",), precision="int8", progress=lines.append
    )
    assert "digits: quantize int8 ..." in lines and "digits: compare int8 ..." in lines
    return report


@pytest.mark.slow
def test_int8_run_quantizes_the_2of4_model_and_keeps_accuracy(int8_run):
    (model,) = int8_run.models
    folder = model.folder
    quantized = folder / "converted-2of4-int8.onnx"
    for name in ("quantize.json", "compare-int8.json", "converted-2of4-int8.onnx"):
        assert (folder / name).is_file(), name
    # An oracle of its own: the INT8 initializers behind DequantizeLinear keep at most 2 non-zeros per 4 input
    # channels, for the four converted Conv/Gemm weights.
    proto = onnx.load(str(quantized))
    stored = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    dequantized = {n.output[0]: n.input[0] for n in proto.graph.node if n.op_type == "DequantizeLinear"}
    checked = 0
    for node in proto.graph.node:
        weight = stored.get(dequantized.get(node.input[1], "")) if len(node.input) > 1 else None
        if node.op_type in ("Conv", "Gemm") and weight is not None and weight.shape[1] % 4 == 0:
            groups = np.moveaxis(weight, 1, -1).reshape(-1, 4)
            assert (np.count_nonzero(groups, axis=-1) <= 2).all(), node.name
            checked += 1
    assert checked == 4
    assert quantized_types(OnnxModel.load(quantized)) == {"int8"}
    # The bar: within 0.3 points of the 2:4 fp32 model's accuracy on the 450 held-out images.
    task = model.task_accuracy
    assert abs(task["int8"] - task["converted"]) <= 0.003
    quantization = model.quantization
    assert quantization["precision"] == "int8" and quantization["comparison"]["mean_cosine"] > 0.99
    # All five layers are quantized; the first convolution reduces over one channel (not 2:4) and the last Gemm's
    # output is the graph output (kept in floating point), so 3 of 5 are 2:4 + INT8 in and out.
    assert (quantization["layers"], quantization["sparse_quantized_layers"]) == (5, 3)
    rows = [row for row in json.loads((folder / "quantize.json").read_text())["report"] if row["item"] == "layer"]
    assert sum(row["sparse_integer"] for row in rows) == 3
    summary = (int8_run.out_dir / "summary.md").read_text()
    assert "- INT8 Q/DQ: 3 of 5 layers 2:4 + INT8 in/out; against dense: cosine" in summary
    assert (
        summary.rstrip()
        .splitlines()[-1]
        .startswith(
            "PASSED | pipeline (digits): 4 weights converted to 2:4, 3 layers 2:4 + INT8 in/out (int8 model of digits "
            "NOT judged: no baselines entry),"  # the bundled baselines judge the 2:4 model only
        )
    )
    reason = pipeline.engine_skip_reason()
    if reason is None:  # TensorRT and a GPU: the engine of the Q/DQ model, its INT8 layers counted
        assert model.engine["engine"].endswith("converted-2of4-int8.engine") and model.engine["quantized"]
    else:
        assert model.engine == {"skipped": reason}


@pytest.mark.slow
def test_fp8_step_on_the_same_2of4_model(int8_run, tmp_path):
    (model,) = int8_run.models
    prepared = user_model(
        model.folder / "dense.onnx", model.folder / "calibration", model.folder / "evaluation", tmp_path
    )
    output = tmp_path / "converted-2of4-fp8.onnx"
    summary = quantize(prepared, model.folder / pipeline.CONVERTED, output, tmp_path / "quantize.json", "fp8")
    # One more 2:4 layer than INT8's 3: the 2:4 layer whose output stays in float (INT8's report says why) is
    # eligible for sparse FP8 kernels, which need FP8 in only.
    assert (summary["precision"], summary["method"], summary["sparse_quantized_layers"]) == ("fp8", "max", 4)
    assert quantized_types(OnnxModel.load(output)) == {"fp8"}
    assert not (model.folder / "converted-2of4-fp8.onnx").exists()


def test_the_command_line_passes_the_precision_and_a_wrong_one_is_one_line(tmp_path, capsys):
    from nmdeploy.cli import main

    out = tmp_path / "out"
    assert main(["pipeline", "--models", "digits", "--precision", "int4", "-o", str(out)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--precision 'int4': choose one of fp16, int8, fp8" in error[0]
    assert not out.exists()


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--recover", "20", "--seed", "3", "--recover-precision", "float32"],
        ["--range-method", "max", "--no-smooth"],
    ],
    ids=["one-shot", "recovered", "quantization-flags"],
)
def test_a_floor_and_an_8bit_precision_make_the_pipeline_write_what_convert_writes(tmp_path, capsys, extra):
    """The pipeline's conversion is the precision budget (no separate quantize step): its Q/DQ model is byte for
    byte convert's with the same options (recovery, quantization flags), and converted-2of4.onnx is that mix before
    quantization."""
    from test_pipeline_user import build_mlp, write_data

    from nmdeploy.cli import main

    model = build_mlp(tmp_path / "model.onnx")
    calibration, evaluation = write_data(tmp_path / "calib.npz", 256, 1), write_data(tmp_path / "eval.npz", 64, 2)
    options = ["--calib", str(calibration), "--min-fidelity", "0.9", "--precision", "int8", *extra]
    recover = "--recover" in extra
    out = tmp_path / "out"
    assert main(["pipeline", str(model), "--data", str(evaluation), "-o", str(out), "--batch", "1", *options]) == 0
    progress = capsys.readouterr().err
    assert "quantize int8" not in progress and "compare int8 ..." in progress
    assert main(["convert", str(model), "-o", str(tmp_path / "convert.onnx"), *options, "--json"]) == 0
    budget = json.loads(capsys.readouterr().out)["budget"]
    choices = [layer["choice"] for layer in budget["layers"]]
    assert len(set(choices)) > 1  # a mixed choice: the whole model quantized after the fact would differ
    deployed = onnx.load(out / "converted-2of4-int8.onnx")
    assert deployed.graph.SerializeToString() == onnx.load(tmp_path / "convert.onnx").graph.SerializeToString()
    assert json.loads((out / "convert.json").read_text())["budget"]["layers"] == budget["layers"]
    assert ("recovery" in budget) == recover

    # converted-2of4.onnx: the dense model with the 2:4 layers of the mix, in floating point.
    dense = {t.name: numpy_helper.to_array(t) for t in onnx.load(model).graph.initializer}
    converted = {t.name: numpy_helper.to_array(t) for t in onnx.load(out / "converted-2of4.onnx").graph.initializer}
    for layer in budget["layers"]:
        weight = converted[layer["weight"]]
        if layer["choice"].startswith("2:4"):
            assert ((weight.T.reshape(-1, 4) != 0).sum(axis=1) <= 2).all() and weight.dtype == np.float32
        else:  # recovery trains the 2:4 weights, biases and normalisations, never a weight left dense
            assert np.array_equal(weight, dense[layer["weight"]])
    quantization = json.loads((out / "summary.json").read_text())["models"][0]["quantization"]
    assert quantization["choices"] == {choice: choices.count(choice) for choice in set(choices)}
    assert quantization["method"] == ("max" if "--range-method" in extra else "auto")
    assert "(the budget chose " in (out / "summary.md").read_text()


def test_quantization_flags_reach_the_pipelines_quantize_step_and_need_an_8bit_precision(tmp_path, capsys):
    from test_pipeline_user import build_mlp, write_data

    from nmdeploy.cli import main

    model = build_mlp(tmp_path / "model.onnx")
    calibration, evaluation = write_data(tmp_path / "calib.npz", 64, 1), write_data(tmp_path / "eval.npz", 16, 2)
    out = tmp_path / "out"
    argv = ["pipeline", str(model), "--calib", str(calibration), "--data", str(evaluation), "-o", str(out)]
    assert main([*argv, "--range-method", "max", "--batch", "1"]) == 2  # fp16: the flag would do nothing
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--range-method: quantization flags" in error[0] and not out.exists()
    assert main([*argv, "--precision", "int8", "--range-method", "max", "--batch", "1"]) == 0
    assert "quantize int8 ..." in capsys.readouterr().err  # no floor: the quantize step, with the flag
    summary = json.loads((out / "summary.json").read_text())["models"][0]["quantization"]
    assert summary["method"] == "max" and "choices" not in summary
    rows = json.loads((out / "quantize.json").read_text())["report"]
    assert [row["method"] for row in rows if row.get("item") == "summary"] == ["max"]


def test_the_quantize_step_calibrates_with_the_rows_per_run_of_calib_batch(tmp_path, capsys, monkeypatch):
    from test_pipeline_user import build_mlp, write_data

    from nmdeploy.cli import main
    from nmdeploy.passes.quantize import QuantizePass

    seen = []
    original = QuantizePass.call

    def recording(self, model):
        seen.append(self.batch_size)
        return original(self, model)

    monkeypatch.setattr(QuantizePass, "call", recording)
    model = build_mlp(tmp_path / "model.onnx")
    calibration, evaluation = write_data(tmp_path / "calib.npz", 64, 1), write_data(tmp_path / "eval.npz", 16, 2)
    out = tmp_path / "out"
    argv = ["pipeline", str(model), "--calib", str(calibration), "--data", str(evaluation), "-o", str(out)]
    assert main([*argv, "--precision", "int8", "--calib-batch", "16", "--batch", "1"]) == 0
    assert "quantize int8 ..." in capsys.readouterr().err
    assert seen == [16]  # as the conversion calibrated: 16 rows a run
    conversion = json.loads((out / "convert.json").read_text())
    assert [row["calibration_batches"] for row in conversion["report"] if row.get("step") == "summary"] == [4]


def test_the_8bit_model_the_engine_is_built_from_is_judged_by_the_baselines(tmp_path, capsys):
    """The first run writes an entry for the INT8 model beside the 2:4 one; a later run whose quantization breaks
    (activation ranges clipped to the 1st percentile) fails on that entry, where before it passed on the 2:4 model
    alone; judged by a baselines file without such an entry, the verdict says the INT8 model was not judged."""
    import tomllib

    from test_pipeline_user import build_mlp, write_data

    from nmdeploy.cli import main

    model = build_mlp(tmp_path / "model.onnx")
    calibration, evaluation = write_data(tmp_path / "calib.npz", 64, 1), write_data(tmp_path / "eval.npz", 16, 2)
    out = tmp_path / "out"
    argv = ["pipeline", str(model), "--calib", str(calibration), "--data", str(evaluation), "-o", str(out)]
    assert main([*argv, "--precision", "int8", "--batch", "1"]) == 0
    capsys.readouterr()
    entries = tomllib.loads((out / "baselines.toml").read_text())["model"]
    assert [entry["candidate"] for entry in entries] == ["converted-2of4.onnx", "converted-2of4-int8.onnx"]
    assert "latency" not in entries[1] and "mean_cosine" in next(iter(entries[1]["accuracy"].values()))

    assert (
        main([*argv, "--precision", "int8", "--batch", "1", "--range-method", "percentile", "--percentile", "1"]) == 1
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("FAILED | pipeline (model)") and "-2of4-int8: " in last, last

    fp16_only = tmp_path / "fp16"
    assert main([*argv[:-2], "-o", str(fp16_only), "--batch", "1"]) == 0
    capsys.readouterr()
    before = (fp16_only / "baselines.toml").read_bytes()
    assert main([*argv[:-2], "-o", str(fp16_only), "--batch", "1", "--precision", "int8"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("PASSED") and "(int8 model of model NOT judged: no baselines entry)" in last, last
    assert (fp16_only / "baselines.toml").read_bytes() == before
