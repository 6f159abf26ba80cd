"""The command line's shape: every verb module is short and takes all its flags from argument groups, each flag is
declared by one group for every verb, and a group's parse gives what the library takes."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy import progress
from nmdeploy.cli import VERBS, build_parser, main

MAX_VERB_LINES = 80
# Flags two groups declare: an old name kept hidden (one warning line) where it meant something else, and --require,
# one meaning (exit 1 unless the sparsity asked for is there) checked where it can be: kernels in build, weights else.
SAME_NAME_OTHER_MEANING = {
    "--batch": {"BatchArgs", "ShardArgs"},  # the batch sizes timed; data's hidden old name of --shard-rows
    "--method": {"ConversionArgs", "PrecisionArgs"},  # the fitting method; quantize's hidden old name of --range-method
    "--require": {"EngineArgs", "RequireArgs"},  # build: layers ran sparse kernels; others: eligible weights are N:M
}


def verb_file(verb: str) -> Path:
    return Path(importlib.import_module(VERBS[verb].module).__file__)


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_module_is_under_80_lines(verb: str) -> None:
    lines = verb_file(verb).read_text(encoding="utf-8").count("\n")
    assert lines < MAX_VERB_LINES, f"nmdeploy/cli/{verb}.py has {lines} lines; move flags to a group, text to views"


def declared_flags(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, set[str]]]:
    """flag -> owner -> the verbs it is declared for; the owner is the class whose method called add_argument, or
    the module that did."""
    owners: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    original = argparse._ActionsContainer.add_argument
    current = {"verb": ""}

    def recording(self, *names, **options):
        caller = inspect.currentframe().f_back
        owner = caller.f_locals.get("self")
        where = type(owner).__name__ if owner is not None else caller.f_globals["__name__"]
        for name in names:
            if name.startswith("-"):
                owners[name][where].add(current["verb"])
        return original(self, *names, **options)

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", recording)
    for verb in VERBS:
        current["verb"] = verb
        build_parser(verb)
    return owners


def test_each_flag_is_declared_by_one_group_for_every_verb(monkeypatch: pytest.MonkeyPatch) -> None:
    owners = declared_flags(monkeypatch)
    assert {"--calib", "--pattern", "--min-fidelity", "--device", "--outputs", "--json"} <= set(owners)
    verb_modules = {VERBS[verb].module for verb in VERBS}
    for flag, by_owner in owners.items():
        assert not set(by_owner) & verb_modules, f"{flag} is declared in a verb module, not in a group"
    shared = {flag: set(by_owner) for flag, by_owner in owners.items() if len(by_owner) > 1}
    assert shared == SAME_NAME_OTHER_MEANING
    # The families the verbs share really are shared: one owner, several verbs.
    assert owners["--calib"]["CalibrationArgs"] == {"convert", "pipeline", "quantize", "run"}
    assert owners["--outputs"]["OutputsArgs"] == {"cast", "compare", "convert", "pipeline", "regress"}
    assert owners["--pattern"]["PatternArgs"] == {"convert", "inspect", "prune", "stats"}
    assert owners["--device"]["DeviceArgs"] == {"bench", "convert", "pipeline"}
    assert owners["--verbose"] == {"nmdeploy.cli": set(VERBS)}


def test_verb_modules_import_nothing_heavy_at_module_level() -> None:
    """`nmdeploy VERB --help` loads the verb's module and builds its groups' flags: none of them may import
    onnxruntime or torch (seconds of start-up; prune and inspect even run without torch)."""
    script = (
        "import sys\n"
        "from nmdeploy.cli import VERBS, build_parser\n"
        "for verb in VERBS:\n"
        "    build_parser(verb)\n"
        "print(sorted(name for name in ('torch', 'onnxruntime', 'tensorrt') if name in sys.modules))\n"
    )
    import subprocess

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_names_copied_to_keep_help_light_match_the_library() -> None:
    from nmdeploy.calibration import statistics
    from nmdeploy.cli.args import baselines, conversion, data, fidelity, precision
    from nmdeploy.conversion import recovery
    from nmdeploy.passes.quantization_ranges import QUANTIZED_MAX
    from nmdeploy.passes.quantize import OUTPUT_ERROR_LIMIT
    from nmdeploy.pipeline import MODELS, PRECISIONS
    from nmdeploy.runtimes.data import RANDOM

    assert data.RANDOM == RANDOM and set(precision.QUANTIZED) == set(QUANTIZED_MAX)
    assert precision.DEPLOYED == PRECISIONS and precision.OUTPUT_ERROR_LIMIT == OUTPUT_ERROR_LIMIT
    assert (conversion.DEFAULT_CACHE_LIMIT, conversion.RUNNERS) == (statistics.DEFAULT_CACHE_LIMIT, statistics.RUNNERS)
    copies = (fidelity.DEFAULT_STEPS, fidelity.DEFAULT_BATCH, fidelity.PRECISIONS)
    assert copies == (recovery.DEFAULT_STEPS, recovery.DEFAULT_BATCH, recovery.PRECISIONS)
    assert baselines.MODELS == MODELS


def parse(verb: str, *argv: str) -> argparse.Namespace:
    return build_parser(verb).parse_args([verb, *argv])


def test_precision_group_gives_the_quantize_pass_its_options(tmp_path: Path) -> None:
    from nmdeploy.cli.args import PrecisionArgs
    from nmdeploy.passes.quantize import QuantizePass

    args = parse("quantize", "m.onnx", "-o", "q.onnx", "--calib", "random", "--precision", "fp8", "--no-smooth")
    options = PrecisionArgs(quantized=True).parse(args)
    assert options["precision"] == "fp8" and options["smooth"] is False and "method" not in options
    quantizer = QuantizePass(calibration="random", **options)
    assert (quantizer.precision, quantizer.layer_outputs) == ("fp8", "float")
    assert (quantizer.output_error_limit, quantizer.rescale_outputs, quantizer.quantize_raw_input) == (
        0.05,
        True,
        False,
    )
    flags = ("--range-method", "auto", "--no-output-error-limit", "--no-rescale-outputs", "--quantize-raw-input")
    flags += ("--layer-outputs", "float", "--weight-rounding", "nearest")
    options = PrecisionArgs(quantized=True).parse(parse("quantize", "m.onnx", "-o", "q.onnx", "--calib", "x", *flags))
    quantizer = QuantizePass(calibration="random", **options)
    assert (quantizer.output_error_limit, quantizer.rescale_outputs, quantizer.quantize_raw_input) == (
        None,
        False,
        True,
    )
    assert (quantizer.precision, quantizer.layer_outputs, quantizer.weight_rounding) == ("int8", "float", "nearest")
    default = QuantizePass(calibration="random")
    assert (default.layer_outputs, default.weight_rounding) == ("quantized", "gptq")  # INT8 sparse kernels: in and out


def test_conversion_groups_build_convert_options() -> None:
    from nmdeploy.cli.args import ConversionArgs, FidelityArgs, PatternArgs, SelectionArgs
    from nmdeploy.conversion.controller import ConversionOptions

    args = parse("convert", "m.onnx", "-o", "c.onnx", "--calib", "random", "--pattern", "1:4", "--fit", "parallel",
                 "--exclude", "head", "--min-fidelity", "0.9", "--cache-limit", "2")  # fmt: skip
    fidelity = FidelityArgs("convert").parse(args)
    options = ConversionOptions(
        calibration="random",
        min_fidelity=fidelity.min_fidelity,
        **ConversionArgs().parse(args),
        **PatternArgs(transposable=True).parse(args).as_options(),
        **SelectionArgs().parse(args).as_options(),
    )
    assert str(options.pattern) == "1:4" and options.sequential is False and options.exclude == "head"
    assert options.min_fidelity == 0.9 and options.cache_limit == 2 * 2**20 and options.transposable is False


def mlp(path: Path) -> str:
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "W")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def test_bench_in_a_log_writes_a_few_progress_lines_and_none_with_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = mlp(tmp_path / "m.onnx")
    monkeypatch.setattr(progress, "INTERVAL", 0.0)  # a line every 5 %, however fast the runs
    assert main(["bench", model, "--iterations", "300", "--warmup", "0", "--batch", "1,2"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert 2 <= len(lines) <= 40 and lines[-1].startswith("batch 2: 100% (300/300 round)")
    assert main(["bench", model, "--iterations", "300", "--warmup", "0", "--json"]) == 0
    assert capsys.readouterr().err == ""


def test_one_flag_means_the_same_in_every_verb_that_takes_it(tmp_path: Path, capsys) -> None:
    """--outputs is parsed by one group: the same bad value is the same one-line usage error in each verb."""
    errors = set()
    for argv in (
        ["compare", "a.onnx", "b.onnx", "--data", "random"],
        ["cast", "a.onnx", "-o", "b.onnx"],
        ["convert", "a.onnx", "-o", "b.onnx", "--calib", "random"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--outputs", "logits,,probs"])
        assert exit_info.value.code == 2
        errors.add(capsys.readouterr().err.strip().splitlines()[-1].split("error: ", 1)[1])
    assert errors == {
        "argument --outputs: 'logits,,probs': give output names separated by commas, e.g. logits,embeddings"
    }


def test_quantize_method_is_the_range_method_under_its_old_name_with_one_warning(capsys) -> None:
    from nmdeploy.cli.args import PrecisionArgs
    from nmdeploy.errors import InputError

    base = ("quantize", "m.onnx", "-o", "q.onnx", "--calib", "random")
    assert PrecisionArgs(quantized=True).parse(parse(*base, "--range-method", "mse"))["method"] == "mse"
    assert capsys.readouterr().err == ""
    assert PrecisionArgs(quantized=True).parse(parse(*base, "--method", "mse"))["method"] == "mse"
    assert capsys.readouterr().err.count("\n") == 1  # one line, naming the new flag
    with pytest.raises(InputError, match="old name of --range-method"):
        PrecisionArgs(quantized=True).parse(parse(*base, "--method", "mse", "--range-method", "max"))
    # In convert, --method stays the fitting method; the range method of the precision budget is --range-method.
    convert = ("convert", "m.onnx", "-o", "c.onnx", "--calib", "random", "--method", "magnitude")
    options = PrecisionArgs(budgeted=True).parse(parse(*convert, "--range-method", "mse", "--precision", "int8"), 0.9)
    assert options == {"precision": "int8", "quantize": {"method": "mse"}}
    assert PrecisionArgs(budgeted=True).parse(parse(*convert), 0.9) == {"precision": None, "quantize": None}
    with pytest.raises(InputError, match="--range-method, --smooth: quantization flags"):
        PrecisionArgs(budgeted=True).parse(parse(*convert, "--range-method", "mse", "--no-smooth"), 0.9)


def test_data_batch_is_the_shard_rows_under_its_old_name_with_one_warning(capsys) -> None:
    from nmdeploy.cli.args import ShardArgs
    from nmdeploy.errors import InputError

    base = ("text", "m.onnx", "t.txt", "--tokenizer", "tok", "-o", "out")
    assert ShardArgs().parse(parse("data", *base)) == 32
    assert ShardArgs().parse(parse("data", *base, "--shard-rows", "4")) == 4 and capsys.readouterr().err == ""
    assert ShardArgs().parse(parse("data", *base, "--batch", "4")) == 4
    assert capsys.readouterr().err == "warning: data --batch is deprecated, use --shard-rows\n"
    with pytest.raises(InputError, match="old name of --shard-rows"):
        ShardArgs().parse(parse("data", *base, "--batch", "4", "--shard-rows", "8"))
