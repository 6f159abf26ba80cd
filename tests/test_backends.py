"""The backend registry: one registration makes a backend usable by bench, compare and regress; names, devices and
missing dependencies are checked in one place, each in one line."""

import numpy as np
import pytest
from test_bench import mlp_file
from test_compare import linear_model

from nmdeploy import InputError
from nmdeploy.errors import MissingDependencyError
from nmdeploy.evaluation.bench import benchmark
from nmdeploy.evaluation.compare import compare_models
from nmdeploy.evaluation.regress.schema import load_baselines
from nmdeploy.runtimes.backends import BACKENDS, Backend, backend_named, open_runner, register_backend
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner


class NegatingRunner(OnnxRuntimeRunner):
    """ONNX Runtime with every output negated, noting each model it opens."""

    opened = []

    def __enter__(self):
        NegatingRunner.opened.append(self.path.name)
        return super().__enter__()

    def infer(self, feeds, outputs=None):
        return {name: -value for name, value in super().infer(feeds, outputs).items()}


@pytest.fixture
def negating_backend():
    @register_backend("negating", help="ONNX Runtime, outputs negated")
    class NegatingBackend(Backend):
        def open(self, path, device="auto", *, interleaved=False):
            return NegatingRunner(path)

    yield BACKENDS
    if "negating" in BACKENDS:
        BACKENDS.unregister("negating")  # registered for this test only


def test_one_registration_makes_a_backend_usable_by_bench_compare_and_regress(negating_backend, tmp_path):
    model = mlp_file(tmp_path / "m.onnx", 0)
    report = benchmark([model], backend="negating", batches=[2], warmup=0, iterations=2, duration=0)
    assert report.backend == "negating" and report.latencies[2][0].runs == 2
    assert report.sparse_kernels.startswith("sparse kernels: none (ONNX Runtime, outputs negated")
    rng = np.random.default_rng(0)
    ref = linear_model(tmp_path / "ref.onnx", rng.standard_normal((4, 3)))
    NegatingRunner.opened.clear()
    assert compare_models(ref, ref, "random", backend="negating").fidelity == pytest.approx(1.0)  # both negated
    assert NegatingRunner.opened == ["ref.onnx", "ref.onnx"]
    baselines = tmp_path / "baselines.toml"
    baselines.write_text(
        f'[[model]]\nname = "m"\nreference = "{ref}"\ncandidate = "{ref}"\ndata = "random"\n'
        '[model.latency]\nbackend = "negating"\n[model.latency.p50_ratio]\n1 = { baseline = 1.0, tolerance = 0.5 }\n'
    )
    (entry,) = load_baselines(baselines)
    assert entry.latency.backend == "negating"
    negating_backend.unregister("negating")
    with pytest.raises(InputError, match="latency.backend 'negating'; choose one of ort, torch, tensorrt"):
        load_baselines(baselines)


def test_an_unknown_name_lists_the_registered_backends():
    with pytest.raises(InputError, match=r"unknown backend 'onnx'; choose one of ort, torch, tensorrt$"):
        backend_named("onnx")


def test_a_device_the_backend_does_not_run_on_names_the_backends_that_do(tmp_path):
    model = mlp_file(tmp_path / "m.onnx", 0)
    with pytest.raises(InputError, match="--backend ort runs on cpu, not cuda:1; use --backend torch or tensorrt"):
        open_runner("ort", model, "cuda:1")
    with pytest.raises(InputError, match="--backend tensorrt runs on cuda, not cpu; use --backend ort or torch"):
        open_runner("tensorrt", model, "cpu")


def test_a_missing_dependency_says_what_to_install_before_anything_is_opened(monkeypatch, tmp_path):
    monkeypatch.setattr(BACKENDS["torch"], "requires", ("torch", "no_such_module_for_this_test"))
    with pytest.raises(MissingDependencyError, match="torch backend needs no_such_module_for_this_test: pip install"):
        open_runner("torch", tmp_path / "absent.onnx", "cpu")
    assert BACKENDS["ort"].missing() is None


def test_compare_on_the_torch_backend_agrees_with_onnxruntime_and_refuses_an_engine_backend(tmp_path):
    rng = np.random.default_rng(1)
    ref = linear_model(tmp_path / "ref.onnx", rng.standard_normal((4, 3)))
    cand = linear_model(tmp_path / "cand.onnx", rng.standard_normal((4, 3)))
    on_ort = compare_models(ref, cand, "random")
    on_torch = compare_models(ref, cand, "random", backend="torch", device="cpu")
    assert on_torch.fidelity == pytest.approx(on_ort.fidelity, abs=1e-5) and on_ort.fidelity < 0.99
    with pytest.raises(InputError, match="compare runs .onnx models; --backend tensorrt runs built engines"):
        compare_models(ref, cand, "random", backend="tensorrt")
