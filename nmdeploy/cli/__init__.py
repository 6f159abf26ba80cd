"""The ``nmdeploy`` command: one module per verb, each with ``add_arguments(parser)`` and ``run(args) -> int``.

``main`` turns an :class:`nmdeploy.Error` into one line on stderr and exit code 2; any other exception keeps its
traceback, because it is a bug in nmdeploy.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from nmdeploy import __version__
from nmdeploy.cli import (
    bench,
    build,
    cast,
    compare,
    convert,
    export,
    inspect,
    pipeline,
    prune,
    regress,
    run,
    stats,
    train,
)
from nmdeploy.errors import Error

VERBS = {
    "bench": bench,
    "build": build,
    "cast": cast,
    "compare": compare,
    "convert": convert,
    "export": export,
    "inspect": inspect,
    "pipeline": pipeline,
    "prune": prune,
    "regress": regress,
    "run": run,
    "stats": stats,
    "train": train,
}

USER_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nmdeploy",
        description="N:M structured sparsity for ONNX and TensorRT deployment, and sparse training in PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"nmdeploy {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    for name, module in VERBS.items():
        sub = verbs.add_parser(name, help=module.HELP, description=module.HELP)
        sub.add_argument("-v", "--verbose", action="count", default=0, help="more log output (repeatable)")
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
