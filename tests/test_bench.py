"""bench: statistics, interleaving and ratios on injected runners and clock (no timing thresholds), input
generation, and the CLI on real ONNX Runtime runs."""

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_tables import table_cells

from nmdeploy import InputError
from nmdeploy.cli import main
from nmdeploy.evaluation.bench import (
    Latency,
    benchmark,
    input_shape,
    parse_batches,
    random_feeds,
)
from nmdeploy.runtimes.base import InputSpec
from nmdeploy.runtimes.data import index_bounds
from nmdeploy.runtimes.shapes import parse_shapes


def test_latency_statistics_match_numpy():
    times = np.random.default_rng(0).uniform(1e-3, 5e-3, 101)
    stats = Latency.from_seconds(times, batch=8)
    p50, p90, p99 = np.percentile(times * 1e3, [50, 90, 99])
    assert (stats.p50_ms, stats.p90_ms, stats.p99_ms) == pytest.approx((p50, p90, p99))
    assert stats.throughput == pytest.approx(8 / times.mean()) and stats.runs == 101


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class FakeRunner:
    """A runner whose inference 'takes' a known time per sample on the fake clock, and logs the call order."""

    def __init__(self, name, seconds_per_sample, clock, log):
        self.name, self.cost, self.clock, self.log = name, seconds_per_sample, clock, log
        self.inputs = (InputSpec("x", np.dtype(np.float32), (None, 4)),)
        self.output_names = ("y",)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def infer(self, feeds):
        self.clock.now += self.cost * len(feeds["x"])
        self.log.append(self.name)
        return {"y": feeds["x"]}


def fake_bench(costs, **options):
    clock, log = FakeClock(), []
    runners = {name: FakeRunner(name, cost, clock, log) for name, cost in costs.items()}
    report = benchmark(
        list(costs), clock=clock, runner_factory=lambda backend, path, device: runners[str(path)], **options
    )
    return report, log


def test_interleaved_rounds_and_exact_ratios():
    report, log = fake_bench({"dense": 2e-3, "sparse": 1e-3}, batches=[1, 4], warmup=2, iterations=5, duration=0)
    assert report.models == ["dense", "sparse"]
    assert log[:4] == ["dense"] * 2 + ["sparse"] * 2  # warm-up of each model first
    timed = log[4:14]  # batch 1: one run of each per round, the first model alternating
    assert timed == ["dense", "sparse", "sparse", "dense"] * 2 + ["dense", "sparse"]
    dense, sparse = report.latencies[4]
    assert dense.p50_ms == pytest.approx(8.0) and sparse.p50_ms == pytest.approx(4.0) and dense.runs == 5
    assert dense.throughput == pytest.approx(500.0)
    assert [(r.batch, r.p50) for r in report.ratios] == [(1, pytest.approx(0.5)), (4, pytest.approx(0.5))]
    assert report.p50_ratio_geomean("sparse") == pytest.approx(0.5)
    as_json = report.as_dict()
    assert len(as_json["latency"]) == 4 and as_json["ratios"][0]["candidate"] == "sparse"


def test_at_least_the_iterations_and_at_least_the_duration_as_trtexec_times():
    # 2**-9 s per round on the fake clock (exact in binary): the duration asks for 10 rounds, the count for 3
    report, _ = fake_bench({"a": 2**-10}, batches=[2], warmup=0, iterations=3, duration=10 * 2**-9)
    assert report.latencies[2][0].runs == 10
    report, _ = fake_bench({"a": 2**-10}, batches=[2], warmup=0, iterations=25, duration=10 * 2**-9)
    assert report.latencies[2][0].runs == 25  # the count asks for more than the duration
    report, log = fake_bench({"a": 2**-10}, batches=[2], warmup=4, iterations=1, duration=0)
    assert report.latencies[2][0].runs == 1 and len(log) == 5  # the warm-up runs are not timed
    report, _ = fake_bench({"a": 2**-4}, batches=[2])  # the defaults: 10 runs, and 1 s (8 rounds of 1/8 s)
    assert report.latencies[2][0].runs == 10
    report, _ = fake_bench({"a": 2**-8}, batches=[2])
    assert report.latencies[2][0].runs == 128  # 1 s of rounds of 1/128 s
    for options, message in [
        ({"iterations": 0}, "--iterations must be at least 1"),
        ({"duration": -1.0}, "--duration must be a number of seconds"),
        ({"duration": float("nan")}, "--duration must be a number of seconds"),
        ({"warmup": -1}, "--warmup must not be negative"),
    ]:
        with pytest.raises(InputError, match=message):
            fake_bench({"a": 1e-3}, **options)


def test_the_batches_worth_timing_stop_where_one_inference_passes_the_budget(tmp_path):
    from nmdeploy.evaluation.bench import batches_within

    def sizes(cost, largest, budget=0.05):
        clock, log = FakeClock(), []
        runner = FakeRunner("m", cost, clock, log)
        return batches_within(
            tmp_path / "absent.onnx", largest, budget=budget, clock=clock, runner_factory=lambda *a: runner
        )

    assert sizes(1e-3, 256) == [1, 32]  # 32 rows take 32 ms, 64 would take 64 ms
    assert sizes(1e-4, 256) == [1, 256]  # fast enough at the evaluation batch itself
    assert sizes(1e-4, 100) == [1, 100]  # 2, 4, ... 64, then the evaluation batch last
    assert sizes(1.0, 256) == [1]  # even 2 rows pass the budget: batch 1 alone


def test_parsing_of_batches_and_shapes():
    assert parse_batches("1,8, 32") == [1, 8, 32]
    assert parse_shapes("input_ids:Bx128,mask:Bx128", batch=True) == {"input_ids": ("B", 128), "mask": ("B", 128)}
    for bad in ("0", "a", ""):
        with pytest.raises(InputError, match="--batch"):
            parse_batches(bad)
    with pytest.raises(InputError, match="NAME:DIMS"):
        parse_shapes("input_ids=128", batch=True)


def test_shapes_from_the_model_or_given_with_clear_errors():
    tokens = InputSpec("input_ids", np.dtype(np.int64), (None, None))
    assert input_shape(InputSpec("x", np.dtype(np.float32), (None, 3, 8)), 4, None) == (4, 3, 8)
    assert input_shape(tokens, 4, ("B", 128)) == (4, 128)
    with pytest.raises(InputError, match=r"--shapes input_ids:Bx128"):
        input_shape(tokens, 4, None)
    with pytest.raises(InputError, match="fixed batch of 2: use --batch 2"):
        input_shape(InputSpec("x", np.dtype(np.float32), (2, 3)), 4, None)
    with pytest.raises(InputError, match="expects"):
        input_shape(InputSpec("x", np.dtype(np.float32), (None, 3)), 4, ("B", 5))


def embedding_model(path):
    """input_ids -> Gather from a 50-row table; attention_mask multiplies; a float input adds."""
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "input_ids"], ["emb"]),
            helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["maskf", "axis"], ["mask3"]),
            helper.make_node("Mul", ["emb", "mask3"], ["masked"]),
            helper.make_node("Add", ["masked", "noise"], ["out"]),
        ],
        "emb",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("noise", TensorProto.FLOAT, ["batch", "seq", 8]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "seq", 8])],
        [
            numpy_helper.from_array(np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32), "table"),
            numpy_helper.from_array(np.array([2], dtype=np.int64), "axis"),
        ],
    )
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_random_inputs_respect_dtypes_and_token_ranges(tmp_path):
    path = embedding_model(tmp_path / "emb.onnx")
    specs = (
        InputSpec("input_ids", np.dtype(np.int64), (None, None)),
        InputSpec("attention_mask", np.dtype(np.int64), (None, None)),
        InputSpec("noise", np.dtype(np.float32), (None, None, 8)),
    )
    ranges = index_bounds(path, specs)
    assert ranges == {"input_ids": 50}
    shapes = {"input_ids": ("B", 64), "attention_mask": ("B", 64), "noise": ("B", 64, 8)}
    feeds = random_feeds(specs, 16, shapes, ranges)
    ids = feeds["input_ids"]
    assert ids.dtype == np.int64 and ids.shape == (16, 64) and ids.min() >= 0 and ids.max() < 50
    assert len(np.unique(ids)) > 40  # spread over the table, not a constant
    assert (feeds["attention_mask"] == 1).all() and feeds["noise"].dtype == np.float32
    assert abs(feeds["noise"].std() - 1) < 0.05


def mlp_file(path, seed):
    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])],
        [numpy_helper.from_array(rng.standard_normal((32, 16)).astype(np.float32), "W")],
    )
    onnx.save(helper.make_model(graph, ir_version=9, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def test_cli_ab_on_onnxruntime_and_torch(tmp_path, capsys):
    dense, sparse = mlp_file(tmp_path / "dense.onnx", 0), mlp_file(tmp_path / "sparse.onnx", 1)
    args = [dense, sparse, "--batch", "1,4", "--warmup", "1", "--iterations", "5"]
    assert main(["bench", *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["models"] == ["dense.onnx", "sparse.onnx"] and len(report["latency"]) == 4
    assert [r["batch"] for r in report["ratios"]] == [1, 4] and all(r["p50"] > 0 for r in report["ratios"])
    assert main(["bench", *args, "--backend", "torch", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "sparse.onnx / dense.onnx" in out and "0 of 1 MatMul/Gemm layers run 2:4-sparse on cpu" in out
    latency_header, *rest = table_cells(out)
    latencies = [dict(zip(latency_header, row, strict=True)) for row in rest[:4]]
    assert [(row["model"], row["batch"]) for row in latencies] == [
        (model, batch) for batch in ("1", "4") for model in ("dense.onnx", "sparse.onnx")
    ]
    assert all(float(row["p50 ms"]) <= float(row["p90 ms"]) <= float(row["p99 ms"]) for row in latencies)
    assert rest[4] == ["batch", "p50 ratio", "p90 ratio", "mean ratio"] and [row[0] for row in rest[5:]] == ["1", "4"]
    assert out.strip().splitlines()[-1].startswith("measured | bench 2 model(s) x 2 batch size(s) on torch")


def test_cli_data_and_errors(tmp_path, capsys):
    model = mlp_file(tmp_path / "m.onnx", 0)
    np.savez(tmp_path / "d.npz", x=np.ones((3, 32), dtype=np.float32))
    assert main(["bench", model, "--data", str(tmp_path / "d.npz"), "--batch", "5", "--iterations", "2"]) == 0
    assert "measured | bench" in capsys.readouterr().out
    assert main(["bench", model, "--backend", "tensorrt"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "tensorrt" in line.lower()
    assert main(["bench", model, str(tmp_path / "missing.onnx")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "missing.onnx: no such file" in line


def test_report_says_whether_the_backend_has_sparse_kernels_the_shapes_and_threads(tmp_path, capsys):
    import torch

    model = mlp_file(tmp_path / "m.onnx", 0)
    args = [model, "--batch", "1,3", "--warmup", "0", "--iterations", "2"]
    assert main(["bench", *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["input_shapes"] == [{"batch": 1, "inputs": {"x": [1, 32]}}, {"batch": 3, "inputs": {"x": [3, 32]}}]
    assert report["sparse_kernels"].startswith("sparse kernels: none (ONNX Runtime on CPU")
    assert report["threads"].startswith("ONNX Runtime intra-op threads: ")
    assert main(["bench", *args, "--backend", "torch", "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("sparse kernels: none (torch on cpu") and lines[-1].startswith("measured | bench")
    assert not any("PASSED" in line for line in lines)  # nothing was judged
    assert "inputs at batch 1: x 1x32" in lines and "inputs at batch 3: x 3x32" in lines
    assert f"torch threads: {torch.get_num_threads()}" in lines


def test_sparse_kernel_line_follows_what_the_torch_runner_converted():
    from types import SimpleNamespace

    from nmdeploy.runtimes.backends import BACKENDS

    dense = SimpleNamespace(device="cuda:0", sparse_layers=(SimpleNamespace(converted=False),))
    sparse = SimpleNamespace(device="cuda:0", sparse_layers=(SimpleNamespace(converted=True),))
    assert "no layer of these models qualified" in BACKENDS["torch"].sparse_kernels([dense, dense])
    assert BACKENDS["torch"].sparse_kernels([dense, sparse]).startswith("sparse kernels: yes (torch on cuda:0")
    assert BACKENDS["tensorrt"].sparse_kernels([dense]).startswith("sparse kernels: yes (TensorRT")


def test_onnxruntime_sessions_timed_by_bench_do_not_spin(tmp_path):
    """Interleaved timing needs idle thread pools between runs: a spinning pool steals the cores from the other
    model (identical models measured 0.75-1.36 apart with spinning, within 1 % without)."""
    from nmdeploy.evaluation.bench import open_timed_runner
    from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

    model = mlp_file(tmp_path / "m.onnx", 0)
    key = "session.intra_op.allow_spinning"
    with open_timed_runner("ort", model) as runner:
        assert runner._session.get_session_options().get_session_config_entry(key) == "0"
    # Other uses keep ONNX Runtime's default (no entry: spinning).
    with OnnxRuntimeRunner(model) as runner, pytest.raises(RuntimeError, match="does not have configuration"):
        runner._session.get_session_options().get_session_config_entry(key)
