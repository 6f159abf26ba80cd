"""``nmdeploy pipeline [-o OUT_DIR] [--models digits,minilm]``: the deployment pipeline on the reference models;
``nmdeploy pipeline MODEL --calib DATA --data EVAL``: the same steps on the user's own model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nmdeploy.cli.options import (
    add_data_option,
    add_device_option,
    add_filter_options,
    add_json_option,
    add_outputs_option,
)
from nmdeploy.conversion.methods import DEFAULT_METHOD, method_names
from nmdeploy.conversion.recovery import DEFAULT_STEPS
from nmdeploy.errors import InputError
from nmdeploy.fidelity import check_min_fidelity
from nmdeploy.files import check_output_path
from nmdeploy.pipeline import (
    MODELS,
    ConvertSettings,
    engine_lines,
    run_pipeline,
    run_user_pipeline,
    summary_line,
    summary_table,
)
from nmdeploy.reference import MODELS_FOLDER
from nmdeploy.runtimes.devices import resolve_device

REGRESSED = 1


def _models(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in MODELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(MODELS)} (comma-separated)")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="your dense ONNX model (needs --calib and --data); without it, the bundled reference models run",
    )
    parser.add_argument(
        "-o", "--output", default="nmdeploy-out", metavar="OUT_DIR", help="artefact folder (default: ./nmdeploy-out)"
    )
    parser.add_argument("--models", type=_models, help=f"bundled models, comma-separated (default: {','.join(MODELS)})")
    parser.add_argument(
        "--baselines",
        metavar="DIR|FILE",
        help="bundled models: folder holding MODEL/baselines.toml (default: the bundled models/); with MODEL: the "
        "baselines file judging the run, written from the measured figures where it does not exist yet (default: "
        "OUT_DIR/baselines.toml)",
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
    add_device_option(parser)
    group = parser.add_argument_group("your model (MODEL)")
    add_data_option(group, "--calib", purpose="calibration inputs of MODEL")
    add_data_option(group, "--data", purpose="held-out evaluation inputs of MODEL (compare, bench, regress)")
    group.add_argument(
        "--method",
        choices=method_names(),
        default=DEFAULT_METHOD,
        help=f"as nmdeploy convert (default {DEFAULT_METHOD})",
    )
    group.add_argument(
        "--metric",
        default="auto",
        metavar="METRIC",
        help="fidelity for --recover and --min-fidelity: auto (default), cosine, spread, top1, mask-iou@T, as nmdeploy "
        "convert, or MODULE:FUNCTION, which is also compared and checked in the baselines",
    )
    add_outputs_option(group)
    add_filter_options(group)
    group.add_argument("--batch", metavar="1,8", help="batch sizes timed (default: 1 and the evaluation batch, or 8)")
    add_json_option(parser)


USER_FLAGS = ("calib", "data", "batch", "include", "exclude", "outputs")  # flags that only mean something with MODEL
USER_DEFAULTS = {"method": "sparsegpt", "metric": "auto", "eligible_only": False}


def _installed(folder: Path) -> bool:
    """Whether ``folder`` lies inside an installed distribution (site-packages), not in a checkout."""
    return any(part in ("site-packages", "dist-packages") for part in folder.resolve().parts)


def run(args: argparse.Namespace) -> int:
    if args.recover is not None and args.recover < 0:
        raise InputError(f"--recover {args.recover}: the number of steps must be 0 or more")
    if args.min_fidelity is not None:
        check_min_fidelity(args.min_fidelity)
    settings = ConvertSettings(
        method=args.method,
        recover=args.recover,
        min_fidelity=args.min_fidelity,
        metric=args.metric,
        eligible_only=args.eligible_only,
        outputs=args.outputs,
        device=resolve_device(args.device),
    )
    run_models = _run_bundled if args.model is None else _run_user
    report = run_models(args, settings, lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(report.as_dict(), indent=2, default=str))
    else:
        print(summary_table(report))
        for line in engine_lines(report):
            print(line)
        for model in report.models:
            for check in model.regression.regressed:
                print(f"regressed: {check.description}")
            if model.regression.created:
                print(
                    f"baselines written to {model.regression.path} from these figures; "
                    f"check the model again with: nmdeploy regress {model.regression.path}"
                )
        print(f"artefacts and summary.md in {report.out_dir}")
        print(summary_line(report))
    return 0 if report.passed else REGRESSED


def _run_user(args: argparse.Namespace, settings: ConvertSettings, progress):
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
    return run_user_pipeline(
        args.model,
        calibration=args.calib,
        evaluation=args.data,
        out_dir=args.output,
        baselines=args.baselines,
        settings=settings,
        include=args.include,
        exclude=args.exclude,
        batch=None if args.batch is None else parse_batches(args.batch),
        update_baselines=args.update_baselines,
        progress=progress,
    )


def _run_bundled(args: argparse.Namespace, settings: ConvertSettings, progress):
    given = [flag for flag in USER_FLAGS if getattr(args, flag) is not None]
    given += [flag for flag, default in USER_DEFAULTS.items() if getattr(args, flag) != default]
    if given:
        flag = given[0].replace("_", "-")
        raise InputError(f"--{flag} is for your own model: nmdeploy pipeline MODEL --calib DATA --data EVAL ...")
    if args.baselines is None:
        args.baselines = str(MODELS_FOLDER)
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
    return run_pipeline(
        args.output,
        fidelity=settings,
        models=args.models or list(MODELS),
        update_baselines=args.update_baselines,
        baselines_dir=args.baselines,
        progress=progress,
    )
