"""Peak memory of converting a VGG16 classifier whose dense layer after the flatten is 25088 wide.

The model mirrors a Keras VGG16 classifier (issue 23): VGG16's 13 convolutions and five max-pools on a 240x240
image (7x7x512 = 25088 values after the flatten), a 25088 x 64 dense layer, ReLU and a 64 -> 10 output layer;
random weights (memory does not depend on them). It is exported with torch to a folder under the system temporary
directory and converted whole with 16 calibration images (smooth noise, one .npz) by ``nmdeploy convert --json`` in
a fresh process, as a user runs it: seconds, peak RSS (the process's VmHWM) and what the report says about the
wide layer's statistics. ``--before ROOT`` also runs the nmdeploy checkout at ROOT (another branch, say) under a
watchdog that stops it once its resident memory passes ``--cap-gb``, so that a conversion that needs 20 GB does not
take a shared machine down. Writes the ``convert-memory`` section of BENCHMARKS.md.

    python benchmarks/convert_memory.py [--max-memory MB ...] [--before ROOT] [--cap-gb 6] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from convert import export_with_images, vgg16_convolutions
from peak_memory import run_watched
from report import machine, write_section

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(tempfile.gettempdir()) / "nmdeploy-bench-convert-memory"


class VGG16Classifier(torch.nn.Module):
    """VGG16's convolutions (3x3, padding 1, ReLU, five 2x2 max-pools), flatten, 25088 -> 64 -> 10."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.features, channels = vgg16_convolutions()
        side = size
        for _ in range(5):
            side //= 2  # Keras' and torch's max-pools both floor: 240 -> 120 -> 60 -> 30 -> 15 -> 7
        self.flat = channels * side * side
        self.head = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(self.flat, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def export(images: int, size: int) -> tuple[Path, Path, int]:
    """The model and its calibration .npz (cached), and the dense layer's width."""
    folder = CACHE / f"vgg16-classifier-{images}x{size}"
    model, calibration = folder / "model.onnx", folder / "calib.npz"
    torch.manual_seed(0)
    network = VGG16Classifier(size).eval()
    if model.is_file() and calibration.is_file():
        return model, calibration, network.flat
    export_with_images(network, folder, images, size)
    return model, calibration, network.flat


def run(root: Path, model: Path, calibration: Path, out: Path, args: list[str], cap: int | None) -> dict:
    """One ``nmdeploy convert --json`` of the checkout at ``root``; stopped (and said so) past ``cap`` bytes."""
    command = [sys.executable, "-m", "nmdeploy", "convert", str(model), "-o", str(out), "--calib", str(calibration)]
    watched = run_watched([*command, *args, "--json"], cwd=root, cap=cap)
    if watched.stopped:
        return {"stopped": True, "process_seconds": watched.seconds, "sampled_peak_mb": watched.peak_bytes / 2**20}
    if watched.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{watched.stderr[-3000:]}")
    report = json.loads(watched.stdout)
    return {"process_seconds": watched.seconds, "sampled_peak_mb": watched.peak_bytes / 2**20, **report}


def wide_layer(result: dict, width: int) -> dict | None:
    """The report row of the weight with ``width`` inputs."""
    for row in result.get("report", []):
        if row.get("step") == "convert" and row.get("shape") and width in row["shape"]:
            return row
    return None


def describe(label: str, result: dict, width: int, cap_gb: float) -> str:
    if result.get("stopped"):
        cells = [label, "-", f"{result['process_seconds']:.0f}", f"> {cap_gb * 1024:.0f} (stopped)", "-", "-"]
        return "| " + " | ".join(cells) + " |"
    summary = result["summary"]
    row = wide_layer(result, width) or {}
    statistics = row.get("statistics", "full (float64)")
    cost = row.get("approximation_cost")
    cells = [
        label,
        f"{summary['seconds']:.0f}",
        f"{result['process_seconds']:.0f}",
        f"{summary['peak_rss_mb']:.0f}",
        str(summary["converted"]),
        f"{statistics}" + (f"; {cost}" if cost else ""),
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--size", type=int, default=240)
    parser.add_argument("--max-memory", type=int, nargs="*", default=[], help="also run with --max-memory MB")
    parser.add_argument("--before", type=Path, help="an nmdeploy checkout to run the same conversion with first")
    parser.add_argument("--cap-gb", type=float, default=6.0, help="stop a run whose resident memory passes this")
    parser.add_argument("--skip-default", action="store_true", help="no run with the default memory budget")
    parser.add_argument("--no-write", action="store_true")
    options = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    model, calibration, width = export(options.images, options.size)
    cap = int(options.cap_gb * 2**30)
    started = datetime.datetime.now(datetime.UTC)
    load = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="nmdeploy-bench-") as folder:
        out = Path(folder) / "converted.onnx"
        runs: list[tuple[str, Path, list[str]]] = []
        if options.before is not None:
            runs.append((f"before ({options.before.name})", options.before, []))
        if not options.skip_default:
            runs.append(("default budget", ROOT, []))
        runs += [(f"--max-memory {mb}", ROOT, ["--max-memory", str(mb)]) for mb in options.max_memory]
        for label, root, args in runs:
            result = run(root, model, calibration, out, args, cap)
            rows.append(describe(label, result, width, options.cap_gb))
            print(rows[-1], flush=True)
    header = (
        f"Measured {started:%Y-%m-%d %H:%M} UTC on {machine()}; a shared machine, load average {load:.1f} at the "
        f"start and {os.getloadavg()[0]:.1f} at the end. VGG16 classifier: 13 convolutions, flatten to {width}, "
        f"{width} x 64 dense, 64 -> 10; {options.images} calibration images {options.size}x{options.size} in one "
        "`.npz`; each conversion one `nmdeploy convert --json` in a fresh process (sequential fitting, sparsegpt); "
        "peak RSS is the process's VmHWM."
    )
    table = [
        "| run | seconds | process s | peak RSS MB | converted | the 25088-wide layer's statistics |",
        "|---|---:|---:|---:|---:|---|",
        *rows,
    ]
    section = header + "\n\n" + "\n".join(table)
    print(section)
    if not options.no_write:
        write_section(
            "convert-memory",
            "## Conversion memory: a VGG16 classifier with a 25088-wide dense layer (`benchmarks/convert_memory.py`)",
            section,
        )


if __name__ == "__main__":
    main()
