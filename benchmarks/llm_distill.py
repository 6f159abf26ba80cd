"""``llm.py distill``: recovery of a 2:4 decoder in PyTorch, beside ONNX recovery (``convert --recover``).

The student starts from the 2:4 weights a ``row`` wrote (its ONNX export, e.g. ``sparsegpt``: the same one-shot
start as ``convert --recover`` fits), loaded into the transformers model ``prepare`` saved; its masks are the kept
entries, fixed (``sparsify(method="fixed")``). It trains with nmdeploy.train.distillation's LayerDistillation
(SquareHead: every decoder layer's output, plus the next-token KL) toward the dense model on the calibration rows,
a share ``augment`` of their tokens replaced at every step as ``convert --recover`` does (0: the rows as they are):
Adam, the learning rate warmed up and decayed as ``convert --recover`` does, bfloat16 autocast where the CPU
multiplies it natively. The row records the training time and the whole run's wall time, peak RSS and perplexity.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import resource
import time

import numpy as np
import onnx
from llm_common import WORK, save_row, torch_perplexity
from onnx import numpy_helper


def _two_dimensional(path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if len(t.dims) == 2}


def load_converted(model, source: str) -> int:
    """Write the 2:4 weights of row ``source``'s export into ``model``'s block linears: each linear is found by its
    dense weight, which the dense export stores transposed ([in, out]) under a name of its own. Returns how many."""
    import torch

    dense, converted = _two_dimensional(WORK / "dense.onnx"), _two_dimensional(WORK / f"{source}.onnx")
    by_value = {hashlib.sha256(np.ascontiguousarray(v.T).tobytes()).hexdigest(): n for n, v in dense.items()}
    loaded = 0
    for module in model.model.layers.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight.detach().numpy()
        name = by_value.get(hashlib.sha256(np.ascontiguousarray(weight).tobytes()).hexdigest())
        if name is None:
            raise SystemExit(f"no weight of {WORK / 'dense.onnx'} matches a {weight.shape} linear")
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(np.ascontiguousarray(converted[name].T)))
        loaded += 1
    return loaded


def distill(
    source: str,
    steps: int,
    lr: float,
    batch: int,
    augment: float,
    hidden_weight: float,
    train_embedding: bool,
    name: str | None,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from nmdeploy.conversion.recovery import warmup_cosine
    from nmdeploy.masks.augmentation import TokenAugmentation
    from nmdeploy.runtimes.torch import training_precision
    from nmdeploy.train import finalize, sparsify
    from nmdeploy.train.distillation import LayerDistillation

    name = name or f"{source}-distill{steps}"
    started = datetime.datetime.now(datetime.UTC).isoformat()
    start = time.perf_counter()
    teacher = AutoModelForCausalLM.from_pretrained(WORK / "hf", dtype=torch.float32).eval()
    student = copy.deepcopy(teacher)
    loaded = load_converted(student, source)
    linears = {n: m for n, m in student.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    start_weights = {n: m.weight.detach().clone() for n, m in linears.items()}
    sparsifier = sparsify(student, "2:4", method="fixed", init="magnitude", keep_dense="auto")
    for layer, module in linears.items():  # the magnitude masks keep exactly the converted model's kept entries
        if not torch.equal(module.weight.detach(), start_weights[layer]):
            raise SystemExit(f"{layer}: the first masks do not reproduce the converted weights")
    rows = torch.from_numpy(np.load(WORK / "calib.npz")["input_ids"])
    batches = [{"input_ids": rows[i : i + batch]} for i in range(0, len(rows), batch)]
    table = teacher.get_input_embeddings().weight.detach().numpy()
    augmentation = TokenAugmentation({"input_ids": table}, [{"input_ids": rows.numpy()}], augment) if augment else None
    distillation = LayerDistillation(teacher, hidden_weight=hidden_weight, augmentation=augmentation)
    # What convert --recover trains: the block linears' kept weights, biases and normalisations; the token embedding
    # (tied to the lm_head), which the one-shot fit left dense, stays as it is unless asked.
    student.get_input_embeddings().requires_grad_(train_embedding)
    parameters = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(parameters, lr=lr, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, steps))
    precision = training_precision("auto")
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(batches), generator=generator)
    student.train()
    trained = time.perf_counter()
    losses = []
    for step in range(steps):
        if step and step % len(batches) == 0:
            order = torch.randperm(len(batches), generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            loss = distillation(student, batches[int(order[step % len(batches)])])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        sparsifier.step()
        losses.append(float(loss.detach()))
        print(f"step {step + 1}/{steps}: loss {losses[-1]:.4f} {distillation.last}", flush=True)
    training_seconds = time.perf_counter() - trained
    student.eval()
    finalize(student)
    seconds = time.perf_counter() - start
    record = {
        "name": name,
        "method": f"{source} + PyTorch LayerDistillation",
        "start": source,  # the row whose 2:4 weights it started from
        "args": [
            f"--steps {steps}",
            f"--lr {lr:g}",
            f"--batch {batch}",
            f"--augment {augment:g}",
            f"--hidden-weight {hidden_weight:g}",
        ],
        "started": started,
        "seconds": seconds,
        "training_seconds": training_seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "converted": loaded,
        "training_precision": precision,
        "losses": losses,
        "perplexity": torch_perplexity(student),
    }
    save_row(record)
