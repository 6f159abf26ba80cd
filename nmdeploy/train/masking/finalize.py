"""Baking N:M training into plain weights at the end: :func:`finalize` changes the model in place (the same
Parameters, now ``W * hard mask``, plain modules again), :func:`finalized_state_dict` gives that state without
changing the model, from any FSDP2 rank."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from nmdeploy.errors import InputError
from nmdeploy.train.masking.attention import uninstall_attention
from nmdeploy.train.masking.backward import uninstall
from nmdeploy.train.masking.methods import NMParametrization
from nmdeploy.train.masking.sharding import full, is_sharded

__all__ = ["finalize", "finalized_state_dict"]


def finalize(model: nn.Module) -> nn.Module:
    """Bake every N:M parametrisation into its plain weight and restore plain modules, ready for export.

    The weight stays the same Parameter (so optimiser state remains valid) and holds ``W * mask``, with the
    method's hard N:M mask even mid-schedule (the best combination for LBC, the target pattern for decays).
    A model sharded with FSDP2 keeps its structure; take :func:`finalized_state_dict` from it instead.
    """
    if any(is_sharded(parameter) for parameter in model.parameters()):
        raise InputError(
            "the model is sharded (fully_shard): take finalized_state_dict(model) on every rank and load it into "
            "a plain copy of the model"
        )
    for module in model.modules():
        uninstall_attention(module)
        if not parametrize.is_parametrized(module):
            continue
        for attribute in list(module.parametrizations.keys()):
            chain = module.parametrizations[attribute]
            layer = next((p for p in chain if isinstance(p, NMParametrization)), None)
            if layer is None:
                continue
            with torch.no_grad():
                original = chain.original
                baked = original * layer.hard_mask(original)
            if attribute == "weight":
                uninstall(module)
            parametrize.remove_parametrizations(module, attribute, leave_parametrized=False)
            with torch.no_grad():
                getattr(module, attribute).copy_(baked)
    return model


def finalized_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict :func:`finalize` would leave, without changing ``model``: plain weight entries holding
    ``W * hard mask``, no parametrisation entries, every tensor whole.

    Works on a model sharded with FSDP2 (gathering every tensor: a collective, call it on every rank), so a plain
    copy of the model (``load_state_dict``) can be exported from any rank.
    """
    layers: dict[str, tuple[str, NMParametrization]] = {}  # "<module>.parametrizations.<attribute>." -> plain key
    for name, module in model.named_modules():
        if not parametrize.is_parametrized(module):
            continue
        prefix = f"{name}." if name else ""
        for attribute, chain in module.parametrizations.items():
            layer = next((p for p in chain if isinstance(p, NMParametrization)), None)
            if layer is not None:
                layers[f"{prefix}parametrizations.{attribute}."] = (prefix + attribute, layer)
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            value = full(value)
            owner = next((chain for chain in layers if key.startswith(chain)), None)
            if owner is None:
                state[key] = value.detach().clone()
            elif key == owner + "original":
                plain, layer = layers[owner]
                state[plain] = value * layer.hard_mask(value)
    return state
