"""Which real models the torch interpreter runs, and how close it comes to ONNX Runtime on them.

    python benchmarks/interpreter_coverage.py MODEL.onnx [MODEL.onnx ...]

For each model: its op types (If branches included), those the interpreter lacks, and, where it runs them all, the
largest difference from ONNX Runtime over every output on one seeded random input, relative to the output's
largest magnitude. Inputs: float inputs uniform in [0, 1) (audio scaled to 0.1), a scalar int64 named ``sr`` is
16000 (the voice-activity detectors' sample rate), their audio ``input`` [2, 512] and states 2 rows; other free
dimensions 2 (the first axis), 64 (the third) or 128.
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import numpy_helper

from nmdeploy.runtimes.interpreter import SUPPORTED_OPS, GraphProgram, as_tensor, unsupported_nodes


def op_types(graph: onnx.GraphProto, found: collections.Counter) -> collections.Counter:
    for node in graph.node:
        found[node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"] += 1
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                op_types(attribute.g, found)
    return found


def random_feeds(model: onnx.ModelProto, rng: np.random.Generator) -> dict[str, np.ndarray]:
    stored = {tensor.name for tensor in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in stored:
            continue
        tensor_type = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tensor_type.shape.dim]
        if value.name == "sr" and not dims:
            feeds[value.name] = np.array(16000, dtype)
            continue
        audio, state = value.name == "input" and len(dims) == 2, value.name in ("state", "h", "c")
        shape = [d or (2 if axis == 0 or state else 512 if audio else 64 if axis == 2 else 128) for axis, d in
                 enumerate(dims)]  # fmt: skip
        scale = 0.1 if audio or state else 1.0
        feeds[value.name] = (rng.random(shape) * scale).astype(dtype)
    return feeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    args = parser.parse_args()
    print("| model | op types | not run | max abs difference / max abs output | seconds |")
    print("|---|---|---|---|---|")
    for path in args.models:
        model = onnx.load(str(path))
        found = op_types(model.graph, collections.Counter())
        missing = sorted(op for op in found if op not in SUPPORTED_OPS)
        agreement, seconds = "-", "-"
        if not unsupported_nodes(model):
            feeds = random_feeds(model, np.random.default_rng(0))
            session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            try:
                reference = session.run(None, feeds)
            except Exception as error:  # noqa: BLE001 - a model whose fixed shapes these feeds miss
                agreement = f"ONNX Runtime refused the random feeds ({str(error).splitlines()[0][:60]})"
            else:
                values = {t.name: as_tensor(numpy_helper.to_array(t)) for t in model.graph.initializer}
                values |= {name: as_tensor(array) for name, array in feeds.items()}
                start = time.perf_counter()
                outputs = GraphProgram(model).run(values)
                seconds = f"{time.perf_counter() - start:.2f}"
                worst = max(
                    float(np.abs(outputs[o.name].detach().numpy().astype(np.float64) - r).max() / np.abs(r).max())
                    for o, r in zip(model.graph.output, reference, strict=True)
                )
                agreement = f"{worst:.1e}"
        print(f"| {path.name} | {len(found)} | {', '.join(missing) or 'none'} | {agreement} | {seconds} |")


if __name__ == "__main__":
    main()
