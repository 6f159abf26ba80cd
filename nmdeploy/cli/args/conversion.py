"""How ``convert`` fits N:M weights (``--method``, ``--fit``, ``--fit-target``, ``--permute``, ``--damping``, ...) and
the memory and runner its statistics use; the pipeline takes the same flags but ``--distributed``."""

from __future__ import annotations

import argparse
from typing import Any

from nmdeploy.cli.args.base import ArgGroup, Parser
from nmdeploy.errors import InputError
from nmdeploy.runtimes.backends import graph_engines

# A copy of nmdeploy.calibration.statistics' value (a test keeps them equal): that package loads torch, which would
# make `convert --help` take seconds. The statistics runners are the backends that run graphs held in memory.
DEFAULT_CACHE_LIMIT = 1 << 30
RUNNERS = graph_engines()


class ConversionArgs(ArgGroup):
    """The fitting flags of ConvertOptions (``method_only``: ``--method`` alone; ``distributed=False``: no
    ``--distributed``, for a verb that runs more than the conversion, which every rank would repeat)."""

    def __init__(self, *, method_only: bool = False, distributed: bool = True) -> None:
        self.method_only, self.distributed = method_only, distributed

    def add_flags(self, parser: Parser) -> None:
        from nmdeploy.masks.fitting import DEFAULT_METHOD, method_names, methods_help

        method_help = f"as nmdeploy convert (default {DEFAULT_METHOD})" if self.method_only else methods_help()
        parser.add_argument("--method", choices=method_names(), default=DEFAULT_METHOD, help=method_help)
        if self.method_only:
            return
        parser.add_argument(
            "--fit",
            choices=("sequential", "parallel"),
            default="sequential",
            help="sequential: each layer fitted on the inputs of the model converted so far (default); parallel: "
            "every layer on dense inputs, one calibration run",
        )
        parser.add_argument(
            "--fit-target",
            choices=("auto", "model", "layer"),
            default="auto",
            help="what each layer of the sequential fit matches: model: the dense model's outputs there (corrects "
            "the earlier layers' error on the calibration rows); layer: its own dense outputs on the converted "
            "inputs, as SparseGPT; auto (default): layer for language models (logits over a vocabulary), else model",
        )
        parser.add_argument(
            "--permute",
            action="store_true",
            help="first reorder input channels, with their producers' outputs, where that provably keeps the "
            "function, so that the N:M groups keep more saliency",
        )
        parser.add_argument(
            "--damping",
            type=float,
            default=None,
            help="fit damping, relative to mean diag(X^T X): larger generalises better from few calibration samples "
            "(default 0.03 for language models, 0.1 otherwise)",
        )
        parser.add_argument(
            "--reconstruct",
            type=int,
            default=0,
            metavar="STEPS",
            help="after the sequential fit of each region (a run of layers ending where only the residual stream "
            "carries the converted model on: attention, MLP), STEPS Adam steps on its kept weights, masks fixed, "
            "toward what its layers were fitted to (--fit-target: the dense model's outputs there, or the region's "
            "own dense run on its converted inputs) (default 0: none)",
        )
        parser.add_argument(
            "--reconstruct-lr",
            type=float,
            default=1e-3,  # ConvertOptions.reconstruct_lr's (not imported: it would load torch at start-up)
            metavar="LR",
            help="the learning rate of --reconstruct (default %(default)g)",
        )
        parser.add_argument(
            "--reconstruct-span",
            type=int,
            default=1,
            metavar="N",
            help="train N consecutive regions of --reconstruct together (2 on a transformer: attention and MLP, one "
            "block; default %(default)d)",
        )
        parser.add_argument(
            "--reconstruct-precision",
            choices=("auto", "float32", "bfloat16", "float16"),
            default="float32",
            help="precision of --reconstruct's training products (float32 weights and Adam state; the error that "
            "decides whether a region's training is kept is measured in float32): auto is bfloat16 where the CPU "
            "multiplies it natively (default %(default)s)",
        )
        parser.add_argument(
            "--cache-limit",
            type=float,
            default=DEFAULT_CACHE_LIMIT / 2**20,
            metavar="MB",
            help="activations cached between fitting stages kept in memory up to MB (default %(default)g); the rest "
            "goes to a private temporary folder, removed afterwards",
        )
        parser.add_argument(
            "--max-memory",
            type=float,
            metavar="MB",
            help="memory the conversion may hold (default: half the memory available when it starts, raised to what "
            "the conversion needs where that is within 80%% of it); a layer whose statistics do not fit gets "
            "block-diagonal ones (a stated approximation) or, failing that, stays dense",
        )
        parser.add_argument(
            "--statistics",
            choices=("auto", *RUNNERS),
            default="auto",
            help="what runs the model for the statistics: onnxruntime (CPU), torch (the torch interpreter on "
            "--device), or auto (default: torch on a GPU, ONNX Runtime on the CPU, where it is faster)",
        )
        if not self.distributed:
            return
        parser.add_argument(
            "--distributed",
            action="store_true",
            help="share the calibration rows among the processes torchrun started (torchrun --nproc-per-node N -m "
            "nmdeploy convert ... --distributed): statistics summed over them (gloo), rank 0 fits and writes",
        )

    def parse(self, args: argparse.Namespace) -> dict[str, Any]:
        """The ConvertOptions fields these flags set (``method`` alone for the pipeline)."""
        if self.method_only:
            return {"method": args.method}
        distributed = getattr(args, "distributed", False)
        if not distributed and _launched_ranks() > 1:
            # Without the flag every rank would convert all rows and write the same output.
            what = (
                "add --distributed to share the calibration among them, or run one process"
                if self.distributed
                else "run one process (convert --distributed shares a conversion's calibration among processes)"
            )
            raise InputError(f"started among {_launched_ranks()} processes (WORLD_SIZE): {what}")
        return {
            "method": args.method,
            "sequential": args.fit == "sequential",
            "fit_target": args.fit_target,
            "permute": args.permute,
            "damping": args.damping,
            "cache_limit": int(args.cache_limit * 2**20),
            "max_memory_mb": args.max_memory,
            "statistics": args.statistics,
            "distributed": distributed,
            "reconstruct_steps": args.reconstruct,
            "reconstruct_lr": args.reconstruct_lr,
            "reconstruct_span": args.reconstruct_span,
            "reconstruct_precision": args.reconstruct_precision,
        }

    def run(self, conversion: Any, model: Any, args: argparse.Namespace) -> list | None:
        """The conversion's report rows; with --distributed, rank 0's (None on the other ranks, whose model is not
        to be written)."""
        if not args.distributed:
            return conversion(model).report
        options = conversion.options
        if options.recover or options.min_fidelity is not None or getattr(options, "precision", None):
            raise InputError(
                "--distributed shares the fit's statistics only; run --recover, --min-fidelity and --precision in "
                "one process"
            )
        from nmdeploy.calibration.distributed import join, leave

        try:
            leader = join().leader
            report = conversion(model).report
        finally:
            leave()
        return report if leader else None


def _launched_ranks() -> int:
    """The processes a launcher (torchrun) started this one among, 1 where none did."""
    import os

    text = os.environ.get("WORLD_SIZE", "1")
    return int(text) if text.isdigit() else 1
