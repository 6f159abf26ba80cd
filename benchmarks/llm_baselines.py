"""The other tools on the same decoder, calibration tokens and evaluation text as benchmarks/llm.py.

Each tool runs in an environment of its own (none of them is a dependency of nmdeploy), on the transformers model
``llm.py prepare`` saved, and writes a row beside nmdeploy's rows (WORK/rows/<name>.json: seconds, peak RSS,
perplexity) so that ``llm.py table`` lists every tool side by side:

    python3 -m venv /work/lc-venv
    /work/lc-venv/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    /work/lc-venv/bin/python benchmarks/llm_baselines.py llmcompressor          # SparseGPT 2:4, lm_head dense
    /work/lc-venv/bin/python benchmarks/llm_baselines.py llmcompressor-fp8      # the same, then its FP8 scheme
    /work/lc-venv/bin/python benchmarks/llm_baselines.py --model qwen05b llmcompressor   # another decoder

    python3 -m venv /work/mo-venv
    /work/mo-venv/bin/pip install torch==2.13.0 nvidia-modelopt==0.47.0 requests transformers accelerate
    /work/mo-venv/bin/python benchmarks/llm_baselines.py modelopt               # mts.sparsify(mode="sparsegpt")

Every tool gets its documented 2:4 recipe with its own defaults (llm-compressor: SparseGPTModifier, sparsity 0.5,
mask_structure "2:4", its sequential pipeline, lm_head ignored as its examples do; ModelOpt: sparsegpt mode, which
leaves lm_head dense too). Perplexity is exp(mean next-token NLL) over the evaluation rows, one row at a time, the
formula of nmdeploy's perplexity measure. Seconds: loading the model and the tool's whole calibration, as a user
waits for it (no saving). Peak RSS: this process's, which holds the one model.
"""

from __future__ import annotations

import argparse
import datetime
import resource
import time

import numpy as np
import torch
from llm_common import DECODERS, MODEL, WORK, save_row, torch_perplexity


def load_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(WORK / "hf", dtype=torch.float32).eval()


def calibration_ids() -> np.ndarray:
    return np.load(WORK / "calib.npz")["input_ids"]


def sparsity_24(model) -> dict:
    """How many block linears are exactly 2:4 along their input axis, and how many are not."""
    compliant, other = 0, []
    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            groups = (module.weight.detach().reshape(module.out_features, -1, 4) != 0).sum(-1)
            if bool((groups <= 2).all()):
                compliant += 1
            else:
                other.append(name)
    return {"linears_2_4": compliant, "linears_not_2_4": other}


def llmcompressor(fp8: bool) -> dict:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.pruning.sparsegpt import SparseGPTModifier

    ids = calibration_ids()
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()})
    recipe = [SparseGPTModifier(sparsity=0.5, mask_structure="2:4", targets=["Linear"], ignore=["re:.*lm_head"])]
    if fp8:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        recipe.append(QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["re:.*lm_head"]))
    model = load_model()
    oneshot(
        model=model,
        dataset=dataset,
        recipe=recipe,
        num_calibration_samples=len(ids),
        max_seq_length=ids.shape[1],
        shuffle_calibration_samples=False,
    )
    return {"model": model}


def modelopt() -> dict:
    import modelopt.torch.sparsity as mts

    ids = torch.from_numpy(calibration_ids())
    loader = [{"input_ids": ids[row : row + 1]} for row in range(len(ids))]
    model = load_model()
    # Its Hessians default to "cuda"; everything else is the mode's default (damping 0.1, lm_head left dense).
    config = {"data_loader": loader, "collect_func": lambda batch: batch, "device": "cpu"}
    sparsified = mts.sparsify(model, mode="sparsegpt", config=config)
    return {"model": sparsified[0] if isinstance(sparsified, tuple) else sparsified}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=DECODERS, default=MODEL, help="the decoder (read by llm_common)")
    parser.add_argument("tool", choices=("llmcompressor", "llmcompressor-fp8", "modelopt"))
    args = parser.parse_args()
    torch.manual_seed(0)
    started = datetime.datetime.now(datetime.UTC).isoformat()
    start = time.perf_counter()
    result = modelopt() if args.tool == "modelopt" else llmcompressor(fp8=args.tool.endswith("fp8"))
    seconds = time.perf_counter() - start
    model = result["model"]
    record = {
        "name": args.tool,
        "method": args.tool,
        "args": [f"torch {torch.__version__}, {len(calibration_ids())} x {calibration_ids().shape[1]} tokens"],
        "started": started,
        "seconds": seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **sparsity_24(model),
    }
    record["perplexity"] = torch_perplexity(model)
    save_row(record, keys=("name", "seconds", "peak_rss_mb", "perplexity", "linears_2_4"))


if __name__ == "__main__":
    main()
