"""Quantization grids for weights: the rounding onto INT8 or FP8 E4M3 values with symmetric per-output-row scales,
in torch so that the fitting sweep (:func:`nmdeploy.masks.reconstruct.sparsegpt_fit`'s ``round_kept``) rounds each
column as it visits it. The numbers are those of the Q/DQ pairs a quantized model stores: INT8 rounded half to even
and clipped to [-127, 127], FP8 clipped to +-448 and rounded to nearest even; zero stays zero."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nmdeploy.errors import InputError

GRID_MAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}


def grid_rounding(scales: torch.Tensor, precision: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function rounding a column (one value per row, any float dtype) onto the grid of per-row ``scales``."""
    limit = GRID_MAX[check_precision(precision)]

    def round_column(column: torch.Tensor) -> torch.Tensor:
        # float32 division, as the stored Q/DQ computes it, so the rounded value is the one the model will hold.
        scale = scales.to(column.device)
        scaled = (column.to(torch.float32) / scale).clamp(-limit, limit)
        # INT8: half to even; FP8: the cast rounds to the nearest E4M3 value.
        grid = torch.round(scaled) if precision == "int8" else scaled.to(torch.float8_e4m3fn).to(torch.float32)
        return (grid * scale).to(column.dtype)

    return round_column


def round_to_grid(matrix: torch.Tensor, scales: torch.Tensor, precision: str) -> torch.Tensor:
    """Every entry of ``matrix`` [out, K] rounded to the nearest value of its row's grid (no error feedback)."""
    return grid_rounding(scales, precision)(matrix.T).T


def check_precision(precision: str) -> str:
    """``precision`` when it names a grid here, else an InputError listing them."""
    if precision not in GRID_MAX:
        raise InputError(f"unsupported precision {precision!r}; choose one of {', '.join(GRID_MAX)}")
    return precision
