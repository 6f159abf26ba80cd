"""The real pretrained all-mpnet-base-v2 (12 layers, hidden 768): the split archive is read as one stream and checked,
the ONNX export matches torch and embeds sentences sensibly, inspect finds its 72 encoder weights, and a calibrated
conversion of a few encoder weights keeps the embeddings of sentences of another kind than the calibration sentences."""

import io
import json
import zipfile

import numpy as np
import pytest

from nmdeploy.cli import main
from nmdeploy.reference import minilm, mpnet
from nmdeploy.reference.mpnet import _JoinedParts


def test_joined_parts_read_a_split_archive_as_one(tmp_path):
    buffer = io.BytesIO()
    payload = {"a.txt": b"first file " * 50, "b/c.bin": bytes(range(256)) * 40}
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in payload.items():
            archive.writestr(name, data)
    whole = buffer.getvalue()
    cuts = [0, 7, len(whole) // 3, len(whole) // 2, len(whole)]
    parts = []
    for index, (start, stop) in enumerate(zip(cuts, cuts[1:], strict=False)):
        parts.append(tmp_path / f"archive.zip.{index + 1:03d}")
        parts[-1].write_bytes(whole[start:stop])
    with _JoinedParts(parts) as stream:
        assert stream.read() == whole
        stream.seek(-5, io.SEEK_END)
        assert stream.read(100) == whole[-5:]
        stream.seek(cuts[2] - 5)
        assert stream.read(10) == whole[cuts[2] - 5 : cuts[2] + 5]  # across the boundary of two parts
        with zipfile.ZipFile(io.BufferedReader(stream)) as archive:
            assert {name: archive.read(name) for name in archive.namelist()} == payload


pytest.importorskip("transformers")
try:
    mpnet._part_files()
except ImportError:
    pytest.skip("the all-mpnet-base-v2 part packages are not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The pretrained model unpacked into a fresh cache and exported once for the module."""
    folder = tmp_path_factory.mktemp("mpnet")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NMDEPLOY_CACHE", str(folder / "cache"))
        model = mpnet.load_mpnet()
        path = mpnet.export_mpnet_onnx(folder / "mpnet.onnx", model=model)
        yield model, path


@pytest.mark.slow
def test_unpacked_weights_export_and_embed_sentences(exported, tmp_path):
    model, path = exported
    assert sum(p.numel() for p in model.parameters()) > 100_000_000
    assert len(mpnet.encoder_linears(model)) == 72
    texts = [
        "A man is playing a guitar on the stage.",
        "Someone performs music with a guitar in front of an audience.",
        "The quarterly tax return is due at the end of the month.",
        "Open the file and read its contents line by line.",
    ]
    feeds = mpnet.sentence_feeds(texts)
    exported_embeddings = minilm.embed_onnx(path, feeds)
    assert exported_embeddings.shape == (4, mpnet.HIDDEN_SIZE)
    np.testing.assert_allclose(exported_embeddings, minilm.embed_torch(model, feeds), atol=1e-4)
    unit = exported_embeddings / np.linalg.norm(exported_embeddings, axis=1, keepdims=True)
    similarity = unit @ unit.T
    # The paraphrase pair is far closer than any unrelated pair (about 0.57 against at most 0.02).
    assert similarity[0, 1] > 0.45
    assert similarity[0, 1] > np.abs(similarity[[0, 0, 1, 1, 2], [2, 3, 2, 3, 3]]).max() + 0.35


def test_calibration_and_evaluation_sentences_are_different_kinds():
    calibration, evaluation = mpnet.sentences("calibration"), mpnet.sentences("evaluation")
    assert len(calibration) == 171 and len(set(calibration)) == 171 and len(evaluation) >= 200
    assert not set(calibration) & set(evaluation)
    assert evaluation == minilm.sentences("evaluation")


@pytest.mark.slow
def test_inspect_finds_the_72_encoder_weights(exported, capsys):
    assert main(["inspect", "--json", str(exported[1])]) == 0
    weights = json.loads(capsys.readouterr().out)["weights"]
    encoder = [w for w in weights if any("/encoder/layer." in node for node in w["nodes"])]
    assert len(encoder) == 72 and all(w["eligible"] for w in encoder)
    assert sorted({tuple(w["shape"]) for w in encoder}) == [(768, 768), (768, 3072), (3072, 768)]


@pytest.mark.slow
def test_calibrated_conversion_of_a_few_layers_keeps_embeddings_of_another_kind_of_text(exported, tmp_path, capsys):
    _, dense = exported
    mpnet.write_sentence_npz(mpnet.sentences("calibration")[:32], tmp_path / "calib")
    out = tmp_path / "converted.onnx"
    # The first block's query, key and value projections and its feed-forward output (3072 -> 768).
    block = r"/encoder/layer\.0/(attention/attn/[qkv]|output/dense)/"
    assert (
        main(["convert", str(dense), "-o", str(out), "--calib", str(tmp_path / "calib"), "--include", block, "--json"])
        == 0
    )
    rows = [row for row in json.loads(capsys.readouterr().out)["report"] if row["step"] == "convert"]
    assert len(rows) == 4 and not any("skipped" in row for row in rows)
    for row in rows:
        assert 0 < row["retained_saliency"] <= 1 and row["samples"] > 0
        assert all(np.isfinite(row[key]) and row[key] >= 0 for key in ("error_masked", "error_converted"))

    magnitude = tmp_path / "magnitude.onnx"
    assert main(["prune", str(dense), "-o", str(magnitude), "--include", block]) == 0
    evaluation = mpnet.sentence_feeds(mpnet.sentences("evaluation")[:64])
    reference = minilm.embed_onnx(dense, evaluation)
    fidelity = minilm.mean_cosine(reference, minilm.embed_onnx(out, evaluation))
    pruned = minilm.mean_cosine(reference, minilm.embed_onnx(magnitude, evaluation))
    assert 0.9 <= fidelity <= 1.0 + 1e-6, fidelity
    assert fidelity >= pruned, (fidelity, pruned)
