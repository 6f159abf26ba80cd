"""Masked backward passes: custom autograd functions whose three training GEMMs use the pruned operands.

For a layer with weight ``W`` ``[out, in]`` (convolutions: ``[out, in, *kernel]``), input X and output gradient dY:

* forward ``Y = X W~^T`` with the forward-masked weight ``W~`` (N:M along inputs);
* input gradient ``dX = dY B`` where B is ``W~`` itself for ``transposable`` (its mask is N:M along outputs too) or
  ``W~ * M_b`` for ``bimask`` (M_b: N:M along permuted outputs, inside the forward mask), dense ``W~`` otherwise;
* weight gradient ``dW = G^T X`` where G is the minimum-variance unbiased N:M pruning of dY along the token axis
  (a fresh random mask every step) for ``mvue``, dY otherwise. The bias gradient always uses the exact dY.

On CUDA, for fp16/bf16 Linear layers whose sparse operand follows a 2:4-compatible pattern and meets torch's shape
rules, each such GEMM runs torch's semi-structured sparse kernels; everywhere else the same masked math runs densely.
:func:`sparse_kernel_reason` makes that decision and says why not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from nmdeploy.errors import InputError
from nmdeploy.masks import Pattern, mvue_prune
from nmdeploy.masks.training import backward_mask, search_output_permutation
from nmdeploy.train.masking.methods import NMParametrization
from nmdeploy.train.masking.schedules import Every, check_count

BACKWARD_CHOICES: tuple[str, ...] = ("dense", "transposable", "bimask", "mvue")
TRANSPOSABLE_METHODS: tuple[str, ...] = ("exact", "greedy")
TRANSPOSABLE_MASK_INTERVAL = 40
"""Default steps between transposable mask searches (Hubara et al. recompute every 40 iterations)."""


def parse_backward(backward: str | Iterable[str]) -> frozenset[str]:
    """The set of backward options (empty for ``"dense"``), validated."""
    chosen = [backward] if isinstance(backward, str) else list(backward)
    unknown = [name for name in chosen if name not in BACKWARD_CHOICES]
    if unknown or not chosen:
        raise InputError(f"unknown backward option {unknown or chosen!r}; choose from {', '.join(BACKWARD_CHOICES)}")
    options = frozenset(chosen) - {"dense"}
    if "dense" in chosen and options:
        raise InputError(f"backward 'dense' cannot be combined with {', '.join(sorted(options))}; drop 'dense'")
    if {"transposable", "bimask"} <= options:
        raise InputError(
            "backward 'transposable' and 'bimask' are alternatives for the input gradient; choose one of them"
        )
    return options


@dataclass(frozen=True)
class BackwardOptions:
    """Options of the backward passes."""

    transposable_method: str = "exact"
    """Transposable mask solver: "exact" (optimal) or "greedy" (the 2-approximation)."""
    mvue_pattern: str | Pattern = "2:4"
    """Pattern of the neural-gradient pruning: 1:2 or 2:4 in the paper."""
    permutation_interval: int = 100
    """Bi-directional masks: steps between output-channel permutation searches."""
    permutation_candidates: int = 100
    """Bi-directional masks: random permutations scored per search (the current one always competes)."""
    sparse_kernels: bool = True
    """Use torch's semi-structured sparse kernels where they apply (CUDA only)."""
    seed: int = 0
    """Seed of the sparsifier's generators (gradient masks, permutation candidates)."""

    def __post_init__(self) -> None:
        if self.transposable_method not in TRANSPOSABLE_METHODS:
            raise InputError(
                f"unknown transposable_method {self.transposable_method!r}; choose {', '.join(TRANSPOSABLE_METHODS)}"
            )
        Pattern.parse(self.mvue_pattern)
        check_count(self.permutation_interval, "permutation_interval", minimum=1)
        check_count(self.permutation_candidates, "permutation_candidates")
        check_count(self.seed, "seed")


@dataclass(frozen=True)
class BackwardPlan:
    """Which GEMMs of a layer use pruned operands."""

    transposable: bool
    bimask: bool
    mvue: Pattern | None
    sparse_kernels: bool

    @property
    def custom(self) -> bool:
        """Whether the layer needs the custom autograd function (plain autograd computes the dense backward)."""
        return self.transposable or self.bimask or self.mvue is not None


class GeneratorBank:
    """The sparsifier's random generators, all derived from one seed so a resume is exact.

    Two kinds: *shared* generators (one per device, seeded by the seed; permutation candidates), whose draws every
    rank of a distributed run must agree on, and *gradient* generators (MVUE's masks), which each rank reseeds at
    every step from ``(seed, rank, step)``: ranks prune different batch shards with independent streams, and any
    step's draws can be reproduced without a saved state, also on a different number of processes.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.step = 0
        self._generators: dict[str, torch.Generator] = {}
        self._gradient: dict[str, torch.Generator] = {}
        self._gradient_seeded: dict[str, tuple[int, int]] = {}

    def get(self, device: torch.device | str) -> torch.Generator:
        """The shared generator of ``device``."""
        key = str(torch.device(device))
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=key).manual_seed(self.seed)
        return self._generators[key]

    def advance(self, step: int) -> None:
        """Gradient draws from now on belong to ``step`` (optimiser steps done)."""
        self.step = step

    def gradients(self, device: torch.device | str) -> torch.Generator:
        """The gradient generator of ``device`` for this rank and step, reseeded at the first draw of a step."""
        key = str(torch.device(device))
        rank = _rank()
        if self._gradient_seeded.get(key) != (rank, self.step):
            generator = self._gradient.setdefault(key, torch.Generator(device=key))
            generator.manual_seed(stream_seed(self.seed, rank, self.step))
            self._gradient_seeded[key] = (rank, self.step)
        return self._gradient[key]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {key: generator.get_state() for key, generator in self._generators.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for key, generator_state in state.items():
            self.get(key).set_state(generator_state)


def stream_seed(seed: int, rank: int, step: int) -> int:
    """A 64-bit seed for the stream ``(seed, rank, step)``; numpy's SeedSequence mixes the three so that nearby
    triples give unrelated streams."""
    return int(np.random.SeedSequence((seed, rank, step)).generate_state(1, np.uint64)[0])


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


# ------------------------------------------------------------------------------------------------ kernel dispatch


def fits_two_four(pattern: Pattern | None) -> bool:
    """Whether every tensor following ``pattern`` also follows 2:4 (1:2, 1:4 and 2:4 do)."""
    return pattern is not None and 4 % pattern.m == 0 and pattern.n * (4 // pattern.m) <= 2


def semi_structured_constraints() -> dict[torch.dtype, tuple[int, int]] | None:
    """Minimum (rows, cols) of the sparse operand per dtype for torch's active semi-structured backend, or None."""
    try:
        from torch.sparse import semi_structured
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    cutlass = semi_structured.SparseSemiStructuredTensor._FORCE_CUTLASS
    if not cutlass and not torch.backends.cusparselt.is_available():
        return None
    backend = (
        semi_structured.SparseSemiStructuredTensorCUTLASS
        if cutlass
        else semi_structured.SparseSemiStructuredTensorCUSPARSELT
    )
    return {
        dtype: (config.sparse_min_rows, config.sparse_min_cols)
        for dtype, config in backend._DTYPE_SHAPE_CONSTRAINTS.items()
        if dtype in (torch.float16, torch.bfloat16)
    }


def constraints(device_type: str) -> dict[torch.dtype, tuple[int, int]] | None:
    """:func:`semi_structured_constraints` on CUDA, None elsewhere (without asking torch's CUDA backends)."""
    return semi_structured_constraints() if device_type == "cuda" else None


def sparse_kernel_reason(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device_type: str,
    pattern: Pattern | None,
    constraints: dict[torch.dtype, tuple[int, int]] | None,
) -> str | None:
    """None when a sparse GEMM operand of ``shape`` (N:M along its last axis) can run on the semi-structured
    kernels; otherwise why not."""
    if device_type != "cuda":
        return f"semi-structured kernels need CUDA, the operand is on {device_type}"
    if not fits_two_four(pattern):
        return f"pattern {pattern} is not 2:4-compatible" if pattern else "the operand is not N:M sparse"
    if constraints is None:
        return "torch has no semi-structured sparse backend available here"
    if dtype not in constraints:
        return f"dtype {dtype} is not supported (use float16 or bfloat16)"
    if len(shape) != 2:
        return f"the sparse operand must be a matrix, got shape {tuple(shape)}"
    min_rows, min_cols = constraints[dtype]
    rows, cols = shape
    if rows % min_rows or cols % min_cols or rows == 0 or cols == 0:
        return f"shape {tuple(shape)} is not a multiple of ({min_rows}, {min_cols})"
    return None


def semi_structured_linear(dense: torch.Tensor, sparse: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``dense @ sparse^T + bias`` with ``sparse`` compressed to torch's semi-structured format (CUDA)."""
    compressed = torch.sparse.to_sparse_semi_structured(sparse.contiguous())
    return functional.linear(dense.contiguous(), compressed, bias)


class _Kernels:
    """Per-layer GEMM dispatch: semi-structured kernels where :func:`sparse_kernel_reason` allows, dense otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.used: dict[str, bool] = {}
        """GEMM name -> whether its last call ran on sparse kernels (for tests and benchmarks)."""

    def sparse(self, name: str, operand: torch.Tensor, shape: tuple[int, int], pattern: Pattern | None) -> bool:
        """Whether GEMM ``name`` runs sparse, for a sparse operand of ``shape`` (N:M along its last axis)."""
        device = operand.device.type
        use = self.enabled and sparse_kernel_reason(shape, operand.dtype, device, pattern, constraints(device)) is None
        self.used[name] = use
        return use


# ------------------------------------------------------------------------------------------------ autograd functions


def _mvue_tokens(grad: torch.Tensor, pattern: Pattern, generator: torch.Generator) -> torch.Tensor:
    """MVUE-prune ``[tokens, out]`` along tokens; a partial trailing group stays exact (it cannot bias anything)."""
    return mvue_prune(grad, pattern, axis=0, generator=generator, remainder="dense")


class _SparseLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dgrad_mask: torch.Tensor | None,
        permutation: torch.Tensor | None,
        layer: SparseBackward,
    ) -> torch.Tensor:
        if layer.kernels.sparse("forward", weight, tuple(weight.shape), layer.parametrization.sparse_pattern):
            flat = semi_structured_linear(input.reshape(-1, input.shape[-1]), weight, bias)
            output = flat if input.ndim == 2 else flat.reshape(*input.shape[:-1], weight.shape[0])
        else:
            # Not flattened first: the output is then a fresh tensor, not a view of one (FSDP2 warns about modules
            # that return views, on which an in-place op would drop its pre-backward hook).
            output = functional.linear(input, weight, bias)
        ctx.save_for_backward(input, weight, dgrad_mask, permutation)
        ctx.layer = layer
        ctx.input_shape = input.shape
        ctx.has_bias = bias is not None
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, dgrad_mask, permutation = ctx.saved_tensors
        flat = input.reshape(-1, input.shape[-1])
        layer: SparseBackward = ctx.layer
        grad = grad_output.reshape(-1, weight.shape[0])
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = layer.input_gradient(grad, weight, dgrad_mask, permutation).reshape(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            pruned = grad if layer.plan.mvue is None else _mvue_tokens(grad, layer.plan.mvue, layer.generator(grad))
            # dW = G^T X: the sparse operand G^T [out, tokens] is N:M along its last axis (tokens).
            if layer.kernels.sparse("weight", pruned, (pruned.shape[1], pruned.shape[0]), layer.plan.mvue):
                grad_weight = semi_structured_linear(flat.t(), pruned.t(), None).t()
            else:
                grad_weight = pruned.t() @ flat
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(dim=0)
        return grad_input, grad_weight, grad_bias, None, None, None


class _SparseConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        dgrad_mask: torch.Tensor | None,
        layer: SparseBackward,
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight, dgrad_mask)
        ctx.layer = layer
        ctx.has_bias = bias is not None
        return layer.convolution(input, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, dgrad_mask = ctx.saved_tensors
        layer: SparseBackward = ctx.layer
        module = layer.module
        spatial = input.ndim - 2
        input_grad_fn = torch.nn.grad.conv1d_input if spatial == 1 else torch.nn.grad.conv2d_input
        weight_grad_fn = torch.nn.grad.conv1d_weight if spatial == 1 else torch.nn.grad.conv2d_weight
        geometry = (module.stride, layer.padding, module.dilation, module.groups)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            operand = weight if dgrad_mask is None else weight * dgrad_mask
            grad_input = input_grad_fn(input.shape, operand, grad_output, *geometry)
        if ctx.needs_input_grad[1]:
            pruned = grad_output
            if layer.plan.mvue is not None:
                # Tokens are (batch, *spatial): channels last, flattened, pruned along tokens, put back.
                tokens = grad_output.movedim(1, -1)
                flat = _mvue_tokens(tokens.reshape(-1, tokens.shape[-1]), layer.plan.mvue, layer.generator(grad_output))
                pruned = flat.reshape(tokens.shape).movedim(-1, 1)
            grad_weight = weight_grad_fn(input, weight.shape, pruned, *geometry)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(dim=[0, *range(2, grad_output.ndim)])
        return grad_input, grad_weight, grad_bias, None, None


# ------------------------------------------------------------------------------------------------ per-layer state


def conv_padding(module: nn.Module) -> tuple[int, ...] | str:
    """The convolution's padding as integers, or the reason it cannot be expressed as symmetric integers."""
    padding = module.padding
    if padding == "valid":
        return (0,) * len(module.kernel_size)
    if padding == "same":
        totals = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size, strict=True)]
        if any(total % 2 for total in totals):
            return "padding='same' with an even kernel pads asymmetrically, which the custom backward does not support"
        return tuple(total // 2 for total in totals)
    return tuple(padding)


class SparseBackward:
    """Installed as a layer's ``forward``: runs its GEMMs through the custom autograd functions.

    Bi-directional state (the backward mask and the output-channel permutation) lives as buffers on the layer's
    parametrisation, beside the forward mask, so ``state_dict`` carries it.
    """

    def __init__(
        self,
        module: nn.Module,
        parametrization: NMParametrization,
        plan: BackwardPlan,
        generators: GeneratorBank,
        options: BackwardOptions,
    ) -> None:
        self.module = module
        self.parametrization = parametrization
        self.plan = plan
        self.generators = generators
        self.kernels = _Kernels(plan.sparse_kernels)
        self.ran = False
        """Whether the masked forward ran at least once (a weight read around it never sets this)."""
        self.permutation_schedule = Every(options.permutation_interval)
        self.permutation_candidates = options.permutation_candidates
        self.is_conv = isinstance(module, nn.Conv1d | nn.Conv2d)
        self.padding: tuple[int, ...] = ()
        if self.is_conv:
            padding = conv_padding(module)
            assert not isinstance(padding, str), padding  # sparsify skips such layers first
            self.padding = (0,) * len(padding) if module.padding_mode != "zeros" else padding
        if plan.bimask:
            weight = parametrization.mask
            parametrization.register_buffer("backward_mask", torch.zeros_like(weight))
            permutation = torch.arange(weight.shape[0], device=weight.device)
            parametrization.register_buffer("permutation", permutation)

    def generator(self, like: torch.Tensor) -> torch.Generator:
        """MVUE's generator: this rank's stream for the current step."""
        return self.generators.gradients(like.device)

    def refresh(self, weight: torch.Tensor, step: int, forward_changed: bool) -> None:
        """Bi-directional masks: search a permutation when due, and rebuild the backward mask when anything moved."""
        if not self.plan.bimask:
            return
        p = self.parametrization
        searched = False
        if self.permutation_schedule.due(step):
            best = search_output_permutation(
                p.mask,
                p.pattern,
                candidates=self.permutation_candidates,
                generator=self.generators.get("cpu"),
                current=p.permutation,
            )
            searched = not torch.equal(best, p.permutation)
            p.permutation.copy_(best)
        if forward_changed or searched or step == 0:
            with torch.no_grad():
                p.backward_mask.copy_(backward_mask(weight, p.mask, p.pattern, p.permutation))

    def input_gradient(
        self,
        grad: torch.Tensor,
        weight: torch.Tensor,
        dgrad_mask: torch.Tensor | None,
        permutation: torch.Tensor | None,
    ) -> torch.Tensor:
        """dX = dY B for a Linear layer, B as the plan says; the sparse operand is B^T, N:M along outputs."""
        out, inputs = weight.shape
        if dgrad_mask is not None:
            operand = weight * dgrad_mask
            # A slice of the weight (a split attention projection) has no permutation of its own: dense GEMM.
            pattern = self.parametrization.pattern
            if permutation is not None and self.kernels.sparse("input", operand, (inputs, out), pattern):
                # The backward mask's groups are consecutive in permutation order: gather B's rows and dY's
                # columns alike, so the product is unchanged.
                return semi_structured_linear(grad[:, permutation], operand[permutation].t(), None)
            return grad @ operand
        pattern = self.parametrization.sparse_pattern if self.plan.transposable else None
        if self.kernels.sparse("input", weight, (inputs, out), pattern):
            return semi_structured_linear(grad, weight.t(), None)
        return grad @ weight

    def convolution(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        module = self.module
        conv = functional.conv1d if input.ndim == 3 else functional.conv2d
        return conv(input, weight, bias, module.stride, self.padding, module.dilation, module.groups)

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        return _run_custom(self, input)


@torch.compiler.disable
def _run_custom(layer: SparseBackward, input: torch.Tensor) -> torch.Tensor:
    # Kept out of compiled graphs: the backward draws from a generator the sparsifier owns and dispatches on the
    # runtime shape, which a traced graph cannot express; the rest of the model still compiles.
    layer.ran = True
    module = layer.module
    weight = module.weight
    dgrad_mask = layer.parametrization.backward_mask if layer.plan.bimask else None
    if layer.is_conv:
        if module.padding_mode != "zeros":
            input = functional.pad(input, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        return _SparseConvFunction.apply(input, weight, module.bias, dgrad_mask, layer)
    permutation = layer.parametrization.permutation if layer.plan.bimask else None
    return _SparseLinearFunction.apply(input, weight, module.bias, dgrad_mask, permutation, layer)


def install(module: nn.Module, layer: SparseBackward) -> None:
    """Route ``module``'s forward through ``layer`` (an instance attribute, removed by :func:`uninstall`)."""
    module.forward = layer


def uninstall(module: nn.Module) -> None:
    if isinstance(module.__dict__.get("forward"), SparseBackward):
        del module.forward
