"""Block-by-block sequential 2:4 fit of SmolLM2-135M in torch, with optional block reconstruction (the ``blocks``
step of benchmarks/llm.py, which prepares the model and tokens): the torch-side counterpart of
``nmdeploy convert --reconstruct``, for trying reconstruction variants (whole block, or attention and MLP apart)
without an ONNX conversion per variant."""

from __future__ import annotations

import copy
import time

import numpy as np
from llm_common import WORK, save_row, torch_perplexity

# Each block's linears in the order their inputs become known: a group shares one input.
BLOCK_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def blocks(
    name: str,
    calib_rows: int,
    damping: float,
    epochs: int,
    lr: float,
    batch: int,
    split: bool,
    row_name: str | None,
    fit_target: str = "layer",
    reconstruct_target: str = "model",
) -> None:
    """Sequential fit, block by block, then block reconstruction (masks fixed).

    Each block's linears are fitted with ``name`` group by group on the converted model's activations (SparseGPT's
    sequential order), each toward ``fit_target``: "layer", its own dense outputs on those activations (SparseGPT's
    target), or "model", the dense model's outputs there (``convert --fit-target model``: the target weight of
    ``nmdeploy.masks.shifted_target`` with the ridge convert uses, ten times the fit's damping); then ``epochs``
    passes of Adam over the calibration rows train the block's kept weights so that its output on the converted
    model's inputs matches the dense block's output on the dense inputs (MSE; ``reconstruct_target`` "model"), or
    the dense block's output on the converted inputs ("block": the block reproduces itself, as the "layer" fit target
    asks of each layer).
    ``split``: the attention half is fitted and reconstructed first (target: the dense residual stream after
    attention), then the MLP half is fitted on the reconstructed attention's output and reconstructed against the
    dense block output. The row goes to rows/<row_name>.json."""
    import torch
    from transformers import AutoModelForCausalLM

    from nmdeploy.masks import Pattern
    from nmdeploy.masks.fitting import LayerFit, fitting_method
    from nmdeploy.masks.reconstruct import shifted_target

    if split and reconstruct_target == "block":
        raise SystemExit("--reconstruct-target block reconstructs whole blocks: drop --split")
    if split and fit_target == "model":
        raise SystemExit("--split fits each half on its own inputs only: give --fit-target layer with it")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(WORK / "hf", dtype=torch.float32).eval()
    model.requires_grad_(False)
    method = fitting_method(name)
    pattern = Pattern.parse("2:4")
    ids = torch.from_numpy(np.load(WORK / "calib.npz")["input_ids"][:calib_rows])
    chunk = 4

    with torch.no_grad():
        dense_x = model.model.embed_tokens(ids)
        position = torch.arange(ids.shape[1])[None]
        rotary = model.model.rotary_emb(dense_x, position_ids=position)
    converted_x = dense_x.clone()

    def attention_half(block, x):
        return x + block.self_attn(block.input_layernorm(x), attention_mask=None, position_embeddings=rotary)[0]

    def mlp_half(block, h):
        return h + block.mlp(block.post_attention_layernorm(h))

    def run(function, block, x):
        with torch.no_grad():
            return torch.cat([function(block, x[r : r + chunk]) for r in range(0, len(x), chunk)])

    def inputs_of(module, function, block, x):
        captured = []
        handle = module.register_forward_pre_hook(lambda _m, args: captured.append(args[0].flatten(0, -2).float()))
        run(function, block, x)
        handle.remove()
        return torch.cat(captured)

    def fit_groups(block, groups, function, x, dense_block=None, dense_x=None):
        masks = {}
        for group in groups:
            modules = [block.get_submodule(g) for g in group]
            inputs = inputs_of(modules[0], function, block, x)
            hessian = inputs.T @ inputs
            cross = None
            if fit_target == "model":
                dense_inputs = inputs_of(dense_block.get_submodule(group[0]), function, dense_block, dense_x)
                cross = (inputs.T @ dense_inputs).double()
            for g, module in zip(group, modules, strict=True):
                matrix = module.weight.detach().double()
                support = matrix != 0
                if cross is not None:
                    matrix = shifted_target(matrix, hessian.double(), cross, 10 * damping)
                if not method.chooses_mask:
                    from nmdeploy.masks import nm_mask

                    scores = method.score(matrix, hessian)
                    support = support & nm_mask(scores, pattern, 1, score=scores)
                fitted = method.fit(LayerFit(matrix, support, hessian.clone(), pattern, damping)).float()
                module.weight.data.copy_(fitted)
                masks[g] = fitted != 0
        return masks

    def reconstruct(block, masks, function, x, target):
        if not epochs:
            return
        weights = {g: block.get_submodule(g).weight for g in masks}
        for w in weights.values():
            w.requires_grad_(True)
        optimiser = torch.optim.Adam(weights.values(), lr=lr)
        generator = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(epochs):
            for rows in torch.randperm(len(x), generator=generator).split(batch):
                loss = torch.nn.functional.mse_loss(function(block, x[rows]), target[rows])
                losses.append(float(loss))
                optimiser.zero_grad()
                loss.backward()
                for g, w in weights.items():
                    w.grad.mul_(masks[g])
                optimiser.step()
                with torch.no_grad():
                    for g, w in weights.items():
                        w.mul_(masks[g])
        for w in weights.values():
            w.requires_grad_(False)
        per_epoch = len(losses) // epochs
        print(f"  loss {np.mean(losses[:per_epoch]):.4g} -> {np.mean(losses[-per_epoch:]):.4g}", flush=True)

    def whole(block, x):
        return mlp_half(block, attention_half(block, x))

    start = time.perf_counter()
    for index, block in enumerate(model.model.layers):
        if split:
            dense_h = run(attention_half, block, dense_x)
            masks = fit_groups(block, BLOCK_GROUPS[:2], attention_half, converted_x)
            reconstruct(block, masks, attention_half, converted_x, dense_h)
            converted_h = run(attention_half, block, converted_x)
            dense_y = run(mlp_half, block, dense_h)
            masks = fit_groups(block, BLOCK_GROUPS[2:], mlp_half, converted_h)
            reconstruct(block, masks, mlp_half, converted_h, dense_y)
            converted_x = run(mlp_half, block, converted_h)
        else:
            dense_y = run(whole, block, dense_x)
            # The dense block on the converted inputs: what the block itself should reproduce (reconstruct_target
            # "block"), not the dense model's values there ("model"), which carry the earlier blocks' error too.
            target = run(whole, block, converted_x) if epochs and reconstruct_target == "block" else dense_y
            dense_block = copy.deepcopy(block) if fit_target == "model" else None
            masks = fit_groups(block, BLOCK_GROUPS, whole, converted_x, dense_block, dense_x)
            reconstruct(block, masks, whole, converted_x, target)
            converted_x = run(whole, block, converted_x)
        error = float((converted_x - dense_y).pow(2).mean() / dense_y.pow(2).mean())
        print(f"block {index}: relative output error {error:.4f}, {time.perf_counter() - start:.0f} s", flush=True)
        dense_x = dense_y
    seconds = time.perf_counter() - start

    mode = "attention and MLP apart" if split else "whole block"
    record = {
        "name": row_name or f"{name}-blocks",
        "method": name,
        "args": [
            f"torch, sequential, fit target {fit_target}, {calib_rows} x {ids.shape[1]} tokens, damping {damping}; "
            f"reconstruction: {mode} toward the dense {reconstruct_target}'s outputs, "
            f"{epochs} epochs, Adam lr {lr}, batch {batch}"
        ],
        "epochs": epochs,
        "lr": lr,
        "split": split,
        "fit_target": fit_target,
        "reconstruct_target": reconstruct_target,
        "calib_rows": calib_rows,
        "fit_seconds": seconds,
        "perplexity": torch_perplexity(model),
    }
    save_row(record, keys=())
