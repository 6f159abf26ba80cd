"""Cast a model file to fp16/bf16 and check its accuracy against the fp32 original with ONNX Runtime on CPU.

ONNX Runtime's CPU provider has almost no bf16 kernels and lacks some fp16 ones, and a model cast with
``keep_io=False`` takes inputs of another type than the original; in those cases the check runs the cast model
upcast (:func:`nmdeploy.passes.cast.upcast_for_cpu`: fp32 compute, every low-precision value rounded as the cast
model rounds it) and the outcome says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx

from nmdeploy.errors import Error, InputError, first_line
from nmdeploy.evaluation.compare import Comparison, compare_models
from nmdeploy.files import temporary_folder_beside
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.base import ReportRow
from nmdeploy.passes.cast import CastPass, upcast_for_cpu
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner


@dataclass
class CastOutcome:
    output: Path
    precision: str
    report: list[ReportRow]  # the cast pass's rows: CastNode, CastTensor, AddedCast
    modified: bool
    comparison: Comparison | None  # None when the check was skipped
    upcast_reason: str | None  # why the check ran the upcast model rather than the cast one, or None


def cast_model_file(
    model: str | Path,
    output: str | Path,
    *,
    precision: str = "fp16",
    keep_ops: Iterable[str] | None = None,
    keep_nodes: str | None = None,
    keep_io: bool = True,
    data: str | Path | None = "random",
    outputs: Sequence[str] | None = None,
) -> CastOutcome:
    """Cast ``model`` to ``precision``, save it to ``output`` atomically and, unless ``data`` is None, compare its
    judged ``outputs`` (None: the outputs that are not copies of an input) with the original's on ``data`` (an
    .npz, a folder of them, or "random")."""
    loaded = OnnxModel.load(model)
    loaded.check_save_target(output)
    result = CastPass(precision=precision, keep_ops=keep_ops, keep_nodes=keep_nodes, keep_io=keep_io)(loaded)
    if data is None:
        return CastOutcome(loaded.save(output), precision, result.report, result.modified, None, None)
    # The check runs on a copy in a temporary folder, so a model that fails it leaves nothing written at OUTPUT.
    final = Path(output).resolve()
    with temporary_folder_beside(final) as scratch:
        candidate = loaded.save(scratch / final.name)
        try:
            upcast_reason = _upcast_reason(loaded.proto, candidate, precision)
            comparison = _check(model, candidate, data, precision, upcast_reason, outputs)
        except Error as error:  # name the user's output, never the temporary copy
            raise type(error)(str(error).replace(str(candidate), str(final))) from error
    path = loaded.save(final)
    return CastOutcome(path, precision, result.report, result.modified, comparison, upcast_reason)


def _check(
    model: str | Path,
    candidate: Path,
    data: str | Path,
    precision: str,
    upcast_reason: str | None,
    outputs: Sequence[str] | None,
):
    if upcast_reason is None:
        return compare_models(model, candidate, data, outputs=outputs)
    with temporary_folder_beside(candidate) as folder:
        emulated = Path(folder) / candidate.name
        # The cast model's tensors are all inline (casting rewrites them), except fp32 ones it left external.
        proto = onnx.load(str(candidate), load_external_data=True)
        onnx.save(upcast_for_cpu(proto, precision), str(emulated))
        return compare_models(model, emulated, data, outputs=outputs)


def _upcast_reason(cast_proto: onnx.ModelProto, path: Path, precision: str) -> str | None:
    if precision == "bf16":
        return "ONNX Runtime has no CPU kernels for bf16 compute"
    low_inputs = [v.name for v in cast_proto.graph.input if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16]
    if low_inputs:
        return f"the cast model takes fp16 inputs ({', '.join(low_inputs[:3])}); the reference takes fp32"
    try:
        with OnnxRuntimeRunner(path, quiet=True):
            pass
    except InputError as error:  # chained to ORT's NotImplemented/Fail subclasses for missing kernels
        first = first_line(error.__cause__ or error)
        first = first.replace(str(path), path.name)  # ORT names the scratch copy; cut before the path is cut
        if "NOT_IMPLEMENTED" in first or "implementation" in first:
            return f"ONNX Runtime has no CPU kernel for an op of this model in {precision} ({first[:120]})"
        raise InputError(
            f"{path}: ONNX Runtime cannot run the cast model to check it ({first[:160]}); "
            f"pass --no-check to write it unchecked"
        ) from error
    return None
