"""Training runs and their export: ``train --resume`` and ``export --model/--input``."""

from __future__ import annotations

import argparse
import os
import sys

from nmdeploy.cli.args.base import ArgGroup, Parser


def users_modules_importable() -> None:
    """Like ``python -m``, the working directory is importable, so ``[task] model/data`` and ``--model`` may name
    modules beside the user."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


class ResumeArgs(ArgGroup):
    """``--resume CHECKPOINT``: continue a saved run."""

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument("--resume", metavar="CHECKPOINT", help="continue the run saved in this checkpoint")

    def parse(self, args: argparse.Namespace) -> str | None:
        return args.resume


class ExportArgs(ArgGroup):
    """For a checkpoint saved from Python: the function that builds the dense model and the example inputs traced."""

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument(
            "--model",
            metavar="MODULE:FUNCTION",
            help="for a checkpoint saved from Python: the function (no arguments) that builds the dense model, as "
            "'package.module:function' (the working directory is importable)",
        )
        parser.add_argument(
            "--input",
            action="append",
            default=[],
            metavar="SHAPE[:DTYPE]",
            help="with --model: the shape of an example input to trace, e.g. 1x64:int64 (dtype float32 when left "
            "out; repeat for several inputs; the first axis is exported as the batch axis)",
        )

    def parse(self, args: argparse.Namespace) -> dict[str, object]:
        """``export_checkpoint``'s ``model`` and ``inputs``."""
        users_modules_importable()
        return {"model": args.model, "inputs": tuple(args.input)}
