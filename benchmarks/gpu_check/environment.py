"""Section ``environment``: device, capability, torch/CUDA/cuSPARSELt versions, the semi-structured backends' shape
rules."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform

from gpu_check.common import progress
from gpu_check.runner import Run, on_cuda


def environment_section(run: Run, record: dict) -> None:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
        "tomlkit_importable": importlib.util.find_spec("tomlkit") is not None,
    }
    if on_cuda(run):
        properties = torch.cuda.get_device_properties(0)
        info.update(
            device=torch.cuda.get_device_name(0),
            capability=list(torch.cuda.get_device_capability(0)),
            memory_gb=round(properties.total_memory / 2**30, 1),
            multiprocessors=properties.multi_processor_count,
        )
        with contextlib.suppress(Exception):
            info["cusparselt_available"] = bool(torch.backends.cusparselt.is_available())
            info["cusparselt_version"] = torch.backends.cusparselt.version()
    from torch.sparse import SparseSemiStructuredTensor
    from torch.sparse.semi_structured import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    info["force_cutlass_default"] = bool(SparseSemiStructuredTensor._FORCE_CUTLASS)
    # What this torch offers for 2:4 training and tuning (names change between releases).
    info["api"] = {
        "torch._sparse_semi_structured_tile": hasattr(torch, "_sparse_semi_structured_tile"),
        "torch._cslt_sparse_mm": hasattr(torch, "_cslt_sparse_mm"),
        "torch._cslt_sparse_mm_search": hasattr(torch, "_cslt_sparse_mm_search"),
        "prune_dense_static_sort": hasattr(SparseSemiStructuredTensorCUSPARSELT, "prune_dense_static_sort"),
        "_FUSE_TRANSPOSE": getattr(SparseSemiStructuredTensor, "_FUSE_TRANSPOSE", None),
        "torch._int_mm": hasattr(torch, "_int_mm"),
    }
    info["shape_rules"] = {
        backend.__name__: {
            str(dtype).removeprefix("torch."): {
                "sparse_min_rows": config.sparse_min_rows,
                "sparse_min_cols": config.sparse_min_cols,
                "dense_min_rows": config.dense_min_rows,
                "dense_min_cols": config.dense_min_cols,
            }
            for dtype, config in backend._DTYPE_SHAPE_CONSTRAINTS.items()
        }
        for backend in (SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS)
    }
    record["result"] = info
    run.results["device"] = info.get("device", platform.processor() or platform.machine())
    progress(f"environment: {run.results['device']}, torch {info['torch']}, CUDA {info['cuda']}")
