"""Latency benchmarks: p50/p90/p99 and throughput per batch size, and A/B ratios of models measured in one run.

Models are timed interleaved (one inference of each per round, the order rotating every round), so drift of a noisy
machine (other jobs, frequency scaling, thermal) hits every model alike and their ratios stay meaningful even when
absolute times do not. Ratios are always candidate / first model (the dense reference).

Timing follows trtexec: untimed warm-up runs, then rounds until both at least ``iterations`` runs and at least
``duration`` seconds are done (trtexec's ``--iterations``/``--duration``; its defaults are 10 and 3 s), so a fast model
gets enough runs for stable percentiles and a slow one is not timed a fixed, long count.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nmdeploy.errors import InputError
from nmdeploy.progress import progress_bar
from nmdeploy.runtimes.backends import BACKENDS as BACKENDS  # the CLI reads --backend choices from here
from nmdeploy.runtimes.backends import DEFAULT_BACKEND, backend_named, open_runner
from nmdeploy.runtimes.base import InputSpec, Runner
from nmdeploy.runtimes.batch_axes import BatchAxes, model_batch_axes
from nmdeploy.runtimes.data import index_bounds, load_batches, load_graph, random_feed
from nmdeploy.runtimes.shapes import BATCH_DIM, format_dims

DEFAULT_WARMUP = 10  # untimed runs per model and batch size
DEFAULT_ITERATIONS = 10  # at least this many timed runs per model and batch size
DEFAULT_DURATION = 1.0  # and at least this many seconds of timed rounds per batch size


@dataclass(frozen=True)
class Latency:
    """Latency statistics of one model at one batch size, in milliseconds, and its throughput in samples/s."""

    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    throughput: float
    runs: int

    @classmethod
    def from_seconds(cls, times: Sequence[float], batch: int) -> Latency:
        ms = np.asarray(times, dtype=np.float64) * 1e3
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        mean = float(ms.mean())
        return cls(float(p50), float(p90), float(p99), mean, float(ms.min()), batch * 1e3 / mean, len(ms))


@dataclass(frozen=True)
class Ratio:
    """Candidate / reference latency at one batch size (below 1: the candidate is faster)."""

    candidate: str
    reference: str
    batch: int
    p50: float
    p90: float
    mean: float


@dataclass
class BenchReport:
    """Per batch size, the latency of every model; ratios of each later model to the first."""

    backend: str
    models: list[str]
    latencies: dict[int, list[Latency]]  # batch size -> one entry per model, in ``models`` order
    warmup: int
    notes: list[str] = field(default_factory=list)
    sparse_kernels: str = ""  # whether the backend has 2:4 sparse kernels at all, in one line
    threads: str = ""  # the CPU threads the backend runs one inference on, as it is configured
    input_shapes: dict[int, dict[str, list[int]]] = field(default_factory=dict)  # batch -> input name -> shape

    @property
    def ratios(self) -> list[Ratio]:
        return [
            Ratio(
                self.models[index],
                self.models[0],
                batch,
                stats[index].p50_ms / stats[0].p50_ms,
                stats[index].p90_ms / stats[0].p90_ms,
                stats[index].mean_ms / stats[0].mean_ms,
            )
            for batch, stats in self.latencies.items()
            for index in range(1, len(self.models))
        ]

    def p50_ratio_geomean(self, candidate: str) -> float:
        """Geometric mean over batch sizes of the candidate's p50 ratio: one figure for a summary line."""
        values = [r.p50 for r in self.ratios if r.candidate == candidate]
        return math.exp(sum(math.log(v) for v in values) / len(values))

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "models": self.models,
            "warmup": self.warmup,
            "notes": self.notes,
            "sparse_kernels": self.sparse_kernels,
            "threads": self.threads,
            "input_shapes": [{"batch": batch, "inputs": shapes} for batch, shapes in self.input_shapes.items()],
            "latency": [
                {"model": model, "batch": batch, **vars(stats[index])}
                for batch, stats in self.latencies.items()
                for index, model in enumerate(self.models)
            ],
            "ratios": [vars(r) for r in self.ratios],
        }


# ---------------------------------------------------------------------------------------------------------------
# Inputs


def parse_batches(text: str) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32]; sizes must be positive integers."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise InputError(f"--batch {text!r}: expected comma-separated positive integers such as 1,8,32") from error
    if not sizes or any(size < 1 for size in sizes):
        raise InputError(f"--batch {text!r}: expected comma-separated positive integers such as 1,8,32")
    return sizes


def input_shape(
    spec: InputSpec, batch: int, given: tuple[int | str, ...] | None, axis: int | None = 0
) -> tuple[int, ...]:
    """The concrete shape of one input at ``batch``: from --shapes, else the model's with its batch ``axis`` (None:
    the input has no rows, such as a scalar) at ``batch``."""
    if given is not None:
        if len(given) != len(spec.shape) or any(
            isinstance(g, int) and d is not None and g != d for g, d in zip(given, spec.shape, strict=False)
        ):
            raise InputError(
                f"--shapes gives {spec.name} as {format_dims(given)}, but the model expects {spec.describe()}"
            )
        return tuple(batch if d == BATCH_DIM else int(d) for d in given)
    if any(d is None for i, d in enumerate(spec.shape) if i != axis):
        example = "x".join(BATCH_DIM if i == axis else "128" if d is None else str(d) for i, d in enumerate(spec.shape))
        raise InputError(
            f"input {spec.describe()} has dynamic dimensions besides the batch: give them with "
            f"--shapes {spec.name}:{example} (B is replaced by each --batch size)"
        )
    if axis is None:
        return tuple(int(d) for d in spec.shape)  # type: ignore[arg-type]
    if spec.shape[axis] is not None and spec.shape[axis] != batch:
        raise InputError(
            f"input {spec.describe()} has a fixed batch of {spec.shape[axis]}: use --batch {spec.shape[axis]}, or "
            "export the model with a dynamic batch dimension"
        )
    return tuple(batch if i == axis else int(d) for i, d in enumerate(spec.shape))  # type: ignore[arg-type]


def random_feeds(
    specs: Sequence[InputSpec],
    batch: int,
    shapes: dict[str, tuple[int | str, ...]],
    bounds: dict[str, int],
    seed: int = 0,
    axes: BatchAxes | None = None,
) -> dict[str, np.ndarray]:
    """Seeded inputs at ``batch`` (dims from --shapes or the model, rows on ``axes``), as
    :func:`nmdeploy.runtimes.data.random_feed` draws them: ids below ``bounds``
    (:func:`nmdeploy.runtimes.data.index_bounds`), ones for masks."""
    axes = axes or BatchAxes({})
    concrete = {spec.name: input_shape(spec, batch, shapes.get(spec.name), axes.axis(spec.name)) for spec in specs}
    return random_feed(specs, concrete, bounds, np.random.default_rng(seed))


def feeds_from_data(
    source: str | Path, specs: Sequence[InputSpec], batch: int, axes: BatchAxes | None = None
) -> dict[str, np.ndarray]:
    """The first .npz batch of ``source``, its rows (along each input's batch axis in ``axes``) repeated or cut to
    ``batch``; inputs without rows (a scalar sample rate) as they are."""
    axes = axes or BatchAxes({})
    first = next(iter(load_batches(source, specs)))
    rows = axes.rows(first, str(source))
    return axes.take(first, np.arange(batch) % rows)


# ---------------------------------------------------------------------------------------------------------------
# Backends (registered in nmdeploy.runtimes.backends)


def open_timed_runner(backend: str, path: str | Path, device: str = "auto") -> Runner:
    """A runner of the registered ``backend`` for ``path``, set up to be timed in turn with other models."""
    return open_runner(backend, path, device, interleaved=True)


def timed_call(runner: Runner, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    """What one timed inference runs: the backend's device-resident ``prepare`` when it has one, else ``infer``."""
    prepare = getattr(runner, "prepare", None)
    return prepare(feeds) if prepare is not None else (lambda: runner.infer(feeds))


def _sparse_note(label: str, runner: Runner) -> str | None:
    layers = getattr(runner, "sparse_layers", None)
    if layers is None:
        return None
    converted = sum(layer.converted for layer in layers)
    compliant = sum(layer.compliant for layer in layers)
    device = getattr(runner, "device", "?")
    note = f"{label}: {converted} of {len(layers)} MatMul/Gemm layers run 2:4-sparse on {device}"
    reasons = sorted({layer.reason for layer in layers if layer.compliant and not layer.converted})
    if compliant > converted:
        note += f" ({compliant - converted} 2:4 layers dense: {'; '.join(reasons)})"
    return note


# ---------------------------------------------------------------------------------------------------------------
# Measurement


def _rounds(iterations: int, duration: float, clock: Callable[[], float]) -> Iterator[int]:
    """Round numbers until at least ``iterations`` rounds and at least ``duration`` seconds are done."""
    deadline = clock() + duration
    index = 0
    while index < iterations or clock() < deadline:
        yield index
        index += 1


def benchmark(
    models: Sequence[str | Path],
    *,
    backend: str = DEFAULT_BACKEND,
    batches: Sequence[int] | None = None,
    warmup: int = DEFAULT_WARMUP,
    iterations: int | None = None,
    duration: float | None = None,
    shapes: dict[str, tuple[int | str, ...]] | None = None,
    data: str | Path | None = None,
    device: str = "auto",
    progress: bool = False,
    clock: Callable[[], float] = time.perf_counter,
    runner_factory: Callable[[str, str | Path, str], Runner] = open_timed_runner,
    batch_axes: dict[str, int | None] | None = None,
) -> BenchReport:
    """Time every model on the same inputs per batch size, interleaved; the first model is the reference.

    ``warmup`` untimed runs, then timed rounds per batch size until at least ``iterations`` runs per model and at
    least ``duration`` seconds are done (None: DEFAULT_ITERATIONS, DEFAULT_DURATION). Inputs come from ``data``
    (an .npz, rows repeated to each batch size) or are random.
    Each input's rows lie on the batch axis the model's graph gives, or ``batch_axes`` (input name -> axis or None).
    ``clock`` and ``runner_factory`` let tests inject time and runners.
    """
    if not models:
        raise InputError("bench needs at least one model")
    iterations = DEFAULT_ITERATIONS if iterations is None else iterations
    duration = DEFAULT_DURATION if duration is None else duration
    if iterations < 1:
        raise InputError(f"--iterations must be at least 1, got {iterations}")
    if not (math.isfinite(duration) and duration >= 0):
        raise InputError(f"--duration must be a number of seconds, 0 or more, got {duration}")
    if warmup < 0:
        raise InputError(f"--warmup must not be negative, got {warmup}")
    chosen = backend_named(backend)
    labels = _labels(models)
    with ExitStack() as stack:
        runners = [stack.enter_context(runner_factory(backend, path, device)) for path in models]
        specs = runners[0].inputs
        for label, runner in zip(labels[1:], runners[1:], strict=True):
            if [(s.name, s.dtype) for s in runner.inputs] != [(s.name, s.dtype) for s in specs]:
                raise InputError(
                    f"{label} has inputs {[s.describe() for s in runner.inputs]}, but {labels[0]} has "
                    f"{[s.describe() for s in specs]}: A/B models must take the same inputs"
                )
        proto = load_graph(Path(models[0]))
        axes = model_batch_axes(proto, batch_axes)
        sizes = list(batches) if batches else [_default_batch(specs, axes)]
        bounds = index_bounds(proto, specs) if proto is not None else {}
        notes = [note for label, runner in zip(labels, runners, strict=True) if (note := _sparse_note(label, runner))]
        latencies: dict[int, list[Latency]] = {}
        input_shapes: dict[int, dict[str, list[int]]] = {}
        for batch in sizes:
            if data is not None:
                feeds = feeds_from_data(data, specs, batch, axes)
            else:
                feeds = random_feeds(specs, batch, shapes or {}, bounds, axes=axes)
            input_shapes[batch] = {name: list(np.shape(array)) for name, array in feeds.items()}
            calls = [timed_call(runner, feeds) for runner in runners]
            for call in calls:
                for _ in range(warmup):
                    call()
            times: list[list[float]] = [[] for _ in calls]
            with progress_bar(iterations, desc=f"batch {batch}", unit="round", enabled=progress) as bar:
                shown, began = 0, clock()
                for round_index in _rounds(iterations, duration, clock):
                    for offset in range(len(calls)):
                        index = (round_index + offset) % len(calls)
                        start = clock()
                        calls[index]()
                        times[index].append(clock() - start)
                    # Done means both the count and the duration: the bar shows the one further from it.
                    share = (clock() - began) / duration if duration else 1.0
                    done = min(iterations, round_index + 1, math.floor(iterations * min(share, 1.0)))
                    if done > shown:
                        bar.update(done - shown)
                        shown = done
                if shown < iterations:  # the deadline can pass between the last share and the loop's check
                    bar.update(iterations - shown)
            latencies[batch] = [Latency.from_seconds(t, batch) for t in times]
        kernels, threads = chosen.sparse_kernels(runners), chosen.threads(runners[0])
    return BenchReport(backend, labels, latencies, warmup, notes, kernels, threads, input_shapes)


CALL_BUDGET = 0.05  # seconds one inference of the largest batch chosen by batches_within may take


def batches_within(
    model: str | Path,
    largest: int,
    *,
    data: str | Path | None = None,
    budget: float = CALL_BUDGET,
    backend: str = DEFAULT_BACKEND,
    device: str = "auto",
    batch_axes: dict[str, int | None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    runner_factory: Callable[[str, str | Path, str], Runner] = open_timed_runner,
) -> list[int]:
    """The batch sizes worth timing for ``model``: its fixed batch where it has one; else 1 and the largest of 2, 4,
    8, ... up to ``largest`` (``largest`` itself last) whose one inference takes at most ``budget`` seconds, so that
    timing a large model costs seconds, not minutes, and a small one is still timed at a batch that fills the
    machine. Inputs as :func:`benchmark` takes them (``data`` rows repeated, else random)."""
    with runner_factory(backend, model, device) as runner:
        specs = runner.inputs
        proto = load_graph(Path(model))
        axes = model_batch_axes(proto, batch_axes)
        if _fixed_batches(specs, axes):
            return [_default_batch(specs, axes)]
        bounds = index_bounds(proto, specs) if proto is not None else {}
        chosen, size = [1], 2
        while size <= largest:
            feeds = (
                feeds_from_data(data, specs, size, axes)
                if data is not None
                else random_feeds(specs, size, {}, bounds, axes=axes)
            )
            call = timed_call(runner, feeds)
            call()  # the first run of a shape pays for allocations
            start = clock()
            call()
            if clock() - start > budget:
                break
            chosen[1:] = [size]
            if size == largest:
                break
            size = min(2 * size, largest)
    return chosen


def _fixed_batches(specs: Sequence[InputSpec], axes: BatchAxes) -> set[int]:
    """The fixed sizes the model gives its inputs' batch axes (empty where the batch is free)."""
    sizes = {
        spec.shape[axis] for spec in specs if (axis := axes.axis(spec.name)) is not None and axis < len(spec.shape)
    }
    return {size for size in sizes if size is not None}


def _default_batch(specs: Sequence[InputSpec], axes: BatchAxes) -> int:
    fixed = _fixed_batches(specs, axes)
    return fixed.pop() if len(fixed) == 1 else 1


def _labels(models: Sequence[str | Path]) -> list[str]:
    """Short names for the table: file names, or full paths where names repeat."""
    names = [Path(m).name for m in models]
    if len(set(names)) < len(names):
        names = [str(m) for m in models]
    if len(set(names)) < len(names):  # the same file twice: an A/A run, which measures the noise floor
        names = [f"{name} #{index + 1}" for index, name in enumerate(names)]
    return names
