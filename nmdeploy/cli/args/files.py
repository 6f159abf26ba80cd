"""Where a verb writes (``-o``, ``--in-place``) and how it reports (``--json``, ``--no-progress``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from nmdeploy.cli.args.base import ArgGroup, Parser
from nmdeploy.errors import InputError
from nmdeploy.files import check_output_path


class OutputArgs(ArgGroup):
    """``-o OUT`` (or another ``flag`` naming a file a verb writes, such as ``inspect --plot``) and, for verbs that
    rewrite a model, ``--in-place``: the output is never the input by accident."""

    def __init__(
        self,
        metavar: str = "OUT",
        help: str = "where to write the resulting model",
        *,
        required: bool = True,
        default: str | None = None,
        in_place: bool = False,
        flag: str = "--output",
    ) -> None:
        self.metavar, self.help, self.required, self.default, self.in_place = metavar, help, required, default, in_place
        self.flags = ("-o", flag) if flag == "--output" else (flag,)
        self.dest = flag.lstrip("-")

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument(
            *self.flags, required=self.required, default=self.default, metavar=self.metavar, help=self.help
        )
        if self.in_place:
            parser.add_argument(
                "--in-place", action="store_true", help="allow OUT to be MODEL itself (overwritten atomically)"
            )

    def parse(self, args: argparse.Namespace) -> str | None:
        """The output path; with ``--in-place`` declared, checked against ``args.model`` first, so a typo never
        destroys a model."""
        output = getattr(args, self.dest)
        if self.in_place:
            same = Path(output).resolve() == Path(args.model).resolve()
            if same and not args.in_place:
                raise InputError(f"{output} is the input model; choose another -o OUT or pass --in-place")
            if not same:
                check_output_path(output, inputs=[Path(args.model)])
        return output


@dataclass(frozen=True)
class Report:
    json: bool
    progress: bool  # a progress bar (lines in logs) for the long loops


class ReportArgs(ArgGroup):
    """``--json`` (machine-readable output instead of a table) and, for verbs with long loops, ``--no-progress``."""

    def __init__(self, *, progress_flag: bool = False) -> None:
        self.progress_flag = progress_flag

    def add_flags(self, parser: Parser) -> None:
        if self.progress_flag:
            parser.add_argument("--no-progress", action="store_true", help="no progress bar")
        parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")

    def parse(self, args: argparse.Namespace) -> Report:
        return Report(args.json, not args.json and not getattr(args, "no_progress", False))
