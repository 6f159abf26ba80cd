"""What the ``gemm`` section writes beside ``results.json``: the speed-up table of ``gemm.md`` and, per model, where
each eligible layer's 2:4 product becomes faster."""

from __future__ import annotations

from gpu_check.common import ROWS


def gemm_table(measurements: list[dict], shapes: dict) -> str:
    """Markdown: one row per shape, the 2:4 speed-up (dense ms / sparse ms) per dtype/backend and row count."""
    columns: dict[tuple[str, str], list[int]] = {}
    for entry in measurements:
        columns.setdefault((entry["dtype"], entry["backend"]), [])
        if entry["rows"] not in columns[(entry["dtype"], entry["backend"])]:
            columns[(entry["dtype"], entry["backend"])].append(entry["rows"])
    lines = []
    for (dtype, backend), row_counts in columns.items():
        row_counts.sort()
        plain = [r for r in row_counts if r in ROWS]
        timed = sorted(
            {e.get("timed", "eager") for e in measurements if (e["dtype"], e["backend"]) == (dtype, backend)}
        )
        lines += [f"\n2:4 speed-up (dense ms / 2:4 ms), {dtype}, {backend}, timed by {' / '.join(timed)}; "
                  "natural rows: batch x tokens or pixels\n",
                  "| out x in | layers | " + " | ".join(f"{r} rows" for r in plain) + " | natural rows: speed-up |",
                  "|---|---|" + "---|" * len(plain) + "---|"]  # fmt: skip
        by_shape: dict[tuple[int, int], dict[int, dict]] = {}
        for entry in measurements:
            if (entry["dtype"], entry["backend"]) == (dtype, backend):
                by_shape.setdefault((entry["out"], entry["in"]), {})[entry["rows"]] = entry
        for (out, inp), entries in by_shape.items():
            layers = next((s["layers"] for s in shapes["unique"] if (s["out"], s["in"]) == (out, inp)), [])
            models = sorted({name.split(":", 1)[0] for name in layers})
            cells = [f"{entries[r]['speedup']:.2f}" if r in entries else "-" for r in plain]
            natural = ", ".join(f"{r}: {e['speedup']:.2f}" for r, e in sorted(entries.items()) if r not in ROWS)
            lines.append(
                f"| {out}x{inp} | {len(layers)} ({', '.join(models)}) | {' | '.join(cells)} | {natural or '-'} |"
            )
    return "\n".join(lines)


def layer_wins(measurements: list[dict], shapes: dict) -> dict:
    """Per model: for each eligible layer, the speed-ups by dtype/backend and rows, and the smallest row count from
    which 2:4 is faster (the budget's speed term)."""
    by_shape: dict[tuple[int, int], list[dict]] = {}
    for entry in measurements:
        by_shape.setdefault((entry["out"], entry["in"]), []).append(entry)
    wins: dict[str, dict] = {}
    for layer in shapes["layers"]:
        if not layer["eligible"]:
            continue
        entries = by_shape.get((layer["out"], layer["in"]), [])
        speedups: dict[str, dict[str, float]] = {}
        for entry in entries:
            speedups.setdefault(f"{entry['dtype']} {entry['backend']}", {})[str(entry["rows"])] = round(
                entry["speedup"], 3
            )
        wins_from = {
            key: min((int(r) for r, s in values.items() if s > 1.0), default=None) for key, values in speedups.items()
        }
        wins.setdefault(layer["model"], {})[layer["layer"]] = {
            "shape": [layer["out"], layer["in"]],
            "speedup": speedups,
            "faster_from_rows": wins_from,
        }
    return wins
