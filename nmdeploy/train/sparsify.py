"""Make a model's Linear, Conv1d and Conv2d layers N:M trainable: choose layers, attach the method's parametrisation
and the backward passes, step the schedules, save and restore their state, and bake everything at the end."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern, is_nm, is_transposable
from nmdeploy.masks.pattern import PatternLike
from nmdeploy.train.backward import (
    TRANSPOSABLE_MASK_INTERVAL,
    BackwardOptions,
    BackwardPlan,
    GeneratorBank,
    SparseBackward,
    conv_padding,
    install,
    parse_backward,
    uninstall,
)
from nmdeploy.train.methods import METHODS, FixedOptions, MaskSelector, MethodOptions, NMParametrization
from nmdeploy.train.sharding import full, is_sharded

__all__ = ["Sparsifier", "finalize", "finalized_state_dict", "sparsify", "sparsify_like"]

logger = logging.getLogger(__name__)

SPARSIFIABLE = (nn.Linear, nn.Conv1d, nn.Conv2d)


def _split_options(
    options: Mapping[str, Any], method: str, method_type: type[MethodOptions]
) -> tuple[MethodOptions, BackwardOptions]:
    method_fields = {field.name for field in dataclasses.fields(method_type)}
    backward_fields = {field.name for field in dataclasses.fields(BackwardOptions)}
    unknown = sorted(set(options) - method_fields - backward_fields)
    if unknown:
        valid = ", ".join(sorted(method_fields | backward_fields))
        raise InputError(f"unknown option(s) {', '.join(unknown)} for method {method!r}; valid options: {valid}")
    try:
        method_options = method_type(**{k: v for k, v in options.items() if k in method_fields})
        backward_options = BackwardOptions(**{k: v for k, v in options.items() if k in backward_fields})
    except TypeError as error:  # a required option given with a wrong type, for example
        raise InputError(f"invalid options for method {method!r}: {error}") from None
    return method_options, backward_options


def _dense_names(dense_layers: Iterable[str], candidates: list[str]) -> dict[str, str]:
    """Layer name -> why it stays dense, for the ``dense_layers`` entries ("first", "last" or layer names)."""
    dense: dict[str, str] = {}
    for entry in dense_layers:
        if entry == "first" and candidates:
            dense.setdefault(candidates[0], "first layer kept dense (dense_layers)")
        elif entry == "last" and candidates:
            dense.setdefault(candidates[-1], "last layer kept dense (dense_layers)")
        elif entry in candidates:
            dense.setdefault(entry, "listed in dense_layers")
        elif entry not in ("first", "last"):
            raise InputError(
                f"dense_layers entry {entry!r} is not a Linear/Conv1d/Conv2d layer of the model; "
                f"use 'first', 'last' or one of: {', '.join(candidates[:10])}{' ...' if len(candidates) > 10 else ''}"
            )
    return dense


def _compile(regex: str | None, what: str) -> re.Pattern[str] | None:
    if regex is None:
        return None
    try:
        return re.compile(regex)
    except re.error as error:
        raise InputError(f"{what} {regex!r} is not a valid regular expression: {error}") from None


def _shape_reason(module: nn.Module, pattern: Pattern, plan: BackwardPlan) -> str | None:
    """Why ``module`` cannot take the pattern and backward plan, or None."""
    weight = module.weight
    if not torch.is_floating_point(weight):
        return f"weight dtype {weight.dtype} is not floating point"
    if parametrize.is_parametrized(module, "weight"):
        return "weight is already parametrised"
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


def _given_mask(
    name: str, given: torch.Tensor, weight: torch.Tensor, pattern: Pattern, transposable: bool
) -> torch.Tensor:
    mask = given if given.dtype == torch.bool else given != 0
    if mask.shape != weight.shape:
        raise InputError(f"given mask for {name!r} has shape {tuple(mask.shape)}, the weight {tuple(weight.shape)}")
    mask = mask.to(weight.device)
    if not is_nm(mask, pattern, axis=1):
        raise InputError(f"given mask for {name!r} is not {pattern} along input channels (axis 1); prune it first")
    if transposable and not is_transposable(mask, pattern, axis=1, out_axis=0):
        raise InputError(f"given mask for {name!r} is not transposable {pattern}, as backward='transposable' needs")
    return mask


class Sparsifier:
    """The sparse layers of one model: their parametrisations, the step counter and the random generators.

    Call :meth:`step` after every optimiser step. ``layers`` maps layer names to parametrisations (each holds its
    ``mask`` buffer), ``skipped`` maps the other Linear/Conv layers to the reason they stay dense.
    """

    def __init__(
        self,
        *,
        pattern: Pattern,
        method: str,
        backward: frozenset[str],
        layers: dict[str, NMParametrization],
        modules: dict[str, nn.Module],
        backwards: dict[str, SparseBackward],
        skipped: dict[str, str],
        generators: GeneratorBank,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.pattern = pattern
        self.options = dict(options or {})
        self.method = method
        self.backward = backward
        self.layers = layers
        self.skipped = skipped
        self.generators = generators
        self.step_count = 0
        self._modules = modules
        self._backwards = backwards

    def _weight(self, name: str) -> torch.Tensor:
        return self._modules[name].parametrizations.weight.original

    def step(self) -> None:
        """Advance one optimiser step: schedules move on, masks are recomputed where due."""
        self.step_count += 1
        self.generators.advance(self.step_count)
        with torch.no_grad():
            for name, layer in self.layers.items():
                weight = self._weight(name)
                # Sharded (FSDP2): gathered only when read; every rank walks the same layers in the same order,
                # so the collectives match up.
                if is_sharded(weight) and (layer.reads_weight(self.step_count) or "bimask" in self.backward):
                    weight = full(weight)
                changed = layer.update(weight, self.step_count)
                if name in self._backwards:
                    self._backwards[name].refresh(weight, self.step_count, changed)

    def masks(self) -> dict[str, torch.Tensor]:
        """Layer name -> the current forward mask (the live buffer, weight layout; clone it to keep a copy)."""
        return {name: layer.mask for name, layer in self.layers.items()}

    def backward_masks(self) -> dict[str, torch.Tensor]:
        """Layer name -> bi-directional backward mask (only with ``backward="bimask"``)."""
        return {name: layer.backward_mask for name, layer in self.layers.items() if hasattr(layer, "backward_mask")}

    def buffer_bytes(self) -> dict[str, int]:
        """Bytes of the sparse layers' buffers on this process: masks, the forward's multipliers and the method's
        own, against the weights themselves (``weights``: what this process holds of them, its shards under FSDP2).

        Under FSDP2 the buffers stay whole on every rank while the weights are sharded (see
        :mod:`nmdeploy.train.sharding`), so ``buffers / weights`` grows with the number of ranks.
        """
        buffers = weights = 0
        for name, layer in self.layers.items():
            buffers += sum(buffer.numel() * buffer.element_size() for buffer in layer.buffers())
            weight = self._weight(name)
            local = weight.to_local() if is_sharded(weight) else weight
            weights += local.numel() * local.element_size()
        return {"buffers": buffers, "weights": weights}

    def kernels_used(self) -> dict[str, dict[str, bool]]:
        """Layer name -> GEMM -> whether its last call ran on semi-structured sparse kernels."""
        return {name: dict(backward.kernels.used) for name, backward in self._backwards.items()}

    def state_dict(self) -> dict[str, Any]:
        """What an exact resume needs beyond ``model.state_dict()`` (which holds masks, scores and permutations),
        plus the settings that :func:`sparsify_like` needs to rebuild the same layers on a fresh dense model.

        Plain values and tensors only, so checkpoints load with ``weights_only=True``.
        """
        return {
            "step": self.step_count,
            "method": self.method,
            "pattern": str(self.pattern),
            "backward": sorted(self.backward),
            "layers": sorted(self.layers),
            "options": dict(self.options),
            "generators": self.generators.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the model's own state dict must be loaded as well."""
        expected = {
            "method": self.method,
            "pattern": str(self.pattern),
            "backward": sorted(self.backward),
            "layers": sorted(self.layers),
        }
        for key, value in expected.items():
            if state.get(key) != value:
                raise InputError(
                    f"sparsifier state does not match this model: {key} is {state.get(key)!r} in the state, "
                    f"{value!r} here; sparsify the model with the same settings before loading"
                )
        self.step_count = int(state["step"])
        self.generators.load_state_dict(state["generators"])
        self.generators.advance(self.step_count)
        for layer in self.layers.values():
            layer.sync(self.step_count)


def sparsify(
    model: nn.Module,
    pattern: PatternLike = "2:4",
    method: str = "srste",
    backward: str | Iterable[str] = "dense",
    include: str | None = None,
    exclude: str | None = None,
    dense_layers: Iterable[str] = ("first", "last"),
    **options: Any,
) -> Sparsifier:
    """Make the model's Linear, Conv1d and Conv2d layers N:M along input channels, in place.

    ``method`` is one of ``ste``, ``srste``, ``fixed``, ``lbc``, ``mask-decay``, ``structure-decay``; ``backward``
    is ``"dense"`` or any of ``transposable``, ``bimask`` (not both) and ``mvue``. ``include``/``exclude`` are
    regular expressions searched in layer names; ``dense_layers`` names layers to keep dense ("first" and "last"
    are the first and last eligible layers in registration order). ``options`` are the method's
    (:mod:`nmdeploy.train.methods`) and the backward's (:class:`BackwardOptions`) keyword options.
    """
    if any(is_sharded(parameter) for parameter in model.parameters()):
        raise InputError(
            "the model is already sharded (fully_shard): call sparsify on the plain model first, then fully_shard"
        )
    pattern = Pattern.parse(pattern)
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    method_type = METHODS[method]
    chosen = parse_backward(backward)
    if method == "lbc" and "transposable" in chosen:
        raise InputError("method 'lbc' learns 1-D combinations and cannot give transposable masks; use 'bimask'")
    method_options, backward_options = _split_options(options, method, method_type.options_type)
    transposable = "transposable" in chosen
    if method_options.mask_interval is None:
        default_interval = TRANSPOSABLE_MASK_INTERVAL if transposable else 1
        method_options = dataclasses.replace(method_options, mask_interval=default_interval)
    plan = BackwardPlan(
        transposable=transposable,
        bimask="bimask" in chosen,
        mvue=Pattern.parse(backward_options.mvue_pattern) if "mvue" in chosen else None,
        sparse_kernels=backward_options.sparse_kernels,
    )
    selector = MaskSelector(backward_options.transposable_method if transposable else None)
    given_masks = dict(method_options.masks or {}) if isinstance(method_options, FixedOptions) else {}

    candidates = [(name, module) for name, module in model.named_modules() if isinstance(module, SPARSIFIABLE)]
    names = [name for name, _ in candidates]
    unknown = sorted(set(given_masks) - set(names))
    if unknown:
        raise InputError(f"masks given for unknown layers: {', '.join(unknown)}; layers: {', '.join(names[:10])}")
    dense = _dense_names(dense_layers, names)
    include_re, exclude_re = _compile(include, "include"), _compile(exclude, "exclude")
    generators = GeneratorBank(backward_options.seed)
    layers: dict[str, NMParametrization] = {}
    modules: dict[str, nn.Module] = {}
    backwards: dict[str, SparseBackward] = {}
    skipped: dict[str, str] = {}
    for name, module in candidates:
        if include_re is not None and not include_re.search(name):
            skipped[name] = f"not matched by include {include!r}"
        elif exclude_re is not None and exclude_re.search(name):
            skipped[name] = f"matched by exclude {exclude!r}"
        elif name in dense:
            skipped[name] = dense[name]
        elif (reason := _shape_reason(module, pattern, plan)) is not None:
            skipped[name] = reason
        if name in skipped:
            if name in given_masks:
                raise InputError(f"a mask is given for {name!r}, but the layer is skipped: {skipped[name]}")
            continue
        weight = module.weight.detach()
        layer = method_type(weight, pattern, selector, method_options)
        given = given_masks.get(name)
        layer.initialize(weight, None if given is None else _given_mask(name, given, weight, pattern, transposable))
        parametrize.register_parametrization(module, "weight", layer)
        layers[name], modules[name] = layer, module
        if plan.custom:
            backwards[name] = SparseBackward(module, layer, plan, generators, backward_options)
            backwards[name].refresh(weight, 0, True)
            install(module, backwards[name])
    if not layers:
        logger.warning("sparsify: no layer was made N:M (%d skipped)", len(skipped))
    return Sparsifier(
        pattern=pattern,
        method=method,
        backward=chosen,
        layers=layers,
        modules=modules,
        backwards=backwards,
        skipped=skipped,
        generators=generators,
        options=_recorded_options(options),
    )


def _recorded_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword options as plain values (a checkpoint loads with ``weights_only=True``). Given masks are left
    out: the mask buffers in the model's state carry them."""
    recorded = {}
    for key, value in options.items():
        if key == "masks":
            continue
        recorded[key] = str(value) if isinstance(value, Pattern) else value
    return recorded


def sparsify_like(model: nn.Module, state: Mapping[str, Any]) -> Sparsifier:
    """Sparsify a fresh dense ``model`` as the run that wrote ``state`` (:meth:`Sparsifier.state_dict`) was: the
    same pattern, method, backward, options and exactly the same layers; then restore ``state``.

    The model's own state (weights, masks, scores) is loaded separately, after this call.
    """
    try:
        names = list(state["layers"])
        settings = {
            "pattern": state["pattern"],
            "method": state["method"],
            "backward": list(state["backward"]) or "dense",
        }
        options = dict(state.get("options", {}))
    except (KeyError, TypeError) as error:
        raise InputError(
            f"sparsifier state is incomplete ({error}); it was not written by Sparsifier.state_dict"
        ) from None
    only = "^(" + "|".join(re.escape(name) for name in names) + ")$" if names else "^$"
    sparsifier = sparsify(model, **settings, include=only, dense_layers=(), **options)
    missing = sorted(set(names) - set(sparsifier.layers))
    if missing:
        raise InputError(
            f"the model has no sparsifiable layer(s) {', '.join(missing[:5])} that the checkpoint trained N:M; "
            "build the same model before loading"
        )
    sparsifier.load_state_dict(state)
    return sparsifier


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
        if not parametrize.is_parametrized(module, "weight"):
            continue
        chain = module.parametrizations.weight
        layer = next((p for p in chain if isinstance(p, NMParametrization)), None)
        if layer is None:
            continue
        with torch.no_grad():
            original = chain.original
            baked = original * layer.hard_mask(original)
        uninstall(module)
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
        with torch.no_grad():
            module.weight.copy_(baked)
    return model


def finalized_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict :func:`finalize` would leave, without changing ``model``: plain ``weight`` entries holding
    ``W * hard mask``, no parametrisation entries, every tensor whole.

    Works on a model sharded with FSDP2 (gathering every tensor: a collective, call it on every rank), so a plain
    copy of the model (``load_state_dict``) can be exported from any rank.
    """
    layers = {}
    for name, module in model.named_modules():
        if parametrize.is_parametrized(module, "weight"):
            layer = next((p for p in module.parametrizations.weight if isinstance(p, NMParametrization)), None)
            if layer is not None:
                layers[f"{name}." if name else ""] = layer
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            value = full(value)
            prefix, marker, rest = key.partition("parametrizations.weight.")
            if not marker or prefix not in layers:
                state[key] = value.detach().clone()
            elif rest == "original":
                state[f"{prefix}weight"] = value * layers[prefix].hard_mask(value)
    return state
