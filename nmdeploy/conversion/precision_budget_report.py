"""What the precision budget reports: each layer's options and choice, the outcome, and the result it returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from nmdeploy.fidelity import Figure
from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes.base import PassResult, ReportRow

if TYPE_CHECKING:
    from nmdeploy.conversion.recovery import RecoveryReport


@dataclass
class LayerChoice:
    """One weighted layer's options (predicted fidelity loss of each, measured alone on the held-out rows), the
    one chosen and why."""

    weight: str
    node: str
    share: float  # the layer's share of the model's multiply-adds per sample (weights x output positions)
    choice: str  # "2:4 + INT8", "dense INT8", "2:4 fp16" or "dense fp16" (FP8 in place of INT8 for --precision fp8)
    reason: str
    losses: dict[str, float] = field(default_factory=dict)  # option -> fidelity lost (2:4 + INT8: the sum, predicted)
    speed_ups: dict[str, float] = field(default_factory=dict)  # option -> expected speed-up over dense fp16

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PrecisionBudgetReport(ReportRow):
    """The budget's outcome: the held-out fidelity measured on exactly the written model, every layer's choice and
    each verified attempt."""

    step: str = field(default="precision-budget", init=False)
    min_fidelity: float = 0.0
    metric: str = "auto"
    precision: str = "int8"
    fidelity: float = 0.0
    fidelity_bound: float | None = None  # its lower confidence bound, what the floor was checked against
    bound_note: str = ""  # why there is no bound, or what it was drawn over where not rows
    predicted: float = 0.0
    held_out_rows: int = 0
    expected_speed_up: float = 1.0  # over dense fp16, weighted by each layer's share of the multiply-adds
    layers: list[LayerChoice] = field(default_factory=list)
    attempts: list[dict[str, Any]] = field(default_factory=list)
    judged: list[Figure] = field(default_factory=list)  # each judged output's figure for the written model
    recovery: RecoveryReport | None = None  # the written mix's recovery (its 2:4 layers, before quantization)

    def to_json(self) -> dict[str, Any]:
        kept = [name for name in self.__dataclass_fields__ if name not in ("layers", "judged", "recovery")]
        document = {name: getattr(self, name) for name in kept}
        judged = [figure.to_json() for figure in self.judged]
        document |= {"judged": judged, "layers": [layer.to_json() for layer in self.layers]}
        return document | ({"recovery": self.recovery.to_json()} if self.recovery is not None else {})


@dataclass
class PrecisionBudgetResult(PassResult):
    """The precision budget's result: the written Q/DQ ``model`` and ``unquantized``, the same mix before
    quantization (the dense model with the chosen 2:4 layers fitted, and recovered when asked): the floating-point
    2:4 model that was quantized."""

    unquantized: OnnxModel | None = None


def option_label(sparse: bool, quantized: bool, precision: str) -> str:
    """ "2:4 + INT8", "dense INT8", "2:4 fp16" or "dense fp16" (fp16: left in floating point for the engine)."""
    if sparse and quantized:
        return f"2:4 + {precision.upper()}"
    return f"{'2:4' if sparse else 'dense'} {precision.upper() if quantized else 'fp16'}"
