"""Sections ``train_step`` and ``minilm_finetune``: one training step of an FFN block, dense against torch's
semi-structured kernels and nmdeploy's ``sparsify``; distillation steps of a MiniLM-shaped student, dense and 2:4."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from gpu_check import timing
from gpu_check.common import progress
from gpu_check.convert import carried_data
from gpu_check.gemm import two_four_mask
from gpu_check.plan import build_plan, finetune_config
from gpu_check.runner import Run, SectionTimeout, on_cuda


class _CompressedLinear:
    """``y = x W^T + b`` with W (2:4 both ways) compressed every call: forward on W, input gradient on W^T, both
    through torch's semi-structured kernels; weight gradient dense (it is a dense x dense product)."""

    @staticmethod
    def function():
        import torch
        from torch.nn import functional

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, weight, bias, compress):
                ctx.save_for_backward(x, weight)
                ctx.compress = compress
                flat = x.reshape(-1, x.shape[-1])
                return functional.linear(flat, compress(weight), bias).reshape(*x.shape[:-1], weight.shape[0])

            @staticmethod
            def backward(ctx, grad):
                x, weight = ctx.saved_tensors
                flat_grad = grad.reshape(-1, grad.shape[-1])
                grad_x = functional.linear(flat_grad, ctx.compress(weight.t().contiguous()))
                grad_w = flat_grad.t() @ x.reshape(-1, x.shape[-1])
                return grad_x.reshape(x.shape), grad_w, flat_grad.sum(0), None

        return Function


class _StaticSortLinear:
    """The same layer through ``prune_dense_static_sort``: one call packs W and W^T (4x4-tile 2:4 both ways)."""

    @staticmethod
    def function():
        import torch
        from torch.nn import functional

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, weight, bias, kernel):
                packed = kernel.prune_dense_static_sort(weight)
                ctx.save_for_backward(x)
                ctx.packed = packed
                flat = x.reshape(-1, x.shape[-1])
                return functional.linear(flat, packed, bias).reshape(*x.shape[:-1], weight.shape[0])

            @staticmethod
            def backward(ctx, grad):
                (x,) = ctx.saved_tensors
                flat_grad = grad.reshape(-1, grad.shape[-1])
                grad_x = flat_grad @ ctx.packed  # dense @ sparse: the transposed packing
                grad_w = flat_grad.t() @ x.reshape(-1, x.shape[-1])
                return grad_x.reshape(x.shape), grad_w, flat_grad.sum(0), None

        return Function


def _ffn(hidden: int, inner: int, device: str, dtype):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden)).to(device=device, dtype=dtype)


def _custom_ffn(model, make_function, extra):
    """``model``'s two Linear layers run through a custom autograd function (GELU between)."""
    from torch import nn
    from torch.nn import functional

    first, second = model[0], model[2]
    function = make_function()

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = first, second

        def forward(self, x):
            hidden = functional.gelu(function.apply(x, self.first.weight, self.first.bias, extra))
            return function.apply(hidden, self.second.weight, self.second.bias, extra)

    return Block()


def step_timer(
    model, x, cuda: bool, steps: int, after_step: Callable[[], None] | None = None, graphed: bool = False
) -> dict:
    """Median ms of forward + MSE loss + backward + AdamW step (+ ``after_step``) over ``steps`` steps after three
    warm-up steps, and the peak memory of those steps on CUDA. ``graphed``: the whole step captured once in a CUDA
    graph (AdamW with capturable state) and replayed, so the host's per-call dispatch is not timed."""
    import torch

    if graphed and not cuda:
        raise NotImplementedError("CUDA graphs need CUDA")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=graphed)
    target = torch.zeros_like(x)

    def step():
        optimizer.zero_grad(set_to_none=not graphed)  # a graph zeroes the gradients it holds, in place
        loss = torch.nn.functional.mse_loss(model(x).float(), target.float())
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step()

    if graphed:  # warm-up on a side stream, then one capture; gradients stay in place (no set_to_none)
        run_step = timing.graphed(step)
    else:
        for _ in range(3):
            step()
        run_step = step
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        run_step()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    result = {"ms_per_step": round(statistics.median(times), 3), "steps": steps}
    if graphed:
        result["timed"] = "CUDA graph replay of the whole step"
    if cuda:
        result["max_memory_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return result


def train_variants(block: dict, device: str) -> dict[str, Callable[[], dict]]:
    """Name -> a function building and timing that variant of the block (each on its own fresh model)."""
    import torch

    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    steps = block["steps"]

    def data():
        generator = torch.Generator(device=device).manual_seed(2)
        return torch.randn(block["tokens"], block["hidden"], generator=generator, device=device).to(dtype)

    def masked(model):
        with torch.no_grad():
            for layer in (model[0], model[2]):
                layer.weight.mul_(two_four_mask(*layer.weight.shape, device).to(dtype))
        return model

    def dense(graphed: bool = False):
        return step_timer(_ffn(block["hidden"], block["inner"], device, dtype), data(), cuda, steps, graphed=graphed)

    def compressed(graphed: bool = False):
        from torch.sparse import to_sparse_semi_structured

        model = masked(_ffn(block["hidden"], block["inner"], device, dtype))
        compress = to_sparse_semi_structured if cuda else (lambda w: w)
        layers = (model[0], model[2])
        masks = [two_four_mask(*layer.weight.shape, device).to(dtype) for layer in layers]

        def remask():  # AdamW moves pruned weights off zero: the fixed mask is applied again after each step
            with torch.no_grad():
                for layer, mask in zip(layers, masks, strict=True):
                    layer.weight.mul_(mask)

        block_model = _custom_ffn(model, _CompressedLinear.function, compress)
        return step_timer(block_model, data(), cuda, steps, remask, graphed=graphed)

    def static_sort(graphed: bool = False):
        if not cuda:
            raise NotImplementedError("prune_dense_static_sort runs on CUDA only")
        from torch.sparse import SparseSemiStructuredTensor
        from torch.sparse.semi_structured import (
            SparseSemiStructuredTensorCUSPARSELT,
            SparseSemiStructuredTensorCUTLASS,
        )

        cutlass = SparseSemiStructuredTensor._FORCE_CUTLASS or not torch.backends.cusparselt.is_available()
        kernel = SparseSemiStructuredTensorCUTLASS if cutlass else SparseSemiStructuredTensorCUSPARSELT
        model = _ffn(block["hidden"], block["inner"], device, dtype)
        return step_timer(_custom_ffn(model, _StaticSortLinear.function, kernel), data(), cuda, steps, graphed=graphed)

    def trainer(method: str, backward: str):
        def variant():
            from nmdeploy.train import sparsify

            model = _ffn(block["hidden"], block["inner"], device, dtype)
            sparsifier = sparsify(model, "2:4", method=method, backward=backward, keep_dense="none")
            result = step_timer(model, data(), cuda, steps, sparsifier.step)
            result["sparse_layers"] = len(sparsifier.layers)
            result["kernels_used"] = sparsifier.kernels_used()
            return result

        return variant

    return {
        "dense": dense,
        "torch semi-structured, W compressed every step (fixed transposable 2:4 mask)": compressed,
        "torch prune_dense_static_sort every step (W and W^T packed in one call)": static_sort,
        "nmdeploy sparsify fixed, backward transposable": trainer("fixed", "transposable"),
        "nmdeploy sparsify srste, backward transposable": trainer("srste", "transposable"),
        "nmdeploy sparsify srste, backward dense": trainer("srste", "dense"),
        # Eager semi-structured calls pay about 0.7 ms of host dispatch each (measured on an H200): the same steps
        # replayed from CUDA graphs show the kernels' own cost.
        "dense, CUDA graph": lambda: dense(graphed=True),
        "torch semi-structured, W compressed every step, CUDA graph": lambda: compressed(graphed=True),
        "torch prune_dense_static_sort every step, CUDA graph": lambda: static_sort(graphed=True),
    }


def train_step_section(run: Run, record: dict) -> None:
    import torch

    record["result"] = result = {}
    for block in build_plan(run.shapes, run.smoke)["train_step"]["blocks"]:
        rows = result[block["name"]] = {"block": block}
        for name, variant in train_variants(block, run.device).items():
            try:
                rows[name] = variant()
            except SectionTimeout:
                raise
            except Exception as error:
                rows[name] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
            finally:
                if on_cuda(run):
                    torch.cuda.empty_cache()
            baseline = "dense, CUDA graph" if name.endswith("CUDA graph") else "dense"
            dense = rows.get(baseline, {}).get("ms_per_step")
            if dense and "ms_per_step" in rows[name]:
                rows[name]["dense_over_this"] = round(dense / rows[name]["ms_per_step"], 3)
            progress(f"train_step: {block['name']}: {name}: {rows[name].get('ms_per_step', rows[name].get('error'))}")
            run.save()


def minilm_finetune_section(run: Run, record: dict) -> None:
    """Distillation steps of a MiniLM-shaped student (random weights, speed only) against its dense copy, on the
    carried calibration batches: dense, and 2:4 through nmdeploy's sparsify."""
    import copy

    import numpy as np
    import torch
    from transformers import BertConfig, BertModel

    config = finetune_config(run.smoke)
    cuda = on_cuda(run)
    device = run.device
    bert_config = BertConfig(vocab_size=30522, hidden_size=config["hidden"], num_hidden_layers=config["layers"],
                             num_attention_heads=config["heads"], intermediate_size=config["intermediate"])  # fmt: skip
    batches = []
    for path in sorted(carried_data(run)["calib"].glob("*.npz")):
        with np.load(path) as arrays:
            ids, mask = arrays["input_ids"], arrays["attention_mask"]
            batches.append((torch.from_numpy(ids[: config["batch"]]).to(device),
                            torch.from_numpy(mask[: config["batch"]]).to(device)))  # fmt: skip
    record["result"] = result = {"config": config, "note": "random weights: the figures are speed only"}

    def embed(model, ids, mask):
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)

    def timed(sparse: dict | None, bfloat16_weights: bool) -> dict:
        torch.manual_seed(0)
        teacher = BertModel(bert_config).to(device).eval()
        if bfloat16_weights:
            teacher = teacher.to(torch.bfloat16)
        student = copy.deepcopy(teacher).train()
        sparsifier = None
        if sparse is not None:
            from nmdeploy.train import sparsify

            sparsifier = sparsify(student, "2:4", include=r"^encoder\.", keep_dense="none", **sparse)
        optimizer = torch.optim.AdamW(student.parameters(), lr=1e-4)
        autocast_on = cuda and not bfloat16_weights

        def step(index: int) -> None:
            ids, mask = batches[index % len(batches)]
            with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=autocast_on):
                with torch.no_grad():
                    target = embed(teacher, ids, mask).float()
                loss = torch.nn.functional.mse_loss(embed(student, ids, mask).float(), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if sparsifier is not None:
                sparsifier.step()

        # Warm-up past the first steps' one-time costs (library handles, autocast caches, cuSPARSELt plans), then
        # the median step: one slow step (a first use) must not decide the row.
        for index in range(5):
            step(index)
        times = []
        for index in range(config["steps"]):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            step(index)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        row = {
            "seconds_per_1000_steps": round(1000 * statistics.median(times), 1),
            "mean_seconds_per_1000_steps": round(1000 * statistics.fmean(times), 1),
            "steps": config["steps"],
        }
        if sparsifier is not None:
            row["sparse_layers"] = len(sparsifier.layers)
            used = [ran for gemms in sparsifier.kernels_used().values() for ran in gemms.values()]
            row["gemms_on_sparse_kernels"] = f"{sum(used)} of {len(used)}"
        return row

    # name -> (sparsify options or None for dense, bfloat16 weights without autocast)
    variants = {
        "dense, float32 weights, bf16 autocast": (None, False),
        "2:4 srste, backward dense, float32 weights, bf16 autocast": ({"method": "srste"}, False),
        "dense, bfloat16 weights": (None, True),
        "2:4 fixed, backward transposable, bfloat16 weights (semi-structured kernels)": (
            {"method": "fixed", "backward": "transposable"},
            True,
        ),
    }
    for name, (options, bfloat16_weights) in variants.items():
        try:
            result[name] = timed(options, bfloat16_weights)
        except SectionTimeout:
            raise
        except Exception as error:
            result[name] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
        progress(f"minilm_finetune: {name}: {result[name]}")
        run.save()
