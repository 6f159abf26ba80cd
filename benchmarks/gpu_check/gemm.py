"""Section ``gemm``: dense against 2:4 ``F.linear`` per eligible layer shape, in every dtype and backend torch offers,
timed with CUDA events (and CUDA graph replay); ``gemm.md`` from :mod:`gpu_check.report`."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpu_check.common import progress
from gpu_check.plan import build_plan
from gpu_check.report import gemm_table, layer_wins
from gpu_check.runner import Run, SectionTimeout, on_cuda
from gpu_check.timing import graphed, time_call


def two_four_mask(rows: int, cols: int, device) -> object:
    """A 2:4 mask along columns that is 2:4 along rows too (each 4x4 tile keeps a band of two diagonals), so a
    weight and its transpose both compress; timing does not depend on which positions are kept."""
    import torch

    r = torch.arange(rows, device=device).unsqueeze(1) % 4
    c = torch.arange(cols, device=device).unsqueeze(0) % 4
    return (c - r) % 4 < 2


def _padded(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


@dataclass
class GemmCase:
    """One weight shape in one dtype and backend: the dense weight, its compressed copy, the padding it needed."""

    out: int
    inp: int
    dtype: str
    backend: str
    padded: tuple[int, int]
    weight: object
    sparse: object
    emulated: bool


def gemm_case(out: int, inp: int, dtype_name: str, backend: str, device: str) -> GemmCase:
    """Random 2:4 weight [out, in] padded up to the backend's tile; compressed with to_sparse_semi_structured
    (on the CPU, where no kernel exists, the masked dense weight stands in: emulated)."""
    import torch
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured
    from torch.sparse.semi_structured import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    dtype = getattr(torch, dtype_name)
    kernel = SparseSemiStructuredTensorCUTLASS if backend == "cutlass" else SparseSemiStructuredTensorCUSPARSELT
    rule = kernel._DTYPE_SHAPE_CONSTRAINTS.get(dtype)
    if rule is None:
        raise NotImplementedError(f"{kernel.__name__} has no {dtype_name} kernels in torch {torch.__version__}")
    rows, cols = _padded(out, rule.sparse_min_rows), _padded(inp, rule.sparse_min_cols)
    generator = torch.Generator(device=device).manual_seed(0)
    if dtype == torch.int8:
        weight = torch.randint(-100, 100, (rows, cols), generator=generator, device=device, dtype=torch.int8)
    else:
        weight = torch.randn(rows, cols, generator=generator, device=device).to(dtype)
    weight = weight * two_four_mask(rows, cols, device).to(weight.dtype)
    emulated = not device.startswith("cuda")
    if emulated:
        sparse = weight
    else:
        previous = SparseSemiStructuredTensor._FORCE_CUTLASS
        SparseSemiStructuredTensor._FORCE_CUTLASS = backend == "cutlass"
        try:
            sparse = to_sparse_semi_structured(weight)
        finally:
            SparseSemiStructuredTensor._FORCE_CUTLASS = previous
    return GemmCase(out, inp, dtype_name, backend, (rows, cols), weight, sparse, emulated)


def measure_gemm(case: GemmCase, rows: int, device: str, check: bool) -> dict:
    """Dense ``F.linear(x, W)`` against the 2:4 one for ``rows`` input rows: milliseconds and the speed-up. int8's
    dense product is ``torch._int_mm`` (int32 out; it needs more than 16 rows, so fewer are padded to 32)."""
    import torch
    from torch.nn import functional

    cuda = device.startswith("cuda")
    columns = case.padded[1]
    entry: dict = {"out": case.out, "in": case.inp, "rows": rows, "dtype": case.dtype, "backend": case.backend}
    if case.padded != (case.out, case.inp):
        entry["padded_to"] = list(case.padded)
    if case.emulated:
        entry["emulated"] = "masked dense product (no semi-structured kernel off CUDA)"
    else:
        entry["tensor"] = type(case.sparse).__name__  # the backend torch actually chose
    generator = torch.Generator(device=device).manual_seed(1)
    if case.dtype == "int8":
        x = torch.randint(-100, 100, (rows, columns), generator=generator, device=device, dtype=torch.int8)
        dense_rows = max(rows, 32)
        x_dense = x if dense_rows == rows else torch.nn.functional.pad(x, (0, 0, 0, dense_rows - rows))
        weight_t = case.weight.t()
        if dense_rows != rows:
            entry["dense_rows_padded_to"] = dense_rows
        if cuda:
            contiguous = weight_t.contiguous()
            dense_tries = [
                ("torch._int_mm", lambda: torch._int_mm(x_dense, weight_t)),
                ("torch._int_mm, contiguous weight^T", lambda: torch._int_mm(x_dense, contiguous)),
            ]
            dense = first_working(dense_tries, entry, "int8_dense_call")
            sparse = first_working(int8_sparse_tries(x, case), entry, "int8_call")
        else:
            dense = lambda: x_dense.float() @ weight_t.float()  # noqa: E731
            sparse = lambda: x.float() @ case.weight.t().float()  # noqa: E731
    else:
        x = torch.randn(rows, columns, generator=generator, device=device).to(getattr(torch, case.dtype))
        weight, compressed = case.weight, case.sparse
        dense = lambda: functional.linear(x, weight)  # noqa: E731
        sparse = lambda: functional.linear(x, compressed)  # noqa: E731
    result = sparse() if check else None
    if result is not None and result.dtype == torch.int8:
        entry["not_checked"] = "int8 output saturates; compared only where the product gives int32 or bf16"
    elif result is not None:
        reference = dense().float()[:rows]
        result = result.float()[:rows]
        scale = reference.abs().max().clamp(min=1e-6)
        entry["max_error_relative"] = float(((result - reference).abs().max() / scale).item())
    entry["dense_eager_ms"] = time_call(dense, cuda)
    entry["sparse_eager_ms"] = time_call(sparse, cuda)
    entry["speedup_eager"] = entry["dense_eager_ms"] / entry["sparse_eager_ms"]
    entry["dense_ms"], entry["sparse_ms"] = entry["dense_eager_ms"], entry["sparse_eager_ms"]
    if cuda:
        # Eager calls of the semi-structured tensor pay its Python dispatch and cuSPARSELt's plan on the host at
        # every call (about 0.7 ms, more than the kernel of most layers here); a CUDA graph replays the kernels alone,
        # as a compiled or graph-captured deployment runs them.
        try:
            entry["dense_ms"] = time_call(graphed(dense), cuda)
            entry["sparse_ms"] = time_call(graphed(sparse), cuda)
            entry["timed"] = "CUDA graph replay"
        except Exception as error:
            entry["dense_ms"], entry["sparse_ms"] = entry["dense_eager_ms"], entry["sparse_eager_ms"]
            entry["timed"] = f"eager (graph capture failed: {type(error).__name__}: {str(error)[:160]})"
    entry["speedup"] = entry["dense_ms"] / entry["sparse_ms"]
    entry["dense_tflops"] = 2 * rows * case.out * case.inp / entry["dense_ms"] / 1e9
    return entry


def int8_sparse_tries(x, case: GemmCase) -> list[tuple[str, Callable[[], object]]]:
    """The int8 2:4 products torch may offer: F.linear on the compressed weight (int8 out), cuSPARSELt's matmul
    with int32 or bf16 out."""
    import torch
    from torch.nn import functional

    tries = [("F.linear (int8 out)", lambda: functional.linear(x, case.sparse))]
    packed = getattr(case.sparse, "packed", None)
    if packed is not None and hasattr(torch, "_cslt_sparse_mm"):
        for out_dtype in (torch.int32, torch.bfloat16):
            label = f"torch._cslt_sparse_mm ({str(out_dtype).removeprefix('torch.')} out)"
            tries.append((label, lambda d=out_dtype: torch._cslt_sparse_mm(packed, x.t(), out_dtype=d).t()))
    return tries


def first_working(tries: list[tuple[str, Callable[[], object]]], entry: dict, key: str) -> Callable[[], object]:
    """The first call that runs (its label in ``entry[key]``, the failures before it beside); none: an error."""
    import torch

    failures = []
    for label, call in tries:
        try:
            call()
            torch.cuda.synchronize()
        except Exception as error:
            failures.append(f"{label}: {type(error).__name__}: {str(error)[:200]}")
            continue
        entry[key] = label
        if failures:
            entry[f"{key}_failed"] = failures
        return call
    raise RuntimeError(f"nothing ran for {key}: " + " | ".join(failures))


def gemm_section(run: Run, record: dict) -> None:
    import torch

    plan = build_plan(run.shapes, run.smoke)["gemm"]
    device = run.device
    record["result"] = result = {"measurements": [], "failed": [], "phases_done": [], "phases_skipped": []}
    deadline = time.perf_counter() + max(run.left() - 5, 0)
    section_limit = signal.getitimer(signal.ITIMER_REAL)[0]
    if section_limit:
        deadline = min(deadline, time.perf_counter() + section_limit - 3)
    capability = torch.cuda.get_device_capability() if on_cuda(run) else None
    for phase in plan["phases"]:
        label = f"{phase['dtype']} {phase['backend']} {phase['rows']} rows"
        if phase["backend"] == "cutlass" and capability is not None and capability[0] != 8:
            # torch's CUTLASS semi-structured kernels say "Supported only on GPUs with compute capability 8.x".
            result["phases_skipped"].append(f"{label}: CUTLASS 2:4 kernels need capability 8.x, not {capability}")
            continue
        failures_in_a_row = 0
        done = 0
        for shape in plan["shapes"]:
            rows = plan["rows"] if phase["rows"] == "plain" else ([] if run.smoke else shape["natural_rows"])
            if not rows:
                continue
            if time.perf_counter() > deadline:
                result["phases_skipped"].append(f"{label}: stopped at the section's time limit after {done} shapes")
                break
            try:
                case = gemm_case(shape["out"], shape["in"], phase["dtype"], phase["backend"], device)
                for index, count in enumerate(rows):
                    entry = measure_gemm(case, count, device, check=index == 0)
                    entry["layers"] = len(shape["layers"])
                    result["measurements"].append(entry)
                del case
                failures_in_a_row = 0
                done += 1
            except SectionTimeout:
                raise
            except Exception as error:
                failures_in_a_row += 1
                result["failed"].append({"out": shape["out"], "in": shape["in"], "phase": label,
                                         "error": f"{type(error).__name__}: {str(error)[:300]}"})  # fmt: skip
                if failures_in_a_row >= 3:
                    result["phases_skipped"].append(f"{label}: given up after three failing shapes in a row")
                    break
            finally:
                if on_cuda(run):
                    torch.cuda.empty_cache()
            run.save()
        else:
            result["phases_done"].append(label)
        progress(f"gemm: {label}: {done} shapes")
    result["table"] = gemm_table(result["measurements"], run.shapes)
    result["wins"] = layer_wins(result["measurements"], run.shapes)
    from nmdeploy.files import write_atomically

    write_atomically(run.out / "gemm.md", result["table"] + "\n")
    print(result["table"], flush=True)
