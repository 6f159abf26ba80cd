"""Make a model's Linear, Conv1d and Conv2d layers N:M trainable: attach the method's parametrisation and the backward
passes to the layers :mod:`~nmdeploy.train.masking.selection` chooses, step the schedules, and save and restore their
state; :mod:`~nmdeploy.train.masking.finalize` bakes everything at the end."""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern, is_nm, is_transposable
from nmdeploy.masks.pattern import PatternLike
from nmdeploy.train.masking.attention import (
    AttentionForward,
    install_attention,
)
from nmdeploy.train.masking.backward import (
    TRANSPOSABLE_MASK_INTERVAL,
    BackwardOptions,
    BackwardPlan,
    GeneratorBank,
    SparseBackward,
    install,
    parse_backward,
)
from nmdeploy.train.masking.methods import METHODS, FixedOptions, MaskSelector, MethodOptions, NMParametrization
from nmdeploy.train.masking.oneshot import INITS, Forward, Target, call_model, sparsegpt_masks
from nmdeploy.train.masking.selection import Slot, skipped_layers, weight_slots
from nmdeploy.train.masking.sharding import full, is_sharded

__all__ = ["Sparsifier", "sparsify", "sparsify_like"]

logger = logging.getLogger(__name__)


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
    ``mask`` buffer), ``skipped`` maps the other Linear/Conv layers and attention weights to the reason they stay
    dense. A layer is named after its module, an attention projection after its weight (``attn.in_proj_weight``).
    """

    def __init__(
        self,
        *,
        pattern: Pattern,
        method: str,
        backward: frozenset[str],
        layers: dict[str, NMParametrization],
        slots: dict[str, tuple[nn.Module, str]],
        backwards: dict[str, SparseBackward],
        skipped: dict[str, str],
        generators: GeneratorBank,
        parameters: dict[str, str] | None = None,
        options: dict[str, Any] | None = None,
        initialized: dict[str, str] | None = None,
    ) -> None:
        self.pattern = pattern
        self.options = dict(options or {})
        self.method = method
        self.backward = backward
        self.layers = layers
        self.skipped = skipped
        self.generators = generators
        self.parameters = dict(parameters or {})
        """Layer name (sparse or skipped) -> the weight's name in ``model.named_parameters()`` after finalising."""
        self.initialized = dict(initialized or {})
        """Layer name -> how its first mask was chosen beyond magnitude ("sparsegpt", or why not), for init."""
        self.step_count = 0
        self._slots = slots
        self._backwards = backwards

    def _weight(self, name: str) -> torch.Tensor:
        module, attribute = self._slots[name]
        return getattr(module.parametrizations, attribute).original

    def report(self) -> dict[str, Any]:
        """Which weights are N:M and which stay dense and why (plain data; export stores it with the model)."""
        return {
            "pattern": str(self.pattern),
            "method": self.method,
            "backward": sorted(self.backward) or ["dense"],
            "sparse": {name: self.parameters.get(name, name) for name in sorted(self.layers)},
            "dense": {
                name: {"parameter": self.parameters.get(name, name), "reason": reason}
                for name, reason in self.skipped.items()
            },
        }

    def _check_backwards_ran(self) -> None:
        """After the first step: every masked backward must have run, or its weight is read around it."""
        silent = sorted(name for name, backward in self._backwards.items() if not backward.ran)
        if silent:
            message = (
                f"sparsify: the masked backward ({'+'.join(sorted(self.backward))}) of {len(silent)} layer(s) did "
                f"not run in the first step: {', '.join(silent[:8])}{' ...' if len(silent) > 8 else ''}. Unless "
                "they were unused in that step, their weights are read directly by another module and train with "
                "the forward mask but a dense backward; keep them dense (dense_layers=...) or use backward='dense'"
            )
            logger.warning(message)
            warnings.warn(message, stacklevel=3)

    def step(self) -> None:
        """Advance one optimiser step: schedules move on, masks are recomputed where due."""
        self.step_count += 1
        self.generators.advance(self.step_count)
        if self.step_count == 1:
            self._check_backwards_ran()
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

    def begin_masks(self, step: int) -> None:
        """Start the masks of layers that wait for a switch (method ``step``) at optimiser step ``step``."""
        for layer in self.layers.values():
            if hasattr(layer, "begin"):
                layer.begin(step)

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
        :mod:`nmdeploy.train.masking.sharding`), so ``buffers / weights`` grows with the number of ranks.
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
    dense_layers: Iterable[str] = (),
    keep_dense: str = "auto",
    init: str = "magnitude",
    calibration: Iterable[Any] | None = None,
    calibration_forward: Forward = call_model,
    **options: Any,
) -> Sparsifier:
    """Make the model's Linear, Conv1d and Conv2d layers and ``nn.MultiheadAttention`` projections N:M along input
    channels, in place.

    ``method`` is one of ``ste``, ``srste``, ``fixed``, ``lbc``, ``mask-decay``, ``structure-decay``; ``backward``
    is ``"dense"`` or any of ``transposable``, ``bimask`` (not both) and ``mvue``. ``include``/``exclude`` are
    regular expressions searched in layer names. ``keep_dense`` says which layers stay dense unasked: ``"auto"``
    (output heads and input embeddings by name, weights tied to an embedding, else the last layer as the output
    head), ``"first-last"`` (the first and last layers in registration order) or ``"none"``; ``dense_layers`` adds
    layer names, regular expressions matching whole names, or "first"/"last". Weights shared between modules stay
    dense. ``options`` are the method's (:mod:`nmdeploy.train.masking.methods`) and the backward's
    (:class:`BackwardOptions`) keyword options.

    ``init`` chooses the first masks of a pretrained model: ``"magnitude"``, or ``"sparsegpt"``, which prunes the
    layers one at a time from ``calibration`` (batches the model is called on through ``calibration_forward``,
    by default ``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple, else ``model(batch)``) and updates
    the kept weights (:mod:`nmdeploy.train.masking.oneshot`). Fine-tuning then goes on with the method.
    """
    if any(is_sharded(parameter) for parameter in model.parameters()):
        raise InputError(
            "the model is already sharded (fully_shard): call sparsify on the plain model first, then fully_shard"
        )
    pattern = Pattern.parse(pattern)
    method_type = METHODS.lookup(method)
    chosen = parse_backward(backward)
    if method == "lbc" and "transposable" in chosen:
        raise InputError("method 'lbc' learns 1-D combinations and cannot give transposable masks; use 'bimask'")
    if init not in INITS:
        raise InputError(f"unknown init {init!r}; choose one of {', '.join(INITS)}")
    method_options, backward_options = _split_options(options, method, method_type.options_type)
    if init != "magnitude" and not method_type.starts_sparse(method_options):
        sparse_start = ", ".join(name for name, cls in METHODS.items() if cls.starts_sparse(cls.options_type()))
        raise InputError(
            f"init={init!r} chooses the masks of step 0, but method {method!r} starts dense with these options; "
            f"use one of {sparse_start} (without a dense warm-up)"
        )
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

    slots = weight_slots(model)
    names = [slot.name for slot in slots]
    unknown = sorted(set(given_masks) - set(names))
    if unknown:
        raise InputError(f"masks given for unknown layers: {', '.join(unknown)}; layers: {', '.join(names[:10])}")
    skipped, bypassed = skipped_layers(
        model, slots, pattern, plan, include=include, exclude=exclude, dense_layers=dense_layers, keep_dense=keep_dense
    )
    for name, reason in skipped.items():
        if name in given_masks:
            raise InputError(f"a mask is given for {name!r}, but the layer is skipped: {reason}")
    chosen_slots = {slot.name: slot for slot in slots if slot.name not in skipped}
    named_modules = dict(model.named_modules())
    generators = GeneratorBank(backward_options.seed)
    layers: dict[str, NMParametrization] = {}
    backwards: dict[str, SparseBackward] = {}
    given_masks = {
        name: _given_mask(name, mask, _slot_weight(chosen_slots[name]), pattern, transposable)
        for name, mask in given_masks.items()
    }
    initialized: dict[str, str] = {}
    if init == "sparsegpt":
        given_masks, initialized = _sparsegpt_start(
            model, chosen_slots, given_masks, selector, pattern, calibration, calibration_forward
        )
    for name, slot in chosen_slots.items():
        weight = getattr(slot.module, slot.attribute).detach()
        layer = method_type(weight, pattern, selector, method_options)
        layer.initialize(weight, given_masks.get(name))
        parametrize.register_parametrization(slot.module, slot.attribute, layer)
        layers[name] = layer
        if plan.custom:
            backwards[name] = SparseBackward(slot.module, layer, plan, generators, backward_options)
            backwards[name].refresh(weight, 0, True)
            if slot.attribute == "weight":  # a Linear/Conv, also the out_proj the attention forward calls for itself
                install(slot.module, backwards[name])
    if plan.custom:
        _install_attention(chosen_slots, backwards, named_modules)
    if bypassed:
        message = (
            f"sparsify: {len(bypassed)} weight(s) stay dense because the masked backward cannot run for them: "
            + "; ".join(f"{name}: {skipped[name]}" for name in bypassed)
        )
        logger.warning(message)
        warnings.warn(message, stacklevel=2)
    if not layers:
        logger.warning("sparsify: no layer was made N:M (%d skipped)", len(skipped))
    return Sparsifier(
        pattern=pattern,
        method=method,
        backward=chosen,
        layers=layers,
        slots={name: (slot.module, slot.attribute) for name, slot in chosen_slots.items()},
        backwards=backwards,
        skipped=skipped,
        generators=generators,
        parameters={slot.name: slot.parameter for slot in slots},
        options=_recorded_options(options),
        initialized=initialized,
    )


def _slot_weight(slot: Slot) -> torch.Tensor:
    return getattr(slot.module, slot.attribute).detach()


def _sparsegpt_start(
    model: nn.Module,
    slots: Mapping[str, Slot],
    given: Mapping[str, torch.Tensor],
    selector: MaskSelector,
    pattern: Pattern,
    calibration: Iterable[Any] | None,
    forward: Forward,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """SparseGPT's masks and kept-weight updates for the chosen layers, inside the given or transposable masks
    where there are such; returns (masks by layer, how each layer's first mask was chosen)."""
    targets = []
    for name, slot in slots.items():
        weight = _slot_weight(slot)
        allowed = given.get(name)
        if allowed is None and selector.transposable is not None:
            allowed = selector(weight, pattern)
        reader = None if slot.attention is None else model.get_submodule(slot.attention)
        targets.append(Target(name, slot.module, slot.attribute, allowed, reader))
    masks, fallbacks = sparsegpt_masks(model, targets, pattern, calibration, forward=forward)
    for name, reason in fallbacks.items():
        logger.info("sparsify: %s: %s", name, reason)
    initialized = {name: fallbacks.get(name, "sparsegpt") for name in slots}
    return {**given, **masks}, initialized


def _install_attention(
    slots: Mapping[str, Slot], backwards: Mapping[str, SparseBackward], modules: Mapping[str, nn.Module]
) -> None:
    """Give every attention module with a sparse projection the forward that runs their masked backwards."""
    readers: dict[str, tuple[dict[str, SparseBackward], list[SparseBackward]]] = {}
    for name, slot in slots.items():
        if slot.attention is None:
            continue
        projections, output = readers.setdefault(slot.attention, ({}, []))
        if slot.attribute == "weight":
            output.append(backwards[name])
        else:
            projections[slot.attribute] = backwards[name]
    for attention, (projections, output) in readers.items():
        module = modules[attention]
        install_attention(module, AttentionForward(module, projections, output[0] if output else None))


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
    sparsifier = sparsify(model, **settings, include=only, dense_layers=(), keep_dense="none", **options)
    missing = sorted(set(names) - set(sparsifier.layers))
    if missing:
        raise InputError(
            f"the model has no sparsifiable layer(s) {', '.join(missing[:5])} that the checkpoint trained N:M; "
            "build the same model before loading"
        )
    sparsifier.load_state_dict(state)
    return sparsifier
