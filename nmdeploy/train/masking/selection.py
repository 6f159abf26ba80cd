"""Which of a model's weights can become N:M, and why each of the others stays dense: the weight slots (Linear,
Conv1d, Conv2d and ``nn.MultiheadAttention`` projections), the keep-dense rules (output heads, input embeddings,
first and last layers, named layers), tied weights, shapes the pattern or backward cannot take, and readers that
bypass the masked backward."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern
from nmdeploy.train.masking.attention import attention_weights, unsupported_attention
from nmdeploy.train.masking.backward import BackwardPlan, conv_padding

SPARSIFIABLE = (nn.Linear, nn.Conv1d, nn.Conv2d)
KEEP_DENSE = ("auto", "first-last", "none")
"""Which layers stay dense without being named: output heads and input embeddings, the first and last layers by
position, or none."""
HEAD_NAME = re.compile(
    r"(lm_|out_|output_|cls_|classification_)?head|classifier|score|logits|fc_out|output(_layer|_projection)?"
)
"""Leaf names of output layers (``lm_head``, ``classifier``, ...): the layer whose output feeds the loss."""
EMBEDDING_NAME = re.compile(r"(tok_|token_|patch_|word_|input_)?embed(ding)?s?(_in)?|wte|stem")
"""Leaf names of input embeddings written as Linear or Conv layers (``embed``, ``patch_embed``, ``stem``, ...)."""


@dataclass(frozen=True)
class Slot:
    """One weight that could become N:M: ``module.<attribute>``, listed as ``name`` in ``layers``/``skipped``."""

    name: str
    module: nn.Module
    attribute: str
    parameter: str
    """The weight's name in ``model.named_parameters()`` once finalised (what exporters name it after)."""
    attention: str | None = None
    """The ``nn.MultiheadAttention`` that reads this weight directly (its projections and ``out_proj``), or None."""

    @property
    def leaf(self) -> str:
        return self.name.rpartition(".")[2]


def weight_slots(model: nn.Module) -> list[Slot]:
    """Every Linear/Conv1d/Conv2d weight and every MultiheadAttention projection weight, in registration order."""
    slots: list[Slot] = []
    attention: dict[str, nn.MultiheadAttention] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, nn.MultiheadAttention):
            attention[name] = module
            for attribute in attention_weights(module):
                slots.append(Slot(prefix + attribute, module, attribute, prefix + attribute, name))
        elif isinstance(module, SPARSIFIABLE):
            parent = name.rpartition(".")[0]
            reader = parent if parent in attention and attention[parent].out_proj is module else None
            slots.append(Slot(name, module, "weight", prefix + "weight", reader))
    return slots


def dense_reasons(keep_dense: str, dense_layers: Iterable[str], slots: list[Slot], tied: set[str]) -> dict[str, str]:
    """Layer name -> why it stays dense: the ``keep_dense`` rule, then ``dense_layers`` ("first", "last", layer
    names or regular expressions matching whole names)."""
    if keep_dense not in KEEP_DENSE:
        raise InputError(f"keep_dense={keep_dense!r} is not one of {', '.join(KEEP_DENSE)}")
    names = [slot.name for slot in slots]
    dense: dict[str, str] = {}
    if keep_dense == "first-last" and names:
        dense[names[0]] = "first layer kept dense (keep_dense='first-last')"
        dense.setdefault(names[-1], "last layer kept dense (keep_dense='first-last')")
    elif keep_dense == "auto":
        for slot in slots:
            if HEAD_NAME.fullmatch(slot.leaf):
                dense[slot.name] = "output head, kept dense (keep_dense='auto')"
            elif EMBEDDING_NAME.fullmatch(slot.leaf):
                dense[slot.name] = "input embedding, kept dense (keep_dense='auto')"
        has_head = any("output head" in reason for reason in dense.values()) or bool(tied)
        if names and not has_head:
            dense.setdefault(names[-1], "last layer, taken as the output head and kept dense (keep_dense='auto')")
    for entry in dense_layers:
        if entry == "first" and names:
            dense.setdefault(names[0], "first layer kept dense (dense_layers)")
        elif entry == "last" and names:
            dense.setdefault(names[-1], "last layer kept dense (dense_layers)")
        elif entry in names:
            dense[entry] = "listed in dense_layers"
        elif entry not in ("first", "last"):
            regex = compile_regex(entry, "dense_layers entry")
            matched = [name for name in names if regex is not None and regex.fullmatch(name)]
            if not matched:
                raise InputError(
                    f"dense_layers entry {entry!r} names no Linear/Conv1d/Conv2d layer or attention weight of the "
                    f"model; use 'first', 'last', a layer name or a regular expression matching whole names, e.g. "
                    f"{', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
                )
            for name in matched:
                dense[name] = f"matched by dense_layers {entry!r}"
    return dense


def tied_reasons(model: nn.Module, slots: list[Slot]) -> dict[str, str]:
    """Layer name -> why its weight stays dense because another module holds the same Parameter (tied weights)."""
    holders: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(parameter), []).append(name)
    embeddings = {
        f"{name}.weight" if name else "weight"
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding | nn.EmbeddingBag)
    }
    reasons: dict[str, str] = {}
    for slot in slots:
        others = [n for n in holders.get(id(getattr(slot.module, slot.attribute)), []) if n != slot.parameter]
        if not others:
            continue
        tied_to_embedding = [n for n in others if n in embeddings]
        if tied_to_embedding:
            reasons[slot.name] = f"weight tied to the embedding {tied_to_embedding[0]}: an output head, kept dense"
        else:
            reasons[slot.name] = f"weight shared with {', '.join(others)}: masking it would change the other use too"
    return reasons


def backward_reason(slot: Slot, model_modules: Mapping[str, nn.Module]) -> str | None:
    """Why the masked backward cannot run for this weight (its reader bypasses our forward), or None."""
    if slot.attention is not None:
        return unsupported_attention(model_modules[slot.attention])
    base = next(cls for cls in SPARSIFIABLE if isinstance(slot.module, cls))
    if type(slot.module).forward is not base.forward:
        return (
            f"{type(slot.module).__name__} overrides {base.__name__}.forward, which the masked backward would "
            "replace; use backward='dense' or exclude it"
        )
    return None


def compile_regex(regex: str | None, what: str) -> re.Pattern[str] | None:
    if regex is None:
        return None
    try:
        return re.compile(regex)
    except re.error as error:
        raise InputError(f"{what} {regex!r} is not a valid regular expression: {error}") from None


def shape_reason(module: nn.Module, attribute: str, pattern: Pattern, plan: BackwardPlan) -> str | None:
    """Why ``module.<attribute>`` cannot take the pattern and backward plan, or None."""
    weight = getattr(module, attribute)
    if not torch.is_floating_point(weight):
        return f"weight dtype {weight.dtype} is not floating point"
    if parametrize.is_parametrized(module, attribute):
        return "weight is already parametrised"
    if weight.ndim < 2:
        return f"weight of shape {tuple(weight.shape)} is not a matrix or a convolution kernel"
    inputs = weight.shape[1]
    if inputs % pattern.m:
        return f"{inputs} input channels (per group) are not a multiple of M={pattern.m}"
    groups = getattr(module, "groups", 1)
    outputs_per_group = weight.shape[0] // groups
    if plan.transposable and outputs_per_group % pattern.m:
        return f"{outputs_per_group} output channels (per group) are not a multiple of M={pattern.m} (transposable)"
    if plan.bimask and groups != 1:
        return f"bi-directional masks need an ungrouped layer, this one has groups={groups}"
    if plan.bimask and weight.shape[0] % pattern.m:
        return f"{weight.shape[0]} output channels are not a multiple of M={pattern.m} (bi-directional masks)"
    if plan.custom and isinstance(module, nn.Conv1d | nn.Conv2d):
        padding = conv_padding(module)
        if isinstance(padding, str):
            return padding
    return None


def skipped_layers(
    model: nn.Module,
    slots: list[Slot],
    pattern: Pattern,
    plan: BackwardPlan,
    *,
    include: str | None,
    exclude: str | None,
    dense_layers: Iterable[str],
    keep_dense: str,
) -> tuple[dict[str, str], list[str]]:
    """Layer name -> why it stays dense, in slot order, for every slot that does not become N:M; and the names among
    them that stay dense only because the masked backward cannot run for them. The first reason that applies counts:
    include, exclude, tied weights, the ``keep_dense`` rule and ``dense_layers``, the weight's shape and type, the
    backward."""
    tied = tied_reasons(model, slots)
    dense = dense_reasons(keep_dense, dense_layers, slots, {n for n, r in tied.items() if "embedding" in r})
    include_re, exclude_re = compile_regex(include, "include"), compile_regex(exclude, "exclude")
    named_modules = dict(model.named_modules())
    skipped: dict[str, str] = {}
    bypassed: list[str] = []
    for slot in slots:
        name = slot.name
        if include_re is not None and not include_re.search(name):
            skipped[name] = f"not matched by include {include!r}"
        elif exclude_re is not None and exclude_re.search(name):
            skipped[name] = f"matched by exclude {exclude!r}"
        elif name in tied:
            skipped[name] = tied[name]
        elif name in dense:
            skipped[name] = dense[name]
        elif (reason := shape_reason(slot.module, slot.attribute, pattern, plan)) is not None:
            skipped[name] = reason
        elif plan.custom and (reason := backward_reason(slot, named_modules)) is not None:
            skipped[name] = reason
            bypassed.append(name)
    return skipped, bypassed
