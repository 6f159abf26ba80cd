"""What nmdeploy hands to polygraphy's TensorRT loaders, checked without TensorRT: the optimisation profile, the
builder configuration, polygraphy's log kept off stdout; and ``nmdeploy build`` run end to end through polygraphy's
real loaders on a stand-in ``tensorrt`` module (tests/fixtures/fake_tensorrt) that records what reached it."""

from __future__ import annotations

import glob
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import pytest
from polygraphy.backend.trt import CreateConfig, Profile
from polygraphy.exception import PolygraphyException
from polygraphy.logger import G_LOGGER
from test_engine_report import sparse_mlp

from nmdeploy.errors import InputError
from nmdeploy.runtimes.engine_report import DENSE_CHOSEN, MISSED, NOT_ELIGIBLE, SPARSE
from nmdeploy.runtimes.tensorrt import _errors, builder_config, optimisation_profile, polygraphy_log

FIXTURES = Path(__file__).resolve().parent / "fixtures"

# The two TensorRT enums builder_config reads, as stand-ins: nothing here needs TensorRT itself.
FAKE_TRT = SimpleNamespace(
    MemoryPoolType=SimpleNamespace(WORKSPACE="WORKSPACE"), ProfilingVerbosity=SimpleNamespace(DETAILED="DETAILED")
)


def shapes_of(profile: Profile) -> dict[str, tuple]:
    return {name: tuple(profile[name]) for name in profile}


def test_profile_fixes_static_inputs_and_takes_the_given_ranges_for_dynamic_ones():
    inputs = [("ids", (-1, -1)), ("mask", (-1, -1)), ("scale", (1,))]
    ranges = {name: ((1, 8), (4, 128), (8, 512)) for name in ("ids", "mask")}
    profile = optimisation_profile(inputs, ranges)
    assert isinstance(profile, Profile)
    assert shapes_of(profile) == {
        "ids": ((1, 8), (4, 128), (8, 512)),
        "mask": ((1, 8), (4, 128), (8, 512)),
        "scale": ((1,), (1,), (1,)),
    }
    static = optimisation_profile([("x", (8, 512))], {})
    assert shapes_of(static) == {"x": ((8, 512),) * 3}


def test_profile_keys_match_exactly_their_own_input_under_polygraphys_patterns():
    names = ["x[0]", "x0", "a*b", "a?c"]
    inputs = [(name, (-1, 2) if name == "x[0]" else (1, 2)) for name in names]
    profile = optimisation_profile(inputs, {"x[0]": ((1, 2), (2, 2), (4, 2))})
    for name, key in zip(names, profile, strict=True):
        assert [other for other in names if fnmatch(other, key)] == [name]
    assert tuple(profile[glob.escape("x[0]")]) == ((1, 2), (2, 2), (4, 2))


@pytest.mark.parametrize(
    ("inputs", "shapes", "message"),
    [
        ([("x", (-1, 512))], {"y": ((1, 512),) * 3}, r"--shapes names y, which the model lacks; its inputs are"),
        ([("x", (-1, 512))], {}, r"input 'x' has dynamic shape \[-1, 512\]; give it with --shapes x:1x512"),
        ([("x", (-1, 512))], {"x": ((1, 256),) * 3}, r"shapes given for 'x' do not fit its shape \[-1, 512\]"),
        ([("x", (-1, 512))], {"x": ((1, 512, 1),) * 3}, r"shapes given for 'x' do not fit"),
    ],
)
def test_profile_errors_are_one_line_input_errors(inputs, shapes, message):
    with pytest.raises(InputError, match=message) as raised:
        optimisation_profile(inputs, shapes)
    assert "\n" not in str(raised.value)


def test_strongly_typed_sparse_config():
    profile = Profile().add("x", (8, 512), (8, 512), (8, 512))
    config = builder_config(
        FAKE_TRT, profile=profile, strongly_typed=True, sparse=True, timing_cache=b"cache", workspace_mib=1024
    )
    assert isinstance(config, CreateConfig)
    assert config.sparse_weights is True
    assert (config.fp16, config.bf16, config.int8, config.fp8) == (False, False, False, False)
    assert config.tf32 is True  # TensorRT's own default, which CreateConfig would otherwise clear
    assert config.profiles == [profile]
    assert config.memory_pool_limits == {"WORKSPACE": 1024 << 20}
    assert config.profiling_verbosity == "DETAILED"
    cache = config.timing_cache_path  # a file-like object (polygraphy checks its mode): no .lock file beside the cache
    assert isinstance(cache, io.BytesIO) and cache.mode == "rb" and cache.getvalue() == b"cache"


def test_weakly_typed_dense_config_allows_half_precision_and_keeps_defaults():
    profile = Profile().add("x", (1, 4), (1, 4), (1, 4))
    config = builder_config(FAKE_TRT, profile=profile, strongly_typed=False)
    assert config.sparse_weights is False and config.fp16 is True and config.bf16 is True
    assert config.timing_cache_path is None and config.memory_pool_limits is None


def test_polygraphy_log_is_collected_off_stdout_and_restored(capsys, caplog):
    before = (G_LOGGER.use_python_logging_system, G_LOGGER.letter, G_LOGGER.module_severity.get())
    with caplog.at_level(logging.WARNING, logger="nmdeploy.runtimes.tensorrt"), polygraphy_log() as lines:
        G_LOGGER.verbose("(Sparsity) Layers eligible for sparse math: fc1, fc2")  # TensorRT's INFO arrives so
        G_LOGGER.extra_verbose("tactic timing details")  # TensorRT's VERBOSE: not kept
        G_LOGGER.warning("weights look odd")
        G_LOGGER.error("something failed")
    assert lines == [
        "[I] (Sparsity) Layers eligible for sparse math: fc1, fc2",
        "[W] weights look odd",
        "[E] something failed",
    ]
    assert capsys.readouterr().out == ""
    assert [record.getMessage() for record in caplog.records] == ["TensorRT: weights look odd"]
    assert (G_LOGGER.use_python_logging_system, G_LOGGER.letter, G_LOGGER.module_severity.get()) == before
    assert not logging.getLogger("Polygraphy").handlers


def test_polygraphy_log_is_restored_after_an_error(capsys):
    with pytest.raises(RuntimeError), polygraphy_log():
        raise RuntimeError("build failed")
    G_LOGGER.warning("after the build")
    assert "after the build" in capsys.readouterr().out  # polygraphy prints again, as it did before


def test_error_messages_name_tensorrts_lines_before_polygraphys_summary():
    summary = PolygraphyException("Invalid Engine. Please ensure the engine was built correctly")
    lines = [
        "[I] Building engine",
        "[E] Error Code 4: Internal Error (fc1: no implementation\n obeys the requested constraints)",
        "[E] Error Code 2: out of memory",
        f"[E] {summary}",
    ]
    assert _errors(lines, summary) == [
        "Error Code 4: Internal Error (fc1: no implementation obeys the requested constraints)",
        "Error Code 2: out of memory",
    ]
    assert _errors(["[I] only info", f"[E] {summary}"], summary) == [str(summary)]
    assert _errors([], TypeError()) == ["TypeError"]
    traceback = '[E] File "polygraphy/backend/trt/config.py", line 340, in call_impl trt_util.fail_unavailable('
    assert _errors([traceback, "[E] timing cache unavailable"], summary) == ["timing cache unavailable"]


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_loaders_import_without_tensorrt_and_leave_it_unimported():
    Profile().add("x", (1,), (1,), (1,))
    builder_config(FAKE_TRT, profile=Profile(), strongly_typed=True)
    assert "tensorrt" not in sys.modules


def build(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``nmdeploy build`` in a fresh interpreter that imports the stand-in TensorRT (and the real polygraphy)."""
    environment = {
        **os.environ,
        # The checkout's nmdeploy, not an installed copy: the command runs in tmp_path.
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(FIXTURES / "fake_tensorrt"), str(FIXTURES.parents[1]), os.environ.get("PYTHONPATH")])
        ),
        "FAKE_TENSORRT_RECORD": str(tmp_path / "record.json"),
        **env,
    }
    command = [sys.executable, "-m", "nmdeploy", "build", *args]
    return subprocess.run(command, capture_output=True, text=True, env=environment, cwd=tmp_path)


SPARSITY_LOG = (
    "(Sparsity) Layers eligible for sparse math: /fc1/Gemm + /act/Relu, /fc2/Gemm + /act2/Relu\n"
    "(Sparsity) TRT inference plan picked sparse implementation for layers: /fc1/Gemm + /act/Relu"
)


def test_sparse_build_through_polygraphy_reports_from_the_captured_builder_log(tmp_path):
    model = sparse_mlp(tmp_path / "mlp.onnx", batch="batch")
    args = [str(model), "-o", "mlp.plan", "--sparse", "--shapes", "x:8x512", "--timing-cache", "t.cache"]
    first = build(tmp_path, *args, "--workspace", "64", "--json", FAKE_TENSORRT_BUILD_LOG=SPARSITY_LOG)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)  # nothing polygraphy logged reached stdout
    assert report["evidence"] == "builder log" and report["strongly_typed"] is True
    statuses = {row["node"]: row["status"] for row in report["layers"]}
    expected = {"/fc1/Gemm": SPARSE, "/fc2/Gemm": DENSE_CHOSEN, "/fc3/Gemm": MISSED, "/head/MatMul": NOT_ELIGIBLE}
    assert statuses == expected
    assert (tmp_path / "mlp.plan").read_bytes() == b"fake engine"
    record = json.loads((tmp_path / "record.json").read_text())
    assert record == {
        "strongly_typed": True,
        "flags": ["SPARSE_WEIGHTS", "TF32"],  # no FP16/BF16 flag on a strongly typed network
        "profiles": [{"x": [[8, 512], [8, 512], [8, 512]]}],
        "pools": {"WORKSPACE": 64 << 20},
        "profiling_verbosity": "DETAILED",
        "timing_cache": "",  # no cache file yet: an empty cache
    }
    assert (tmp_path / "t.cache").read_bytes() == b"+timed"
    second = build(tmp_path, *args, FAKE_TENSORRT_LAYERS=(FIXTURES / "tensorrt" / "mlp-layers.json").read_text())
    assert second.returncode == 0, second.stderr
    assert json.loads((tmp_path / "record.json").read_text())["timing_cache"] == "+timed"  # loaded, then saved
    assert (tmp_path / "t.cache").read_bytes() == b"+timed+timed"
    assert "(evidence: engine inspector)" in second.stdout.splitlines()[-1]
    # --require judges: two predicted-eligible layers ran dense, so no PASSED (the engine is still written).
    third = build(tmp_path, *args[:6], "--require", FAKE_TENSORRT_BUILD_LOG=SPARSITY_LOG)
    assert third.returncode == 1, third.stderr
    last = third.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED | TensorRT") and "/fc2/Gemm (dense-chosen), /fc3/Gemm (missed)" in last
    assert not [path.name for path in tmp_path.iterdir() if path.name.endswith(".lock")]


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        (
            {"FAKE_TENSORRT_FAIL": "Error Code 4: no implementation obeys the requested constraints"},
            ["--shapes", "x:8x512"],
            "TensorRT could not build an engine from mlp.onnx: Error Code 4: no implementation obeys",
        ),
        (
            {"FAKE_TENSORRT_NO_GPU": "1"},
            ["--shapes", "x:8x512"],
            "TensorRT found no usable NVIDIA GPU (CUDA initialization failure with error: 35)",
        ),
        ({}, [], "input 'x' has dynamic shape [-1, 512]; give it with --shapes x:1x512"),
        ({}, ["--shapes", "y:8x512"], "--shapes names y, which the model lacks; its inputs are ['x']"),
    ],
)
def test_failed_builds_are_one_line_and_write_nothing(tmp_path, env, args, message):
    sparse_mlp(tmp_path / "mlp.onnx", batch="batch")
    result = build(tmp_path, "mlp.onnx", "-o", "mlp.plan", *args, **env)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "mlp.plan").exists()


def test_quantized_networks_get_no_precision_flag_when_strongly_typed():
    """TensorRT 10's explicit quantization guide: with strong typing, precision flags are not needed and should not
    be set; the scales are in the graph, so no INT8 calibrator either. Weakly typed, Q/DQ are honoured only with
    the INT8 flag."""
    profile = Profile().add("x", (8, 512), (8, 512), (8, 512))
    strong = builder_config(FAKE_TRT, profile=profile, strongly_typed=True, sparse=True, quantized={"int8", "fp8"})
    assert (strong.fp16, strong.bf16, strong.int8, strong.fp8, strong.calibrator) == (False,) * 4 + (None,)
    weak = builder_config(FAKE_TRT, profile=profile, strongly_typed=False, quantized={"int8"})
    assert (weak.fp16, weak.bf16, weak.int8, weak.fp8) == (True, True, True, False)
    assert builder_config(FAKE_TRT, profile=profile, strongly_typed=False).int8 is False


def test_the_stand_in_refuses_precision_flags_on_a_strongly_typed_network(tmp_path):
    """The rule the builds below rely on: the stand-in fails a strongly typed build that sets FP16 (or INT8)."""
    script = (
        "import tensorrt as trt\n"
        "builder = trt.Builder(trt.Logger())\n"
        "network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))\n"
        "config = builder.create_builder_config()\n"
        "print(builder.build_serialized_network(network, config))\n"
        "config.set_flag(trt.BuilderFlag.INT8)\n"
        "print(builder.build_serialized_network(network, config))\n"
    )
    environment = {**os.environ, "PYTHONPATH": str(FIXTURES / "fake_tensorrt"), "FAKE_TENSORRT_RECORD": "r.json"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment, cwd=tmp_path
    )
    assert result.stdout.split() == ["b'fake", "engine'", "None"], result.stderr


INT8_LOG = (FIXTURES / "tensorrt" / "mlp-int8-trtexec.log").read_text()


def test_int8_qdq_build_is_strongly_typed_without_calibrator_and_reports_sparse_integer_layers(tmp_path):
    from test_engine_report import quantized_mlp

    quantized_mlp(tmp_path / "mlp-int8.onnx")
    result = build(
        tmp_path,
        "mlp-int8.onnx",
        "-o",
        "mlp.plan",
        "--sparse",
        "--json",
        FAKE_TENSORRT_BUILD_LOG=INT8_LOG,
        FAKE_TENSORRT_LAYERS=(FIXTURES / "tensorrt" / "mlp-int8-layers.json").read_text(),
    )
    assert result.returncode == 0, result.stderr
    assert "fp32" not in result.stderr  # INT8 weights: no "cast to fp16 first" warning
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["strongly_typed"] is True and record["flags"] == ["SPARSE_WEIGHTS", "TF32"]
    report = json.loads(result.stdout)
    assert report["quantized"] == ["2:4 + INT8 in/out: 2 of 3 layers picked sparse integer kernels"]
    assert {row["node"]: row["precision"] for row in report["layers"]} == {
        "/fc1/Gemm": "int8",
        "/fc2/Gemm": "int8",
        "/fc3/Gemm": "int8",
        "/head/MatMul": "int8 in, fp32 out",
    }
    text = build(
        tmp_path,
        "mlp-int8.onnx",
        "-o",
        "mlp-text.plan",
        "--sparse",
        FAKE_TENSORRT_BUILD_LOG=INT8_LOG,
        FAKE_TENSORRT_LAYERS=(FIXTURES / "tensorrt" / "mlp-int8-layers.json").read_text(),
    )
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert "2:4 + INT8 in/out: 2 of 3 layers picked sparse integer kernels" in lines
    assert any("/head/MatMul" in line and "int8 in, fp32 out" in line for line in lines)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_without_strongly_typed_networks_int8_gets_its_flag_and_fp8_is_refused(tmp_path, precision):
    from test_engine_report import quantized_mlp

    quantized_mlp(tmp_path / "mlp-q.onnx", precision)
    result = build(tmp_path, "mlp-q.onnx", "-o", "mlp.plan", "--sparse", FAKE_TENSORRT_WEAKLY_TYPED="1")
    if precision == "int8":
        assert result.returncode == 0, result.stderr
        record = json.loads((tmp_path / "record.json").read_text())
        assert record["strongly_typed"] is False
        assert record["flags"] == ["BF16", "FP16", "INT8", "SPARSE_WEIGHTS", "TF32"]
        assert "has no strongly typed networks" in result.stderr
        return
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1
    assert "holds FP8 Q/DQ, which TensorRT builds only as a strongly typed network" in result.stderr
    assert not (tmp_path / "mlp.plan").exists() and not (tmp_path / "record.json").exists()


@pytest.mark.parametrize("flag", ["kept", "removed"])
def test_tensorrt_11_builds_strongly_typed_with_no_precision_flag_and_reads_its_inspector(tmp_path, flag):
    """TensorRT 11 removed the precision flags (a build asking polygraphy for FP16 or INT8 fails there) and always
    builds strongly typed, with or without the deprecated STRONGLY_TYPED flag; its inspector writes the new schema."""
    from test_engine_report import quantized_mlp

    quantized_mlp(tmp_path / "mlp-int8.onnx")
    env = {"FAKE_TENSORRT_VERSION": "11.4.0", "FAKE_TENSORRT_BUILD_LOG": INT8_LOG}
    env["FAKE_TENSORRT_LAYERS"] = (FIXTURES / "tensorrt" / "mlp-int8-layers-tensorrt11.json").read_text()
    if flag == "removed":
        env["FAKE_TENSORRT_WEAKLY_TYPED"] = "1"
    result = build(tmp_path, "mlp-int8.onnx", "-o", "mlp.plan", "--sparse", "--json", **env)
    assert result.returncode == 0, result.stderr
    assert "strongly typed" not in result.stderr  # no "has no strongly typed networks" warning
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["strongly_typed"] is True and record["flags"] == ["SPARSE_WEIGHTS", "TF32"]
    report = json.loads(result.stdout)
    assert report["tensorrt"] == "11.4.0" and report["strongly_typed"] is True
    assert report["quantized"] == ["2:4 + INT8 in/out: 2 of 3 layers picked sparse integer kernels"]
    assert report["engine_io"] == [
        {"name": "x", "mode": "input", "precision": "fp32", "shape": [8, 512]},
        {"name": "y", "mode": "output", "precision": "fp32", "shape": [8, 16]},
    ]


def test_the_stand_in_for_tensorrt_11_has_no_precision_flag_to_set(tmp_path):
    """What makes the build above a check: on the TensorRT 11 stand-in, polygraphy cannot set FP16 (as on TensorRT
    11), so a weakly typed configuration fails to build."""
    script = (
        "from polygraphy.backend.trt import CreateConfig, NetworkFromOnnxPath\n"
        "import tensorrt as trt\n"
        "builder = trt.Builder(trt.Logger())\n"
        "network = builder.create_network(0)\n"
        "try:\n"
        "    CreateConfig(fp16=True)(builder, network)\n"
        "except Exception as error:\n"
        "    print('refused', type(error).__name__)\n"
        "print(sorted(flag.name for flag in trt.BuilderFlag))\n"
    )
    environment = {**os.environ, "PYTHONPATH": str(FIXTURES / "fake_tensorrt"), "FAKE_TENSORRT_VERSION": "11.4.0"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment, cwd=tmp_path
    )
    # polygraphy names the flag it cannot set ("fp16 in CreateConfig is not available on TensorRT version 11.4.0")
    assert result.stdout.splitlines()[-2:] == ["refused PolygraphyException", "['SPARSE_WEIGHTS', 'TF32']"]
    assert "fp16 in CreateConfig is not available on TensorRT version 11.4.0" in result.stderr


def test_tensorrt_outside_10_and_11_is_refused_in_one_line(tmp_path):
    sparse_mlp(tmp_path / "mlp.onnx")
    result = build(tmp_path, "mlp.onnx", "-o", "mlp.plan", FAKE_TENSORRT_VERSION="12.0.0")
    assert result.returncode == 2 and result.stdout == "" and result.stderr.count("\n") == 1
    assert "nmdeploy supports TensorRT 10 and 11, found 12.0.0" in result.stderr
    assert not (tmp_path / "mlp.plan").exists()
