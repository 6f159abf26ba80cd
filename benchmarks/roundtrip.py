"""Does a load + save change the model? onnx-ir, onnx-graphsurgeon and nmdeploy's OnnxModel on real ONNX files.

Each tool loads every model from its file and saves it to a new one, with no edit in between; the copy is then
compared with the original (both read with their external data) on three counts:

* graph: nodes, inputs, outputs, value_info, initializers (names, types, shapes, values), sparse initializers,
  local functions, graph name and doc string; tensor values are compared as arrays, so re-encoding the same
  numbers (float_data -> raw_data, external -> inline) is not counted as a change;
* opset imports: the (domain, version) pairs;
* metadata: IR version, producer name and version, model domain, model version, doc string, metadata_props.

Models: every real .onnx file shipped inside the installed onnx and onnxruntime packages (the ONNX model zoo's
``light_*`` architectures, scikit-learn and small operator models), the digits CNN and MiniLM-L6 exported by
``nmdeploy.reference`` (TorchScript exporter, and the dynamo exporter with external data).
Writes a table into BENCHMARKS.md between the ``roundtrip`` markers (ARCHITECTURE.md quotes its totals).

    python benchmarks/roundtrip.py [--no-write] [--skip-exports]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx
from onnx import numpy_helper
from report import machine, write_section

GRAPH_FIELDS = ("node", "input", "output", "value_info", "sparse_initializer", "name", "doc_string")
METADATA_FIELDS = ("ir_version", "producer_name", "producer_version", "domain", "model_version", "doc_string")


def packaged_models() -> list[Path]:
    """Real models inside installed packages: onnx's zoo architectures and ONNX Runtime's example models."""
    import onnxruntime

    found = sorted((Path(onnx.__file__).parent / "backend" / "test" / "data" / "light").glob("*.onnx"))
    found += sorted((Path(onnxruntime.__file__).parent / "datasets").glob("*.onnx"))
    return found


def exported_models(folder: Path) -> list[Path]:
    """The reference models as nmdeploy exports them (needs the models extra)."""
    import torch

    from nmdeploy.reference import digits, minilm

    torch.manual_seed(0)
    cnn = digits.DigitsCNN()
    digits.train_digits(cnn, digits.digits_splits(), epochs=1)
    paths = [digits.export_digits_onnx(cnn, folder / "digits-cnn.onnx")]
    paths.append(minilm.export_minilm_onnx(folder / "minilm-l6.onnx"))
    paths.append(minilm.export_minilm_onnx(folder / "minilm-l6-dynamo.onnx", dynamo=True))
    return paths


def _external(path: Path) -> bool:
    model = onnx.load(str(path), load_external_data=False)
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def via_onnx_ir(source: Path, target: Path) -> None:
    import onnx_ir

    model = onnx_ir.load(source)
    onnx_ir.save(model, target, external_data=target.name + ".data" if _external(source) else None)


def via_graphsurgeon(source: Path, target: Path) -> None:
    import onnx_graphsurgeon as gs

    exported = gs.export_onnx(gs.import_onnx(onnx.load(str(source))))
    onnx.save(exported, str(target), save_as_external_data=_external(source), location=target.name + ".data")


def via_nmdeploy(source: Path, target: Path) -> None:
    from nmdeploy.graph.model import OnnxModel

    OnnxModel.load(source).save(target)


TOOLS: dict[str, Callable[[Path, Path], None]] = {
    "onnx-ir load/save": via_onnx_ir,
    "onnx-graphsurgeon import/export": via_graphsurgeon,
    "nmdeploy OnnxModel load/save": via_nmdeploy,
}


def _values(tensor: onnx.TensorProto) -> tuple:
    array = numpy_helper.to_array(tensor)
    return tensor.name, tensor.data_type, tuple(tensor.dims), array.tobytes() if array.dtype != object else repr(array)


def _canonical(message):
    """A copy whose tensors (initializers and attribute values, at any depth) hold their values as raw bytes, so
    the comparison sees values, not the storage field they were written in."""
    copy = type(message)()
    copy.CopyFrom(message)
    stack = [copy]
    while stack:
        item = stack.pop()
        for field, value in item.ListFields():
            if field.message_type is None:
                continue
            children = list(value) if field.is_repeated else [value]
            for child in children:
                if isinstance(child, onnx.TensorProto) and child.data_type not in (0, onnx.TensorProto.STRING):
                    array = numpy_helper.to_array(child)
                    child.CopyFrom(numpy_helper.from_array(array, child.name))
                else:
                    stack.append(child)
    return copy


def changes(original: onnx.ModelProto, copy: onnx.ModelProto) -> dict[str, list[str]]:
    """What differs between two models, by count (graph, opset imports, metadata), each with the fields."""
    found: dict[str, list[str]] = {"graph": [], "opset imports": [], "metadata": []}
    a, b = _canonical(original.graph), _canonical(copy.graph)
    for name in GRAPH_FIELDS:
        left, right = getattr(a, name), getattr(b, name)
        if hasattr(left, "__len__") and not isinstance(left, str):
            same = len(left) == len(right) and all(x == y for x, y in zip(left, right, strict=True))
        else:
            same = left == right
        if not same:
            found["graph"].append(name)
    if sorted(map(_values, a.initializer)) != sorted(map(_values, b.initializer)):
        found["graph"].append("initializer")
    elif [t.name for t in a.initializer] != [t.name for t in b.initializer]:
        found["graph"].append("initializer order")
    functions_a = [_canonical(f).SerializeToString(deterministic=True) for f in original.functions]
    functions_b = [_canonical(f).SerializeToString(deterministic=True) for f in copy.functions]
    if functions_a != functions_b:
        found["graph"].append("functions")
    if sorted((o.domain, o.version) for o in original.opset_import) != sorted(
        (o.domain, o.version) for o in copy.opset_import
    ):
        found["opset imports"].append("opset_import")
    for name in METADATA_FIELDS:
        if getattr(original, name) != getattr(copy, name):
            found["metadata"].append(name)
    if {p.key: p.value for p in original.metadata_props} != {p.key: p.value for p in copy.metadata_props}:
        found["metadata"].append("metadata_props")
    return found


def measure(models: list[Path], work: Path) -> tuple[list[str], dict[str, dict[str, int]]]:
    rows = [
        "| model | nodes | " + " | ".join(TOOLS) + " |",
        "|---|---:|" + "---|" * len(TOOLS),
    ]
    totals = {
        tool: dict.fromkeys(("graph", "order only", "opset imports", "metadata", "any", "failed"), 0) for tool in TOOLS
    }
    for source in models:
        original = onnx.load(str(source))
        cells = []
        for tool, run in TOOLS.items():
            folder = work / tool.split()[0] / source.stem
            folder.mkdir(parents=True, exist_ok=True)
            target = folder / source.name
            try:
                run(source, target)
                copy = onnx.load(str(target))
            except Exception as error:  # a tool that cannot round-trip the model is a finding too
                totals[tool]["failed"] += 1
                cells.append(f"fails ({type(error).__name__}: {str(error).splitlines()[0][:80] if str(error) else ''})")
                continue
            found = changes(original, copy)
            changed = {count: fields for count, fields in found.items() if fields}
            for count in changed:
                # Initializers stored in another order hold the same model: counted apart from real changes.
                reordered = count == "graph" and changed[count] == ["initializer order"]
                totals[tool]["order only" if reordered else count] += 1
            totals[tool]["any"] += bool(changed)
            cells.append("; ".join(f"{count}: {', '.join(fields)}" for count, fields in changed.items()) or "none")
        rows.append(f"| {source.stem} | {len(original.graph.node)} | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    return rows, totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--skip-exports", action="store_true", help="only the models shipped in packages")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nmdeploy-roundtrip-"))
    try:
        models = packaged_models()
        if not args.skip_exports:
            exports = work / "exports"
            exports.mkdir()
            models += exported_models(exports)
        rows, totals = measure(models, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = [
        "",
        "| tool | models changed | graph | only initializer order | opset imports | metadata | fails |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for tool, total in totals.items():
        summary.append(
            f"| {tool} | {total['any']} of {len(models)} | {total['graph']} | {total['order only']} "
            f"| {total['opset imports']} | {total['metadata']} | {total['failed']} |"
        )
    section = (
        f"Measured {datetime.date.today().isoformat()} on {machine()}, load average "
        f"{os.getloadavg()[0]:.1f}.\n"
        "Load from file and save to a new file with no edit; the copy compared with the original. Tensor values "
        "are compared as arrays (a re-encoding of the same numbers is not a change).\n\n" + "\n".join(rows + summary)
    )
    print(section)
    if not args.no_write:
        write_section("roundtrip", "## Load/save round trips (`python benchmarks/roundtrip.py`)", section)


if __name__ == "__main__":
    main()
