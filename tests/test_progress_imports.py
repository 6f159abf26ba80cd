"""Progress: a tqdm bar on a terminal, a bounded number of plain lines in logs (no carriage returns), nothing when
disabled. Optional dependencies: one helper that imports them or says in one line what to install."""

from __future__ import annotations

import io
import json
import sys

import onnx
import pytest
from onnx import TensorProto, helper

from nmdeploy import progress
from nmdeploy.errors import Error, MissingDependencyError
from nmdeploy.imports import optional, require
from nmdeploy.progress import Lines, Silent, progress_bar


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_every_five_percent_at_most_every_interval() -> None:
    clock, stream = Clock(), io.StringIO()
    with Lines(10_000, desc="recover", unit="step", stream=stream, interval=1.0, clock=clock) as bar:
        bar.set_postfix(held_out="0.9900")
        for _ in range(10_000):
            clock.now += 0.01  # 100 s in all: a line per 5 % (5 s), not one per update
            bar.update()
    text = stream.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    assert len(lines) == 20
    assert lines[0].startswith("recover: 5% (500/10000 step), 5 s, about 95 s left, held_out=0.9900")
    assert lines[-1] == "recover: 100% (10000/10000 step), 100 s, held_out=0.9900"


def test_lines_never_closer_than_the_interval_and_a_last_line_at_the_end() -> None:
    clock, stream = Clock(), io.StringIO()
    with Lines(1000, desc="convert", unit="layer", stream=stream, interval=30.0, clock=clock) as bar:
        for _ in range(999):
            clock.now += 0.125  # 5 % every 6.25 s, but a line at most every 30 s
            bar.update()
    lines = stream.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"convert: {p}%" for p in (24, 48, 72, 96, 100)]
    assert lines[-1].startswith("convert: 100% (999/1000 layer)")  # the count it ended at, written once more


def test_a_short_loop_in_a_log_writes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    with progress_bar(100_000, desc="bench", unit="round") as bar:
        assert isinstance(bar, Lines)
        for _ in range(100_000):
            bar.update()
    assert stream.getvalue() == ""


def test_unknown_totals_write_a_line_per_interval() -> None:
    clock, stream = Clock(), io.StringIO()
    with Lines(None, desc="batch 8", unit="round", stream=stream, interval=10.0, clock=clock) as bar:
        for _ in range(480):
            clock.now += 0.125
            bar.update()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 6 and lines[0] == "batch 8: 80 round, 10 s"


def test_a_terminal_gets_a_tqdm_bar_and_disabled_gets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from tqdm import tqdm

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with progress_bar(50, desc="train", unit="step") as bar:
        assert isinstance(bar, tqdm)
        for _ in range(50):
            bar.update()
    assert "\r" in terminal.getvalue() and "50/50" in terminal.getvalue()
    quiet = Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    with progress_bar(50, desc="train", enabled=False) as bar:
        assert isinstance(bar, Silent)
        bar.update(50)
    assert quiet.getvalue() == ""


def test_a_real_benchmark_in_a_log_writes_bounded_lines(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_cli_groups import mlp

    from nmdeploy.evaluation.bench import benchmark

    path = mlp(tmp_path / "m.onnx")
    monkeypatch.setattr(progress, "INTERVAL", 0.0)  # every 5 % then, however fast the runs are
    benchmark([str(path)], batches=[1], warmup=0, iterations=400, progress=True)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and 1 <= len(lines) <= 20
    assert lines[-1].startswith("batch 1: 100% (400/400 round)")


def test_require_imports_or_names_what_to_install(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert require("json", purpose="reading JSON") is json
    with pytest.raises(MissingDependencyError) as missing:
        require("nmdeploy_absent.sub", purpose="the widget", package="widget-kit", install="pip install 'x[w]'")
    assert str(missing.value) == "the widget needs widget-kit: pip install 'x[w]'"
    assert isinstance(missing.value, Error) and isinstance(missing.value, ImportError)
    # A native library that does not load is missing too, with the default install line.
    (tmp_path / "nmdeploy_broken_native.py").write_text("raise OSError('libnvinfer.so.10: cannot open')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        MissingDependencyError, match="^building engines needs nmdeploy_broken_native: pip install nmdeploy_b"
    ):
        require("nmdeploy_broken_native", purpose="building engines")
    assert optional("json") is json and optional("nmdeploy_absent") is None


def test_a_blocked_optional_dependency_is_one_line_from_the_cli(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from nmdeploy.cli import main

    graph = helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], ["y"])],
        "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", 8])],
    )
    model = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model))
    (tmp_path / "s.txt").write_text("a sentence\n")
    (tmp_path / "tok").mkdir()
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    code = main(["data", "text", str(model), str(tmp_path / "s.txt"), "--tokenizer", str(tmp_path / "tok"),
                 "-o", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [
        "nmdeploy data: error: nmdeploy data text needs tokenizers: pip install tokenizers"
    ]
    assert not (tmp_path / "out").exists()
