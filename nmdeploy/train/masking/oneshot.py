"""The first masks of a pretrained model, before sparse fine-tuning: magnitude, or SparseGPT from calibration data.

``init="sparsegpt"`` prunes layer by layer in the order the model runs them. For each layer a forward pre-hook
accumulates the second moments ``H = X^T X`` of its GEMM input over the calibration batches (a convolution's input
unfolded, input channels fastest), :func:`nmdeploy.masks.sparsegpt` chooses the N:M mask and updates the kept
weights, and the pruned weight is written back before the next layer is measured, so later layers see the outputs
of the pruned ones (SparseGPT's sequential scheme). Only one layer's statistics exist at a time: the memory is one
``[K, K]`` matrix plus what the model's own forward needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from nmdeploy.errors import InputError, first_line
from nmdeploy.masks import Pattern, nm_mask, sparsegpt
from nmdeploy.train.masking.backward import conv_padding

INITS = ("magnitude", "sparsegpt")
"""How the first masks are chosen: by weight magnitude (no data), or by SparseGPT on calibration batches."""

Forward = Callable[[nn.Module, Any], Any]


def call_model(model: nn.Module, batch: Any) -> Any:
    """Run one calibration batch: a mapping as keyword arguments (a tokenizer's output), a tuple or list as
    positional arguments, anything else as the one argument."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple | list):
        return model(*batch)
    return model(batch)


@dataclass(frozen=True)
class Target:
    """One weight to prune: ``module.<attribute>``, named ``name``; ``allowed`` limits the support (or None)."""

    name: str
    module: nn.Module
    attribute: str
    allowed: torch.Tensor | None = None


def _kernel_matrix(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in, *kernel]`` -> ``[out, kernel positions * in]`` with input channels fastest, so groups of M along
    the columns are groups of M input channels at one kernel position (the layout every mask here follows)."""
    return weight.movedim(1, -1).reshape(weight.shape[0], -1)


def _from_kernel_matrix(matrix: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    moved = (shape[0], *shape[2:], shape[1])
    return matrix.reshape(moved).movedim(-1, 1)


def _unsupported(module: nn.Module, attribute: str) -> str | None:
    """Why the layer's GEMM input cannot be observed by a forward pre-hook, or None."""
    if attribute != "weight":
        return "an attention projection read inside nn.MultiheadAttention; magnitude mask"
    if isinstance(module, nn.Linear):
        return None
    if isinstance(module, nn.Conv1d | nn.Conv2d):
        if module.groups != 1:
            return f"grouped convolution (groups={module.groups}); magnitude mask"
        if module.padding_mode != "zeros":
            return f"padding_mode={module.padding_mode!r}; magnitude mask"
        if isinstance(conv_padding(module), str):
            return "asymmetric 'same' padding; magnitude mask"
        return None
    return f"{type(module).__name__} is not a Linear or Conv layer; magnitude mask"


def _gemm_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows ``X`` [samples, K] the layer's GEMM multiplies by its kernel matrix (see :func:`_kernel_matrix`)."""
    if isinstance(module, nn.Linear):
        return x.reshape(-1, x.shape[-1])
    two_d = isinstance(module, nn.Conv2d)
    image = x if two_d else x.unsqueeze(-2)
    if image.ndim == 3:  # an unbatched input
        image = image.unsqueeze(0)
    kernel = module.kernel_size if two_d else (1, *module.kernel_size)
    padding = conv_padding(module)
    padding = padding if two_d else (0, *padding)
    stride = module.stride if two_d else (1, *module.stride)
    dilation = module.dilation if two_d else (1, *module.dilation)
    columns = functional.unfold(image, kernel, dilation=dilation, padding=padding, stride=stride)
    batch, channels = image.shape[0], image.shape[1]
    positions = math.prod(kernel)
    # unfold orders a column (channel, kernel position); the kernel matrix wants (kernel position, channel)
    return columns.view(batch, channels, positions, -1).permute(0, 3, 2, 1).reshape(-1, positions * channels)


class _Moments:
    """``X^T X`` of one layer's GEMM input, accumulated over calls (float32, on the weight's device)."""

    def __init__(self, module: nn.Module, size: int, device: torch.device) -> None:
        self.module = module
        self.hessian = torch.zeros(size, size, dtype=torch.float32, device=device)
        self.rows = 0

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        rows = _gemm_rows(self.module, args[0].detach()).to(torch.float32)
        self.hessian.addmm_(rows.T, rows)
        self.rows += rows.shape[0]


def _as_batches(calibration: Iterable[Any] | None) -> list[Any] | Iterable[Any]:
    if calibration is None:
        raise InputError("init='sparsegpt' needs calibration batches: sparsify(..., calibration=batches)")
    if iter(calibration) is calibration:  # a generator or iterator can be read once; every layer reads it again
        calibration = list(calibration)
    return calibration


def _run(model: nn.Module, batches: Iterable[Any], forward: Forward) -> int:
    count = 0
    for batch in batches:
        try:
            forward(model, batch)
        except InputError:
            raise
        except Exception as error:  # the user's model on the user's batches
            message = f"calibration: the model fails on calibration batch {count} ({first_line(error)[:200]})"
            raise InputError(message) from None
        count += 1
    if not count:
        raise InputError("calibration: no batches; give at least one batch the model accepts")
    return count


def _execution_order(model: nn.Module, targets: list[Target], batches: Iterable[Any], forward: Forward) -> list[Target]:
    """The targets in the order the model first calls them; the uncalled ones last. Every batch runs once here,
    before any weight changes, so a batch the model rejects leaves the model as it was."""
    order: dict[int, int] = {}
    handles = []
    for index, target in enumerate(targets):

        def seen(module: nn.Module, args: tuple[Any, ...], index: int = index) -> None:
            order.setdefault(index, len(order))

        handles.append(target.module.register_forward_pre_hook(seen))
    try:
        _run(model, batches, forward)
    finally:
        for handle in handles:
            handle.remove()
    ranked = sorted(range(len(targets)), key=lambda index: order.get(index, len(targets)))
    return [targets[index] for index in ranked]


@torch.no_grad()
def sparsegpt_masks(
    model: nn.Module,
    targets: list[Target],
    pattern: Pattern,
    calibration: Iterable[Any] | None,
    *,
    forward: Forward = call_model,
    damping: float = 0.01,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Prune ``targets`` in place with SparseGPT, one layer at a time in execution order.

    Returns ``(masks, fallbacks)``: the N:M mask of every pruned layer (the layers' weights now hold SparseGPT's
    result: pruned entries 0, kept ones updated), and for the layers it could not measure the reason they got a
    magnitude mask instead (their weights unchanged).
    """
    batches = _as_batches(calibration)
    was_training = model.training
    model.eval()
    masks: dict[str, torch.Tensor] = {}
    fallbacks: dict[str, str] = {}
    try:
        measurable = []
        for target in targets:
            reason = _unsupported(target.module, target.attribute)
            if reason is None:
                measurable.append(target)
            else:
                fallbacks[target.name] = reason
        ordered = _execution_order(model, measurable, batches, forward)
        for target in ordered:
            weight = getattr(target.module, target.attribute)
            matrix = _kernel_matrix(weight.detach())
            moments = _Moments(target.module, matrix.shape[1], weight.device)
            handle = target.module.register_forward_pre_hook(moments)
            try:
                _run(model, batches, forward)
            finally:
                handle.remove()
            if not moments.rows:
                fallbacks[target.name] = "never called on the calibration batches; magnitude mask"
                continue
            allowed = None if target.allowed is None else _kernel_matrix(target.allowed)
            pruned = sparsegpt(matrix, moments.hessian, pattern.n, pattern.m, damping=damping, allowed=allowed)
            del moments
            # SparseGPT keeps N per group, some perhaps exactly 0: the top N magnitudes hold every non-zero.
            keep = nm_mask(pruned.abs().float(), pattern, axis=1) if allowed is None else allowed
            weight.copy_(_from_kernel_matrix(pruned, weight.shape).to(weight.dtype))
            masks[target.name] = _from_kernel_matrix(keep, weight.shape)
    finally:
        model.train(was_training)
    return masks, fallbacks
