"""``nmdeploy pipeline [-o OUT_DIR] [--models digits,minilm]``: the deployment pipeline on the reference models."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nmdeploy.calibration.recovery import DEFAULT_STEPS
from nmdeploy.cli.options import add_json_option
from nmdeploy.errors import InputError
from nmdeploy.evaluation.budget import check_min_fidelity
from nmdeploy.files import check_output_path
from nmdeploy.pipeline import MODELS, FidelitySettings, engine_lines, run_pipeline, summary_line, summary_table
from nmdeploy.reference import MODELS_FOLDER

REGRESSED = 1


def _models(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(MODELS)} (comma-separated)")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o", "--output", default="nmdeploy-out", metavar="OUT_DIR", help="artefact folder (default: ./nmdeploy-out)"
    )
    parser.add_argument(
        "--models", type=_models, default=list(MODELS), help=f"comma-separated (default: {','.join(MODELS)})"
    )
    parser.add_argument(
        "--baselines",
        default=str(MODELS_FOLDER),
        metavar="DIR",
        help="folder holding MODEL/baselines.toml for each model (default: the bundled models/)",
    )
    parser.add_argument(
        "--update-baselines",
        action="store_true",
        help="rewrite the baselines files with the figures measured now (tolerances and comments kept)",
    )
    parser.add_argument(
        "--recover",
        nargs="?",
        type=int,
        const=DEFAULT_STEPS,
        metavar="STEPS",
        help="fine-tune each converted model by distilling its dense model (as nmdeploy convert --recover)",
    )
    parser.add_argument(
        "--min-fidelity",
        type=float,
        metavar="F",
        help="convert only the layers that keep held-out output cosine >= F (as nmdeploy convert --min-fidelity)",
    )
    add_json_option(parser)


def _installed(folder: Path) -> bool:
    """Whether ``folder`` lies inside an installed distribution (site-packages), not in a checkout."""
    return any(part in ("site-packages", "dist-packages") for part in folder.resolve().parts)


def run(args: argparse.Namespace) -> int:
    if not MODELS_FOLDER.is_dir() and args.baselines == str(MODELS_FOLDER):
        raise InputError(
            f"{MODELS_FOLDER}: the bundled baselines are missing; reinstall nmdeploy or pass --baselines DIR"
        )
    if args.update_baselines and args.baselines == str(MODELS_FOLDER) and _installed(MODELS_FOLDER):
        raise InputError(
            "--update-baselines would rewrite the baselines inside the installed package; "
            "copy its models/ folder and pass --baselines DIR"
        )
    if not Path(args.baselines).is_dir():
        raise InputError(f"--baselines {args.baselines}: no such folder; give the folder holding MODEL/baselines.toml")
    check_output_path(Path(args.output) / "summary.json")
    if args.min_fidelity is not None:
        check_min_fidelity(args.min_fidelity)
    if args.recover is not None and args.recover < 0:
        raise InputError(f"--recover {args.recover}: the number of steps must be 0 or more")
    report = run_pipeline(
        args.output,
        fidelity=FidelitySettings(args.recover, args.min_fidelity),
        models=args.models,
        update_baselines=args.update_baselines,
        baselines_dir=args.baselines,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    if args.json:
        print(json.dumps(report.as_dict(), indent=2, default=str))
    else:
        print(summary_table(report))
        for line in engine_lines(report):
            print(line)
        for model in report.models:
            for check in model.regression.regressed:
                print(
                    f"regressed: {check.model} {check.key[0]} {check.label}: measured {check.measured}, baseline "
                    f"{check.baseline} +- {check.tolerance} ({check.as_dict()['better']} is better)"
                )
        print(f"artefacts and summary.md in {report.out_dir}")
        print(summary_line(report))
    return 0 if report.passed else REGRESSED
