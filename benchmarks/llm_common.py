"""What every decoder benchmark script shares: the work folder, the torch perplexity and how a row is stored.

Kept to the standard library and numpy (torch imported inside), so the other tools' environments
(benchmarks/llm_baselines.py) import it too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

WORK = Path(os.environ.get("NMDEPLOY_LLM_BENCH", "/tmp/nmdeploy-llm-bench"))
SUMMARY_KEYS = ("name", "seconds", "peak_rss_mb", "perplexity")


def torch_perplexity(model) -> float:
    """exp(mean next-token NLL) of a transformers causal LM over the evaluation rows, one row at a time: the formula
    of nmdeploy's perplexity measure, for models run in torch."""
    import torch

    evaluation = torch.from_numpy(np.load(WORK / "eval.npz")["input_ids"])
    total, count = 0.0, 0
    with torch.no_grad():
        for row in evaluation:
            logits = model(input_ids=row[None]).logits[0, :-1].double()
            total += float(torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum"))
            count += len(row) - 1
    return float(np.exp(total / count))


def save_row(record: dict, keys: tuple[str, ...] = SUMMARY_KEYS) -> None:
    """Write ``record`` to WORK/rows/<its name>.json and print its ``keys`` (every key when empty) as one line."""
    (WORK / "rows").mkdir(exist_ok=True)
    (WORK / "rows" / f"{record['name']}.json").write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record.get(k) for k in keys} if keys else record), flush=True)
