"""Calibrated N:M conversion as users ask for it: the fit, recovery after it and the budgets around it; recipes.

``Conversion(ConversionOptions(...))`` is the one controller (:mod:`.controller`), for ``convert``, the pipeline
and recipes alike: it runs the leaf fit (:class:`nmdeploy.passes.convert.ConvertPass`) on the calibration data
(:mod:`nmdeploy.calibration`) through one of its strategies: the precision budget (:mod:`.precision_budget`), the
fidelity budget (:mod:`.budget`), or the fit with recovery after it when asked (:mod:`.recovery`). The names
below are imported on first use, so importing the package loads neither torch nor ONNX Runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nmdeploy.imports import lazy_exports

if TYPE_CHECKING:
    from nmdeploy.conversion.controller import Conversion, ConversionOptions
    from nmdeploy.conversion.recipes import PASSES, load_recipe

_LAZY: dict[str, str] = {
    "Conversion": "controller",
    "ConversionOptions": "controller",
    "PASSES": "recipes",
    "load_recipe": "recipes",
}

__all__ = ["PASSES", "Conversion", "ConversionOptions", "load_recipe"]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
