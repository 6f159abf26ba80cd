"""What ``nmdeploy data`` builds a data set from (text, images, a Python hook) and how it shards it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from nmdeploy.cli.args.base import ArgGroup, Parser
from nmdeploy.cli.args.data import BatchAxisArgs
from nmdeploy.errors import InputError

Build = Callable[[str, str, int], Any]  # (model, output folder, rows per shard) -> the data set's report


def _size(text: str) -> tuple[int, int]:
    height, _, width = text.lower().partition("x")
    try:
        return int(height), int(width)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxW such as 224x224, not {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers such as 0.485,0.456,0.406, not {text!r}"
        ) from None


class ShardArgs(ArgGroup):
    """``--shard-rows N``: rows per written shard. ``--batch`` was its name before it meant, in every verb, the batch
    sizes timed; it still works here, hidden, with one warning line."""

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument("--shard-rows", type=int, metavar="N", help="rows per shard (default: 32)")
        parser.add_argument("--batch", type=int, dest="old_shard_rows", help=argparse.SUPPRESS)

    def parse(self, args: argparse.Namespace) -> int:
        if args.old_shard_rows is None:
            return 32 if args.shard_rows is None else args.shard_rows
        if args.shard_rows is not None:
            raise InputError("--batch is the old name of --shard-rows: give one of them")
        print("warning: data --batch is deprecated, use --shard-rows", file=sys.stderr)
        return args.old_shard_rows


class TextArgs(ArgGroup):
    """Sentences through the model's tokenizer; each source's parse gives the function that builds its set."""

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument(
            "text", metavar="FILE|DIR", help="a UTF-8 text file, or a folder of .txt files (name order)"
        )
        parser.add_argument(
            "--tokenizer",
            metavar="DIR_OR_PACKAGE",
            help="a folder holding tokenizer.json (or a WordPiece vocab.txt), or an installed package that ships one "
            "(default: the model's folder)",
        )
        parser.add_argument(
            "--max-length", type=int, default=128, metavar="N", help="longest sequence in tokens (default: 128)"
        )
        parser.add_argument("--limit", type=int, metavar="N", help="use at most the first N sentences")
        parser.add_argument(
            "--seq-len",
            type=int,
            metavar="L",
            help="causal language models: pack the whole text into rows of exactly L tokens, no padding, each fed "
            "as a first pass (attention mask of ones, positions 0..L-1, KV-cache inputs empty); SparseGPT and "
            "llm-compressor calibrate on 128 rows of 2048 tokens",
        )
        parser.add_argument(
            "--rows", type=int, metavar="R", help="with --seq-len: the first R packed rows (default: every full row)"
        )

    def parse(self, args: argparse.Namespace) -> Build:
        from nmdeploy.errors import InputError
        from nmdeploy.runtimes.datasets import build_text_set
        from nmdeploy.runtimes.datasets.packed import build_packed_set
        from nmdeploy.runtimes.datasets.text import DEFAULT_MAX_LENGTH, default_tokenizer

        if args.seq_len is not None and (args.limit is not None or args.max_length != DEFAULT_MAX_LENGTH):
            raise InputError("--seq-len packs the whole text into rows: --max-length and --limit are for sentences")
        if args.seq_len is None and args.rows is not None:
            raise InputError("--rows counts packed rows of --seq-len tokens: give --seq-len too (or --limit sentences)")

        def build(model, output, rows):
            tokenizer = args.tokenizer or default_tokenizer(model)
            if args.seq_len is not None:
                return build_packed_set(
                    model, args.text, tokenizer, output, seq_len=args.seq_len, rows=args.rows, shard_rows=rows
                )
            return build_text_set(
                model, args.text, tokenizer, output, max_length=args.max_length, rows=rows, limit=args.limit
            )

        return build


class ImageArgs(ArgGroup):
    """A folder of images, resized and normalised."""

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument("images", metavar="DIR", help="folder of image files (.png, .jpg, ...; name order)")
        parser.add_argument("--size", type=_size, metavar="HxW", help="image size (default: the model's fixed size)")
        parser.add_argument("--layout", choices=("NCHW", "NHWC"), help="default: read from the model's input shape")
        parser.add_argument("--mean", type=_floats, metavar="R,G,B", help="subtracted after scaling (default: 0)")
        parser.add_argument("--std", type=_floats, metavar="R,G,B", help="divided by after the mean (default: 1)")
        parser.add_argument("--scale", type=float, default=255.0, help="pixels are divided by it first (default: 255)")

    def parse(self, args: argparse.Namespace) -> Build:
        from nmdeploy.runtimes.datasets import build_image_set

        options = {name: getattr(args, name) for name in ("size", "layout", "mean", "std", "scale")}
        return lambda model, output, rows: build_image_set(model, args.images, output, rows=rows, **options)


class HookArgs(ArgGroup):
    """A Python function that yields feed dicts, and where their rows lie (``--batch-axis``)."""

    axes = BatchAxisArgs()

    def add_flags(self, parser: Parser) -> None:
        parser.add_argument(
            "hook", metavar="MODULE:FUNCTION", help="a function that takes no arguments and yields feeds"
        )
        self.axes.add_flags(parser)
        parser.add_argument(
            "--carry",
            metavar="OUTPUT:INPUT,...",
            help="streaming calibration: run the model on each batch and feed its OUTPUT to the next batch's INPUT "
            "(e.g. stateN:state); the hook leaves INPUT out (zeros start the stream) or yields it to start a new one",
        )

    def parse(self, args: argparse.Namespace) -> Build:
        from nmdeploy.runtimes.datasets import build_hook_set
        from nmdeploy.runtimes.datasets.hook import parse_carry

        axes, carry = self.axes.parse(args), parse_carry(args.carry)
        return lambda model, output, rows: build_hook_set(
            model, args.hook, output, rows=rows, batch_axes=axes, carry=carry
        )
