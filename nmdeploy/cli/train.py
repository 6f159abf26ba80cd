"""``nmdeploy train CONFIG.toml``: train a reference model with an N:M method, logging and checkpointing as it goes."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from nmdeploy.cli.options import add_json_option
from nmdeploy.files import check_output_path

HELP = "train a reference model (models/*/*.toml) or your own with an N:M sparse training method; resumable checkpoints"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="a TOML run configuration, e.g. models/digits/srste.toml")
    parser.add_argument(
        "-o", "--output", metavar="RUN_DIR", help="folder for checkpoint.pt and the logs (default: runs/CONFIG-NAME)"
    )
    parser.add_argument("--resume", metavar="CHECKPOINT", help="continue the run saved in this checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json_option(parser)


def run(args: argparse.Namespace) -> int:
    # Imported here: the trainer pulls in torch's compiler stack, which every other verb can do without.
    from nmdeploy.train.config import load_config
    from nmdeploy.train.trainer import train

    # Like `python -m`, the working directory is importable, so [task] model/data may name modules beside it.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    config = load_config(args.config)
    run_dir = Path(args.output) if args.output else Path("runs") / Path(args.config).stem
    # The checkpoint resumed from may be the one the run goes on writing: it is read whole before the first save.
    check_output_path(run_dir / "checkpoint.pt", inputs=[Path(args.config)])
    result = train(config, run_dir, resume=args.resume, progress=not args.no_progress and not args.json)
    last = result.epochs[-1]
    if args.json:
        print(
            json.dumps(
                {
                    "config": args.config,
                    "run_dir": str(result.run_dir),
                    "checkpoint": str(result.checkpoint),
                    "sparsified": result.sparsified,
                    "skipped": result.skipped,
                    "epochs": [asdict(e) for e in result.epochs],
                },
                indent=2,
            )
        )
        return 0
    sparsity = config.sparsity
    recipe = (
        f"{sparsity.method} {sparsity.pattern} backward {'+'.join(sparsity.backward)}" if sparsity.enabled else "dense"
    )
    print(f"{config.task.label}  {recipe}  -> {result.run_dir}")
    print(f"{'epoch':>5} {'loss':>8} {'train acc':>9} {'test loss':>9} {'test acc':>8} {'mask flips':>10} {'SAD':>8}")
    for e in result.epochs:
        print(
            f"{e.epoch:>5} {e.train_loss:>8.4f} {e.train_accuracy:>9.4f} {e.test_loss:>9.4f} {e.test_accuracy:>8.4f} "
            f"{e.mask_flips:>10} {e.sad:>8.5f}"
        )
    if result.sparsified:
        print(f"sparsified {len(result.sparsified)} layers: {', '.join(result.sparsified)}")
    for name, reason in result.skipped.items():
        print(f"dense {name}: {reason}")
    print(
        f"PASSED | train: {config.task.label} {recipe}, test accuracy {last.test_accuracy:.4f} after {last.epoch} "
        f"epochs, checkpoint {result.checkpoint}"
    )
    return 0
