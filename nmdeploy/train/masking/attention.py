"""Masked backward passes for ``nn.MultiheadAttention``, whose forward reads its projection weights directly.

The module hands ``in_proj_weight`` (or ``q/k/v_proj_weight``) and ``out_proj.weight`` to
``F.multi_head_attention_forward``, which multiplies them itself: a parametrisation masks those reads, but a masked
backward has to own the matrix products, and the ``out_proj`` Linear's own forward never runs. So while gradients are
recorded, :class:`AttentionForward` replaces the module's forward with the same computation, term for term as torch
writes it, whose four projections run through the sparse layers' autograd function. Without gradients (evaluation,
export) the stock forward runs, fast path included, on the masked weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from nmdeploy.train.masking.backward import SparseBackward, _SparseLinearFunction

IN_PROJECTIONS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
"""The attention module's own projection weights (packed, or separate when key and value widths differ)."""


def attention_weights(module: nn.MultiheadAttention) -> tuple[str, ...]:
    """The module's projection weight attributes that exist (packed ``in_proj_weight`` or the three separate ones)."""
    return tuple(name for name in IN_PROJECTIONS if getattr(module, name, None) is not None)


def unsupported_attention(module: nn.MultiheadAttention) -> str | None:
    """Why the masked backward cannot own this module's projections, or None."""
    if type(module).forward is not nn.MultiheadAttention.forward:
        return f"{type(module).__name__} overrides MultiheadAttention.forward, which the masked backward would bypass"
    if module.bias_k is not None or module.add_zero_attn:
        return "MultiheadAttention with add_bias_kv or add_zero_attn is not supported by the masked backward"
    return None


@torch.compiler.disable
def _project(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layer: SparseBackward | None,
    rows: slice | None = None,
) -> torch.Tensor:
    """``input @ weight^T + bias``; through the layer's masked backward when there is one.

    ``rows`` says which rows of the layer's weight ``weight`` is (a packed projection split for cross-attention).
    """
    if layer is None:
        return functional.linear(input, weight, bias)
    layer.ran = True
    dgrad_mask = permutation = None
    if layer.plan.bimask:
        dgrad_mask = layer.parametrization.backward_mask
        if rows is None:
            permutation = layer.parametrization.permutation
        else:
            dgrad_mask = dgrad_mask[rows]
    return _SparseLinearFunction.apply(input, weight, bias, dgrad_mask, permutation, layer)


class AttentionForward:
    """Installed as an ``nn.MultiheadAttention``'s ``forward``: the module's computation with masked backwards.

    ``projections`` maps the module's projection weight attributes to their sparse layers; ``output`` is the
    ``out_proj`` Linear's. A weight without a layer (kept dense) is multiplied by plain autograd.
    """

    def __init__(
        self,
        module: nn.MultiheadAttention,
        projections: dict[str, SparseBackward],
        output: SparseBackward | None,
        observe: Observer | None = None,
    ) -> None:
        self.module = module
        self.projections = projections
        self.output = output
        self.observe = observe
        """Called with every projection's input (calibration): ``(weight attribute or "out_proj", input, rows)``."""

    def layers(self) -> list[SparseBackward]:
        return [*self.projections.values(), *([self.output] if self.output is not None else [])]

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        arguments = (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)
        if not torch.is_grad_enabled() and self.observe is None:
            return nn.MultiheadAttention.forward(self.module, *arguments)
        return self._forward(*arguments)

    def _forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None,
        need_weights: bool,
        attn_mask: torch.Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        module = self.module
        heads = module.num_heads
        key_padding_mask = functional._canonical_mask(
            mask=key_padding_mask,
            mask_name="key_padding_mask",
            other_type=functional._none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=query.dtype,
        )
        attn_mask = functional._canonical_mask(
            mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="", target_type=query.dtype,
            check_other=False,
        )  # fmt: skip
        batch_first = module.batch_first and query.dim() == 3
        if batch_first:  # keep the identities that tell self-attention from cross-attention
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        is_batched = functional._mha_shape_check(query, key, value, key_padding_mask, attn_mask, heads)
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        target_length, batch, width = query.shape
        if width != module.embed_dim:
            raise AssertionError(f"was expecting embedding dimension of {module.embed_dim}, but got {width}")
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # scaled_dot_product_attention applies the causal mask itself
        elif key_padding_mask is not None:
            is_causal = False
        q, k, v = self._in_projection(query, key, value)

        head_width = width // heads
        source_length = k.shape[0]
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if attn_mask.shape != (target_length, source_length):
                    raise RuntimeError(
                        f"The shape of the 2D attn_mask is {attn_mask.shape}, "
                        f"but should be {(target_length, source_length)}."
                    )
                attn_mask = attn_mask.unsqueeze(0)
            elif attn_mask.shape != (batch * heads, target_length, source_length):
                raise RuntimeError(
                    f"The shape of the {attn_mask.dim()}D attn_mask is {attn_mask.shape}, "
                    f"but should be {(batch * heads, target_length, source_length)}."
                )
        q = q.view(target_length, batch * heads, head_width).transpose(0, 1)
        k = k.view(source_length, batch * heads, head_width).transpose(0, 1)
        v = v.view(source_length, batch * heads, head_width).transpose(0, 1)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (batch, source_length):
                raise AssertionError(
                    f"expecting key_padding_mask shape of {(batch, source_length)}, but got {key_padding_mask.shape}"
                )
            key_padding_mask = (
                key_padding_mask.view(batch, 1, 1, source_length)
                .expand(-1, heads, -1, -1)
                .reshape(batch * heads, 1, source_length)
            )
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        dropout = module.dropout if module.training else 0.0
        weights = None
        if need_weights:
            scaled = q * math.sqrt(1.0 / head_width)
            if attn_mask is None:
                scores = torch.bmm(scaled, k.transpose(-2, -1))
            else:
                scores = torch.baddbmm(attn_mask, scaled, k.transpose(-2, -1))
            weights = torch.softmax(scores, dim=-1)
            if dropout > 0.0:
                weights = functional.dropout(weights, p=dropout)
            mixed = torch.bmm(weights, v).transpose(0, 1).reshape(target_length * batch, width)
            weights = weights.view(batch, heads, target_length, source_length)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            if attn_mask is not None:
                if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                    attn_mask = attn_mask.unsqueeze(0)
                else:
                    attn_mask = attn_mask.view(batch, heads, -1, source_length)
            mixed = functional.scaled_dot_product_attention(
                q.view(batch, heads, target_length, head_width),
                k.view(batch, heads, source_length, head_width),
                v.view(batch, heads, source_length, head_width),
                attn_mask,
                dropout,
                is_causal,
            )
            mixed = mixed.permute(2, 0, 1, 3).reshape(batch * target_length, width)
        self._observe("out_proj", mixed, None)
        output = _project(mixed, module.out_proj.weight, module.out_proj.bias, self.output)
        output = output.view(target_length, batch, width)
        if not is_batched:
            output = output.squeeze(1)
            weights = weights.squeeze(0) if weights is not None else None
        if batch_first:
            output = output.transpose(1, 0)
        return output, weights

    def _observe(self, name: str, input: torch.Tensor, rows: slice | None) -> None:
        if self.observe is not None:
            self.observe(name, input, rows)

    def _in_projection(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        module = self.module
        self._observe_inputs(query, key, value)
        width = module.embed_dim
        bias: Any = module.in_proj_bias
        if not module._qkv_same_embed_dim:
            biases = (None, None, None) if bias is None else bias.chunk(3)
            q, k, v = (
                _project(x, getattr(module, name), b, self.projections.get(name))
                for x, name, b in zip(
                    (query, key, value), ("q_proj_weight", "k_proj_weight", "v_proj_weight"), biases, strict=True
                )
            )
            return q, k, v
        weight = module.in_proj_weight
        layer = self.projections.get("in_proj_weight")
        if key is value and query is key:
            packed = _project(query, weight, bias, layer)
            packed = packed.unflatten(-1, (3, width)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
            return packed[0], packed[1], packed[2]
        parts = (slice(0, width), slice(width, 2 * width), slice(2 * width, 3 * width))
        if key is value:
            kv_rows = slice(width, 3 * width)
            q = _project(query, weight[parts[0]], None if bias is None else bias[parts[0]], layer, parts[0])
            kv = _project(key, weight[kv_rows], None if bias is None else bias[kv_rows], layer, kv_rows)
            kv = kv.unflatten(-1, (2, width)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
            return q, kv[0], kv[1]
        q, k, v = (
            _project(x, weight[rows], None if bias is None else bias[rows], layer, rows)
            for x, rows in zip((query, key, value), parts, strict=True)
        )
        return q, k, v

    def _observe_inputs(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Each in-projection's input, with the rows of the packed weight it meets (all rows for self-attention)."""
        if self.observe is None:
            return
        if not self.module._qkv_same_embed_dim:
            for x, name in zip((query, key, value), ("q_proj_weight", "k_proj_weight", "v_proj_weight"), strict=True):
                self.observe(name, x, None)
            return
        width = self.module.embed_dim
        if key is value and query is key:
            self.observe("in_proj_weight", query, None)
        elif key is value:
            self.observe("in_proj_weight", query, slice(0, width))
            self.observe("in_proj_weight", key, slice(width, 3 * width))
        else:
            for x, index in zip((query, key, value), range(3), strict=True):
                self.observe("in_proj_weight", x, slice(index * width, (index + 1) * width))


Observer = Callable[[str, torch.Tensor, slice | None], None]


def install_attention(module: nn.MultiheadAttention, forward: AttentionForward) -> None:
    """Route the module's forward through ``forward`` (an instance attribute; see :func:`uninstall_attention`)."""
    module.forward = forward


def uninstall_attention(module: nn.Module) -> None:
    if isinstance(module.__dict__.get("forward"), AttentionForward):
        del module.forward
