"""A tiny decoder language model exported to ONNX the ways users export theirs.

transformers' LlamaForCausalLM with a tiny config (2 layers, hidden 64, GQA 4 query / 2 key-value heads, RoPE, the
lm_head tied to the token embedding), random weights from a fixed seed, exported with
``torch.onnx.export(..., dynamo=True, opset_version=18)`` in the forms seen in practice:

- ``plain``: input_ids -> logits, traced at batch 2 with a dynamic batch and sequence (``dynamic_shapes``);
  weights embedded in the .onnx file.
- ``batch1``: the same traced from a batch-1 example with the legacy ``dynamic_axes``: the batch is declared
  symbolic, yet the exported masks keep batch 1, so ONNX Runtime fails at batch 2 (what a first export often is).
- ``cache``: input_ids, attention_mask, position_ids and past_key_values.{i}.key / .value in; logits and
  present.{i}.key / .value out, as optimum-onnx names them; weights in external data (``model.onnx.data``).
- ``untied`` (not in ``FORMS``): ``plain`` with an lm_head of its own, as Qwen2.5 and Llama 3 8B have.

An export takes several seconds on two cores, so each form is exported once per test session (``exported``) into a
temporary folder; tests that change a model copy it first (``copy_model``).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np

VOCABULARY, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 64, 128, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
FORMS = ("plain", "batch1", "cache")


def build_decoder(seed: int = 0, tied: bool = True):
    """The tiny LlamaForCausalLM in eval mode, its weights drawn from ``seed``; the lm_head is the embedding unless
    ``tied`` is False."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCABULARY,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # The default initialisation draws N(0, 0.02): widen it so each layer's weights shape the logits.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.5 / parameter.shape[1] ** 0.5)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    return model


def _plain_module(model):
    import torch

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    return Logits(model).eval()


def _cache_module(model):
    import torch
    from transformers import DynamicCache

    class WithCache(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(LAYERS)], config=self.model.config)
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
            present = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *present)

    return WithCache(model).eval()


def cache_names() -> tuple[list[str], list[str]]:
    """(past input names, present output names) in optimum-onnx's spelling."""
    past = [f"past_key_values.{i}.{kind}" for i in range(LAYERS) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(LAYERS) for kind in ("key", "value")]
    return past, present


def export_decoder(form: str, path: Path, seed: int = 0) -> Path:
    """Export the tiny decoder in ``form`` (see the module's docstring) to ``path``."""
    import torch

    model = build_decoder(seed, tied=form != "untied")
    generator = torch.Generator().manual_seed(seed + 1)
    if form in ("plain", "batch1", "untied"):
        batch = 1 if form == "batch1" else 2
        ids = torch.randint(0, VOCABULARY, (batch, 8), generator=generator)
        shapes = {}
        if form != "batch1":
            shapes["dynamic_shapes"] = {"input_ids": {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")}}
        else:
            axes = {0: "batch", 1: "sequence"}
            shapes["dynamic_axes"] = {"input_ids": axes, "logits": axes}
        torch.onnx.export(
            _plain_module(model), (ids,), str(path), dynamo=True, opset_version=18, external_data=False,
            input_names=["input_ids"], output_names=["logits"], verbose=False, **shapes,
        )  # fmt: skip
        return path
    if form != "cache":
        raise ValueError(f"unknown form {form!r}; choose one of {FORMS}")
    batch, sequence, past_length = 2, 5, 3
    ids = torch.randint(0, VOCABULARY, (batch, sequence), generator=generator)
    mask = torch.ones(batch, past_length + sequence, dtype=torch.int64)
    positions = torch.arange(past_length, past_length + sequence).expand(batch, -1).contiguous()
    past = [torch.randn(batch, KV_HEADS, past_length, HEAD_DIM, generator=generator) for _ in range(2 * LAYERS)]
    past_names, present_names = cache_names()
    b, s, p = torch.export.Dim("batch"), torch.export.Dim("sequence"), torch.export.Dim("past_sequence")
    total = torch.export.Dim("total_sequence")
    shapes = ({0: b, 1: s}, {0: b, 1: total}, {0: b, 1: s}, tuple([{0: b, 2: p}] * len(past)))
    torch.onnx.export(
        _cache_module(model), (ids, mask, positions, *past), str(path), dynamo=True, opset_version=18,
        external_data=True, input_names=["input_ids", "attention_mask", "position_ids", *past_names],
        output_names=["logits", *present_names], dynamic_shapes=shapes, verbose=False,
    )  # fmt: skip
    return path


_FOLDER: list[Path] = []


@functools.cache
def exported(form: str) -> Path:
    """The session's one export of ``form`` (read only: copy it with ``copy_model`` before changing it)."""
    if not _FOLDER:
        _FOLDER.append(Path(tempfile.mkdtemp(prefix="nmdeploy-decoder-")))
        atexit.register(shutil.rmtree, _FOLDER[0], True)
    folder = _FOLDER[0] / form
    folder.mkdir()
    with warnings.catch_warnings():  # the exporter's notes on dynamic_axes and axis names: the forms are on purpose
        warnings.simplefilter("ignore")
        return export_decoder(form, folder / "model.onnx")


def copy_model(source: Path, folder: Path) -> Path:
    """``source`` and its external data file, if any, copied into ``folder``; the copy's path."""
    folder.mkdir(parents=True, exist_ok=True)
    for file in source.parent.iterdir():
        if file.name == source.name or file.name.startswith(source.name + "."):
            shutil.copy2(file, folder / file.name)
    return folder / source.name


def token_rows(rows: int, length: int, seed: int = 0) -> np.ndarray:
    """Token ids drawn from the vocabulary, [rows, length] int64."""
    return np.random.default_rng(seed).integers(0, VOCABULARY, (rows, length)).astype(np.int64)


def cache_feed(ids: np.ndarray) -> dict[str, np.ndarray]:
    """The inputs of the ``cache`` form for a first pass over ``ids``: an empty cache (past length 0), the mask all
    ones, positions 0..L-1."""
    rows, length = ids.shape
    past_names, _ = cache_names()
    feed = {
        "input_ids": ids,
        "attention_mask": np.ones((rows, length), np.int64),
        "position_ids": np.broadcast_to(np.arange(length, dtype=np.int64), (rows, length)).copy(),
    }
    return feed | {name: np.zeros((rows, KV_HEADS, 0, HEAD_DIM), np.float32) for name in past_names}
