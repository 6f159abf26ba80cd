"""Peak memory of converting decoder-like stacks block by block, and of whole-model prune / inspect of a large one.

The models are synthetic stacks of decoder blocks at Llama-3-8B width (hidden 4096, FFN 14336, 32 query heads and 8
key/value heads of 128: RMSNorm, grouped-query causal attention, RMSNorm, SwiGLU MLP, residuals), built with
onnx.helper, random weights (memory does not depend on their values) written tensor by tensor into one external
data file, so that making an 8-block model (7 GB of float32) never holds more than one tensor. A block holds
218 M weights (0.87 GB float32).

Each run is a fresh ``nmdeploy`` process (``nmdeploy.cli.main`` in a subprocess, as a user runs it), its peak
resident memory read from /proc (VmHWM) by the report's summary and, for verbs without one, by a poller of the
child's RSS. ``convert`` runs SparseGPT sequentially on calibration rows of hidden states; ``prune`` and
``inspect`` run on a model of ``--whole`` blocks, beside a bare ``onnx.load`` + ``onnx.save`` of it (the reference
the issue sets: at most 1.3x). Prints the figures as JSON; BENCHMARKS.md, "Decoder LMs: memory of block-by-block
conversion", holds them. ``--root`` runs another checkout (main, to measure before a change).

    python benchmarks/llm_memory.py [--blocks 2 8] [--rows 4] [--seq 128] [--whole 3] [--skip-convert]
        [--root CHECKOUT] [--extra --method saliency ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper
from peak_memory import run_watched

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(tempfile.gettempdir()) / "nmdeploy-bench-llm-memory"
HIDDEN, FFN, HEADS, KV_HEADS, HEAD = 4096, 14336, 32, 8, 128


class ExternalWriter:
    """Initializers written into one external data file as they are made, one tensor in memory at a time."""

    def __init__(self, folder: Path, location: str, seed: int) -> None:
        self.location, self.handle = location, open(folder / location, "wb")  # noqa: SIM115 (closed by close)
        self.generator = np.random.default_rng(seed)
        self.initializers: list[TensorProto] = []

    def add(self, name: str, shape: tuple[int, ...], scale: float | None = None, fill: float | None = None) -> str:
        offset = self.handle.tell()
        rows = shape[0]
        step = max(1, (1 << 24) // max(1, int(np.prod(shape[1:], dtype=np.int64))))  # about 64 MB per chunk
        for start in range(0, rows, step):
            part = (min(step, rows - start), *shape[1:])
            if fill is not None:
                values = np.full(part, fill, dtype=np.float32)
            else:
                values = self.generator.standard_normal(part, dtype=np.float32) * np.float32(scale)
            self.handle.write(values.tobytes())
        tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", self.location),
            ("offset", str(offset)),
            ("length", str(self.handle.tell() - offset)),
        ):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self.initializers.append(tensor)
        return name

    def close(self) -> None:
        self.handle.close()


def decoder_stack(path: Path, blocks: int, seq: int, seed: int = 0) -> Path:
    """An ONNX model of ``blocks`` decoder blocks on hidden states [batch, seq, 4096] (cached by its name)."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    data = ExternalWriter(path.parent, path.name + ".data", seed)
    nodes: list[onnx.NodeProto] = []
    constants = [
        helper.make_tensor("q_shape", TensorProto.INT64, [4], [0, 0, HEADS, HEAD]),
        helper.make_tensor("kv_shape", TensorProto.INT64, [4], [0, 0, KV_HEADS, HEAD]),
        helper.make_tensor("kv_grouped", TensorProto.INT64, [5], [0, KV_HEADS, 1, seq, HEAD]),
        helper.make_tensor("kv_expand", TensorProto.INT64, [5], [1, 1, HEADS // KV_HEADS, 1, 1]),
        helper.make_tensor("heads_shape", TensorProto.INT64, [4], [-1, HEADS, seq, HEAD]),
        helper.make_tensor("hidden_shape", TensorProto.INT64, [3], [0, 0, HIDDEN]),
        helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-5]),
        helper.make_tensor("scale", TensorProto.FLOAT, [], [HEAD**-0.5]),
        helper.make_tensor(
            "causal", TensorProto.FLOAT, [seq, seq], np.triu(np.full((seq, seq), -1e9, np.float32), 1).ravel()
        ),
        helper.make_tensor("axes_last", TensorProto.INT64, [1], [-1]),
    ]
    scale_in, scale_ffn = HIDDEN**-0.5, FFN**-0.5

    def node(op: str, inputs: list[str], output: str, **attributes) -> str:
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attributes))
        return output

    def rms_norm(x: str, prefix: str) -> str:
        gamma = data.add(f"{prefix}.weight", (HIDDEN,), fill=1.0)
        square = node("Mul", [x, x], f"{prefix}/square")
        mean = node("ReduceMean", [square, "axes_last"], f"{prefix}/mean", keepdims=1)
        root = node("Sqrt", [node("Add", [mean, "eps"], f"{prefix}/eps")], f"{prefix}/root")
        return node("Mul", [node("Div", [x, root], f"{prefix}/normed"), gamma], f"{prefix}/out")

    def linear(x: str, name: str, k: int, out: int, scale: float) -> str:
        return node("MatMul", [x, data.add(f"{name}.weight", (k, out), scale)], f"{name}/out")

    x = "hidden"
    for b in range(blocks):
        p = f"layers.{b}"
        normed = rms_norm(x, f"{p}.input_norm")
        q = linear(normed, f"{p}.q_proj", HIDDEN, HIDDEN, scale_in)
        k = linear(normed, f"{p}.k_proj", HIDDEN, KV_HEADS * HEAD, scale_in)
        v = linear(normed, f"{p}.v_proj", HIDDEN, KV_HEADS * HEAD, scale_in)
        qh = node("Transpose", [node("Reshape", [q, "q_shape"], f"{p}/q4")], f"{p}/qh", perm=[0, 2, 1, 3])

        def grouped(value: str, tag: str, p: str = p) -> str:
            heads = node(
                "Transpose", [node("Reshape", [value, "kv_shape"], f"{p}/{tag}4")], f"{p}/{tag}h", perm=[0, 2, 1, 3]
            )
            five = node("Reshape", [heads, "kv_grouped"], f"{p}/{tag}5")
            return node("Reshape", [node("Expand", [five, "kv_expand"], f"{p}/{tag}x"), "heads_shape"], f"{p}/{tag}g")

        kh, vh = grouped(k, "k"), grouped(v, "v")
        kt = node("Transpose", [kh], f"{p}/kt", perm=[0, 1, 3, 2])
        scores = node(
            "Add", [node("Mul", [node("MatMul", [qh, kt], f"{p}/qk"), "scale"], f"{p}/scaled"), "causal"], f"{p}/masked"
        )
        attention = node("MatMul", [node("Softmax", [scores], f"{p}/probs", axis=-1), vh], f"{p}/attn")
        merged = node(
            "Reshape", [node("Transpose", [attention], f"{p}/attn_t", perm=[0, 2, 1, 3]), "hidden_shape"], f"{p}/merged"
        )
        x = node("Add", [x, linear(merged, f"{p}.o_proj", HIDDEN, HIDDEN, scale_in)], f"{p}/attn_res")
        normed = rms_norm(x, f"{p}.post_norm")
        gate = linear(normed, f"{p}.gate_proj", HIDDEN, FFN, scale_in)
        up = linear(normed, f"{p}.up_proj", HIDDEN, FFN, scale_in)
        silu = node("Mul", [gate, node("Sigmoid", [gate], f"{p}/sigmoid")], f"{p}/silu")
        down = linear(node("Mul", [silu, up], f"{p}/swiglu"), f"{p}.down_proj", FFN, HIDDEN, scale_ffn)
        x = node("Add", [x, down], f"{p}/mlp_res")
    out = rms_norm(x, "final_norm")
    nodes.append(helper.make_node("Identity", [out], ["output"], name="output"))
    data.close()
    graph = helper.make_graph(
        nodes,
        f"decoder-stack-{blocks}",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", seq, HIDDEN])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", seq, HIDDEN])],
        initializer=constants + data.initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="llm_memory")
    model.ir_version = 9
    path.write_bytes(model.SerializeToString())
    return path


def calibration(path: Path, rows: int, seq: int) -> Path:
    if not path.is_file():
        values = np.random.default_rng(1).standard_normal((rows, seq, HIDDEN), dtype=np.float32)
        np.savez(path, hidden=values)
    return path


def _peak_of(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(seconds, peak RSS in MB of the child, its stdout), the RSS polled every 50 ms (VmHWM read at the end too)."""
    # Run from the temporary directory: `python -c` puts the working directory first on sys.path, which would
    # import the checkout the benchmark was started in instead of --root.
    watched = run_watched(command, cwd=tempfile.gettempdir(), env=env)
    if watched.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(command)} failed ({watched.returncode}): {watched.stderr[-2000:]}")
    return watched.seconds, watched.peak_bytes / 2**20, watched.stdout


def nmdeploy(argv: list[str], root: Path) -> tuple[float, float, str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    code = f"import sys; from nmdeploy.cli import main; sys.exit(main({argv!r}))"
    return _peak_of([sys.executable, "-c", code], env)


def bare_round_trip(model: Path, output: Path) -> tuple[float, float, str]:
    code = (
        "import onnx, sys; m = onnx.load(sys.argv[1]); "
        "onnx.save(m, sys.argv[2], save_as_external_data=True, location=sys.argv[3])"
    )
    return _peak_of([sys.executable, "-c", code, str(model), str(output), output.name + ".data"], dict(os.environ))


def convert(blocks: int, rows: int, seq: int, root: Path, extra: list[str]) -> dict:
    model = decoder_stack(CACHE / f"stack-{HIDDEN}-{FFN}-{blocks}-{seq}" / "model.onnx", blocks, seq)
    calib = calibration(CACHE / f"calib-{rows}x{seq}x{HIDDEN}.npz", rows, seq)
    out = CACHE / f"out-{HIDDEN}-{blocks}-{os.getpid()}" / "model.onnx"
    seconds, polled, stdout = nmdeploy(
        ["convert", str(model), "-o", str(out), "--calib", str(calib), "--json", *extra], root
    )
    summary = json.loads(stdout)["summary"]
    weights = sum(int(np.prod(t.dims)) * 4 for t in onnx.load(str(model), load_external_data=False).graph.initializer)
    cached = summary.get("cached_peak_mb") or 0.0
    result = {
        "blocks": blocks,
        "weights_mb": weights / 2**20,
        "seconds": seconds,
        "peak_rss_mb": summary["peak_rss_mb"],
        "polled_peak_mb": polled,
        "cached_peak_mb": cached,
        "spilled_mb": summary.get("spilled_mb"),
        "converted": summary["converted"],
    }
    for item in (out, out.with_name(out.name + ".data")):
        item.unlink(missing_ok=True)
    print(json.dumps(result), flush=True)
    return result


def whole_model(blocks: int, seq: int, root: Path) -> dict:
    model = decoder_stack(CACHE / f"stack-{HIDDEN}-{FFN}-{blocks}-{seq}" / "model.onnx", blocks, seq)
    folder = CACHE / f"whole-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    figures = {"blocks": blocks, "data_mb": (model.parent / (model.name + ".data")).stat().st_size / 2**20}
    figures["onnx_round_trip"] = bare_round_trip(model, folder / "bare.onnx")[:2]
    figures["prune"] = nmdeploy(["prune", str(model), "-o", str(folder / "pruned.onnx")], root)[:2]
    figures["inspect"] = nmdeploy(["inspect", str(model)], root)[:2]
    for item in folder.iterdir():
        item.unlink()
    print(json.dumps(figures), flush=True)
    return figures


def main() -> None:
    global HIDDEN, FFN, HEAD
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="model width (32 heads, 8 key/value heads)")
    parser.add_argument("--ffn", type=int, default=FFN, help="MLP width")
    parser.add_argument("--root", type=Path, default=ROOT, help="the nmdeploy checkout to run (another branch, say)")
    parser.add_argument("--whole", type=int, default=None, help="blocks of the model prune and inspect run on")
    parser.add_argument("--skip-convert", action="store_true")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more convert flags")
    args = parser.parse_args()
    HIDDEN, FFN, HEAD = args.hidden, args.ffn, args.hidden // HEADS
    CACHE.mkdir(parents=True, exist_ok=True)
    results = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes")}
    if not args.skip_convert:
        results["convert"] = [convert(blocks, args.rows, args.seq, args.root, args.extra) for blocks in args.blocks]
    if args.whole:
        results["whole"] = whole_model(args.whole, args.seq, args.root)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
