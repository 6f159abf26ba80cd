"""A stateful streaming model (a scalar sample-rate input, a [2, B, H] state in and out, one probability per row)
through every verb, in-process: its rows are found on axis 1 of the state, the scalar goes whole with every piece,
and no verb ends in a traceback; a crash exits 3, never the 1 that means "regressed"."""

from __future__ import annotations

import json
import tomllib

import numpy as np
import onnx
import pytest
from stateful_model import FEATURES, RATE, STATE, save_stateful, stateful_batch, write_stateful_batches

from nmdeploy.calibration.data import CalibrationData, SplitSettings
from nmdeploy.cli import INTERNAL_ERROR, main
from nmdeploy.errors import InputError
from nmdeploy.runtimes.batch_axes import model_batch_axes, parse_batch_axes
from nmdeploy.runtimes.data import graph_inputs, load_batches


@pytest.fixture(scope="module")
def stateful(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stateful")
    model = save_stateful(folder / "vad.onnx")
    calib = write_stateful_batches(folder / "calib", seed=1, batches=4)
    evaluation = write_stateful_batches(folder / "eval", seed=2, batches=2)
    return folder, model, calib, evaluation


def paired_batch(rows: int, start: int) -> dict[str, np.ndarray]:
    """Rows whose state carries the row's own number, so that a split can be checked for keeping rows together."""
    numbers = np.arange(start, start + rows, dtype=np.float32)
    frame = np.repeat(numbers[:, None], FEATURES, axis=1)
    state = np.repeat(np.stack([numbers, -numbers])[:, :, None], STATE, axis=2)
    return {"input": frame, "sr": np.array(RATE, np.int64), "state": state}


def with_dims(model_path, target, dims: dict[str, list]):
    """A copy of the model whose inputs and outputs declare ``dims`` (None: an unnamed free dimension)."""
    proto = onnx.load(model_path)
    for value in [*proto.graph.input, *proto.graph.output]:
        if value.name in dims:
            shape = value.type.tensor_type.shape
            for dim, size in zip(shape.dim, dims[value.name], strict=True):
                dim.Clear()
                if isinstance(size, int):
                    dim.dim_value = size
                elif isinstance(size, str):
                    dim.dim_param = size
    onnx.save(proto, target)
    return target


def test_the_axes_come_from_symbols_or_the_one_free_axis_or_the_flag(stateful, tmp_path):
    _, model, _, _ = stateful
    axes = model_batch_axes(onnx.load(model))
    assert dict(axes.axes) == {"input": 0, "sr": None, "state": 1, "output": 0, "stateN": 1}
    unnamed = with_dims(model, tmp_path / "unnamed.onnx", {"input": [None, FEATURES], "state": [2, None, STATE]})
    assert model_batch_axes(onnx.load(unnamed)).axes["state"] == 1  # the one free axis
    fixed = with_dims(model, tmp_path / "fixed.onnx", {"input": [1, FEATURES], "state": [2, 1, STATE]})
    assert dict(model_batch_axes(onnx.load(fixed)).axes)["state"] is None  # fixed: rows only where dim 0 agrees
    given = model_batch_axes(onnx.load(fixed), parse_batch_axes("state:1,sr:none"))
    assert given.axes["state"] == 1 and given.axes["sr"] is None
    with pytest.raises(InputError, match="has no input 'states'"):
        model_batch_axes(onnx.load(model), {"states": 1})
    with pytest.raises(InputError, match="has 3 dimensions"):
        model_batch_axes(onnx.load(model), {"state": 3})
    with pytest.raises(InputError, match="expected NAME:AXIS"):
        parse_batch_axes("state=1")
    batch = stateful_batch(np.random.default_rng(0), 5)
    assert axes.rows(batch) == 5
    with pytest.raises(InputError, match="disagree on the number of rows"):
        axes.rows({**batch, "state": batch["state"][:, :3]})
    pieces = axes.pieces(batch, 2)
    assert [p["state"].shape for p in pieces] == [(2, 2, STATE), (2, 2, STATE), (2, 1, STATE)]
    assert all(p["sr"] is batch["sr"] for p in pieces)
    joined = axes.join(pieces)
    assert all(np.array_equal(joined[name], batch[name]) for name in batch)


def test_the_held_out_split_keeps_each_row_with_its_state_and_is_disjoint_and_complete(stateful):
    _, model, _, _ = stateful
    batches = [paired_batch(16, 0), paired_batch(16, 16)]
    data = CalibrationData(batches, onnx.load(model))
    split = data.split(SplitSettings(rows=4, held_out=0.25, seed=0))
    seen = []
    for piece in [*split.train, *split.held_out]:
        numbers = piece["input"][:, 0]
        assert np.array_equal(piece["state"][0, :, 0], numbers) and np.array_equal(piece["state"][1, :, 0], -numbers)
        assert piece["sr"].shape == ()
        seen += numbers.tolist()
    assert sorted(seen) == list(range(32))  # complete, and each row once: disjoint
    assert split.held_out_rows == 8
    assert sum(b["state"].shape[1] for b in split.train_batches()) == 24


def test_every_verb_runs_on_the_stateful_model(stateful, tmp_path, capsys):
    folder, model, calib, evaluation = stateful
    assert main(["inspect", str(model)]) == 0
    converted = tmp_path / "converted.onnx"
    assert main(["convert", str(model), "-o", str(converted), "--calib", str(calib), "--calib-batch", "8"]) == 0
    assert "PASSED | converted 3 weights" in capsys.readouterr().out
    budget = tmp_path / "budget.onnx"
    code = main(["convert", str(model), "-o", str(budget), "--calib", str(calib), "--min-fidelity", "0.5", "--json"])
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    assert document["budget"]["held_out_rows"] > 0
    recovered = tmp_path / "recovered.onnx"
    assert main(["convert", str(model), "-o", str(recovered), "--calib", str(calib), "--recover", "--json"]) == 0
    capsys.readouterr()
    assert main(["compare", str(model), str(converted), "--data", str(evaluation), "--json"]) == 0
    compared = json.loads(capsys.readouterr().out)
    assert {row["name"] for row in compared["outputs"]} >= {"output", "stateN"}
    for data in ([], ["--data", str(evaluation)]):
        argv = ["bench", str(model), str(converted), "--batch", "1,8", "--iterations", "3", "--warmup", "1", "--json"]
        assert main(argv + data) == 0
        shapes = {row["batch"]: row["inputs"] for row in json.loads(capsys.readouterr().out)["input_shapes"]}
        assert shapes[8] == {"input": [8, FEATURES], "sr": [], "state": [2, 8, STATE]}
    out = tmp_path / "pipeline"
    assert main(["pipeline", str(model), "--calib", str(calib), "--data", str(evaluation), "-o", str(out)]) == 0
    assert "CREATED | pipeline (vad)" in capsys.readouterr().out
    assert "batch = [1, 32]" in (out / "baselines.toml").read_text()  # 32: the evaluation data's rows, axis 1 of state
    assert main(["regress", str(out / "baselines.toml")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("PASSED")


def test_bench_suggests_shapes_with_the_batch_where_it_lies(stateful, tmp_path, capsys):
    _, model, _, _ = stateful
    wide = with_dims(model, tmp_path / "wide.onnx", {"state": [2, "batch", "width"]})
    assert main(["bench", str(wide), "--iterations", "2"]) == 2
    assert "--shapes state:2xBx128 " in capsys.readouterr().err
    argv = ["bench", str(wide), "--iterations", "2", "--warmup", "0", "--shapes", f"state:2xBx{STATE}"]
    assert main(argv) == 0


def test_data_hook_regroups_rows_on_the_state_axis_and_carries_the_state(stateful, tmp_path, monkeypatch, capsys):
    _, model, _, _ = stateful
    (tmp_path / "frames.py").write_text(
        "import numpy as np\n"
        f"RATE, FEATURES, STATE = {RATE}, {FEATURES}, {STATE}\n"
        "def with_state():\n"
        "    for n in range(10):\n"
        "        yield {'input': np.full((1, FEATURES), n, np.float32), 'sr': np.array(RATE, np.int64),\n"
        "               'state': np.full((2, 1, STATE), n, np.float32)}\n"
        "def stream():\n"
        "    rng = np.random.default_rng(0)\n"
        "    for n in range(10):\n"
        "        yield {'input': rng.standard_normal((1, FEATURES)).astype(np.float32), 'sr': np.array(RATE)}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "shards"
    assert main(["data", "hook", str(model), "frames:with_state", "-o", str(out), "--shard-rows", "4"]) == 0
    captured = capsys.readouterr()
    assert "exactly" not in captured.err and "PASSED | wrote 10 rows in 3 shards" in captured.out
    batches = list(load_batches(out, graph_inputs(onnx.load(model))))
    assert [b["state"].shape for b in batches] == [(2, 4, STATE), (2, 4, STATE), (2, 2, STATE)]
    assert np.concatenate([b["state"][1, :, 0] for b in batches]).tolist() == list(range(10))
    assert all(b["sr"].shape == () for b in batches)

    streamed = tmp_path / "streamed"
    argv = [
        "data",
        "hook",
        str(model),
        "frames:stream",
        "-o",
        str(streamed),
        "--shard-rows",
        "5",
        "--carry",
        "stateN:state",
    ]
    assert main(argv) == 0
    rows = list(load_batches(streamed, graph_inputs(onnx.load(model))))
    frames = np.concatenate([b["input"] for b in rows])
    states = np.concatenate([b["state"] for b in rows], axis=1)
    from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

    expected = np.zeros((2, 1, STATE), np.float32)  # the stream starts from zeros; each step feeds the next
    with OnnxRuntimeRunner(model) as runner:
        for index in range(10):
            np.testing.assert_allclose(states[:, index : index + 1], expected, rtol=1e-6, atol=1e-6)
            feeds = {"input": frames[index : index + 1], "sr": np.array(RATE, np.int64), "state": expected}
            expected = runner.infer(feeds)["stateN"]
    assert np.abs(states[:, 1:]).min() > 0  # a real carried state, not zeros after the first step
    for carry, message in [("nope:state", "has no output 'nope'"), ("stateN", "expected OUTPUT:INPUT")]:
        target = tmp_path / f"bad-{carry}"
        assert main(["data", "hook", str(model), "frames:stream", "-o", str(target), "--carry", carry]) == 2
        assert message in capsys.readouterr().err and not target.exists()


def test_a_crash_exits_3_never_the_1_that_means_regressed(stateful, monkeypatch, capsys):
    _, model, _, _ = stateful

    def broken(*args, **kwargs):
        raise TypeError("len() of unsized object")

    monkeypatch.setattr("nmdeploy.evaluation.bench.benchmark", broken)
    assert main(["bench", str(model)]) == INTERNAL_ERROR == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "TypeError: len() of unsized object" in err
    assert err.strip().splitlines()[-1].startswith("nmdeploy bench: internal error (exit 3, not a verdict")


def test_the_other_model_verbs_run_on_the_stateful_model(stateful, tmp_path, capsys):
    _, model, calib, evaluation = stateful
    for argv in [
        ["prune", str(model), "-o", str(tmp_path / "pruned.onnx")],
        ["cast", str(model), "-o", str(tmp_path / "fp16.onnx"), "--data", str(evaluation)],
        ["quantize", str(model), "-o", str(tmp_path / "int8.onnx"), "--calib", str(calib)],
        ["run", "tensorrt-2of4", str(model), "-o", str(tmp_path / "recipe.onnx"), "--calib", str(calib)],
        ["compare", str(model), str(tmp_path / "pruned.onnx"), "--data", "random"],
    ]:
        assert main(argv) == 0, argv
        assert "Traceback" not in capsys.readouterr().err
    # random inputs put the rows on the state's axis 1 and leave the sample rate a scalar
    from nmdeploy.runtimes.data import random_batches

    (batch,) = random_batches(graph_inputs(onnx.load(model)), batch_size=3, count=1, model=model)
    assert batch["state"].shape == (2, 3, STATE) and batch["sr"].shape == () and batch["input"].shape == (3, FEATURES)


def test_batch_axis_decides_where_the_graph_cannot(stateful, tmp_path, capsys):
    """A state of two unnamed free dimensions: the graph cannot say which holds the rows, --batch-axis can."""
    _, model, calib, evaluation = stateful
    vague = with_dims(model, tmp_path / "vague.onnx", {"input": [None, FEATURES], "state": [2, None, None]})
    out = tmp_path / "out.onnx"
    argv = ["convert", str(vague), "-o", str(out), "--calib", str(calib), "--min-fidelity", "0.5"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "disagree on the number of rows" in error and "--batch-axis NAME:AXIS" in error and not out.exists()
    assert main([*argv, "--batch-axis", "state:1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budget"]["held_out_rows"] > 0
    bench = ["bench", str(vague), "--data", str(evaluation), "--batch", "3", "--iterations", "1", "--duration", "0"]
    assert main([*bench, "--batch-axis", "state:1", "--json"]) == 0
    (shapes,) = json.loads(capsys.readouterr().out)["input_shapes"]
    assert shapes["inputs"]["state"] == [2, 3, STATE]
    assert main([*bench, "--batch-axis", "state:5"]) == 2
    assert "input 'state' has 3 dimensions" in capsys.readouterr().err


def test_pipeline_and_regress_take_the_batch_axis_given(stateful, tmp_path, capsys):
    _, model, calib, evaluation = stateful
    vague = with_dims(model, tmp_path / "vague.onnx", {"input": [None, FEATURES], "state": [2, None, None]})
    out = tmp_path / "pipeline"
    argv = ["pipeline", str(vague), "--calib", str(calib), "--data", str(evaluation), "-o", str(out)]
    assert main(argv) == 2 and "--batch-axis NAME:AXIS" in capsys.readouterr().err and not out.exists()
    assert main([*argv, "--batch-axis", "state:1", "--min-fidelity", "0.5"]) == 0
    (entry,) = tomllib.loads((out / "baselines.toml").read_text())["model"]
    assert entry["latency"]["batch"] == [1, 32] and entry["latency"]["batch_axes"] == {"state": 1}
    assert json.loads((out / "convert.json").read_text())["budget"]["held_out_rows"] > 0
    capsys.readouterr()
    assert main(["regress", str(out / "baselines.toml")]) == 0  # regress times with the axes the file names
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("PASSED")
    path, good = out / "baselines.toml", "[model.latency.batch_axes]\nstate = 1"
    text = path.read_text()
    for bad in ("state = -1", 'state = "one"', "state = true"):
        path.write_text(text.replace(good, f"[model.latency.batch_axes]\n{bad}"))
        assert main(["regress", str(path)]) == 2
        assert "latency.batch_axes must be a table such as" in capsys.readouterr().err


def test_a_batch_fixed_at_one_row_is_axis_0_when_the_free_axis_is_named_as_a_size(stateful, tmp_path):
    # A CRNN exported with batch 1 and a free image width: the width is not the batch (it once was cut into
    # one-pixel "rows"); an unnamed free axis beside a fixed 1 (a one-layer state [1, B, H]) still is.
    _, model, _, _ = stateful
    width = with_dims(model, tmp_path / "width.onnx", {"input": [1, "image_width"], "state": [1, None, STATE]})
    axes = model_batch_axes(onnx.load(width)).axes
    assert axes["input"] == 0 and axes["state"] == 1
    named = with_dims(model, tmp_path / "named.onnx", {"input": [1, "batch_size"], "state": [2, "batch_size", STATE]})
    assert model_batch_axes(onnx.load(named)).axes["input"] == 1
