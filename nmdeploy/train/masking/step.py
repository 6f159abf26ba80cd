"""``STEPAdam``: Adam for method ``step`` (Lu et al., ICML 2023), whose second-moment estimate freezes when masks
start.

SR-STE under Adam loses accuracy because the mask's changes keep disturbing the second moment. STEP trains dense
first (the "precondition" phase) until the estimate settles, then freezes it and learns masks. Here the switch is
either given (``switch_step``) or found from the estimate itself: every ``switch_every`` steps the bias-corrected
estimate is compared with the last snapshot, and once ``|v - v_prev|_1 / |v_prev|_1 <= switch_tolerance`` (after
``min_dense_steps``, at the latest at ``max_dense_steps``) the optimiser freezes it and tells the sparsifier.

Update rule, with ``g`` the gradient (plus ``weight_decay * w``, as torch's Adam), ``t`` the step:
``m = b1 m + (1 - b1) g``; dense phase ``v = b2 v + (1 - b2) g^2``, ``w -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t))
+ eps)``, identical to ``torch.optim.Adam``; after the switch at ``T`` the denominator is ``sqrt(v_T / (1 - b2^T)) +
eps`` for good.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nmdeploy.errors import InputError
from nmdeploy.train.masking.methods import STEP, STEPOptions
from nmdeploy.train.masking.sparsify import Sparsifier


class STEPAdam(torch.optim.Optimizer):
    """Adam that freezes its second moment at STEP's switch and then starts the sparsifier's masks."""

    def __init__(
        self,
        params: Iterable[Any],
        sparsifier: Sparsifier,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        rule = next((layer.options for layer in sparsifier.layers.values() if isinstance(layer, STEP)), None)
        if rule is None:
            raise InputError("STEPAdam drives method 'step': sparsify the model with method='step' first")
        assert isinstance(rule, STEPOptions)
        if not (lr > 0 and eps >= 0 and weight_decay >= 0 and all(0 <= beta < 1 for beta in betas)):
            raise InputError(f"STEPAdam: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.sparsifier = sparsifier
        self.rule = rule
        for group in self.param_groups:
            group.setdefault("step", 0)
            group.setdefault("switched_at", None)
        self.last_change: float | None = None
        """The relative change of the second moment at the last check (for logs and benchmarks)."""

    @property
    def switched_at(self) -> int | None:
        """The step at which the second moment froze, or None while dense."""
        return self.param_groups[0]["switched_at"]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        frozen = self.switched_at is not None
        step = self.param_groups[0]["step"] + 1
        for group in self.param_groups:
            group["step"] = step
            self._update(group, step, frozen)
        if not frozen and self._due(step):
            for group in self.param_groups:
                group["switched_at"] = step
            for state in self.state.values():
                state.pop("snapshot", None)
            self.sparsifier.begin_masks(step)
        return loss

    def _update(self, group: dict[str, Any], step: int, frozen: bool) -> None:
        beta1, beta2 = group["betas"]
        for parameter in group["params"]:
            if parameter.grad is None:
                continue
            grad = parameter.grad
            if group["weight_decay"]:
                grad = grad.add(parameter, alpha=group["weight_decay"])
            state = self.state[parameter]
            if not state:
                state["exp_avg"] = torch.zeros_like(parameter)
                state["exp_avg_sq"] = torch.zeros_like(parameter)
            state["exp_avg"].lerp_(grad, 1 - beta1)
            if frozen:
                corrected = state["exp_avg_sq"] / (1 - beta2 ** group["switched_at"])
            else:
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                corrected = state["exp_avg_sq"] / (1 - beta2**step)
            denominator = corrected.sqrt_().add_(group["eps"])
            parameter.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / (1 - beta1**step))

    def _due(self, step: int) -> bool:
        """Whether the dense phase ends at ``step``: given, or the second moment has settled."""
        rule = self.rule
        if rule.switch_step is not None:
            return step >= rule.switch_step
        if rule.max_dense_steps is not None and step >= rule.max_dense_steps:
            return True
        if step % rule.switch_every:
            return False
        change = total = 0.0
        for group in self.param_groups:
            correction = 1 - group["betas"][1] ** step
            for parameter in group["params"]:
                state = self.state.get(parameter)
                if not state:
                    continue
                current = state["exp_avg_sq"] / correction
                previous = state.get("snapshot")
                if previous is not None:
                    change += float((current - previous).abs().sum())
                    total += float(previous.abs().sum())
                state["snapshot"] = current
        self.last_change = change / total if total else None
        return (
            step >= rule.min_dense_steps and self.last_change is not None and self.last_change <= rule.switch_tolerance
        )
