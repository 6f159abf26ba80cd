"""Settings every part of the GPU check shares (files of the carry folder, models, row counts, sections), its
progress lines, and making this checkout's nmdeploy importable where it is not installed."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()  # the budget counts from here: importing torch and starting CUDA are part of the run
REPOSITORY = Path(__file__).resolve().parent.parent.parent
CARRY_LIMIT_BYTES = 55 * 2**20
MANIFEST = "manifest.json"
SHAPES = "shapes.json"
RESULTS = "results.json"
MINILM_CARRIED = "minilm.fp16-storage.onnx"
# nmdeploy depends on tomlkit (regress --update); the GPU machine lacks it, so its pure-Python package travels as a
# zip that zipimport reads, put last on sys.path only where tomlkit is missing.
CARRIED_PACKAGES = ("tomlkit",)
DATA_SETS = {
    "calib": "calibration sentences (models/minilm/calibration.txt)",
    "same": "everyday sentences, the calibration's kind (models/minilm/evaluation.txt)",
    "other": "docstring sentences, another kind (models/mpnet/calibration.txt)",
}
MODELS = ("digits", "minilm", "textdet", "mpnet", "vgg16")
ENCODERS = ("minilm", "mpnet")
ROWS = (1, 8, 32, 128, 256)
SEQUENCE = 128  # tokens per sentence for an encoder's natural rows
NATURAL_BATCHES = ROWS
CONV_BATCHES = (1, 8, 32)
MAX_ROWS = 2**17
MAX_OPERAND_BYTES = 2**31  # no activation operand above 2 GB
MAX_LENGTH = 64  # tokens per calibration/evaluation sentence, as the CPU benchmarks use
ENCODER_FILTER = "encoder"  # node names /encoder/layer.N/...: MiniLM's 36 encoder Linear weights
RECOVER_STEPS = (1000, 10000)
SECTIONS = ("environment", "gemm", "convert", "train_step", "minilm_finetune", "convert_10000", "convert_oneshot")
FLOAT16_NOTE = (
    "MiniLM's float32 weights were carried stored as float16 and cast back to float32 before use: the dense "
    "reference on the device is the fp16-rounded model (float32 compute), and every cosine is against it"
)


def progress(message: str) -> None:
    """One line per step, flushed at once (the device returns the output's tail)."""
    print(f"[gpu.py {time.strftime('%H:%M:%S')}] {message}", flush=True)


def repository_imports(carry: Path | None = None) -> dict[str, str]:
    """Make this checkout's nmdeploy importable when it is not installed (the GPU machine): the checkout on
    sys.path, the two data packages that setup.py maps from top-level folders (models/, passes/), and the carried
    pure-Python packages that are missing. Returns where each carried package comes from."""
    if str(REPOSITORY) not in sys.path:
        sys.path.insert(0, str(REPOSITORY))
    sources = {}
    for name in CARRIED_PACKAGES:
        archive = None if carry is None else carry / f"{name}.zip"
        if importlib.util.find_spec(name) is not None:
            sources[name] = "installed"
        elif archive is not None and archive.is_file():
            sys.path.append(str(archive))
            sources[name] = f"carried ({archive.name})"
        else:
            sources[name] = "missing"
    import nmdeploy

    for package, folder in (("nmdeploy.models", "models"), ("nmdeploy.recipes", "passes")):
        if package in sys.modules or importlib.util.find_spec(package) is not None:
            continue
        init = REPOSITORY / folder / "__init__.py"
        spec = importlib.util.spec_from_file_location(package, init, submodule_search_locations=[str(init.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        spec.loader.exec_module(module)
        setattr(nmdeploy, package.rsplit(".", 1)[1], module)
    return sources
