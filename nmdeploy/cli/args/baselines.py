"""Baselines files and what judges a run against them: ``regress`` (a file, ``--update``, or ``--init`` for a new
one) and ``pipeline`` (the bundled models, or the user's MODEL with its own flags)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmdeploy.cli.args.base import ArgGroup, Parser
from nmdeploy.errors import InputError
from nmdeploy.files import check_output_path

INIT_FLAGS = ("reference", "candidate", "data", "metric", "outputs")  # flags that only mean something with --init


@dataclass(frozen=True)
class Regression:
    baselines: str | None  # the file judged (None with --init)
    update: bool
    init: str | None  # the new file --init writes
    reference: Path | None = None
    candidate: Path | None = None


class BaselinesArgs(ArgGroup):
    """``regress``'s ``--update`` and the ``--init`` family (``--reference``, ``--candidate``; with it, ``--data``,
    ``--metric``, ``--outputs`` and ``--batch`` from their own groups, declared after this one)."""

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument(
            "--update",
            action="store_true",
            help="rewrite the file's baseline numbers with the measured ones (tolerances and comments kept); latency "
            "is the median of [model.latency] runs (at least 3) benchmarks",
        )

    def add_init_flags(self, parser: Parser) -> None:
        parser.add_argument(
            "--init",
            metavar="BASELINES",
            help="measure --reference against --candidate on --data once and write a new baselines file, with "
            "tolerances derived from the measurement (never overwrites: refresh an existing file with --update)",
        )
        parser.add_argument("--reference", metavar="DENSE", help="the reference (dense) ONNX model")
        parser.add_argument("--candidate", metavar="SPARSE", help="the candidate (converted) ONNX model")

    def parse(self, args: argparse.Namespace) -> Regression:
        given = [flag for flag in INIT_FLAGS if getattr(args, flag) is not None]
        if args.init is None:
            if args.baselines is None:
                raise InputError("regress needs a baselines file (BASELINES), or --init BASELINES to write a new one")
            if given:
                raise InputError(f"--{given[0]} belongs to --init BASELINES; a baselines file names its own models")
            return Regression(args.baselines, args.update, None)
        if args.baselines is not None or args.update:
            raise InputError("--init BASELINES writes a new file: give no other BASELINES and no --update")
        missing = [f"--{flag}" for flag in ("reference", "candidate", "data") if getattr(args, flag) is None]
        if missing:
            raise InputError(f"--init needs {', '.join(missing)}: the two models and the evaluation data to measure")
        reference, candidate = Path(args.reference), Path(args.candidate)
        check_output_path(args.init, inputs=[reference, candidate])
        return Regression(None, False, args.init, reference, candidate)


MODELS = ("digits", "minilm")  # nmdeploy.pipeline.MODELS (a test keeps them equal): that package loads torch
USER_FLAGS = ("calib", "calib_batch", "data", "held_out", "batch", "include", "exclude", "outputs")  # MODEL's alone
USER_DEFAULTS = {"metric": "auto", "eligible_only": False, "sparse_lm_head": False}


def _models(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(MODELS)} (comma-separated)")
    return names


def installed(folder: Path) -> bool:
    """Whether ``folder`` lies inside an installed distribution (site-packages), not in a checkout."""
    return any(part in ("site-packages", "dist-packages") for part in folder.resolve().parts)


@dataclass(frozen=True)
class PipelineRun:
    model: str | None  # the user's MODEL; None: the bundled models
    options: dict[str, Any] = field(default_factory=dict)  # run_pipeline's or run_user_pipeline's keywords


class PipelineArgs(ArgGroup):
    """``pipeline``'s models and baselines: ``--models`` (bundled), ``--baselines``, ``--update-baselines``; its
    parse checks that each mode gets only its own flags (MODEL's: ``--calib``, ``--data`` and the rest)."""

    def __init__(self, models_folder: Path) -> None:
        self.models_folder = models_folder

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument(
            "--models", type=_models, help=f"bundled models, comma-separated (default: {','.join(MODELS)})"
        )
        parser.add_argument(
            "--baselines",
            metavar="DIR|FILE",
            help="bundled models: folder holding MODEL/baselines.toml (default: the bundled models/); with MODEL: the "
            "baselines file judging the run, written from the measured figures where it does not exist yet "
            "(default: OUT_DIR/baselines.toml)",
        )
        parser.add_argument(
            "--update-baselines",
            action="store_true",
            help="rewrite the baselines files with the figures measured now (tolerances and comments kept)",
        )

    def parse(self, args: argparse.Namespace) -> PipelineRun:
        return self._bundled(args) if args.model is None else self._user(args)

    def _user(self, args: argparse.Namespace) -> PipelineRun:
        from nmdeploy.evaluation.bench import parse_batches

        if args.models is not None:
            raise InputError("--models picks bundled models; with MODEL, your model is the one that runs")
        if args.update_baselines and args.baselines is None and not (Path(args.output) / "baselines.toml").is_file():
            raise InputError("--update-baselines: no baselines file to update yet; a first run writes one")
        missing = [flag for flag in ("calib", "data") if getattr(args, flag) is None]
        if missing:
            raise InputError(
                f"pipeline MODEL needs {' and '.join('--' + flag for flag in missing)}: calibration inputs to convert "
                "with, and held-out evaluation inputs to judge the result on (.npz files or folders of them)"
            )
        if args.baselines is not None and Path(args.baselines).is_dir():
            raise InputError(f"--baselines {args.baselines} is a folder; with MODEL, give the baselines file")
        options = {
            "calibration": args.calib,
            "evaluation": args.data,
            "out_dir": args.output,
            "baselines": args.baselines,
            "include": args.include,
            "exclude": args.exclude,
            "batch": None if args.batch is None else parse_batches(args.batch),
            "update_baselines": args.update_baselines,
        }
        return PipelineRun(args.model, options)

    def _bundled(self, args: argparse.Namespace) -> PipelineRun:
        given = [flag for flag in USER_FLAGS if getattr(args, flag) is not None]
        given += [flag for flag, default in USER_DEFAULTS.items() if getattr(args, flag) != default]
        if given:
            flag = given[0].replace("_", "-")
            raise InputError(f"--{flag} is for your own model: nmdeploy pipeline MODEL --calib DATA --data EVAL ...")
        folder = self.models_folder
        baselines = str(folder) if args.baselines is None else args.baselines
        if not folder.is_dir() and baselines == str(folder):
            raise InputError(f"{folder}: the bundled baselines are missing; reinstall nmdeploy or pass --baselines DIR")
        if args.update_baselines and baselines == str(folder) and installed(folder):
            raise InputError(
                "--update-baselines would rewrite the baselines inside the installed package; "
                "copy its models/ folder and pass --baselines DIR"
            )
        if not Path(baselines).is_dir():
            raise InputError(f"--baselines {baselines}: no such folder; give the folder holding MODEL/baselines.toml")
        check_output_path(Path(args.output) / "summary.json")
        options = {
            "out_dir": args.output,
            "models": args.models or list(MODELS),
            "update_baselines": args.update_baselines,
            "baselines_dir": baselines,
        }
        return PipelineRun(None, options)
