"""Sparse training step time: each forward method and backward option as a ratio to the dense step, on CPU.

Every configuration trains its own copy of the same seeded model on the same batches; the configurations take
turns (interleaved repetitions of a few steps each), so machine load affects them alike, and the reported figure
is the median over repetitions of (configuration time / dense time of the same repetition). A step is the whole
optimiser step: forward, loss, backward, Adam update and ``sparsifier.step()`` (mask recomputation when due).
Masks are recomputed every step (transposable ones every 40); work due only every k steps is timed apart and added
to every step as 1/k of its cost. Rows marked "compiled" train ``torch.compile(model)`` (inductor) with the same
optimiser and ``sparsifier.step()`` in eager; they compile during the warm-up step, which is not timed. Targets:
each method at most 1.05x its memory-traffic floor (the floor rows), per column; a compiled row no slower than its
eager row. Writes the ``train-step`` section of BENCHMARKS.md.

    python benchmarks/train_step.py [--repetitions 5] [--steps 4] [--threads 1] [--models ...] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable

import torch
from report import machine, write_section
from torch import nn

from nmdeploy.reference.digits import DigitsTransformer
from nmdeploy.train import sparsify

# name -> sparsify keywords (None: the dense baseline)
OPTIONS: dict[str, dict | None] = {
    "dense": None,
    "STE": {"method": "ste"},
    "SR-STE": {"method": "srste"},
    "SR-STE, mask every 40 steps": {"method": "srste", "mask_interval": 40},
    "fixed mask": {"method": "fixed"},
    "LBC": {"method": "lbc", "removal_end": 10_000},
    "mask decay": {"method": "mask-decay", "decay_steps": 10_000},
    "structure decay": {"method": "structure-decay", "decay_steps": 10_000},
    "SR-STE + transposable (exact, every 40)": {"method": "srste", "backward": "transposable"},
    "SR-STE + transposable (greedy, every 40)": {
        "method": "srste",
        "backward": "transposable",
        "transposable_method": "greedy",
    },
    "SR-STE + MVUE 2:4": {"method": "srste", "backward": "mvue"},
    "SR-STE + transposable (every 40) + MVUE 1:2": {
        "method": "srste",
        "backward": ("transposable", "mvue"),
        "mvue_pattern": "1:2",
    },
    "SR-STE + transposable (every 40) + MVUE 2:4": {"method": "srste", "backward": ("transposable", "mvue")},
    "SR-STE + bi-directional masks (permutations every 100)": {"method": "srste", "backward": "bimask"},
}
# Work done every k > 1 steps, which the short timed windows rarely contain: option -> those k. Its cost is measured
# apart (a step where it is due against one where it is not) and added to every step as (extra time) / k.
PERIODIC: dict[str, tuple[int, ...]] = {
    "SR-STE, mask every 40 steps": (40,),
    "SR-STE + transposable (exact, every 40)": (40,),
    "SR-STE + transposable (greedy, every 40)": (40,),
    "SR-STE + transposable (every 40) + MVUE 1:2": (40,),
    "SR-STE + transposable (every 40) + MVUE 2:4": (40,),
    "SR-STE + bi-directional masks (permutations every 100)": (100,),
}
# The least memory traffic each method adds to the dense step, whatever the implementation (short of a GEMM that
# applies the mask itself): per sparse weight, the forward's W * mask (read W and the multiplier, write the product),
# the SR-STE gradient g + decay * W * pruned (read three, write one) and the mask selection (read W, write a boolean).
SRSTE_BYTES_PER_WEIGHT = 4 * 3 + 4 * 4 + 4 + 1
# MVUE reads each sparse layer's output gradient and writes its pruned copy: per output element and step.
MVUE_BYTES_PER_OUTPUT = 4 * 2
TARGET_OVER_FLOOR = 1.05
# The forward methods timed compiled as well (the masked backward options run their GEMMs outside compiled graphs).
COMPILED = ("dense", "STE", "SR-STE", "fixed mask", "LBC", "mask decay", "structure decay")
COMPILED_SUFFIX = ", compiled"


def floor_of(option: str) -> str | None:
    """The floor row a configuration is held to: SR-STE's for every masked forward, plus MVUE's gradient pass."""
    base = option.removesuffix(COMPILED_SUFFIX)
    if base == "dense" or base.startswith("floor"):
        return None
    return "floor: SR-STE + MVUE" if "MVUE" in base else "floor: SR-STE"


def mlp() -> nn.Module:
    """GEMM-dominated: 3 hidden Linear layers of 1024, the shape where sparse GEMMs would pay off."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 10),
    )


def transformer() -> nn.Module:
    return DigitsTransformer(width=256, heads=8, hidden=1024, blocks=2, seed=0)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], torch.Tensor]]] = {
    "MLP 256-1024x4-10, batch 256": (mlp, lambda g: torch.randn(256, 256, generator=g)),
    # The masking work per step does not depend on the batch, the GEMMs grow with it: the same MLP at larger batches.
    "MLP 256-1024x4-10, batch 1024": (mlp, lambda g: torch.randn(1024, 256, generator=g)),
    "MLP 256-1024x4-10, batch 4096": (mlp, lambda g: torch.randn(4096, 256, generator=g)),
    "transformer width 256, 2 blocks, batch 64 x 8 tokens": (
        transformer,
        lambda g: torch.rand(64, 1, 8, 8, generator=g),
    ),
}


class Trainee:
    def __init__(self, build: Callable[[], nn.Module], options: dict | None, compiled: bool = False) -> None:
        self.model = build()
        self.sparsifier = sparsify(self.model, **options) if options is not None else None
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.forward = torch.compile(self.model) if compiled else self.model

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(self.forward(x), y).backward()
        self.optimizer.step()
        if self.sparsifier is not None:
            self.sparsifier.step()

    def traffic_floor_bytes(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Least bytes per step that SR-STE, and SR-STE with MVUE, add to the dense step for this model and batch."""
        modules = dict(self.model.named_modules())
        weights = sum(layer.mask.numel() for layer in self.sparsifier.layers.values())
        outputs = []
        hooks = [
            modules[name].register_forward_hook(lambda _module, _input, output: outputs.append(output.numel()))
            for name in self.sparsifier.layers
        ]
        self.step(x, y)
        for hook in hooks:
            hook.remove()
        srste = weights * SRSTE_BYTES_PER_WEIGHT
        return {"SR-STE": srste, "SR-STE + MVUE": srste + sum(outputs) * MVUE_BYTES_PER_OUTPUT}

    def periodic_seconds(self, periods: tuple[int, ...], repeats: int = 3) -> float:
        """Per-step share of the work due every k steps: (due ``sparsifier.step()`` - plain one) / k, summed."""
        share = 0.0
        for period in periods:
            due, plain = [], []
            for _ in range(repeats):
                for arriving, times in ((period, due), (period + 1, plain)):
                    self.sparsifier.step_count = arriving - 1  # the next step() arrives at `arriving`
                    start = time.perf_counter()
                    self.sparsifier.step()
                    times.append(time.perf_counter() - start)
            share += max(statistics.median(due) - statistics.median(plain), 0.0) / period
        return share


def copy_bandwidth() -> float:
    """Bytes per second this machine moves in a large tensor copy (read plus write), far beyond the caches."""
    source = torch.randn(16 * 2**20)
    target = torch.empty_like(source)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return 2 * source.nbytes / statistics.median(times)


def configurations() -> dict[str, tuple[dict | None, bool]]:
    """Row name -> (sparsify keywords, compiled), eager rows first."""
    rows = {option: (kwargs, False) for option, kwargs in OPTIONS.items()}
    rows.update({option + COMPILED_SUFFIX: (OPTIONS[option], True) for option in COMPILED})
    return rows


def bench_model(name: str, repetitions: int, steps: int, bandwidth: float, log) -> dict[str, list[float]]:
    build, make_input = MODELS[name]
    rows = configurations()
    trainees = {option: Trainee(build, kwargs, compiled) for option, (kwargs, compiled) in rows.items()}
    generator = torch.Generator().manual_seed(1)
    inputs = [make_input(generator) for _ in range(steps)]
    batches = [(x, torch.randint(0, 10, (len(x),), generator=generator)) for x in inputs]
    for trainee in trainees.values():  # warm-up: first calls allocate and pick kernels
        trainee.step(*batches[0])
    ratios: dict[str, list[float]] = {option: [] for option in rows}
    seconds: dict[str, list[float]] = {option: [] for option in rows}
    for repetition in range(repetitions):
        times = {}
        for option, trainee in trainees.items():
            start = time.perf_counter()
            for x, y in batches:
                trainee.step(x, y)
            times[option] = (time.perf_counter() - start) / steps
        for option in rows:
            ratios[option].append(times[option] / times["dense"])
            seconds[option].append(times[option])
        log(f"{name}: repetition {repetition + 1}/{repetitions}, dense step {times['dense'] * 1e3:.1f} ms")
    for option, periods in PERIODIC.items():
        share = trainees[option].periodic_seconds(periods)
        ratios[option] = [r + share / d for r, d in zip(ratios[option], seconds["dense"], strict=True)]
        seconds[option] = [t + share for t in seconds[option]]
    results = {option: [statistics.median(ratios[option]), statistics.median(seconds[option])] for option in rows}
    floors = trainees["SR-STE + transposable (every 40) + MVUE 1:2"].traffic_floor_bytes(*batches[0])
    dense_seconds = results["dense"][1]
    for key, size in floors.items():
        results[f"floor: {key}"] = [1 + size / bandwidth / dense_seconds, dense_seconds + size / bandwidth]
    return results


def verdict(results: dict[str, dict[str, list[float]]], names: list[str], option: str) -> str:
    """The target column: the bound per column (1.05x the floor row) and where it is met; for compiled rows also
    compiled / eager per column."""
    parts = []
    floor = floor_of(option)
    if floor is not None:
        bounds = [TARGET_OVER_FLOOR * results[name][floor][0] for name in names]
        met = sum(results[name][option][0] <= bound for name, bound in zip(names, bounds, strict=True))
        where = "everywhere" if met == len(names) else f"in {met} of {len(names)} columns"
        parts.append(f"<= {' / '.join(f'{bound:.2f}' for bound in bounds)}x: met {where}")
    if option.endswith(COMPILED_SUFFIX):
        eager = option.removesuffix(COMPILED_SUFFIX)
        speed = [results[name][option][1] / results[name][eager][1] for name in names]
        faster = sum(ratio <= 1.0 for ratio in speed)
        parts.append(
            f"compiled / eager {' / '.join(f'{ratio:.2f}' for ratio in speed)}x ({faster} of {len(names)} <= 1)"
        )
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps per configuration per repetition")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadiest on a shared machine)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), metavar="MODEL")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Every compiled row is its own model whose parametrised layers have their own classes, so each one recompiles
    # the shared forward code; dynamo's default limit of 8 would send the later rows back to eager.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 1024
    load = os.getloadavg()[0]
    bandwidth = copy_bandwidth()
    results = {name: bench_model(name, args.repetitions, args.steps, bandwidth, print) for name in args.models}
    names = list(args.models)
    lines = [
        f"`python benchmarks/train_step.py` on {machine()}, {datetime.date.today()}; {args.repetitions} interleaved "
        f"repetitions of {args.steps} steps per configuration; median of (step time / dense step time in the same "
        "repetition). A step is forward + backward + Adam + `sparsifier.step()`; work due every k steps (transposable "
        "mask searches every 40, permutation searches every 100) is timed apart and added to every step as 1/k of its "
        "cost. On CPU the masked GEMMs run densely, so these ratios are the overhead of the masking (no speed-up is "
        "possible here). The floor rows are the least time the masking can add: the bytes it must move at least "
        f"(SR-STE {SRSTE_BYTES_PER_WEIGHT} per sparse weight, MVUE {MVUE_BYTES_PER_OUTPUT} more per element of a "
        f"sparse layer's output gradient) at this machine's copy bandwidth ({bandwidth / 1e9:.1f} GB/s), on top of "
        f"the dense step. Target: at most {TARGET_OVER_FLOOR:.2f}x the floor row of the method (SR-STE's, MVUE's "
        "for the MVUE rows), per column; compiled rows (`torch.compile(model)`, inductor) no slower than eager. "
        f"Load average at the start: {load:.1f} on {os.cpu_count()} cores.",
        "",
        "| method / backward | " + " | ".join(names) + " | target |",
        "|---|" + "---:|" * len(names) + "---:|",
    ]
    for option in results[names[0]]:
        cells = []
        for name in names:
            ratio, seconds = results[name][option]
            cells.append(f"{ratio:.2f}x ({seconds * 1e3:.1f} ms)")
        lines.append(f"| {option} | " + " | ".join(cells) + f" | {verdict(results, names, option)} |")
    section = "\n".join(lines)
    print(section)
    if not args.no_write:
        write_section("train-step", "## Sparse training step time", section)


if __name__ == "__main__":
    main()
