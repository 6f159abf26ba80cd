"""The first masks of a pretrained model, before sparse fine-tuning: magnitude, or SparseGPT from calibration data.

``init="sparsegpt"`` prunes layer by layer in the order the model runs them. For each layer a forward pre-hook
accumulates the second moments ``H = X^T X`` of its GEMM input over the calibration batches (a convolution's input
unfolded, input channels fastest), the ``sparsegpt`` fitting method of :mod:`nmdeploy.masks.fitting` (the one
``nmdeploy convert`` runs) chooses the N:M mask and updates the kept weights, and the pruned weight is written back
before the next layer is measured, so later layers see the outputs of the pruned ones (SparseGPT's sequential
scheme). Only one layer's statistics exist at a time: the memory is one ``[K, K]`` matrix plus what the model's own
forward needs. ``nn.MultiheadAttention`` multiplies its projection weights itself; its inputs are observed through
the attention forward of :mod:`nmdeploy.train.masking.attention`.
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
from nmdeploy.masks import Pattern, nm_mask
from nmdeploy.masks.fitting import LayerFit, fitting_method
from nmdeploy.train.masking.attention import (
    AttentionForward,
    install_attention,
    uninstall_attention,
    unsupported_attention,
)
from nmdeploy.train.masking.backward import conv_padding

INITS = ("magnitude", "sparsegpt")
"""How the first masks are chosen: by weight magnitude (no data), or by SparseGPT on calibration batches. Not a copy
of the fitting methods' registry (:mod:`nmdeploy.masks.fitting`): ``magnitude`` is each training method's own
data-free start, and ``sparsegpt`` the one sequential start below, which runs that registry's ``sparsegpt`` method;
the registry's other methods (wanda, refit, ...) have no start here."""

Forward = Callable[[nn.Module, Any], Any]
_FUSED = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


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
    reader: nn.MultiheadAttention | None = None
    """The attention module that multiplies this weight itself (its projections and ``out_proj``), or None."""


def _kernel_matrix(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in, *kernel]`` -> ``[out, kernel positions * in]`` with input channels fastest, so groups of M along
    the columns are groups of M input channels at one kernel position (the layout every mask here follows)."""
    return weight.movedim(1, -1).reshape(weight.shape[0], -1)


def _from_kernel_matrix(matrix: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    moved = (shape[0], *shape[2:], shape[1])
    return matrix.reshape(moved).movedim(-1, 1)


def _unsupported(target: Target) -> str | None:
    """Why the layer's GEMM input cannot be observed, or None."""
    module = target.module
    if target.reader is not None:
        reason = unsupported_attention(target.reader)
        return None if reason is None else f"{reason}; magnitude mask"
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
    """``X^T X`` of one layer's GEMM inputs, accumulated over calls (float32, on the weight's device); one matrix
    per block of the weight's rows that meets its own input (the query, key and value rows of a packed attention
    projection in cross-attention), else one for all rows."""

    def __init__(self, target: Target, size: int, device: torch.device) -> None:
        self.target = target
        self.size, self.device = size, device
        self.hessians: dict[tuple[int, int] | None, torch.Tensor] = {}
        self.rows = 0

    def add(self, rows: torch.Tensor, block: tuple[int, int] | None = None) -> None:
        rows = rows.detach().reshape(-1, self.size).to(torch.float32)
        if block not in self.hessians:
            self.hessians[block] = torch.zeros(self.size, self.size, dtype=torch.float32, device=self.device)
        self.hessians[block].addmm_(rows.T, rows)
        self.rows += rows.shape[0]

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self.add(_gemm_rows(module, args[0]))

    def observe(self, name: str, input: torch.Tensor, rows: slice | None) -> None:
        wanted = "out_proj" if self.target.attribute == "weight" else self.target.attribute
        if name == wanted:
            self.add(input, None if rows is None else (rows.start, rows.stop))

    def attach(self) -> Callable[[], None]:
        """Start observing the layer's inputs; returns what stops it."""
        reader = self.target.reader
        if reader is None:
            return self.target.module.register_forward_pre_hook(self).remove
        install_attention(reader, AttentionForward(reader, {}, None, observe=self.observe))
        return lambda: uninstall_attention(reader)


def _as_batches(calibration: Iterable[Any] | None) -> list[Any] | Iterable[Any]:
    if calibration is None:
        raise InputError("init='sparsegpt' needs calibration batches: sparsify(..., calibration=batches)")
    if iter(calibration) is calibration:  # a generator or iterator can be read once; every layer reads it again
        calibration = list(calibration)
    return calibration


def _run(model: nn.Module, batches: Iterable[Any], forward: Forward) -> int:
    # Without gradients torch's transformer layers may take fused fast paths that call neither their Linear
    # modules nor the attention's forward, so the hooks would see nothing: gradients stay enabled (eval mode still).
    fused = any(isinstance(module, _FUSED) for module in model.modules())
    count = 0
    for batch in batches:
        try:
            with torch.set_grad_enabled(fused):
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

        called = target.module if target.reader is None else target.reader  # an attention module runs them all
        handles.append(called.register_forward_pre_hook(seen))
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
            reason = _unsupported(target)
            if reason is None:
                measurable.append(target)
            else:
                fallbacks[target.name] = reason
        ordered = _execution_order(model, measurable, batches, forward)
        for target in ordered:
            weight = getattr(target.module, target.attribute)
            matrix = _kernel_matrix(weight.detach())
            moments = _Moments(target, matrix.shape[1], weight.device)
            detach = moments.attach()
            try:
                _run(model, batches, forward)
            finally:
                detach()
            if not moments.rows:
                fallbacks[target.name] = "never called on the calibration batches; magnitude mask"
                continue
            allowed = None if target.allowed is None else _kernel_matrix(target.allowed)
            pruned = _prune(matrix, moments.hessians, pattern, damping, allowed)
            del moments
            # SparseGPT keeps N per group, some perhaps exactly 0: the top N magnitudes hold every non-zero.
            keep = nm_mask(pruned.abs().float(), pattern, axis=1) if allowed is None else allowed
            weight.copy_(_from_kernel_matrix(pruned, weight.shape).to(weight.dtype))
            masks[target.name] = _from_kernel_matrix(keep, weight.shape)
    finally:
        model.train(was_training)
    return masks, fallbacks


def _prune(
    matrix: torch.Tensor,
    hessians: Mapping[tuple[int, int] | None, torch.Tensor],
    pattern: Pattern,
    damping: float,
    allowed: torch.Tensor | None,
) -> torch.Tensor:
    """SparseGPT on every block of rows with the moments of the inputs those rows met (rows are independent given
    H): ``None`` holds inputs every row met, a ``(start, stop)`` block those only its rows met. Rows no input
    reached keep the magnitude mask."""
    shared = hessians.get(None)
    blocks = [block for block in hessians if block is not None]
    if shared is not None:
        pruned = _fit(matrix, shared, pattern, damping, allowed)
    else:
        pruned = matrix * (nm_mask(matrix, pattern, axis=1) if allowed is None else allowed)
    for start, stop in blocks:
        hessian = hessians[(start, stop)] if shared is None else hessians[(start, stop)] + shared
        block_allowed = None if allowed is None else allowed[start:stop]
        pruned[start:stop] = _fit(matrix[start:stop], hessian, pattern, damping, block_allowed)
    return pruned


def _fit(
    matrix: torch.Tensor, hessian: torch.Tensor, pattern: Pattern, damping: float, allowed: torch.Tensor | None
) -> torch.Tensor:
    """SparseGPT through the fitting methods' registry: mask and kept values chosen together, within ``allowed``
    (None: anywhere)."""
    support = torch.ones_like(matrix, dtype=torch.bool) if allowed is None else allowed
    return fitting_method("sparsegpt").fit(LayerFit(matrix, support, hessian, pattern, damping))
