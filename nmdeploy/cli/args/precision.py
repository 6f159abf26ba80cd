"""The precision a model is cast or quantized to, and what stays out of it: ``cast`` (fp16/bf16) and ``quantize``
(INT8/FP8 with calibrated activation ranges) take the same family."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from nmdeploy.cli.args.base import ArgGroup, LazyText, Parser, comma_list
from nmdeploy.errors import InputError

QUANTIZED = ("int8", "fp8")  # nmdeploy.passes.quantization_ranges.QUANTIZED_MAX, without importing numpy here
DEPLOYED = ("fp16", *QUANTIZED)  # nmdeploy.pipeline.PRECISIONS: what the pipeline's engine runs
OUTPUT_ERROR_LIMIT = 0.05  # nmdeploy.passes.quantize.OUTPUT_ERROR_LIMIT, without importing numpy here
KEEP_OPS = "op types whose inputs get no Q/DQ, replacing the default (Softmax, LogSoftmax and the normalisations)"
# Flag -> QuantizePass keyword, for every quantization flag; ``--method`` is quantize's old name of --range-method.
QUANTIZATION_KEYWORDS = {
    "range_method": "method",
    "percentile": "percentile",
    "keep_ops": "keep_ops",
    "quantize_residuals": "quantize_residuals",
    "smooth": "smooth",
    "smooth_strength": "smoothing_strength",
    "output_error_limit": "output_error_limit",
    "rescale_outputs": "rescale_outputs",
    "layer_outputs": "layer_outputs",
    "weight_rounding": "weight_rounding",
    "quantize_raw_input": "quantize_raw_input",
}


class PrecisionArgs(ArgGroup):
    """``--precision`` and ``--keep-ops``; ``quantized`` (INT8/FP8, ``quantize``) adds the activation-range and
    smoothing flags, float (fp16/bf16, ``cast``) the nodes kept in fp32 and ``--cast-io``; ``deployed``
    (``pipeline``) the precision its engine runs in and the quantization flags that replace its recipe's options;
    ``budgeted`` (``convert``) the 8-bit type the fidelity budget may choose per layer, and the same flags."""

    def __init__(self, *, quantized: bool = False, deployed: bool = False, budgeted: bool = False) -> None:
        self.quantized, self.deployed, self.budgeted = quantized, deployed, budgeted

    def add_flags(self, parser: Parser) -> None:
        if self.budgeted:
            parser.add_argument(
                "--precision",
                metavar="|".join(QUANTIZED),
                help="with --min-fidelity: choose per layer among 2:4 + PRECISION, dense PRECISION, 2:4 fp16 and dense "
                "fp16 by measured sensitivity and expected speed-up, and write one Q/DQ model (default: 2:4 or dense, "
                "no quantization); with --recover its 2:4 layers are recovered before quantization; the "
                "quantization flags below (--range-method, --smooth, ...) shape its 8-bit layers",
            )
            parser.add_argument(
                "--keep-ops", metavar="OP,OP", type=comma_list, default=argparse.SUPPRESS, help=KEEP_OPS
            )
            self._add_quantized(parser)
            return
        if self.deployed:
            parser.add_argument(
                "--precision",
                default="fp16",
                metavar="|".join(DEPLOYED),  # checked by the pipeline: a wrong value is one line, not argparse's usage
                help="fp16 (default), or int8 / fp8: quantize the 2:4 model with the quantize step of recipe "
                "tensorrt-2of4-PRECISION (calibrated on the calibration data), compare it with the dense model and "
                "build the engine from it; with --min-fidelity the conversion chooses per layer among 2:4 and dense, "
                "each in fp16 or PRECISION, as convert --min-fidelity F --precision PRECISION does; the quantization "
                "flags below (--range-method, --smooth, ...) replace the recipe's options for its 8-bit layers",
            )
            parser.add_argument(
                "--keep-ops", metavar="OP,OP", type=comma_list, default=argparse.SUPPRESS, help=KEEP_OPS
            )
            self._add_quantized(parser)
            return
        if self.quantized:
            # Checked by the pass, not by argparse choices: a wrong value is then one line, as every bad input is.
            parser.add_argument(
                "--precision", default="int8", metavar="|".join(QUANTIZED), help="quantized type (default int8)"
            )
            keep = KEEP_OPS
        else:
            from nmdeploy.passes.cast import DEFAULT_KEEP_OPS, PRECISIONS

            parser.add_argument(
                "--precision", choices=sorted(PRECISIONS), default="fp16", help="target type (default fp16)"
            )
            keep = f"op types that stay fp32, replacing the default list ({', '.join(sorted(DEFAULT_KEEP_OPS))})"
        parser.add_argument("--keep-ops", metavar="OP,OP", type=comma_list, help=keep)
        if self.quantized:
            self._add_quantized(parser)
        else:
            parser.add_argument("--keep-nodes", metavar="REGEX", help="nodes whose name matches also stay fp32")
            parser.add_argument(
                "--cast-io",
                action="store_true",
                help="give the model fp16/bf16 inputs and outputs (default: they stay fp32)",
            )

    @staticmethod
    def _budgeted(precision: str | None, min_fidelity: float | None) -> str | None:
        if precision is None:
            return None
        if precision not in QUANTIZED:
            raise InputError(f"--precision {precision}: the budget chooses among {' and '.join(QUANTIZED)}; give one")
        if min_fidelity is None:
            raise InputError(
                f"--precision {precision} chooses per layer under a fidelity floor: add --min-fidelity F (or quantize "
                "the converted model with nmdeploy quantize)"
            )
        return precision

    def _add_quantized(self, parser: Parser) -> None:
        """The flags of the activation ranges and smoothing. Their defaults are QuantizePass's: a flag not given
        leaves no attribute (``SUPPRESS``), so ``convert`` can tell that one was given without ``--precision``."""
        unset = argparse.SUPPRESS
        flag = parser.add_argument(
            "--range-method",
            metavar="METHOD",
            default=unset,
            help="activation range from the calibration histogram: %(methods)s; default auto for int8, max for fp8",
        )
        flag.methods = LazyText(_range_methods_help)  # the registry's module loads numpy: only when help is shown
        if self.quantized:  # quantize's name for it before 0.x; convert's --method is the fitting method
            parser.add_argument("--method", dest="old_range_method", default=unset, help=argparse.SUPPRESS)
        parser.add_argument(
            "--percentile", type=float, default=unset, metavar="P", help="for --range-method percentile (default 99.99)"
        )
        parser.add_argument(
            "--quantize-residuals",
            action="store_true",
            default=unset,
            help="also quantize the other input of residual Adds after quantized layers, so TensorRT can fuse the "
            "Add (off by default: it quantizes the residual stream, which costs accuracy in transformers)",
        )
        parser.add_argument(
            "--smooth",
            action=argparse.BooleanOptionalAction,
            default=unset,
            help="SmoothQuant before quantizing: divide each MatMul/Gemm input channel by max|x|^ALPHA / "
            "max|w|^(1-ALPHA) (a Mul before its Q/DQ) and multiply the weights' matching rows by it, so outlier "
            "channels move into the per-channel weight scales; zeros stay zeros (default: on for int8, off for fp8)",
        )
        parser.add_argument(
            "--smooth-strength", type=float, default=unset, metavar="ALPHA", help="ALPHA of --smooth (default 0.85)"
        )
        parser.add_argument(
            "--output-error-limit",
            type=float,
            default=unset,
            metavar="F",
            help="a layer output whose per-tensor range loses more than this share of its energy on the "
            f"calibration data is rescaled per channel, or kept floating point where it cannot be (default "
            f"{OUTPUT_ERROR_LIMIT})",
        )
        parser.add_argument(
            "--no-output-error-limit",
            dest="output_error_limit",
            action="store_const",
            const=None,
            default=unset,
            help="quantize every layer output however much its range loses",
        )
        parser.add_argument(
            "--no-rescale-outputs",
            dest="rescale_outputs",
            action="store_false",
            default=unset,
            help="keep lossy layer outputs in floating point instead of rescaling their outlier channels",
        )
        parser.add_argument(
            "--layer-outputs",
            metavar="auto|quantized|float",
            default=unset,
            help="Q/DQ on layer outputs too (quantized), or on weights and inputs only (float); auto: quantized for "
            "int8 (TensorRT's sparse INT8 kernels are INT8 in and out), float for fp8 (sparse FP8 kernels write "
            "fp16/bf16/fp32); default auto",
        )
        parser.add_argument(
            "--weight-rounding",
            metavar="gptq|nearest",
            default=unset,
            help="gptq: round each layer's weights onto their grid column by column, the rounding error of each "
            "column spread over the columns not yet rounded by the layer's input statistics (GPTQ; zeros stay "
            "zeros), one more pass over the calibration data; nearest: each weight to its nearest grid value; "
            "default gptq",
        )
        parser.add_argument(
            "--quantize-raw-input",
            action="store_true",
            default=unset,
            help="quantize a first layer that reads the model's few-channel input too (default: floating point)",
        )

    @staticmethod
    def _quantization(args: argparse.Namespace) -> dict[str, Any]:
        """The QuantizePass keywords of the quantization flags given (the pass's defaults for the others)."""
        found = {keyword: getattr(args, flag) for flag, keyword in QUANTIZATION_KEYWORDS.items() if hasattr(args, flag)}
        if hasattr(args, "old_range_method"):
            if "method" in found:
                raise InputError("--method is the old name of --range-method: give one of them")
            print("warning: quantize --method is deprecated, use --range-method", file=sys.stderr)
            found["method"] = args.old_range_method
        return found

    def parse(self, args: argparse.Namespace, min_fidelity: float | None = None) -> dict[str, Any]:
        """The keyword options of QuantizePass (``quantized``), of ``cast_model_file``, or the pipeline's precision
        and the quantization flags given (``quantize``); ``budgeted``: the 8-bit type (None: no precision budget),
        checked with the ``min_fidelity`` floor it needs, before any model is read."""
        if self.budgeted or self.deployed:
            precision = self._budgeted(args.precision, min_fidelity) if self.budgeted else args.precision
            quantization = self._quantization(args)
            if quantization and precision in (None, "fp16"):  # a flag that would do nothing
                flags = [flag for flag in QUANTIZATION_KEYWORDS if hasattr(args, flag)]
                given = ", ".join(f"--{flag.replace('_', '-')}" for flag in flags)
                raise InputError(f"{given}: quantization flags shape the 8-bit layers of --precision int8|fp8; add "
                                 "--precision, or drop them")  # fmt: skip
            return {"precision": precision, "quantize": quantization or None}
        if self.quantized:
            return {"precision": args.precision, **self._quantization(args)}
        return {
            "precision": args.precision,
            "keep_ops": args.keep_ops,
            "keep_nodes": args.keep_nodes,
            "keep_io": not args.cast_io,
        }


def _range_methods_help() -> str:
    from nmdeploy.passes.quantization_ranges import RANGE_METHODS

    return RANGE_METHODS.help_text()
