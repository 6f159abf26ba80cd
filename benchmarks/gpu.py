"""GPU check in one call: 2:4 semi-structured GEMM speed, MiniLM conversion and recovery on CUDA, sparse training.

Two halves, so that the GPU machine needs nothing it cannot reach:

- ``--prepare DIR`` (here, on the CPU) writes the carry folder: the GEMM shape of every TensorRT-eligible weight of
  the reference models (digits CNN, MiniLM-L6; the PP-OCRv6 detector and all-mpnet-base-v2 where
  ``python -m nmdeploy.reference.ppocr`` and ``python -m nmdeploy.reference.mpnet`` prepared them) and of a VGG16
  classifier (13 convolutions, 25088 x 4096 dense layers), found by nmdeploy's ``find_prunable_weights`` and
  TensorRT rules on their ONNX exports; the MiniLM export with its float weights stored as float16 (cast back to
  float32 on the device: the dense reference there is the fp16-rounded model);
  calibration sentences (models/minilm/calibration.txt) and two evaluation sets, everyday sentences of the same kind
  (models/minilm/evaluation.txt) and docstring sentences of another kind (models/mpnet/calibration.txt), tokenised
  by ``nmdeploy data text``. One flat folder, committed in one rename, ``manifest.json`` describing it.
- ``--carry DIR --out DIR [--budget-s 420]`` (on the GPU) runs the sections, each on its own: a failure is recorded
  with its error and the others still run, each respects the global time budget (skipped, with the reason, when it
  no longer fits; stopped by an alarm at its own limit), and ``results.json`` in ``--out`` is rewritten after every
  step, so a run killed at the call's limit keeps what it measured:

  ``environment``      device, capability, torch/CUDA/cuSPARSELt versions, the semi-structured backends' shape rules;
  ``gemm``             dense vs 2:4 ``F.linear`` per layer shape (weight [out, in], 2:4 along in) for 1-256 rows and
                       the layer's natural rows (batch x 128 tokens for encoders, batch x output pixels for
                       convolutions): fp16 and bf16 on cuSPARSELt, int8 where torch offers it, fp16 on CUTLASS;
                       CUDA-event medians; which layers win, per model (``gemm.md``);
  ``convert``          ``nmdeploy convert --device cuda --recover 1000`` on MiniLM's 36 encoder weights, in process;
                       steps per second, embedding cosine against dense on both evaluation sets (``compare_models``);
                       without ``--device`` (recorded) when the flag is rejected;
  ``train_step``       forward + backward + AdamW of an FFN block (MiniLM width, and 4096 x 4096), dense against
                       torch's semi-structured kernels (weights compressed every step, transposable 2:4 so the
                       input gradient is sparse too; ``prune_dense_static_sort``) and against nmdeploy's trainer
                       (``sparsify``, masked backward on the kernels);
  ``minilm_finetune``  seconds per 1000 distillation steps of a MiniLM-shaped BertModel (random weights: speed only),
                       dense and 2:4 through ``sparsify``;
  ``convert_oneshot``  the same conversion without recovery (the one-shot cosine beside the recovered one);
  ``convert_10000``    ``--recover 10000`` when the measured step rate says it fits the time left.

  Every section records ``torch.cuda.max_memory_allocated``.
- ``--dry-run`` prints the plan (shapes, measurements, sections, commands) without timing anything; with
  ``--carry`` it reads the prepared shapes, otherwise it finds them on the models first. ``--cpu-smoke`` runs every
  section for real on the CPU with tiny sizes (semi-structured kernels are CUDA-only, so ``gemm`` times a masked
  dense product there, labelled emulated) to exercise the code paths.

    python benchmarks/gpu.py --prepare .gpucarry [--models digits minilm textdet mpnet vgg16]
    python benchmarks/gpu.py --carry .gpucarry --out OUT [--budget-s 420] [--sections ...]
    python benchmarks/gpu.py --dry-run [--carry .gpucarry] [--models ...] [--out OUT]
    python benchmarks/gpu.py --carry .gpucarry --out OUT --cpu-smoke

The sections live in ``benchmarks/gpu_check/`` (one module each, beside the carry preparation, the plan, the runner
and the report); this script is their one entry point.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

# The gpu_check package beside this script: first on sys.path when the script runs, added here when it is loaded
# as a module (the tests).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

from gpu_check import carry  # noqa: E402
from gpu_check.carry import gather_shapes, prepare  # noqa: E402
from gpu_check.common import (  # noqa: E402
    CARRY_LIMIT_BYTES,
    FLOAT16_NOTE,
    MANIFEST,
    MINILM_CARRIED,
    MODELS,
    RESULTS,
    SECTIONS,
    progress,
    repository_imports,
)
from gpu_check.convert import convert_long_section, convert_oneshot_section, convert_section  # noqa: E402
from gpu_check.environment import environment_section  # noqa: E402
from gpu_check.gemm import gemm_section, two_four_mask  # noqa: E402
from gpu_check.plan import build_plan, print_plan  # noqa: E402
from gpu_check.runner import Run, run_section  # noqa: E402
from gpu_check.training import minilm_finetune_section, train_step_section  # noqa: E402

# What the tests and other callers read of this script besides its entry points.
__all__ = [
    "CARRY_LIMIT_BYTES",
    "MINILM_CARRIED",
    "RESULTS",
    "SECTIONS",
    "carry",
    "device_run",
    "dry_run",
    "main",
    "parse_args",
    "prepare",
    "two_four_mask",
]


# name -> (body, share of the budget it may use at most, seconds it needs to be worth starting)
SECTION_TABLE: dict[str, tuple[Callable[[Run, dict], None], float, float]] = {
    "environment": (environment_section, 0.05, 1),
    "gemm": (gemm_section, 0.30, 20),
    "convert": (convert_section, 0.40, 30),
    "train_step": (train_step_section, 0.08, 10),
    "minilm_finetune": (minilm_finetune_section, 0.08, 10),
    "convert_oneshot": (convert_oneshot_section, 0.10, 15),
    "convert_10000": (convert_long_section, 1.0, 30),
}
# Seconds kept back for the sections after the one starting, so that one slow section cannot starve them.
RESERVE_AFTER = {"gemm": 0.30, "convert": 0.16}


def device_run(args: argparse.Namespace) -> int:
    import torch

    carry = Path(args.carry)
    if not (carry / MANIFEST).is_file():
        print(f"gpu.py: {carry / MANIFEST} is missing: write the carry folder first with --prepare", file=sys.stderr)
        return 2
    packages = repository_imports(carry)
    from nmdeploy.files import private_temporary_folder

    manifest = json.loads((carry / MANIFEST).read_text())
    shapes = json.loads((carry / manifest["shapes"]).read_text())
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        progress("no CUDA device: running the sections on the CPU (figures are not GPU figures)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out=out, carry=carry, budget=args.budget_s, smoke=args.cpu_smoke, device="cuda" if cuda else "cpu")
    run.manifest, run.shapes = manifest, shapes
    run.long_steps = args.long_steps
    run.results = {
        "script": "benchmarks/gpu.py",
        "mode": "cpu-smoke" if args.cpu_smoke else "device",
        "budget_s": args.budget_s,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "notes": [FLOAT16_NOTE] if "minilm" in manifest else [],
        "models": shapes["models"],
        "skipped_models": shapes["skipped"],
        "packages": packages,
        "sections": {},
    }
    sections = [name for name in SECTIONS if name in args.sections]
    with private_temporary_folder("gpu-bench") as scratch:
        run.scratch = Path(scratch)
        for index, name in enumerate(sections):
            body, share, needs = SECTION_TABLE[name]
            if name.startswith("convert") and "minilm" not in manifest:
                run.results["sections"][name] = {"status": "skipped", "reason": "the carry holds no MiniLM"}
                continue
            later = RESERVE_AFTER.get(name, 0) * args.budget_s if index < len(sections) - 1 else 0
            limit = min(share * args.budget_s, run.left() - later)
            run_section(run, name, body, limit, needs)
    run.results["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    run.results["tomlkit_imported"] = "tomlkit" in sys.modules
    run.save()
    statuses = ", ".join(f"{n} {s['status']}" for n, s in run.results["sections"].items())
    progress(f"done in {time.perf_counter() - run.started:.0f} s: {statuses}; results in {out / RESULTS}")
    return 0


def dry_run(args: argparse.Namespace) -> dict:
    """The plan without timing anything: shapes (prepared, or found on the models now), measurements, sections."""
    repository_imports()
    if args.carry:
        carry = Path(args.carry)
        manifest = json.loads((carry / MANIFEST).read_text())
        shapes = json.loads((carry / manifest["shapes"]).read_text())
    else:
        manifest, shapes = {}, gather_shapes(args.models)
    plan = build_plan(shapes, args.cpu_smoke)
    sections = [name for name in SECTIONS if name in args.sections]
    if args.carry and "minilm" not in manifest:
        sections = [name for name in sections if not name.startswith("convert")]
    print_plan(plan, shapes, sections)
    document = {"mode": "dry-run", "sections": sections, "plan": plan, "shapes": shapes}
    if args.out:
        from nmdeploy.files import write_atomically

        write_atomically(Path(args.out) / "plan.json", json.dumps(document, indent=1))
    return document


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prepare", metavar="DIR", help="write the carry folder DIR (here, on the CPU)")
    mode.add_argument("--carry", metavar="DIR", help="run the sections from the carry folder DIR")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (from --carry, or from the models)")
    parser.add_argument("--cpu-smoke", action="store_true", help="every section for real on the CPU, tiny sizes")
    parser.add_argument("--out", metavar="DIR", help="folder for results.json and gemm.md (plan.json with --dry-run)")
    parser.add_argument("--budget-s", type=float, default=420, help="seconds for the whole run (default 420)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models to take shapes from")
    parser.add_argument(
        "--long-steps", type=int, metavar="N", help="steps of the long recovery (section convert_10000; default 10000)"
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="sections to run")
    args = parser.parse_args(argv)
    if args.dry_run and args.prepare:
        parser.error("--dry-run reads --carry or the models, not --prepare")
    if not (args.prepare or args.carry or args.dry_run):
        parser.error("give --prepare DIR, --carry DIR --out DIR, or --dry-run")
    if args.carry and not args.dry_run and not args.out:
        parser.error("--carry needs --out DIR for the results")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        dry_run(args)
        return 0
    if args.prepare:
        repository_imports()
        from nmdeploy.errors import Error

        try:
            prepare(Path(args.prepare), args.models)
        except Error as error:
            print(f"gpu.py --prepare: error: {error}", file=sys.stderr)
            return 2
        return 0
    return device_run(args)


if __name__ == "__main__":
    sys.exit(main())
