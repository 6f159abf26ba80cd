"""``nmdeploy train CONFIG.toml``: train a reference model with an N:M method, logging and checkpointing as it goes."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path

from nmdeploy.cli.args import OutputArgs, ReportArgs, ResumeArgs, add_groups
from nmdeploy.cli.args.training import users_modules_importable
from nmdeploy.files import check_output_path
from nmdeploy.tables import render_table

DIVERGED = 1
RUN_DIR = OutputArgs("RUN_DIR", "folder for checkpoint.pt and the logs (default: runs/CONFIG-NAME)", required=False)
RESUME, REPORT = ResumeArgs(), ReportArgs(progress_flag=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="a TOML run configuration, e.g. models/digits/srste.toml")
    add_groups(parser, RUN_DIR, RESUME, REPORT)


def run(args: argparse.Namespace) -> int:
    # Imported here: the trainer pulls in torch's compiler stack, which every other verb can do without.
    from nmdeploy.train.config import load_config
    from nmdeploy.train.trainer import train

    users_modules_importable()
    config, report = load_config(args.config), REPORT.parse(args)
    run_dir = Path(RUN_DIR.parse(args) or Path("runs") / Path(args.config).stem)
    # The checkpoint resumed from may be the one the run goes on writing: it is read whole before the first save.
    check_output_path(run_dir / "checkpoint.pt", inputs=[Path(args.config)])
    result = train(config, run_dir, resume=RESUME.parse(args), progress=report.progress)
    last = result.epochs[-1]
    diverged = next((e for e in result.epochs if not all(math.isfinite(v) for v in (e.train_loss, e.test_loss))), None)
    if report.json:
        document = {
            "config": args.config,
            "run_dir": str(result.run_dir),
            "checkpoint": result.checkpoint and str(result.checkpoint),
        }
        document |= {"sparsified": result.sparsified, "skipped": result.skipped}
        document |= {"epochs": [asdict(e) for e in result.epochs]}
        print(json.dumps(document | {"diverged_at_epoch": None if diverged is None else diverged.epoch}, indent=2))
        return 0 if diverged is None else DIVERGED
    sparsity = config.sparsity
    recipe = (
        f"{sparsity.method} {sparsity.pattern} backward {'+'.join(sparsity.backward)}" if sparsity.enabled else "dense"
    )
    print(f"{config.task.label}  {recipe}  -> {result.run_dir}")
    columns = ("epoch", "loss", "train acc", "test loss", "test acc", "mask flips", "SAD")
    rows = [
        (e.epoch, f"{e.train_loss:.4f}", f"{e.train_accuracy:.4f}", f"{e.test_loss:.4f}", f"{e.test_accuracy:.4f}",
         e.mask_flips, f"{e.sad:.5f}")
        for e in result.epochs
    ]  # fmt: skip
    print(render_table(columns, rows, right=columns))
    if result.sparsified:
        print(f"sparsified {len(result.sparsified)} layers: {', '.join(result.sparsified)}")
    for name, reason in result.skipped.items():
        print(f"dense {name}: {reason}")
    if diverged is not None:
        print(
            f"FAILED | train: {config.task.label} {recipe}: the loss is not finite from epoch {diverged.epoch} "
            f"(training diverged: lower [train] lr); the run's files were removed, nothing kept"
        )
        return DIVERGED
    print(
        f"PASSED | train: {config.task.label} {recipe}, test accuracy {last.test_accuracy:.4f} after {last.epoch} "
        f"epochs, checkpoint {result.checkpoint}"
    )
    return 0
