"""How close a result must stay to its reference: ``--outputs`` judged, ``--metric`` and its bar (``--min-fidelity``,
``cast --min-cosine``), and conversion's recovery (``--recover`` and its precision and seed)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from nmdeploy.cli.args.base import ArgGroup, LazyText, Parser
from nmdeploy.errors import InputError

DEFAULT_MIN_COSINE = 0.99
USER_METRIC = (
    "MODULE:FUNCTION(reference_outputs, candidate_outputs, feeds) -> float (each a dict of name -> numpy array, "
    "one batch; averaged over batches)"
)


def outputs_type(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give output names separated by commas, e.g. logits,embeddings")
    return names


class OutputsArgs(ArgGroup):
    """``--outputs NAME[,NAME]``: the outputs fidelity figures judge, the same in every verb that measures one."""

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument(
            "--outputs",
            type=outputs_type,
            metavar="NAME[,NAME]",
            help="outputs to judge fidelity on (default: every output that is not a copy of an input, so "
            "pass-throughs such as input_ids do not count; integer outputs by agreement)",
        )

    def parse(self, args: argparse.Namespace) -> tuple[str, ...] | None:
        return args.outputs


# Per verb: the default --metric, its help, and the help of --min-fidelity (None: the verb has no such flag).
_METRIC = {
    "convert": (
        "auto",
        f"fidelity for --recover and --min-fidelity: %(metrics)s; or {USER_METRIC}; a model's figure is its "
        "lowest judged output's, and a figure the data cannot move is refused",
        "convert only the layers that keep the held-out fidelity (--metric) at F or above, choosing the most "
        "parameters TensorRT runs sparse; judged after recovery with --recover",
    ),
    "pipeline": (
        "auto",
        "fidelity for --recover and --min-fidelity: %(metrics)s; as nmdeploy convert, or MODULE:FUNCTION, "
        "which is also compared and checked in the baselines",
        "convert only the layers that keep the held-out fidelity (--metric) >= F (as nmdeploy convert --min-fidelity)",
    ),
    "compare": (
        "auto",
        f"the fidelity figure, the lowest judged output's: %(metrics)s; or {USER_METRIC}",
        "PASSED only when the fidelity figure is F or above (exit 1 otherwise; exit 2 where the measure cannot "
        "judge the data, e.g. a per-row cosine of one value); without it the figures are measured, not judged",
    ),
    "regress": (
        None,
        "a figure (higher is better) to check besides each output's: a built-in measure (perplexity, ctc, boxes, "
        "...: as compare --metric) or your own MODULE:FUNCTION",
        None,
    ),
}


@dataclass(frozen=True)
class Fidelity:
    spec: str | None  # --metric as given
    metric: Any  # the built-in name, or the user's function loaded (None: no --metric)
    min_fidelity: float | None
    held_out: str | None = None  # --held-out DATA (convert, pipeline): the rows judged instead of a share of --calib


class FidelityArgs(ArgGroup):
    """``--metric`` and ``--min-fidelity`` as ``use`` (convert, pipeline, compare, regress) means them: the same
    measures (nmdeploy.fidelity) everywhere, with the verb's default and bar; ``cast`` has ``--min-cosine``."""

    def __init__(self, use: str) -> None:
        self.use = use

    def add_flags(self, parser: Parser) -> None:
        if self.use == "cast":
            parser.add_argument(
                "--min-cosine",
                type=float,
                default=DEFAULT_MIN_COSINE,
                metavar="F",
                help="FAILED (exit 1; the model is still written, to look at) when a judged output's mean cosine to "
                "MODEL is below F (default %(default)g: fp16/bf16 rounding alone stays far above it); an output of "
                "a few values per row is judged across the batch (spread) instead, as compare's auto does",
            )
            return
        default, metric_help, bar_help = _METRIC[self.use]
        metavar = "METRIC"
        flag = parser.add_argument("--metric", default=default, metavar=metavar, help=metric_help)
        flag.metrics = LazyText(_metrics_help)  # read from the metric registry only when help is shown
        if bar_help:
            parser.add_argument("--min-fidelity", type=float, metavar="F", help=bar_help)
        if default:
            parser.add_argument(
                "--ctc-blank",
                type=int,
                metavar="INDEX",
                help="the blank class of --metric ctc (default: the model's metadata ctc_blank, else 0)",
            )
        if self.use in ("convert", "pipeline"):
            parser.add_argument(
                "--held-out",
                metavar="DATA",
                help="judge --min-fidelity and --recover's early stop on these rows (ideally of the kind the model "
                "will see in deployment) instead of a held-out fifth of --calib, which is then fitted on whole",
            )

    def parse(self, args: argparse.Namespace) -> Fidelity:
        """The checked bar and metric; a bad one is a one-line error before anything is read."""
        from nmdeploy.fidelity import check_min_fidelity, resolve_metric

        if self.use == "cast":
            return Fidelity(None, "cosine", check_min_fidelity(args.min_cosine, "--min-cosine"))
        bar = getattr(args, "min_fidelity", None)
        if bar is not None:
            check_min_fidelity(bar)
        if args.metric is None:
            return Fidelity(None, None, bar)
        spec = args.metric
        blank = getattr(args, "ctc_blank", None)
        if blank is not None:
            if spec != "ctc" or blank < 0:
                raise InputError(f"--ctc-blank {blank}: a class index (0 or more) for --metric ctc")
            spec = f"ctc@{blank}"
        metric = resolve_metric(spec)
        return Fidelity(spec, metric, bar, getattr(args, "held_out", None))


# Copies of nmdeploy.conversion.recovery's values (a test keeps them equal): that module loads torch.
DEFAULT_STEPS = 1000
DEFAULT_BATCH = 8
PRECISIONS = ("auto", "float32", "bfloat16", "float16")


class RecoveryArgs(ArgGroup):
    """``--recover [STEPS]``: fine-tuning after conversion, its precision and ``--seed``, in ``convert`` and
    ``pipeline`` alike."""

    def __init__(self, use: str = "convert") -> None:
        self.use = use

    def add_flags(self, parser: Parser) -> None:
        full = self.use == "convert"
        parser.add_argument(
            "--recover",
            nargs="?",
            type=int,
            const=DEFAULT_STEPS,
            metavar="STEPS",
            help=f"after conversion, fine-tune the kept weights, biases and normalisations (masks fixed) for up to "
            f"STEPS steps (default {DEFAULT_STEPS}) by distilling the dense model on the calibration data, with early "
            "stopping on a held-out fifth of it"
            if full
            else "fine-tune each converted model by distilling its dense model (as nmdeploy convert --recover)",
        )
        parser.add_argument(
            "--recover-precision",
            default=None,
            metavar="{" + ",".join(PRECISIONS) + "}",
            help="precision of recovery's training passes: bfloat16 or float16 (CUDA only) matrix products (float32 "
            "weights), float32, or auto (default: bfloat16 where the CPU has native bfloat16, about twice as fast; "
            "on a GPU bfloat16 where it has it, else float16; held-out checks stay float32)",
        )
        parser.add_argument(
            "--recover-batch",
            type=int,
            default=None,
            metavar="ROWS",
            help=f"calibration rows per recovery step, and per held-out mini-batch (default {DEFAULT_BATCH}); a "
            "language model of 256-token rows gained more per minute with 2-4 (more, cheaper steps)",
        )
        parser.add_argument("--seed", type=int, default=0, help="seed of the held-out split and the recovery batches")

    def parse(self, args: argparse.Namespace, fidelity: Fidelity | None = None, outputs: tuple[str, ...] | None = None):
        """The checked RecoveryOptions (None: no recovery), judged by ``fidelity``'s metric on ``outputs``."""
        held_out = fidelity.held_out if fidelity is not None else None
        if held_out is not None and args.recover is None and fidelity.min_fidelity is None:
            raise InputError("held-out data is read by --min-fidelity and --recover only: add one, or drop --held-out")
        if args.recover is None:
            if getattr(args, "recover_batch", None) is not None:
                raise InputError("--recover-batch sets the rows of recovery's steps: add --recover, or drop it")
            if getattr(args, "recover_precision", None) is not None:
                raise InputError("--recover-precision sets the precision of recovery's steps: add --recover or drop it")
            return None
        from nmdeploy.conversion.recovery import RecoveryOptions

        metric = fidelity.metric if fidelity is not None else "auto"
        return RecoveryOptions(
            steps=args.recover,
            batch_size=DEFAULT_BATCH if args.recover_batch is None else args.recover_batch,
            seed=args.seed,
            metric=metric,
            precision=args.recover_precision or "auto",
            outputs=outputs,
        )


def _metrics_help() -> str:
    from nmdeploy.fidelity import metrics_help

    return metrics_help()
