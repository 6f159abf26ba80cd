"""Trained model -> ONNX: bake the masks into plain weights, export, and record which weights are N:M on purpose.

The exported weights are exactly the masked weights the model trained, so every sparsified layer is N:M along its
input channels in the ONNX file too. The file also carries, under the metadata key :data:`METADATA_KEY`, a JSON
record of every layer the sparsifier saw: ``sparse`` or ``dense`` with the reason (an output head, a tied weight, a
shape that does not fit, ...) and the ONNX initializers that hold its weight, so ``nmdeploy inspect --require``
can tell a layer kept dense on purpose from one that lost its sparsity on the way. Files are written atomically
with the legacy TorchScript exporter at IR version <= 10.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from nmdeploy.errors import InputError, first_line
from nmdeploy.files import atomic_output, commit_exported, temporary_folder_beside
from nmdeploy.train.checkpoint import load_checkpoint, read_checkpoint, restoring
from nmdeploy.train.config import config_from_dict
from nmdeploy.train.masking.finalize import finalize
from nmdeploy.train.masking.sparsify import Sparsifier
from nmdeploy.train.tasks import build_model, import_callable, task_of

METADATA_KEY = "nmdeploy.sparsity"
OPSET = 17
MAX_IR_VERSION = 10


@dataclass(frozen=True)
class ExportResult:
    path: Path
    task: str
    pattern: str | None  # None for a dense run
    sparsified: tuple[str, ...]  # torch module names whose weights were baked N:M
    skipped: dict[str, str]


def export_checkpoint(
    checkpoint: str | Path,
    output: str | Path,
    *,
    model: str | None = None,
    inputs: tuple[str, ...] = (),
) -> ExportResult:
    """Export the model of a training checkpoint to ONNX with its masks baked in and its sparsity recorded.

    A checkpoint of ``nmdeploy train`` records how to build its model. One saved from Python (``save_checkpoint``)
    does not: ``model`` names the function that builds the dense model (``"package.module:function"``, called with
    no arguments, as a ``[task]`` model), ``inputs`` the example inputs the export traces (:func:`parse_input`).
    """
    payload = read_checkpoint(checkpoint)
    if "config" in payload:
        if model is not None or inputs:
            raise InputError(
                f"{checkpoint}: written by 'nmdeploy train', which records its model and inputs; drop --model/--input"
            )
        return _export_run(checkpoint, payload, output)
    if model is None:
        raise InputError(
            f"{checkpoint}: saved from Python (save_checkpoint), without a run configuration; name the function that "
            "builds its model and the shape of an input: --model package.module:function --input 1x64:int64"
        )
    if not inputs:
        raise InputError("--model needs the example input(s) to trace: --input SHAPE[:DTYPE], e.g. --input 1x64:int64")
    examples = tuple(torch.zeros(shape, dtype=dtype) for shape, dtype in (parse_input(text) for text in inputs))
    factory = import_callable(model, "model", flag="--model")
    built = factory()
    if not isinstance(built, nn.Module):
        raise InputError(f"--model {model!r} returned {type(built).__name__}, not a torch nn.Module")
    sparsifier = load_checkpoint(checkpoint, built).sparsifier
    built.eval()
    try:
        with torch.no_grad():
            built(*examples)
    except Exception as error:  # the user's forward on the user's shapes: any failure is a wrong --input
        raise InputError(
            f"--input {' '.join(inputs)}: {model} fails on inputs of that shape ({first_line(error)[:200]})"
        ) from None
    names = [f"input{i}" if len(examples) > 1 else "input" for i in range(len(examples))]
    axes = {name: {0: "batch"} for name in (*names, "output")}
    options = {"input_names": names, "output_names": ["output"], "dynamic_axes": axes}
    path = export_onnx(built, examples, output, sparsifier, **options)
    report = sparsifier.report() if sparsifier is not None else None
    return ExportResult(
        path,
        model,
        report["pattern"] if report is not None else None,
        tuple(sorted(sparsifier.layers)) if sparsifier is not None else (),
        dict(sparsifier.skipped) if sparsifier is not None else {},
    )


_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}


def parse_input(text: str) -> tuple[tuple[int, ...], torch.dtype]:
    """``"1x64:int64"`` -> ((1, 64), torch.int64): an example input's shape (``x`` or ``,`` between sizes) and
    dtype (float32 when left out). The first axis is exported as the batch axis; inputs are zeros."""
    shape_text, _, dtype_text = text.partition(":")
    sizes = shape_text.replace(",", "x").split("x")
    if not all(size.strip().isdigit() and int(size) > 0 for size in sizes):
        raise InputError(f"--input {text!r}: give positive sizes joined by 'x' and an optional dtype, e.g. 1x64:int64")
    dtype = _DTYPES.get(dtype_text or "float32")
    if dtype is None:
        raise InputError(f"--input {text!r}: unknown dtype {dtype_text!r}; choose one of {', '.join(_DTYPES)}")
    return tuple(int(size) for size in sizes), dtype


def _export_run(checkpoint: str | Path, payload: dict[str, Any], output: str | Path) -> ExportResult:
    config = config_from_dict(payload["config"])
    model, sparsifier = build_model(config.task, config.sparsity, config.train.seed, restore=True)
    with restoring(checkpoint):
        model.load_state_dict(payload["model"])
    sparsified: tuple[str, ...] = ()
    skipped: dict[str, str] = {}
    report = None
    if sparsifier is not None:
        with restoring(checkpoint):
            sparsifier.load_state_dict(payload["sparsifier"])
        sparsified, skipped = tuple(sorted(sparsifier.layers)), dict(sparsifier.skipped)
        report = sparsifier.report()
        finalize(model)
    model.eval()
    task = task_of(config.task)
    if task.export_onnx is not None:
        path = task.export_onnx(model, Path(output))
    else:  # a user's task: traced on two test inputs, the batch axis left free
        example = task.load_data(config.task.data_seed).test_x[:2]
        names = {"input_names": ["input"], "output_names": ["output"]}
        axes = {"input": {0: "batch"}, "output": {0: "batch"}}
        path = export_onnx(model, (example,), output, **names, dynamic_axes=axes)
    if report is not None:
        record_sparsity(path, model, report)
    pattern = config.sparsity.pattern if sparsifier is not None else None
    return ExportResult(path, task.name, pattern, sparsified, skipped)


def export_onnx(
    model: nn.Module,
    example_inputs: tuple[Any, ...] | torch.Tensor,
    path: str | Path,
    sparsifier: Sparsifier | None = None,
    **export_options: Any,
) -> Path:
    """Finalise ``model`` (bake its masks, in place) and export it to ONNX at ``path``, atomically, with the
    sparsifier's record of sparse and dense layers in the model's metadata.

    ``export_options`` go to ``torch.onnx.export`` (``input_names``, ``dynamic_axes``, ...); the TorchScript
    exporter and opset 17 are the defaults.
    """
    report = sparsifier.report() if sparsifier is not None else None
    finalize(model)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    inputs = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    options = {"dynamo": False, "opset_version": OPSET, **export_options}
    was_training = model.training
    model.eval()
    try:
        with temporary_folder_beside(target) as folder:
            exported = Path(folder) / target.name
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter, chosen on purpose
                warnings.simplefilter("ignore", torch.jit.TracerWarning)  # shape checks traced as constants
                torch.onnx.export(model, inputs, str(exported), **options)
            import onnx

            proto = onnx.load(str(exported))
            proto.ir_version = min(proto.ir_version, MAX_IR_VERSION)
            if report is not None:
                _annotate(proto, model, report)
            onnx.save(proto, str(exported))
            commit_exported(folder, target)
    finally:
        model.train(was_training)
    return target


def record_sparsity(path: str | Path, model: nn.Module, report: Mapping[str, Any]) -> Path:
    """Add the sparsifier's ``report`` to the ONNX file at ``path`` (rewritten atomically); ``model`` is the
    finalised model that was exported, whose weights identify the ONNX initializers."""
    import onnx

    target = Path(path)
    proto = onnx.load(str(target))
    _annotate(proto, model, report)
    with atomic_output(target) as temporary:
        onnx.save(proto, str(temporary))
    return target


def _annotate(proto: Any, model: nn.Module, report: Mapping[str, Any]) -> None:
    parameters = dict(model.named_parameters(remove_duplicate=False))  # a tied head under its own name
    initializers = _initializer_index(proto)
    layers: dict[str, dict[str, Any]] = {}
    for name, parameter in report["sparse"].items():
        layers[name] = {"status": "sparse", "parameter": parameter}
    for name, entry in report["dense"].items():
        layers[name] = {"status": "dense", "reason": entry["reason"], "parameter": entry["parameter"]}
    for entry in layers.values():
        weight = parameters.get(entry["parameter"])
        entry["initializers"] = [] if weight is None else _holders(weight.detach(), initializers)
    record = {
        "version": 1,
        "pattern": report["pattern"],
        "method": report["method"],
        "backward": report["backward"],
        "layers": layers,
    }
    for prop in list(proto.metadata_props):
        if prop.key == METADATA_KEY:
            proto.metadata_props.remove(prop)
    proto.metadata_props.add(key=METADATA_KEY, value=json.dumps(record, sort_keys=True))


def _initializer_index(proto: Any) -> dict[int, list[tuple[str, np.ndarray]]]:
    """Element count -> (name, values) of the graph's floating-point initializers."""
    from onnx import numpy_helper

    index: dict[int, list[tuple[str, np.ndarray]]] = {}
    for initializer in proto.graph.initializer:
        values = numpy_helper.to_array(initializer)
        if values.dtype.kind == "f" and values.ndim >= 2:
            index.setdefault(values.size, []).append((initializer.name, values.astype(np.float32)))
    return index


def _holders(weight: torch.Tensor, initializers: Mapping[int, list[tuple[str, np.ndarray]]]) -> list[str]:
    """The initializers that hold ``weight``: equal, transposed (MatMul), or scaled per output channel (a
    BatchNorm folded into the convolution before it by the exporter); zeros always in the same places."""
    values = weight.float().cpu().numpy()
    found = []
    for name, candidate in initializers.get(values.size, []):
        same = candidate.shape == values.shape and _same_up_to_row_scale(candidate, values)
        transposed = values.ndim == 2 and candidate.shape == values.T.shape and np.array_equal(candidate, values.T)
        if same or transposed:
            found.append(name)
    return found


def _same_up_to_row_scale(candidate: np.ndarray, values: np.ndarray) -> bool:
    if np.array_equal(candidate, values):
        return True
    if not np.array_equal(candidate == 0, values == 0):
        return False
    rows, expected = candidate.reshape(len(candidate), -1), values.reshape(len(values), -1)
    pivot = np.abs(expected).argmax(axis=1)
    reference = expected[np.arange(len(expected)), pivot]
    if np.any(reference == 0):
        return False
    scale = rows[np.arange(len(rows)), pivot] / reference
    return bool(np.allclose(rows, expected * scale[:, None], rtol=1e-4, atol=1e-6))
