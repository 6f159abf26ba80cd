"""The ``nmdeploy`` command: one module per verb, each with ``add_arguments(parser)`` and ``run(args) -> int``.

Only the chosen verb's module is imported, so ``nmdeploy --help``, ``--version`` and a light verb never pay for
torch or ONNX Runtime. ``main`` turns an :class:`nmdeploy.Error` into one line on stderr and exit code 2; any other
exception keeps its traceback, because it is a bug in nmdeploy, and exits with code 3: never 1, which CI reads as
"a figure regressed" or "FAILED", nor 2, which says the input was wrong.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NamedTuple

from nmdeploy import __version__
from nmdeploy.errors import Error


class Verb(NamedTuple):
    module: str
    help: str


VERBS: dict[str, Verb] = {
    "bench": Verb(
        "nmdeploy.cli.bench",
        "measure latency (p50/p90/p99) and throughput per batch size; with two models, their ratio in one run",
    ),
    "build": Verb(
        "nmdeploy.cli.build",
        "build a TensorRT engine (strongly typed) and report which layers were eligible for, and ran, sparse kernels",
    ),
    "cast": Verb(
        "nmdeploy.cli.cast",
        "cast weights and compute to fp16 or bf16 (sensitive ops and I/O stay fp32) and check accuracy on CPU",
    ),
    "compare": Verb(
        "nmdeploy.cli.compare",
        "run two models on the same inputs (ONNX Runtime) and report errors, cosine and top-1 agreement per output",
    ),
    "convert": Verb(
        "nmdeploy.cli.convert",
        "convert MatMul, Gemm, Conv and LSTM/GRU/RNN input weights to N:M with calibration data, fitting each layer "
        "to its dense outputs",
    ),
    "data": Verb(
        "nmdeploy.cli.data",
        "build calibration or evaluation data for your own model (text through its tokenizer, images, or a Python "
        "data loader) as the .npz shards --calib and --data take",
    ),
    "export": Verb(
        "nmdeploy.cli.export", "export a training checkpoint to ONNX with its N:M masks baked into the weights"
    ),
    "inspect": Verb(
        "nmdeploy.cli.inspect",
        "list prunable weights with their reduction axis, N:M compliance and TensorRT eligibility",
    ),
    "pipeline": Verb(
        "nmdeploy.cli.pipeline",
        "export the reference models, then inspect, convert to 2:4 with calibration, cast to fp16, compare, bench "
        "and check against their baselines (and build TensorRT engines where TensorRT and a GPU exist)",
    ),
    "prune": Verb(
        "nmdeploy.cli.prune",
        "prune every prunable weight to N:M along its reduction axis (transposable where asked or needed)",
    ),
    "quantize": Verb(
        "nmdeploy.cli.quantize",
        "quantize weights (per output channel) and activations (calibrated) to INT8 or FP8 with Q/DQ placed so "
        "2:4 layers can run TensorRT's sparse integer kernels; a verdict per layer",
    ),
    "regress": Verb(
        "nmdeploy.cli.regress",
        "compare and bench models against a baselines file; exit 1 with a table when a figure regressed",
    ),
    "run": Verb(
        "nmdeploy.cli.run", "run a pass pipeline recipe (a TOML file, or a name from passes/ such as tensorrt-2of4)"
    ),
    "stats": Verb(
        "nmdeploy.cli.stats",
        "N:M statistics of a model's weights: compliance and what 1-D and transposable masks would keep",
    ),
    "train": Verb(
        "nmdeploy.cli.train",
        "train a reference model (models/*/*.toml) or your own with an N:M sparse training method; resumable "
        "checkpoints",
    ),
}

FAILED = 1  # a verdict: a figure regressed, a fidelity or compliance check failed
USER_ERROR = 2
INTERNAL_ERROR = 3  # a bug in nmdeploy: its traceback, never mistaken for a verdict or for bad input


def chosen_verb(argv: Sequence[str]) -> str | None:
    """The verb named on the command line: the first word that is not an option (the top level takes no values)."""
    word = next((arg for arg in argv if not arg.startswith("-")), None)
    return word if word in VERBS else None


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser with every verb listed; only ``verb``'s module is imported and given its flags."""
    parser = argparse.ArgumentParser(
        prog="nmdeploy",
        description="N:M structured sparsity for ONNX and TensorRT deployment, and sparse training in PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"nmdeploy {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    for name, entry in VERBS.items():
        sub = verbs.add_parser(name, help=entry.help, description=entry.help)
        if name == verb:
            module = importlib.import_module(entry.module)
            sub.add_argument("-v", "--verbose", action="count", default=0, help="more log output (repeatable)")
            module.add_arguments(sub)
            sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(chosen_verb(argv)).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose > 1 else logging.INFO if args.verbose else logging.WARNING,
        format="[%(levelname)s] %(message)s",
    )
    try:
        return args.run(args)
    except Error as error:
        print(f"nmdeploy {args.verb}: error: {error}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print(f"nmdeploy {args.verb}: interrupted", file=sys.stderr)
        return 130
    except Exception:  # a bug: the traceback for its report, and an exit code no verdict uses
        traceback.print_exc()
        print(
            f"nmdeploy {args.verb}: internal error (exit {INTERNAL_ERROR}, not a verdict on the model): please report "
            "it with the traceback above",
            file=sys.stderr,
        )
        return INTERNAL_ERROR


def console_main() -> int:
    """The ``nmdeploy`` console script and ``python -m nmdeploy``: :func:`main`, then the interpreter's exit without
    its final garbage collection.

    A pruned or inspected model leaves hundreds of thousands of objects (protobuf messages, arrays) that the exit
    would walk once more only to free them with the process; frozen, they are skipped. Not in :func:`main`, which
    tests and other programs call in a process that goes on.

    The current folder goes on ``sys.path`` as ``python -m`` puts it there: users' ``module:function`` paths
    (``--metric``, data hooks, model factories) name modules beside them, and an installed script does not see those.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    code = main()
    gc.freeze()
    return code
