"""Where and how models run: ``--device``, input ``--shapes`` (and TensorRT's profile), the batch sizes timed, the
benchmark's backend and budget, and the TensorRT engine build."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from nmdeploy.cli.args.base import ArgGroup, Parser
from nmdeploy.errors import InputError


class DeviceArgs(ArgGroup):
    """``--device``: where conversion's statistics, fit and recovery run (``bench``: where the torch backend runs)."""

    def __init__(self, use: str = "convert") -> None:
        self.use = use

    def add_flags(self, parser: Parser) -> None:
        if self.use == "bench":
            parser.add_argument(
                "--device",
                choices=("auto", "cpu", "cuda"),
                default="auto",
                help="torch backend only: auto (CUDA when present), cpu (dense only) or cuda (2:4 kernels)",
            )
            return
        parser.add_argument(
            "--device",
            default="cpu",
            metavar="{cpu,cuda,cuda:N,auto}",
            help="where conversion runs: statistics through the torch interpreter, the fit and recovery on that "
            "device (recovery's training passes in bfloat16 or float16 autocast on a GPU); auto picks cuda when "
            "torch sees a GPU (default: cpu, statistics in ONNX Runtime)",
        )

    def parse(self, args: argparse.Namespace) -> str:
        """The device; for conversion resolved on this machine (``auto`` -> ``cuda`` or ``cpu``), one line when
        this machine lacks it."""
        if self.use == "bench":
            return args.device
        from nmdeploy.runtimes.devices import resolve_device

        return resolve_device(args.device)


_PROFILE = {"shapes": "fixed shapes of dynamic inputs", "min_shapes": "smallest shapes of the profile",
            "opt_shapes": "shapes TensorRT tunes for", "max_shapes": "largest shapes of the profile"}  # fmt: skip


class ShapesArgs(ArgGroup):
    """``--shapes NAME:DIMS,...`` in trtexec's syntax: per batch size (``B`` stands for each) for timing, or with
    ``profile``, TensorRT's optimisation profile (``--min/--opt/--max-shapes`` beside it)."""

    def __init__(self, *, profile: bool = False, purpose: str = "") -> None:
        self.profile, self.purpose = profile, purpose
        self.title = "input shapes (NAME:DIMS, comma-separated, e.g. ids:8x128,mask:8x128)" if profile else None

    def add_flags(self, parser: Parser) -> None:
        if not self.profile:
            help = f"{self.purpose}; B stands for each batch size"
            parser.add_argument("--shapes", metavar="NAME:Bx128,...", help=help)
            return
        for key, help in _PROFILE.items():
            parser.add_argument("--" + key.replace("_", "-"), metavar="NAME:DIMS,...", help=help)

    def parse(self, args: argparse.Namespace) -> Any:
        """Timing: NAME -> dims with ``B`` kept (None: none given); profile: NAME -> (min, opt, max)."""
        from nmdeploy.runtimes.shapes import parse_shapes, shape_ranges

        if not self.profile:
            return parse_shapes(args.shapes, batch=True) if args.shapes else None
        given = {
            key: parse_shapes(getattr(args, key), flag="--" + key.replace("_", "-")) if getattr(args, key) else {}
            for key in _PROFILE
        }
        return shape_ranges(given["shapes"], given["min_shapes"], given["opt_shapes"], given["max_shapes"])


class BatchArgs(ArgGroup):
    """``--batch 1,8``: the batch sizes a verb times."""

    def __init__(self, *, default: str | None = None, help: str, metavar: str = "1,8") -> None:
        self.default, self.help, self.metavar = default, help, metavar

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument("--batch", default=self.default, metavar=self.metavar, help=self.help)

    def parse(self, args: argparse.Namespace) -> list[int] | None:
        from nmdeploy.evaluation.bench import parse_batches

        return parse_batches(args.batch) if args.batch is not None else None


@dataclass(frozen=True)
class Timing:
    backend: str
    warmup: int
    iterations: int
    duration: float


class TimingArgs(ArgGroup):
    """How ``bench`` times, as trtexec does: the runtime, untimed warm-up runs, then at least N runs and at least S
    seconds per batch size."""

    def add_flags(self, parser: Parser) -> None:
        from nmdeploy.runtimes.backends import BACKENDS, DEFAULT_BACKEND

        runtimes = "; ".join(f"{name}: {backend.help}" for name, backend in BACKENDS.items())
        parser.add_argument(
            "--backend",
            choices=BACKENDS,
            default=DEFAULT_BACKEND,
            help=f"runtime ({runtimes}; default {DEFAULT_BACKEND})",
        )
        from nmdeploy.evaluation.bench import DEFAULT_DURATION, DEFAULT_ITERATIONS, DEFAULT_WARMUP

        parser.add_argument(
            "--warmup",
            type=int,
            default=DEFAULT_WARMUP,
            metavar="N",
            help=f"untimed runs per model first ({DEFAULT_WARMUP})",
        )
        parser.add_argument(
            "--iterations",
            type=int,
            default=DEFAULT_ITERATIONS,
            metavar="N",
            help=f"at least N timed runs per model and batch size ({DEFAULT_ITERATIONS}), as trtexec's --iterations",
        )
        parser.add_argument(
            "--duration",
            "--seconds",
            type=float,
            default=DEFAULT_DURATION,
            metavar="S",
            help=f"and at least S seconds of timed runs per batch size ({DEFAULT_DURATION:g}; 0: the count alone), as "
            "trtexec's --duration",
        )

    def parse(self, args: argparse.Namespace) -> Timing:
        return Timing(args.backend, args.warmup, args.iterations, args.duration)


@dataclass(frozen=True)
class EngineBuild:
    sparse: bool
    timing_cache: str | None
    workspace_mib: int | None
    require: bool  # FAILED when a layer predicted eligible ran dense


class EngineArgs(ArgGroup):
    """A TensorRT engine build: ``--sparse`` kernels, the timing cache, the workspace, and ``--require`` (that every
    layer predicted eligible ran a sparse kernel: a check of the engine, not of the weights' pattern)."""

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument(
            "--sparse", action="store_true", help="let TensorRT use 2:4 sparse kernels (SPARSE_WEIGHTS)"
        )
        parser.add_argument(
            "--timing-cache", metavar="FILE", help="load the tactic timing cache from FILE and save it back"
        )
        parser.add_argument("--workspace", type=int, metavar="MiB", help="workspace memory limit for the builder")
        parser.add_argument(
            "--require",
            action="store_true",
            help="with --sparse: FAILED (exit 1; the engine is still written) when a layer predicted eligible did "
            "not run a sparse kernel (TensorRT timed a dense one faster, or did not find it eligible)",
        )

    def parse(self, args: argparse.Namespace) -> EngineBuild:
        if args.require and not args.sparse:
            raise InputError("--require checks which layers ran sparse kernels: add --sparse")
        return EngineBuild(args.sparse, args.timing_cache, args.workspace, args.require)
