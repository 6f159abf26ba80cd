"""Model inputs (``--data`` and ``--calib``): one DATA format for every verb (nmdeploy.runtimes.data)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

from nmdeploy.cli.args.base import ArgGroup, Parser
from nmdeploy.errors import InputError

log = logging.getLogger("nmdeploy.cli")
DATA_FORMS = "an .npz (input name -> batched array), a folder of them, or 'random' (seeded; functional checks only)"
RANDOM = "random"  # nmdeploy.runtimes.data.RANDOM, without importing numpy for --help


class DataArgs(ArgGroup):
    """``--data DATA`` (evaluation or timing inputs) or, with ``flag="--calib"``, calibration inputs. ``no_check``
    adds ``--no-check``, exclusive with it, for verbs whose check on the data may be skipped."""

    def __init__(
        self,
        flag: str = "--data",
        *,
        purpose: str,
        required: bool = False,
        default: str | None = None,
        no_check: bool = False,
    ) -> None:
        self.flag, self.purpose, self.required, self.default = flag, purpose, required, default
        self.no_check = no_check

    def add_flags(self, parser: Parser) -> None:
        target = parser.add_mutually_exclusive_group() if self.no_check else parser
        target.add_argument(
            self.flag,
            required=self.required,
            default=self.default,
            metavar="DATA",
            help=f"{self.purpose}: {DATA_FORMS}",
        )
        if self.no_check:
            target.add_argument("--no-check", action="store_true", help="skip the accuracy check")

    def parse(self, args: argparse.Namespace) -> str | None:
        """The DATA given (None: none, or ``--no-check``); random inputs are warned about."""
        if self.no_check and args.no_check:
            return None
        data = getattr(args, self.flag.lstrip("-"))
        if data == RANDOM:
            log.warning("%s random: fine for a functional check, meaningless for accuracy", self.flag)
        return data


@dataclass(frozen=True)
class Calibration:
    source: str | None  # DATA, or None where none was given
    batch_size: int | None  # --calib-batch


class CalibrationArgs(DataArgs):
    """``--calib DATA`` and ``--calib-batch N``. ``missing``, where set, is the error when no ``--calib`` is given
    (a verb that cannot run without it, but whose flag is optional in the parser)."""

    def __init__(self, *, purpose: str, required: bool = False, missing: str | None = None, batch: bool = True):
        super().__init__("--calib", purpose=purpose, required=required)
        self.missing, self.batch = missing, batch

    def add_flags(self, parser: Parser) -> None:
        super().add_flags(parser)
        if self.batch:
            parser.add_argument(
                "--calib-batch",
                type=int,
                metavar="N",
                help="at most N calibration samples per run (default: about 1M input elements per run); "
                "large arrays are split, so memory does not grow with the files",
            )

    def parse(self, args: argparse.Namespace) -> Calibration:
        if args.calib is None and self.missing:
            raise InputError(self.missing)
        return Calibration(super().parse(args), getattr(args, "calib_batch", None))


class BatchAxisArgs(ArgGroup):
    """``--batch-axis NAME:AXIS,...``: which axis of an input holds the rows, where the graph's symbolic dimensions
    do not say (nmdeploy.runtimes.batch_axes)."""

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument(
            "--batch-axis",
            metavar="NAME:AXIS,...",
            help="the axis of an input that holds a batch's rows where the model's symbolic dimensions do not say "
            "(e.g. state:1 for a [2, B, 128] state; NAME:none for an input without rows); default: the axis named "
            "like the other inputs' batch, else a free axis 0, else the one free axis; scalars have none",
        )

    def parse(self, args: argparse.Namespace) -> dict[str, int | None] | None:
        from nmdeploy.runtimes.batch_axes import parse_batch_axes

        return parse_batch_axes(args.batch_axis) if args.batch_axis else None
