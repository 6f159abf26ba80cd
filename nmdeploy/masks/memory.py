"""How much memory a layer's conversion statistics and fit take, and what to do when they do not fit a budget.

Per layer the choice is: full statistics (K^2 float32 numbers, factorised in place by the fit), block-diagonal
statistics of B columns per block (K * B numbers, :mod:`nmdeploy.masks.blockwise`), or skipping the layer with the
reason. The estimates count every K x K or K x B buffer and the fit's [out, K] working copies; they are checked
against measured allocations in the tests.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from nmdeploy.imports import optional

FLOAT32 = 4
# Statistics whose float64 form takes at most this many bytes stay float64: the memory is small, and float32 sums
# depend on the order of the chunks (measured: two statistics runners that agree to 1e-9 in float64 gave digits
# conversions 8e-5 apart in output cosine from float32 sums). Wider layers are float32, half the memory.
FLOAT64_LIMIT = 1 << 26
MIN_BLOCK = 64  # below this many columns per block the fit compensates too little to be worth the statistics
_PANEL = 512  # columns of the fit's panels (reconstruct._PANEL): about four [min(K, B), _PANEL] temporaries
_WORKING_COPIES = 6  # [out, K] float32-sized copies while a layer is fitted (weights, its copy, mask, deltas)
_REFIT_SYSTEMS = 4 << 27  # refit's per-row systems (nmdeploy.masks.reconstruct._SOLVE_BYTES, factor and copies)


@dataclass(frozen=True)
class LayerShape:
    """A layer's GEMM as the statistics see it: ``k`` inputs per output (the reduction length), ``out`` outputs;
    ``shifted``: its inputs will differ from the dense model's, so cross moments are collected too."""

    name: str
    k: int
    out: int
    shifted: bool = False


@dataclass(frozen=True)
class StatisticsPlan:
    """What one layer's statistics will be: ``full``, ``block-diagonal`` (``block`` columns) or ``skip``
    (``reason``), and the bytes its statistics and fit need."""

    name: str
    kind: str
    bytes: int
    block: int | None = None
    reason: str | None = None

    def describe(self) -> str:
        if self.kind == "block-diagonal":
            return f"block-diagonal statistics, blocks of {self.block} columns"
        return self.reason or "full statistics"


def statistics_itemsize(k: int) -> int:
    """Bytes per number of a layer's full statistics: 8 (float64) up to :data:`FLOAT64_LIMIT`, else 4."""
    return 8 if k * k * 8 <= FLOAT64_LIMIT else FLOAT32


def full_cross(layer: LayerShape) -> bool:
    """Whether full statistics collect the [K, K] cross moments (else the [K, out] ones, for narrow layers)."""
    return layer.shifted and 2 * layer.out >= layer.k


def layer_bytes(layer: LayerShape, block: int | None = None, method: str = "sparsegpt") -> int:
    """Bytes of one layer's statistics (float32) plus the peak its fit adds, with full statistics (``block`` None
    or >= K) or blocks of ``block`` columns."""
    k, out = layer.k, layer.out
    blockwise = block is not None and block < k
    moments = k * block if blockwise else k * k
    if layer.shifted:
        moments += k * out if blockwise or not full_cross(layer) else k * k
    working = _WORKING_COPIES * out * k + 4 * _PANEL * (block if blockwise else k)
    if method == "refit":
        working += _REFIT_SYSTEMS
    itemsize = FLOAT32 if blockwise else statistics_itemsize(k)
    return moments * itemsize + working * FLOAT32


def largest_block(layer: LayerShape, budget: int, m: int, method: str = "sparsegpt") -> int | None:
    """The widest block (a multiple of M, at least :data:`MIN_BLOCK`, below K) whose statistics and fit fit
    ``budget`` bytes; None where even the narrowest does not."""
    fixed = layer_bytes(layer, block=0, method=method)
    per_column = (layer.k + 4 * _PANEL) * FLOAT32  # each column of a block: its moments and its panel share
    block = (budget - fixed) // per_column // m * m if budget > fixed else 0
    block = min(block, (layer.k - 1) // m * m)
    narrowest = -(-MIN_BLOCK // m) * m
    return block if block >= narrowest else None


def plan_statistics(
    layers: Sequence[LayerShape], budget: int, m: int, method: str = "sparsegpt"
) -> list[StatisticsPlan]:
    """Full, block-diagonal or skip for layers whose statistics are held together (one fitting stage), within
    ``budget`` bytes in all: the smallest layers are planned first, each given an equal share of what is left, so
    that one wide layer takes the approximation rather than many narrow ones."""
    plans: dict[str, StatisticsPlan] = {}
    left = budget
    ordered = sorted(layers, key=lambda layer: layer_bytes(layer, method=method))
    for position, layer in enumerate(ordered):
        share = left // (len(ordered) - position)
        needed = layer_bytes(layer, method=method)
        if needed <= share:
            plan = StatisticsPlan(layer.name, "full", needed)
        else:
            block = largest_block(layer, share, m, method)
            if block is None:
                smallest = layer_bytes(layer, -(-MIN_BLOCK // m) * m, method)
                plan = StatisticsPlan(
                    layer.name,
                    "skip",
                    0,
                    reason=f"its statistics need {smallest / 2**20:.0f} MB even in blocks of {MIN_BLOCK} columns "
                    f"(share of the memory budget: {share / 2**20:.0f} MB); raise --max-memory",
                )
            else:
                plan = StatisticsPlan(layer.name, "block-diagonal", layer_bytes(layer, block, method), block)
        left -= plan.bytes
        plans[layer.name] = plan
    return [plans[layer.name] for layer in layers]


MEMINFO = "/proc/meminfo"


def available_memory() -> int:
    """Bytes of memory new allocations can have now without swapping: free pages plus the page cache and other
    memory the kernel reclaims on demand (psutil's ``available``; Linux's MemAvailable where psutil is not
    installed). Free pages alone undercount it: on a machine that has read a few GB of files most memory is cache,
    and a conversion that needs 1 GB was refused with 10 GB to hand."""
    psutil = optional("psutil")
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        with open(MEMINFO, encoding="ascii") as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):  # not Linux, or a kernel without MemAvailable (before 3.14)
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        return 8 << 30


DEFAULT_SHARE = 0.5  # of the available memory, what a conversion takes by default
FLOOR_SHARE = 0.8  # of the available memory, the most the default takes to reach what the conversion needs


def default_budget(fraction: float = DEFAULT_SHARE, needed: int = 0) -> int:
    """The conversion's default memory budget: ``fraction`` of the memory available when it starts, raised to
    ``needed`` (what the conversion holds besides its statistics, plus room for some) where that is within
    :data:`FLOOR_SHARE` of it: on a loaded machine half of what is left can be below the fixed cost of any
    conversion, while most of it would do."""
    available = available_memory()
    return int(max(available * fraction, min(needed, available * FLOOR_SHARE)))
