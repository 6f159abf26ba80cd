"""``nmdeploy data text --seq-len L --rows R`` for causal language models: the text packed into rows of exactly L
tokens with the model folder's tokenizer, every decoder input filled for a first pass (an empty KV cache)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import decoder_model as dm  # noqa: E402

from nmdeploy.cli import main  # noqa: E402

pytestmark = pytest.mark.slow  # the decoder exports take seconds (once per session)

PARAGRAPHS = [
    "Sparse weights keep two of every four values along the reduction axis. The kernels skip the zeros.",
    "A decoder reads its own past through a cache of keys and values.\nEach new token attends to all of them.",
    "Calibration rows are packed end to end, so no position is padding and every token predicts the next one.",
    "The tied embedding serves twice: it looks tokens up, and it turns the last hidden state into logits.",
]


def train_tokenizer(folder, vocabulary: int = 200):
    """A byte-level BPE tokenizer of ``vocabulary`` ids trained on the paragraphs, saved as folder/tokenizer.json."""
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocabulary,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(PARAGRAPHS * 4, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return tokenizer


@pytest.fixture
def model_folder(tmp_path):
    """The KV-cache export with its tokenizer beside it, as an exporter leaves a model folder."""
    source = dm.copy_model(dm.exported("cache"), tmp_path / "model")
    train_tokenizer(source.parent, vocabulary=dm.VOCABULARY)
    return source


def write_text(folder, repeats: int = 3):
    folder.mkdir()
    text = "\n\n".join(PARAGRAPHS * repeats)
    (folder / "a.txt").write_text(text)
    (folder / "b.txt").write_text(text.upper())
    return folder, text


def read_shards(folder) -> dict[str, np.ndarray]:
    shards = sorted(folder.glob("*.npz"))
    loaded = [dict(np.load(path)) for path in shards]
    return {name: np.concatenate([shard[name] for shard in loaded]) for name in loaded[0]}


def test_rows_are_the_text_packed_and_every_decoder_input_is_a_first_pass(model_folder, tmp_path, capsys):
    text_folder, text = write_text(tmp_path / "text")
    out = tmp_path / "rows"
    argv = ["data", "text", str(model_folder), str(text_folder), "--seq-len", "24", "--rows", "10", "--shard-rows", "4"]
    assert main([*argv, "-o", str(out), "--json"]) == 0  # no --tokenizer: the model's folder holds it
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == 10 and report["shards"] == 3 and report["sequence_lengths"] == [24, 24]
    rows = read_shards(out)
    ids = rows["input_ids"]
    assert ids.shape == (10, 24) and ids.dtype == np.int64
    # Packed, not padded: the rows read back, end to end, are the start of the text itself.
    tokenizer = tokenizers.Tokenizer.from_file(str(model_folder.parent / "tokenizer.json"))
    decoded = tokenizer.decode(ids.ravel().tolist())
    assert len(decoded) > 200 and text.startswith(decoded)
    np.testing.assert_array_equal(rows["attention_mask"], np.ones((10, 24), np.int64))
    np.testing.assert_array_equal(rows["position_ids"], np.tile(np.arange(24), (10, 1)))
    past, _ = dm.cache_names()
    for name in past:
        assert rows[name].shape == (10, dm.KV_HEADS, 0, dm.HEAD_DIM) and rows[name].dtype == np.float32
    # Fed to the KV-cache export, the rows are a prefill: its logits are the plain export's on the same ids.
    import onnxruntime

    with_cache = onnxruntime.InferenceSession(str(model_folder), providers=["CPUExecutionProvider"])
    plain = onnxruntime.InferenceSession(str(dm.exported("plain")), providers=["CPUExecutionProvider"])
    first = {name: array[:4] for name, array in rows.items()}
    np.testing.assert_allclose(
        with_cache.run(["logits"], first)[0], plain.run(["logits"], {"input_ids": ids[:4]})[0], atol=1e-4
    )


def test_files_are_joined_by_the_end_of_text_token_and_every_full_row_is_kept(model_folder, tmp_path, capsys):
    text_folder, _ = write_text(tmp_path / "text", repeats=1)
    tokenizer = tokenizers.Tokenizer.from_file(str(model_folder.parent / "tokenizer.json"))
    out = tmp_path / "rows"
    assert main(["data", "text", str(model_folder), str(text_folder), "--seq-len", "16", "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"-> {out}")
    ids = read_shards(out)["input_ids"].ravel()
    separator = tokenizer.token_to_id("<|endoftext|>")
    assert (ids == separator).sum() == 1  # between a.txt and b.txt
    before, after = np.split(ids, [int(np.flatnonzero(ids == separator)[0])])
    texts = [(text_folder / name).read_text() for name in ("a.txt", "b.txt")]
    assert tokenizer.decode(before.tolist()) == texts[0]
    tail = tokenizer.decode(after[1:].tolist())
    assert texts[1].startswith(tail)
    # Every full row is kept: only a tail shorter than one row of 16 tokens is left out.
    left_out = tokenizer.encode(texts[1][len(tail) :], add_special_tokens=False).ids
    assert len(ids) % 16 == 0 and len(left_out) < 16


def test_the_rows_calibrate_a_decoder_with_a_kv_cache(model_folder, tmp_path, capsys):
    text_folder, _ = write_text(tmp_path / "text")
    rows = tmp_path / "rows"
    argv = ["data", "text", str(model_folder), str(text_folder), "--seq-len", "32", "--rows", "8", "-o", str(rows)]
    assert main(argv) == 0
    capsys.readouterr()
    out = tmp_path / "sparse.onnx"
    assert main(["convert", str(model_folder), "-o", str(out), "--calib", str(rows), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["summary"]["converted"] == 7 * dm.LAYERS and document["summary"]["calibration_samples"] == 8
    assert document["passed"] is None  # nothing required: the figures are reported, not judged


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seq-len", "64", "--rows", "500"], "tokens make"),
        (["--rows", "4"], "give --seq-len too"),
        (["--seq-len", "16", "--max-length", "32"], "--max-length and --limit are for sentences"),
        (["--seq-len", "0"], "--seq-len must be at least 1"),
        ([], "is a KV cache: a causal language model takes the text packed into rows, give --seq-len"),
    ],
)
def test_bad_requests_are_one_line_and_write_nothing(model_folder, tmp_path, capsys, extra, message):
    text_folder, _ = write_text(tmp_path / "text")
    out = tmp_path / "rows"
    before = {path.name: path.read_bytes() for path in model_folder.parent.iterdir()}
    assert main(["data", "text", str(model_folder), str(text_folder), "-o", str(out), *extra]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error and "Traceback" not in error
    assert not out.exists()
    assert {path.name: path.read_bytes() for path in model_folder.parent.iterdir()} == before


def test_a_tokenizer_larger_than_the_embedding_table_is_refused(tmp_path, capsys):
    source = dm.copy_model(dm.exported("plain"), tmp_path / "model")
    tokenizer_folder = tmp_path / "big"
    train_tokenizer(tokenizer_folder, vocabulary=400)
    text_folder, _ = write_text(tmp_path / "text")
    argv = ["data", "text", str(source), str(text_folder), "--tokenizer", str(tokenizer_folder), "--seq-len", "16"]
    assert main([*argv, "-o", str(tmp_path / "rows")]) == 2
    assert "indexes a table of 256 rows" in capsys.readouterr().err
    # Without --tokenizer and none beside the model: one line saying what to give.
    assert main(["data", "text", str(source), str(text_folder), "--seq-len", "16", "-o", str(tmp_path / "r2")]) == 2
    assert "give --tokenizer" in capsys.readouterr().err
