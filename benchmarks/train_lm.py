"""Quality beyond digits: a character-level transformer language model on the Python standard library's own source.

Dense, STE, SR-STE and SR-STE with the transposable + MVUE backward train the same model (token embedding, two
pre-norm ``nn.TransformerEncoderLayer`` blocks with causal ``nn.MultiheadAttention``, LM head) for the same number
of steps with the same optimiser, schedule, data order and seeds; ``sparsify`` runs with its defaults, so every
attention projection and MLP Linear is 2:4 and the LM head stays dense. Training text is the first 90 % of the
stdlib's ``.py`` files in sorted order, validation text the last 10 % (other modules, never seen in training);
validation loss is the mean cross-entropy in nats per character over fixed windows. SAD is the fraction of sparse
weights whose mask changes per step, averaged over the last tenth of the steps.

    python benchmarks/train_lm.py                  # table on stdout
    python benchmarks/train_lm.py --write          # also replace the section in BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

from nmdeploy.train import finalize, sparsify

VOCABULARY = 128  # ASCII; anything else maps to 0
METHODS = {
    "dense": None,
    "ste": {"method": "ste"},
    "srste": {"method": "srste"},
    "srste + transposable + mvue": {"method": "srste", "backward": ("transposable", "mvue")},
    # ablations of the line above (--methods): which half of the backward costs the quality
    "srste + transposable": {"method": "srste", "backward": "transposable"},
    "srste + mvue": {"method": "srste", "backward": "mvue"},
}
OPTION_FLAGS = {"decay": "decay", "mask_interval": "mask every"}
"""Options a row may add to its method (``--decay``, ``--mask-interval``), and how the row's label shows them."""
DEFAULT_METHODS = ["dense", "ste", "srste", "srste + transposable + mvue"]
SECTION = "## Character-level language model (quality)"


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(training, validation) characters as int64 tensors, from disjoint sets of stdlib modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    cut = int(len(files) * 0.9)

    def encode(paths: list[Path]) -> torch.Tensor:
        data = b"\n".join(p.read_bytes() for p in paths)
        codes = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        return torch.where(codes < VOCABULARY, codes, torch.zeros_like(codes))

    return encode(files[:cut]), encode(files[cut:])


class CharTransformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        block = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, VOCABULARY)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.embed(tokens) + self.position[:length]
        hidden = self.blocks(hidden, mask=self.causal[:length, :length], is_causal=True)
        return self.lm_head(self.norm(hidden))


def windows(text: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = starts[:, None] + torch.arange(context + 1)
    chunk = text[offsets]
    return chunk[:, :-1], chunk[:, 1:]


def row_options(name: str, args: argparse.Namespace) -> dict:
    """The sparsify keywords of one row: the method's, plus ``--decay`` (SR-STE rows) and ``--mask-interval``."""
    options = dict(METHODS[name] or {})
    if options and args.decay is not None and options["method"] == "srste":
        options["decay"] = args.decay
    if options and args.mask_interval is not None:
        options["mask_interval"] = args.mask_interval
    return options


def label(name: str, args: argparse.Namespace) -> str:
    options = row_options(name, args)
    extra = [f"{shown} {options[key]:g}" for key, shown in OPTION_FLAGS.items() if key in options]
    return f"{name} ({', '.join(extra)})" if extra else name


def run(name: str, seed: int, args: argparse.Namespace, train: torch.Tensor, valid: torch.Tensor) -> dict:
    torch.manual_seed(seed)
    model = CharTransformer(args.width, args.layers, args.heads, args.context)
    sparsifier = None
    if METHODS[name] is not None:
        sparsifier = sparsify(model, "2:4", seed=seed, **row_options(name, args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = args.steps // 20

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, args.steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    order = torch.Generator().manual_seed(seed)  # the same batches for every method of one seed
    loss_fn = nn.CrossEntropyLoss()
    flips = 0
    last_tenth = args.steps - args.steps // 10
    begin = time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, len(train) - args.context - 1, (args.batch,), generator=order)
        x, y = windows(train, starts, args.context)
        loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if sparsifier is not None:
            before = {k: m.clone() for k, m in sparsifier.masks().items()} if step >= last_tenth else None
            sparsifier.step()
            if before is not None:
                flips += sum(int((before[k] != m).sum()) for k, m in sparsifier.masks().items())
    seconds = time.perf_counter() - begin
    used = sparsifier.kernels_used() if sparsifier is not None else {}
    sparse_weights = sum(m.numel() for m in sparsifier.masks().values()) if sparsifier is not None else 0
    finalize(model)
    model.eval()
    starts = torch.linspace(0, len(valid) - args.context - 2, args.valid_windows).long()
    total = 0.0
    with torch.no_grad():
        for chunk in starts.split(64):
            x, y = windows(valid, chunk, args.context)
            total += float(loss_fn(model(x).flatten(0, 1), y.flatten())) * len(chunk)
    return {
        "method": label(name, args),
        "sad": flips / max(1, sparse_weights) / max(1, args.steps - last_tenth),
        "seed": seed,
        "valid": total / len(starts),
        "train": float(loss.detach()),
        "seconds": seconds,
        "sparse_layers": len(sparsifier.layers) if sparsifier is not None else 0,
        "masked_backwards_ran": sum(bool(v) for v in used.values()),
    }


def table(results: list[dict], args: argparse.Namespace, train_chars: int, valid_chars: int) -> str:
    dense = statistics.mean(r["valid"] for r in results if r["method"] == "dense")
    lines = [
        SECTION,
        "",
        f"`{' '.join(['python benchmarks/train_lm.py', *sys.argv[1:]])}` ({datetime.date.today()}, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s), "
        f"load {os.getloadavg()[0]:.1f}; torch {torch.__version__}). A "
        f"{args.layers}-block pre-norm transformer (width {args.width}, {args.heads} heads, context {args.context}, "
        f"`nn.TransformerEncoderLayer` with causal `nn.MultiheadAttention`) predicting the next character of the "
        f"Python {sys.version_info.major}.{sys.version_info.minor} standard library's source: {train_chars:,} "
        f"training characters from the first 90 % of its modules, {valid_chars:,} validation characters from the "
        f"other 10 %. {args.steps} AdamW steps of {args.batch} windows (lr {args.lr}, warm-up then cosine to a "
        "tenth), the same batches for every method of a seed. `sparsify` defaults: every attention projection "
        "(packed `in_proj_weight`, `out_proj`) and MLP Linear is 2:4, the LM head stays dense.",
        "",
        "| method | sparse layers | validation loss (nats/char), per seed | mean | vs dense | relative "
        "| SAD, last tenth | seconds |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name in dict.fromkeys(r["method"] for r in results):
        rows = [r for r in results if r["method"] == name]
        mean = statistics.mean(r["valid"] for r in rows)
        per_seed = ", ".join(f"{r['valid']:.4f}" for r in rows)
        lines.append(
            f"| {name} | {rows[0]['sparse_layers']} | {per_seed} | {mean:.4f} | {mean - dense:+.4f} | "
            f"{(mean - dense) / dense:+.2%} | {statistics.mean(r['sad'] for r in rows):.5f} | "
            f"{statistics.mean(r['seconds'] for r in rows):.0f} |"
        )
    if not any(r["method"] == "srste" for r in results):
        return "\n".join(lines) + "\n"
    srste = statistics.mean(r["valid"] for r in results if r["method"] == "srste")
    verdict = "met" if srste - dense <= 0.05 or (srste - dense) / dense <= 0.02 else "NOT met"
    lines += [
        "",
        f"Goal (SR-STE within 0.05 nats/char or 2 % of dense): {verdict}, {srste - dense:+.4f} nats/char "
        f"({(srste - dense) / dense:+.2%}). Seconds are per run on this shared machine; compare them only within "
        "this table.",
        "",
    ]
    return "\n".join(lines)


def write_section(text: str, path: Path) -> None:
    content = path.read_text()
    if SECTION in content:
        start = content.index(SECTION)
        following = content.find("\n## ", start + len(SECTION))
        content = content[:start] + text + ("" if following < 0 else content[following + 1 :])
    else:
        content = content.rstrip("\n") + "\n\n" + text
    path.write_text(content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--valid-windows", type=int, default=512)
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    parser.add_argument("--decay", type=float, help="SR-STE's lambda_W for the SR-STE rows (default: the method's)")
    parser.add_argument("--mask-interval", type=int, help="recompute masks every this many steps (default: method's)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one: a shared CPU thrashes with more)")
    parser.add_argument("--write", action="store_true", help="replace the section in BENCHMARKS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    train, valid = corpus()
    results = []
    for seed in args.seeds:
        for name in args.methods:
            result = run(name, seed, args, train, valid)
            print(
                f"{name:<28} seed {seed}: valid {result['valid']:.4f}  train {result['train']:.4f}  "
                f"{result['seconds']:.0f} s",
                flush=True,
            )
            results.append(result)
    text = table(results, args, len(train), len(valid))
    print(text)
    if args.write:
        write_section(text, Path(__file__).resolve().parent.parent / "BENCHMARKS.md")


if __name__ == "__main__":
    main()
