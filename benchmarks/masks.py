"""Mask engine benchmark: throughput and retained score of 1-D, exact and greedy transposable masks.

Runs every solver on the same seeded fp32 matrices in one process, plus networkx min-cost flow (the usual exact
baseline) on a random subsample of tiles, extrapolated to the whole matrix. Writes a table into BENCHMARKS.md
between the ``masks`` markers, with the machine and the date.

    python benchmarks/masks.py [--sizes 4096 8192] [--networkx-tiles 64] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import time
from dataclasses import dataclass

import networkx as nx
import torch
from report import machine, write_section

from nmdeploy.masks import Pattern, is_transposable, nm_mask, transposable_mask
from nmdeploy.masks.tiles import to_tiles

PATTERNS = ["2:4", "4:8", "8:16", "16:32"]


@dataclass
class Row:
    size: int
    pattern: str
    method: str
    seconds: float
    kept: float  # sum of |w| kept
    note: str = ""


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def networkx_tile(tile: torch.Tensor, n: int, scale: float = 1e6) -> float:
    m = tile.shape[0]
    graph = nx.DiGraph()
    graph.add_node("s", demand=-n * m)
    graph.add_node("t", demand=n * m)
    values = tile.tolist()
    for i in range(m):
        graph.add_edge("s", ("r", i), capacity=n, weight=0)
        graph.add_edge(("c", i), "t", capacity=n, weight=0)
        for j in range(m):
            graph.add_edge(("r", i), ("c", j), capacity=1, weight=-int(round(values[i][j] * scale)))
    flow = nx.min_cost_flow(graph)
    return sum(values[i][j] for i in range(m) for j in range(m) if flow[("r", i)][("c", j)])


def bench_size(size: int, networkx_tiles: int, log) -> list[Row]:
    weight = torch.randn(size, size, generator=torch.Generator().manual_seed(size))
    scores = weight.abs().double()
    rows: list[Row] = []
    mask, seconds = timed(lambda: nm_mask(weight, "2:4", axis=1))
    rows.append(Row(size, "2:4", "1-D (not transposable)", seconds, float((scores * mask).sum())))
    log(rows[-1])
    for text in PATTERNS:
        pattern = Pattern.parse(text)
        for method in ("exact", "greedy"):
            mask, seconds = timed(lambda p=pattern, m=method: transposable_mask(weight, p, method=m))
            assert is_transposable(mask, pattern).fraction == 1.0
            rows.append(Row(size, text, f"transposable {method}", seconds, float((scores * mask).sum())))
            log(rows[-1])
        # networkx on a random subsample of tiles, compared with the exact solver on the same tiles.
        tiles, _ = to_tiles(weight.abs(), pattern, axis=1, out_axis=0)
        pick = torch.randperm(len(tiles), generator=torch.Generator().manual_seed(0))[:networkx_tiles]
        start = time.perf_counter()
        nx_kept = sum(networkx_tile(tiles[t].double(), pattern.n) for t in pick.tolist())
        per_tile = (time.perf_counter() - start) / len(pick)
        ours = transposable_mask(tiles[pick].reshape(-1, pattern.m), pattern, axis=1, out_axis=0)
        ours_kept = float((tiles[pick].reshape(-1, pattern.m).double() * ours).sum())
        rows.append(
            Row(
                size,
                text,
                "networkx min-cost flow",
                per_tile * len(tiles),
                float("nan"),
                note=f"{len(pick)} tiles timed, extrapolated; kept/exact on them {nx_kept / ours_kept:.6f}",
            )
        )
        log(rows[-1])
    return rows


def table(rows: list[Row]) -> str:
    def by(method: str) -> dict[tuple[int, str], Row]:
        return {(r.size, r.pattern): r for r in rows if r.method == method}

    exact, greedy, flow = by("transposable exact"), by("transposable greedy"), by("networkx min-cost flow")
    lines = [
        "| size | pattern | method | seconds | Mweights/s | kept / exact optimum | greedy s / this s "
        "| networkx s / this s | note |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]

    def ratio(reference: Row | None, row: Row) -> str:
        return f"{reference.seconds / row.seconds:.2f}x" if reference and reference is not row else "-"

    for r in rows:
        ref = exact.get((r.size, r.pattern))
        kept = f"{r.kept / ref.kept:.6f}" if ref and r.kept == r.kept else "-"
        lines.append(
            f"| {r.size} | {r.pattern} | {r.method} | {r.seconds:.3f} | {r.size * r.size / r.seconds / 1e6:.2f} "
            f"| {kept} | {ratio(greedy.get((r.size, r.pattern)), r)} | {ratio(flow.get((r.size, r.pattern)), r)} "
            f"| {r.note} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--networkx-tiles", type=int, default=64)
    parser.add_argument("--no-write", action="store_true", help="print the table without updating BENCHMARKS.md")
    args = parser.parse_args()
    rows: list[Row] = []
    for size in args.sizes:
        rows += bench_size(
            size,
            args.networkx_tiles,
            lambda r: print(f"  {r.size} {r.pattern:>5} {r.method:<28} {r.seconds:9.3f}s {r.note}", flush=True),
        )
    section = (
        f"Measured {datetime.date.today().isoformat()} on {machine()}.\n"
        f"Random normal fp32 matrices (seeded), scores = |w|, reduction axis 1. networkx: min-cost flow per "
        f"tile with integer costs (scores x 1e6), {args.networkx_tiles} random tiles timed and extrapolated.\n\n"
        + table(rows)
    )
    print(section)
    if not args.no_write:
        write_section("masks", "## Mask engine (`python benchmarks/masks.py`)", section)


if __name__ == "__main__":
    main()
