"""The one registry of backends: name -> :class:`Backend` (what it runs, on which devices, whether it is installed,
how it opens a :class:`~nmdeploy.runtimes.base.Runner`, what it says about sparse kernels and threads).

``bench``, ``compare``, ``regress`` and the CLI's ``--backend`` choices read :data:`BACKENDS`. Adding a backend is a
Runner in its own module of this package (heavy imports inside functions) and one ``Backend`` subclass below with
``@register_backend(name, help=...)`` (:mod:`nmdeploy.registry`); nothing else lists backend names. Looking a
backend up imports none of the engines.

A backend that also runs graphs held in memory (pieces of a model, as calibration's statistics engine cuts it; the
whole model recovery trains through) sets ``graph_engine`` and implements :meth:`Backend.open_graph`; ``--statistics``
chooses among those by that name (:func:`graph_engines`, :func:`graph_backend`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from nmdeploy.errors import InputError, MissingDependencyError
from nmdeploy.registry import Registry
from nmdeploy.runtimes.base import GraphRunner, Runner

if TYPE_CHECKING:
    import numpy as np
    import onnx

DEFAULT_BACKEND = "ort"


class Backend:
    """One way of running a model. Subclasses set the class attributes and implement :meth:`open`."""

    name: ClassVar[str]  # set by the registry
    help: ClassVar[str]  # one line: what it runs on
    runs: ClassVar[str] = "onnx"  # "onnx": .onnx models; "engine": serialized engines built from them
    devices: ClassVar[tuple[str, ...]] = ("cpu",)  # "cpu" and/or "cuda"
    requires: ClassVar[tuple[str, ...]] = ()  # importable modules it needs
    install: ClassVar[str] = ""  # what to pip install when one is missing
    graph_engine: ClassVar[str] = ""  # the name --statistics gives it by, where it runs graphs held in memory
    keeps_values_on_device: ClassVar[bool] = False  # its graph runners return tensors left on their device

    def missing(self) -> str | None:
        """Why this backend cannot run here (a module is not installed, with what to install), else None; nothing is
        imported, so the check is cheap enough for help text and skipping."""
        absent = [module for module in self.requires if importlib.util.find_spec(module) is None]
        if not absent:
            return None
        return f"the {self.name} backend needs {', '.join(absent)}: {self.install}"

    def check_available(self) -> None:
        """Raise a MissingDependencyError saying what to install when :meth:`missing` finds something."""
        reason = self.missing()
        if reason is not None:
            raise MissingDependencyError(reason)

    def check_device(self, device: str) -> None:
        """Refuse a device this backend does not run on (``auto`` is always accepted)."""
        wanted = "cuda" if device.startswith("cuda") else device
        if device != "auto" and wanted not in self.devices:
            others = [name for name, each in BACKENDS.items() if wanted in each.devices]
            raise InputError(
                f"--backend {self.name} runs on {' or '.join(self.devices)}, not {device}; "
                f"use --backend {' or '.join(others)} for it"
            )

    def open(self, path: Path, device: str = "auto", *, interleaved: bool = False) -> Runner:
        """A Runner for ``path`` on ``device``; ``interleaved``: it is timed in turn with other runners."""
        raise NotImplementedError

    def open_graph(
        self,
        graph: onnx.ModelProto,
        fixed: Mapping[str, np.ndarray] | None = None,
        *,
        device: str = "cpu",
        threads: int = 0,
        quiet: bool = False,
        label: str = "the graph",
        differentiable: bool = False,
        outputs: Sequence[str] = (),
        precision: str = "float32",
    ) -> GraphRunner:
        """A GraphRunner for ``graph`` (held in memory, a piece of a model) on ``device``, fed ``fixed`` with every
        run; ``threads``: CPU threads of one run (0: the engine's default); ``quiet``: the engine logs no failure
        (the caller expects some and says what they mean); ``label`` names the graph in messages;
        ``differentiable``: gradients flow from the outputs to the tensors fed (training through the graph), where the
        backend can give them; ``outputs``: intermediate tensors returned beside the graph's outputs; ``precision``:
        "float32", or "bfloat16"/"float16" products (autocast) handed back as float32, where the backend has them."""
        raise NotImplementedError(f"the {self.name} backend runs model files only")

    def sparse_kernels(self, runners: Sequence[Runner]) -> str:
        """One line: whether this backend, as ``runners`` run it, has 2:4 sparse kernels at all."""
        return f"sparse kernels: none ({self.help} runs 2:4 weights dense; expect no speed-up from sparsity)"

    def threads(self, runner: Runner) -> str:
        """The CPU threads one inference may use, as the backend is configured."""
        return f"{self.help}: inference on the GPU"


BACKENDS: Registry[Backend] = Registry("backend", instances=True)
"""Name -> the one instance of each registered backend."""
register_backend = BACKENDS.register


def backend_named(name: str) -> Backend:
    """The registered backend ``name``; an unknown name is an InputError listing the valid ones."""
    return BACKENDS.lookup(name)


def open_runner(name: str, path: str | Path, device: str = "auto", *, interleaved: bool = False) -> Runner:
    """A Runner for ``path`` on backend ``name``: the device checked, the backend's dependencies checked (one line
    saying what to install), its engine imported only now."""
    backend = backend_named(name)
    backend.check_device(device)
    backend.check_available()
    return backend.open(Path(path), device, interleaved=interleaved)


def run_batches(
    path: str | Path, feeds: Iterable[Mapping[str, np.ndarray]], output: str | None = None, backend: str = "ort"
) -> np.ndarray:
    """Output ``output`` (where the model has one of that name, else its first) of the model at ``path`` on every
    batch of ``feeds``, concatenated along the rows, run on ``backend`` (default: ONNX Runtime on the CPU)."""
    import numpy as np

    with open_runner(backend, path, "cpu") as runner:
        name = output if output in runner.output_names else runner.output_names[0]
        return np.concatenate([runner.infer(dict(feed))[name] for feed in feeds])


def graph_engines() -> tuple[str, ...]:
    """The ``graph_engine`` names of the backends that run graphs held in memory, in registration order."""
    return tuple(backend.graph_engine for backend in BACKENDS.values() if backend.graph_engine)


def graph_backend(engine: str, device: str = "cpu") -> Backend:
    """The backend whose ``graph_engine`` is ``engine``, checked to run on ``device`` and to be installed; an unknown
    name is an InputError listing the known ones."""
    for backend in BACKENDS.values():
        if backend.graph_engine and backend.graph_engine == engine:
            backend.check_device(device)
            backend.check_available()
            return backend
    raise InputError(f"unknown graph engine {engine!r}; choose one of {', '.join(graph_engines())}")


@register_backend("ort", help="ONNX Runtime on CPU")
class OnnxRuntimeBackend(Backend):
    requires = ("onnxruntime",)
    install = "pip install onnxruntime"
    graph_engine = "onnxruntime"

    def open_graph(
        self,
        graph: onnx.ModelProto,
        fixed: Mapping[str, np.ndarray] | None = None,
        *,
        device: str = "cpu",
        threads: int = 0,
        quiet: bool = False,
        label: str = "the graph",
        differentiable: bool = False,
        outputs: Sequence[str] = (),
        precision: str = "float32",
    ) -> GraphRunner:
        from nmdeploy.runtimes.onnxruntime import OnnxRuntimeGraphRunner

        if differentiable:
            raise NotImplementedError("ONNX Runtime's inference sessions give no gradients")
        if outputs or precision != "float32":
            raise NotImplementedError("the ONNX Runtime graph runner returns the graph's outputs, in float32")
        self.check_device(device)
        return OnnxRuntimeGraphRunner(graph, fixed, threads=threads, quiet=quiet, label=label)

    def open(self, path: Path, device: str = "auto", *, interleaved: bool = False) -> Runner:
        from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

        # Timed in turn with other models, a thread pool spinning after its run would steal the next one's cores;
        # timed runs take the fused integer kernels a deployment runs, judged ones the exact Q/DQ arithmetic.
        return OnnxRuntimeRunner(path, spinning=not interleaved, fused_qdq=interleaved)

    def threads(self, runner: Runner) -> str:
        threads = getattr(runner, "intra_op_threads", 0)
        return f"ONNX Runtime intra-op threads: {threads or 'its default (one per physical core)'}"


@register_backend(
    "torch", help="torch (the ONNX graph through the torch interpreter; 2:4 semi-structured kernels on CUDA)"
)
class TorchBackend(Backend):
    devices = ("cpu", "cuda")
    requires = ("torch",)
    install = "pip install torch"
    graph_engine = "torch"
    keeps_values_on_device = True

    def open(self, path: Path, device: str = "auto", *, interleaved: bool = False) -> Runner:
        from nmdeploy.runtimes.torch import TorchRunner

        return TorchRunner(path, device=device)

    def open_graph(
        self,
        graph: onnx.ModelProto,
        fixed: Mapping[str, np.ndarray] | None = None,
        *,
        device: str = "cpu",
        threads: int = 0,
        quiet: bool = False,
        label: str = "the graph",
        differentiable: bool = False,
        outputs: Sequence[str] = (),
        precision: str = "float32",
    ) -> GraphRunner:
        from nmdeploy.runtimes.torch import TorchGraphRunner

        # threads: torch's own setting holds (the statistics engine's products use it too); quiet: it logs nothing.
        return TorchGraphRunner(
            graph,
            fixed,
            device=device,
            label=label,
            differentiable=differentiable,
            outputs=outputs,
            precision=precision,
        )

    def sparse_kernels(self, runners: Sequence[Runner]) -> str:
        device = str(getattr(runners[0], "device", "cpu"))
        if not device.startswith("cuda"):
            return f"sparse kernels: none (torch on {device} runs 2:4 weights dense; expect no speed-up from sparsity)"
        if not any(layer.converted for each in runners for layer in getattr(each, "sparse_layers", ())):
            return (
                f"sparse kernels: torch on {device} has them for 2:4 fp16/bf16 MatMul/Gemm weights, but no layer of "
                "these models qualified (see the counts above); expect no speed-up from sparsity"
            )
        return (
            f"sparse kernels: yes (torch on {device} runs 2:4 fp16/bf16 MatMul/Gemm weights with semi-structured "
            "kernels; the layers each model runs sparse are counted above)"
        )

    def threads(self, runner: Runner) -> str:
        import torch

        return f"torch threads: {torch.get_num_threads()}"


@register_backend("tensorrt", help="TensorRT")
class TensorRTBackend(Backend):
    runs = "engine"
    devices = ("cuda",)
    requires = ("tensorrt", "polygraphy")

    @property
    def install(self) -> str:  # type: ignore[override]
        from nmdeploy.runtimes.tensorrt import INSTALL_HINT

        return INSTALL_HINT

    def open(self, path: Path, device: str = "auto", *, interleaved: bool = False) -> Runner:
        from nmdeploy.runtimes.tensorrt import TensorRTRunner, import_tensorrt

        import_tensorrt()  # the version check, before anything else is said about the file
        if path.suffix == ".onnx":
            raise InputError(
                f"{path}: --backend tensorrt runs engines; build one first with "
                f"nmdeploy build {path} -o {path.with_suffix('.engine').name} --sparse"
            )
        return TensorRTRunner(path)

    def sparse_kernels(self, runners: Sequence[Runner]) -> str:
        return (
            "sparse kernels: yes (TensorRT runs 2:4 weights sparse where the engine was built with --sparse and "
            "chose it)"
        )
