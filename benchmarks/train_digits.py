"""Accuracy bars of sparse training on the digits CNN: every models/digits/*.toml recipe against the dense run.

All configs share one training recipe (20 epochs, Adam, cosine), so the only difference is the sparsity method.
Bars from the issue: SR-STE 2:4 within 0.5 points of dense; transposable 2:4 + MVUE 1:2 within 1.0. With several
``--seeds`` the table shows the mean over seeds (the same seeds for every config). Also draws STE vs SR-STE mask
flips per epoch (sparse architecture divergence) as ``benchmarks/train_digits_flips.png``. Writes the
``train-digits`` section of BENCHMARKS.md.

    python benchmarks/train_digits.py [--seeds 0 1 2] [--threads 1] [--no-write]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch
from report import machine, write_section

from nmdeploy.train.config import load_config
from nmdeploy.train.trainer import train

MODELS = Path(__file__).resolve().parent.parent / "models" / "digits"
PLOT = Path(__file__).resolve().parent / "train_digits_flips.png"
ORDER = ["dense", "srste", "ste", "transposable-mvue", "bimask", "lbc", "mask-decay", "structure-decay", "fixed"]
BARS = {"srste": 0.5, "transposable-mvue": 1.0}


def run_all(seeds: list[int], log) -> dict[str, list]:
    results: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as folder:
        for name in ORDER:
            base = load_config(MODELS / f"{name}.toml")
            results[name] = []
            for seed in seeds:
                config = dataclasses.replace(base, train=dataclasses.replace(base.train, seed=seed))
                start = time.perf_counter()
                result = train(config, Path(folder) / f"{name}-{seed}", progress=False)
                seconds = time.perf_counter() - start
                log(f"{name} seed {seed}: test accuracy {result.test_accuracy:.4f} ({seconds:.0f} s)")
                results[name].append(result)
    return results


def plot_flips(results: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.6))
    for name, label in (("ste", "STE"), ("srste", "SR-STE (lambda 2e-4)")):
        epochs = results[name][0].epochs
        axis.plot([e.epoch for e in epochs], [e.sad for e in epochs], marker="o", markersize=3, label=label)
    axis.set_yscale("symlog", linthresh=1e-4)
    axis.set_xlabel("epoch")
    axis.set_ylabel("mask flips per weight per epoch (SAD)")
    axis.set_title("Digits CNN 2:4: mask flips, STE vs SR-STE (seed 0)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for this tiny model)")
    parser.add_argument("--no-write", action="store_true", help="print the section, leave BENCHMARKS.md alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = run_all(args.seeds, print)
    plot_flips(results, PLOT)
    dense = statistics.mean(r.test_accuracy for r in results["dense"])
    lines = [
        f"`python benchmarks/train_digits.py --seeds {' '.join(map(str, args.seeds))}` on {machine()}, "
        f"{datetime.date.today()}. Digits CNN (`nmdeploy.reference.digits.DigitsCNN`), 1347 training / 450 test "
        "images (one test image = 0.22 points), the recipe of `models/digits/*.toml` (20 epochs, Adam 3e-3, cosine, "
        "weight decay 1e-4); 2:4 on the three middle layers, first convolution and last Linear dense. Test accuracy "
        f"is the mean over seeds {args.seeds}; SAD = mask flips per weight in the last epoch.",
        "",
        "| config | test accuracy % | vs dense (points) | bar | last-epoch SAD | per seed |",
        "|---|---:|---:|---|---:|---|",
    ]
    for name in ORDER:
        accuracies = [r.test_accuracy for r in results[name]]
        mean = statistics.mean(accuracies)
        bar = ""
        if name in BARS:
            bar = f"within {BARS[name]}: {'met' if dense - mean <= BARS[name] else 'NOT met'}"
        sad = statistics.mean(r.epochs[-1].sad for r in results[name])
        lines.append(
            f"| {name} | {100 * mean:.2f} | {100 * (mean - dense):+.2f} | {bar} | {sad:.5f} | "
            + ", ".join(f"{100 * a:.2f}" for a in accuracies)
            + " |"
        )
    lines += ["", f"![STE vs SR-STE mask flips]({PLOT.relative_to(PLOT.parent.parent)})"]
    section = "\n".join(lines)
    print(section)
    if not args.no_write:
        write_section("train-digits", "## Sparse training on digits", section)


if __name__ == "__main__":
    main()
