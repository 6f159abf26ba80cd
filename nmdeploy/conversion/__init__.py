"""Calibrated N:M conversion: calibration data, statistics, fitting methods, recovery and the fidelity budget.

``ConvertPass(ConvertOptions(...))`` is the one entry point (:mod:`.convert`); the names below are imported on first
use, so importing the package loads neither torch nor ONNX Runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nmdeploy.imports import lazy_exports

if TYPE_CHECKING:
    from nmdeploy.conversion.convert import ConvertOptions, ConvertPass
    from nmdeploy.calibration.data import CalibrationData
    from nmdeploy.conversion.methods import FittingMethod, register_method

_LAZY: dict[str, str] = {
    "CalibrationData": "nmdeploy.calibration.data",
    "ConvertOptions": "convert",
    "ConvertPass": "convert",
    "FittingMethod": "methods",
    "register_method": "methods",
}

__all__ = ["CalibrationData", "ConvertOptions", "ConvertPass", "FittingMethod", "register_method"]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
