"""A generated corpus of bad inputs over every verb: each one gets exit code 2, exactly one line on stderr, no
traceback, and leaves every file in its folder byte-identical with nothing new written.

Models, external data, calibration and evaluation data, recipes, training configs, checkpoints, baselines and output
paths are each broken in the ways a damaged download or a hostile file would be, then given to every verb that
reads them. The CLI runs in-process, so the whole corpus takes seconds.
"""

from __future__ import annotations

import hashlib
import os
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from nmdeploy.cli import main

IR_VERSION = 10
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- building blocks -------------------------------------------------------------------------------------------


def mlp(weights: dict[str, np.ndarray] | None = None, extra_nodes=(), cyclic=False) -> onnx.ModelProto:
    """x[2,16] -> MatMul W1[16,32] -> Relu -> Gemm W2[8,32]^T + b2 -> y[2,8]."""
    rng = np.random.default_rng(0)
    values = {
        "W1": rng.standard_normal((16, 32)).astype(np.float32),
        "W2": rng.standard_normal((8, 32)).astype(np.float32),
        "b2": rng.standard_normal(8).astype(np.float32),
        **(weights or {}),
    }
    first_input = "y" if cyclic else "x"  # a cycle: the first node reads the last node's output
    nodes = [
        helper.make_node("MatMul", [first_input, "W1"], ["h"], name="mm"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        *extra_nodes,
        helper.make_node("Gemm", ["r", "W2", "b2"], ["y"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(v, k) for k, v in values.items()],
    )
    opsets = [helper.make_opsetid("", 17)] + [helper.make_opsetid("com.example", 1)] * bool(extra_nodes)
    return helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION)


def save_external(proto: onnx.ModelProto, path: Path, location: str = "model.onnx.data") -> Path:
    onnx.save(proto, path, save_as_external_data=True, location=location, size_threshold=0)
    return path


def external_entry(path: Path, tensor: str, key: str, value: str) -> None:
    """Set one external_data entry of one tensor in a saved model, keeping everything else."""
    proto = onnx.load(path, load_external_data=False)
    target = next(t for t in proto.graph.initializer if t.name == tensor)
    for entry in target.external_data:
        if entry.key == key:
            entry.value = value
            break
    else:
        target.external_data.add(key=key, value=value)
    path.write_bytes(proto.SerializeToString())


def edit_tensor(path: Path, tensor: str, edit: Callable[[onnx.TensorProto], None]) -> None:
    proto = onnx.load(path, load_external_data=False)
    edit(next(t for t in proto.graph.initializer if t.name == tensor))
    path.write_bytes(proto.SerializeToString())


def good_model(folder: Path) -> Path:
    path = folder / "model.onnx"
    onnx.save(mlp(), path)
    return path


def npz(path: Path, **arrays) -> Path:
    with path.open("wb") as handle:
        np.savez(handle, **arrays)
    return path


def good_data(folder: Path) -> Path:
    return npz(folder / "data.npz", x=np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32))


# -- bad models --------------------------------------------------------------------------------------------------
# Each builder writes a model into the case folder (creating whatever else it needs) and returns its path.


def _outside(folder: Path) -> Path:
    secret = folder / "outside" / "secret.bin"
    secret.parent.mkdir()
    secret.write_bytes(os.urandom(4096))
    return secret


def _model_in_subfolder(folder: Path) -> Path:
    (folder / "m").mkdir()
    return save_external(mlp(), folder / "m" / "model.onnx")


def location_absolute(folder):
    path, secret = _model_in_subfolder(folder), _outside(folder)
    external_entry(path, "W1", "location", str(secret))
    return path


def location_dotdot(folder):
    path = _model_in_subfolder(folder)
    _outside(folder)
    external_entry(path, "W1", "location", "../outside/secret.bin")
    return path


def location_dotdot_inside(folder):
    path = _model_in_subfolder(folder)
    external_entry(path, "W1", "location", "sub/../model.onnx.data")
    return path


def location_symlink(folder):
    path, secret = _model_in_subfolder(folder), _outside(folder)
    (path.parent / "link.data").symlink_to(secret)
    external_entry(path, "W1", "location", "link.data")
    return path


def location_folder_symlink(folder):
    path, secret = _model_in_subfolder(folder), _outside(folder)
    (path.parent / "blobs").symlink_to(secret.parent)
    external_entry(path, "W1", "location", "blobs/secret.bin")
    return path


def hub_snapshot(folder: Path, repository: str = "models--org--mlp") -> Path:
    """A model laid out as the Hugging Face cache keeps it: files in blobs/, links to them in snapshots/REV/."""
    blobs = folder / repository / "blobs"
    snapshot = folder / repository / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    staged = save_external(mlp(), blobs / "model.onnx")
    (blobs / "model.onnx").rename(blobs / "aaaa1111")
    (blobs / "model.onnx.data").rename(blobs / "bbbb2222")
    (snapshot / "model.onnx").symlink_to(Path("..", "..", "blobs", "aaaa1111"))
    (snapshot / "model.onnx.data").symlink_to(Path("..", "..", "blobs", "bbbb2222"))
    return snapshot / staged.name


def location_hub_other_repository(folder):
    """A snapshot's data link may lead to its own repository's blobs only."""
    path = hub_snapshot(folder)
    other = hub_snapshot(folder, "models--org--other")
    (path.parent / "model.onnx.data").unlink()
    (path.parent / "model.onnx.data").symlink_to(other.parent.parent.parent / "blobs" / "bbbb2222")
    return path


def location_missing(folder):
    path = _model_in_subfolder(folder)
    external_entry(path, "W1", "location", "nowhere.data")
    return path


def location_empty(folder):
    path = _model_in_subfolder(folder)
    external_entry(path, "W1", "location", "")
    return path


def location_folder(folder):
    path = _model_in_subfolder(folder)
    (path.parent / "adir").mkdir()
    external_entry(path, "W1", "location", "adir")
    return path


def location_model_itself(folder):
    path = _model_in_subfolder(folder)
    external_entry(path, "W1", "location", "model.onnx")
    return path


def data_truncated(folder):
    path = _model_in_subfolder(folder)
    data = path.parent / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:100])
    return path


def offset_value(value):
    def build(folder):
        path = _model_in_subfolder(folder)
        external_entry(path, "W2", "offset", value)
        return path

    build.__name__ = f"offset_{value}"
    return build


def length_value(value):
    def build(folder):
        path = _model_in_subfolder(folder)
        external_entry(path, "W2", "length", value)
        return path

    build.__name__ = f"length_{value}"
    return build


def external_key_added(key: str, value: str, name: str):
    """A model whose W1 gets one more external-data entry: a key it already has, or one ONNX does not define."""

    def build(folder):
        path = _model_in_subfolder(folder)
        edit_tensor(path, "W1", lambda tensor: tensor.external_data.add(key=key, value=value))
        return path

    build.__name__ = name
    return build


def dims_overflow(folder):
    path = _model_in_subfolder(folder)
    edit_tensor(path, "W1", lambda t: t.dims.__setitem__(slice(None), [2**40, 2**40, 2**40]))
    return path


def dims_beyond_data(folder):
    path = _model_in_subfolder(folder)
    edit_tensor(path, "W2", lambda t: t.dims.__setitem__(slice(None), [8, 4096]))
    return path


def dims_negative(folder):
    path = _model_in_subfolder(folder)
    edit_tensor(path, "W2", lambda t: t.dims.__setitem__(slice(None), [-8, -32]))
    return path


def inline_size_mismatch(folder):
    path = good_model(folder)
    edit_tensor(path, "W1", lambda t: setattr(t, "raw_data", t.raw_data[:-8]))
    return path


def empty_file(folder):
    path = folder / "model.onnx"
    path.write_bytes(b"")
    return path


def truncated_model(folder):
    path = good_model(folder)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def garbage_model(folder):
    path = folder / "model.onnx"
    path.write_bytes(np.random.default_rng(3).bytes(2000))
    return path


def text_model(folder):
    path = folder / "model.onnx"
    path.write_text("this is not a model\n")
    return path


def missing_model(folder):
    return folder / "missing.onnx"


def folder_as_model(folder):
    path = folder / "model.onnx"
    path.mkdir()
    return path


def cyclic_model(folder):
    path = folder / "model.onnx"
    onnx.save(mlp(cyclic=True), path)
    return path


BROKEN_MODELS = [
    location_absolute,
    location_dotdot,
    location_dotdot_inside,
    location_symlink,
    location_folder_symlink,
    location_hub_other_repository,
    location_missing,
    location_empty,
    location_folder,
    location_model_itself,
    data_truncated,
    offset_value("abc"),
    offset_value("-4"),
    offset_value("1.5"),
    offset_value("99999999999"),
    length_value("12"),
    length_value("-1"),
    external_key_added("location", "model.onnx.data", "location_repeated"),
    external_key_added("offset", "0", "offset_repeated"),
    external_key_added("basepath", "elsewhere", "key_basepath"),
    dims_overflow,
    dims_beyond_data,
    dims_negative,
    inline_size_mismatch,
    empty_file,
    truncated_model,
    garbage_model,
    text_model,
    missing_model,
    folder_as_model,
    cyclic_model,
]


def test_a_model_in_the_hugging_face_cache_layout_is_read_through_its_links(tmp_path):
    """The hub cache links snapshot files to blobs outside the snapshot folder: that one layout is followed."""
    path = hub_snapshot(tmp_path)
    before = folder_state(tmp_path)
    assert main(["prune", str(path), "-o", str(tmp_path / "pruned.onnx")]) == 0
    assert {k: v for k, v in folder_state(tmp_path).items() if "pruned" not in k} == before
    pruned = onnx.load(tmp_path / "pruned.onnx")
    w1 = numpy_helper.to_array(next(t for t in pruned.graph.initializer if t.name == "W1"))
    dense = numpy_helper.to_array(mlp().graph.initializer[0])
    assert np.count_nonzero(w1) == w1.size // 2
    assert np.array_equal(w1[w1 != 0], dense[w1 != 0])  # the blob's values, not zeros or garbage


def nan_weights(folder):
    path = folder / "model.onnx"
    weights = mlp().graph.initializer
    w1 = numpy_helper.to_array(weights[0]).copy()
    w1[3, 5] = np.nan
    onnx.save(mlp({"W1": w1}), path)
    return path


def nothing_prunable(folder):
    """Reduction axes of 6 and 10: M = 4 divides neither."""
    path = folder / "model.onnx"
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm"),
        helper.make_node("MatMul", ["h", "W2"], ["y"], name="mm2"),
    ]
    graph = helper.make_graph(
        nodes,
        "odd",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [
            numpy_helper.from_array(rng.standard_normal((6, 10)).astype(np.float32), "W1"),
            numpy_helper.from_array(rng.standard_normal((10, 3)).astype(np.float32), "W2"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION), path)
    return path


def custom_op_model(folder):
    path = folder / "model.onnx"
    custom = helper.make_node("Mystery", ["r"], ["r2"], domain="com.example", name="mystery")
    proto = mlp(extra_nodes=[custom])
    proto.graph.node[-1].input[0] = "r2"
    onnx.save(proto, path)
    return path


# -- the corpus --------------------------------------------------------------------------------------------------


@dataclass
class Case:
    id: str
    build: Callable[[Path], list[str]]  # writes the inputs into the folder, returns the argv


CASES: list[Case] = []


def case(id_: str):
    def register(build):
        CASES.append(Case(id_, build))
        return build

    return register


MODEL_VERBS: dict[str, Callable[[Path, Path], list[str]]] = {
    "inspect": lambda model, out: ["inspect", str(model)],
    "prune": lambda model, out: ["prune", str(model), "-o", str(out)],
    "convert": lambda model, out: ["convert", str(model), "-o", str(out), "--calib", "random"],
    "cast": lambda model, out: ["cast", str(model), "-o", str(out), "--no-check"],
    "run": lambda model, out: ["run", "tensorrt-2of4", str(model), "-o", str(out)],
    "compare": lambda model, out: ["compare", str(good_model(out.parent)), str(model), "--data", "random"],
    "bench": lambda model, out: ["bench", str(model), "--iterations", "1", "--warmup", "0"],
    "pipeline": lambda model, out: ["pipeline", str(model), "--calib", "random", "--data", "random", "-o", str(out)],
}


def _model_case(builder, verb):
    def build(folder):
        out_folder = folder / "out"
        out_folder.mkdir()
        return MODEL_VERBS[verb](builder(folder), out_folder / "result.onnx")

    return build


for _builder in BROKEN_MODELS:
    for _verb in MODEL_VERBS:
        case(f"{_verb}-{_builder.__name__}")(_model_case(_builder, _verb))

for _verb in ("prune", "convert", "cast", "run"):
    case(f"{_verb}-nan_weights")(_model_case(nan_weights, _verb))
for _verb in ("prune", "convert", "run"):
    case(f"{_verb}-nothing_prunable")(_model_case(nothing_prunable, _verb))


@case("cast-custom_domain_op")
def _(folder):
    return ["cast", str(custom_op_model(folder)), "-o", str(folder / "out.onnx"), "--data", "random"]


@case("prune-pattern-nothing-eligible")
def _(folder):
    return ["prune", str(good_model(folder)), "-o", str(folder / "out.onnx"), "--pattern", "2:3"]


@case("prune-include-matches-nothing")
def _(folder):
    return ["prune", str(good_model(folder)), "-o", str(folder / "out.onnx"), "--include", "^nothing$"]


# -- output paths ------------------------------------------------------------------------------------------------

OUTPUT_VERBS = {
    "prune": lambda model, out: ["prune", str(model), "-o", str(out)],
    "convert": lambda model, out: ["convert", str(model), "-o", str(out), "--calib", "random"],
    "cast": lambda model, out: ["cast", str(model), "-o", str(out), "--no-check"],
    "run": lambda model, out: ["run", "tensorrt-2of4", str(model), "-o", str(out)],
}


def out_is_folder(folder, model):
    (folder / "existing").mkdir()
    return folder / "existing"


def out_under_file(folder, model):
    (folder / "afile").write_text("x")
    return folder / "afile" / "out.onnx"


def out_is_model_without_in_place(folder, model):
    return model


def out_is_input_data_file(folder, model):
    return model.parent / "model.onnx.data"


def out_derives_input_data_name(folder, model):
    """The model is m.onnx with its data in model.onnx.data: -o model.onnx would derive that data file's name."""
    renamed = model.parent / "m.onnx"
    model.rename(renamed)
    return model  # "model.onnx", whose data file would be model.onnx.data


def out_is_hard_link_to_model(folder, model):
    link = folder / "link.onnx"
    os.link(model, link)
    return link


for _verb, _argv in OUTPUT_VERBS.items():
    for _out in (
        out_is_folder,
        out_under_file,
        out_is_model_without_in_place,
        out_is_input_data_file,
        out_is_hard_link_to_model,
    ):

        def _build(folder, _verb=_verb, _argv=_argv, _out=_out):
            model = save_external(mlp(), folder / "model.onnx")
            return _argv(model, _out(folder, model))

        case(f"{_verb}-{_out.__name__}")(_build)

    def _build_renamed(folder, _argv=_argv):
        model = save_external(mlp(), folder / "model.onnx")
        target = out_derives_input_data_name(folder, model)
        return _argv(folder / "m.onnx", target)

    case(f"{_verb}-out_derives_input_data_name")(_build_renamed)


@case("convert-out_is_calibration_data")
def _(folder):
    return ["convert", str(good_model(folder)), "-o", str(good_data(folder)), "--calib", str(folder / "data.npz")]


@case("export-out_is_folder")
def _(folder):
    (folder / "existing").mkdir()
    return ["export", str(checkpoint_file(folder)), "-o", str(folder / "existing")]


@case("export-out_under_file")
def _(folder):
    (folder / "afile").write_text("x")
    return ["export", str(checkpoint_file(folder)), "-o", str(folder / "afile" / "m.onnx")]


@case("export-out_is_checkpoint")
def _(folder):
    path = checkpoint_file(folder)
    return ["export", str(path), "-o", str(path)]


@case("inspect-plot_is_folder")
def _(folder):
    (folder / "plots.png").mkdir()
    return ["inspect", str(good_model(folder)), "--plot", str(folder / "plots.png")]


@case("inspect-plot_under_file")
def _(folder):
    (folder / "afile").write_text("x")
    return ["inspect", str(good_model(folder)), "--plot", str(folder / "afile" / "p.png")]


@case("inspect-plot_is_the_model")
def _(folder):
    model = save_external(mlp(), folder / "model.onnx")
    return ["inspect", str(model), "--plot", str(folder / "model.onnx.data")]


@case("train-out_under_file")
def _(folder):
    (folder / "afile").write_text("x")
    return ["train", str(config_file(folder, "")), "-o", str(folder / "afile" / "run"), "--no-progress"]


# -- calibration and evaluation data -------------------------------------------------------------------------------

X = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)


def _with(index, value):
    array = X.copy()
    array[index] = value
    return array


BAD_DATA = {
    "zero_rows": lambda folder: npz(folder / "d.npz", x=np.zeros((0, 16), np.float32)),
    "nan": lambda folder: npz(folder / "d.npz", x=_with((0, 3), np.nan)),
    "inf": lambda folder: npz(folder / "d.npz", x=_with((1, 2), np.inf)),
    "wrong_dtype": lambda folder: npz(folder / "d.npz", x=X.astype(np.float64)),
    "wrong_shape": lambda folder: npz(folder / "d.npz", x=X[:, :8]),
    "missing_input": lambda folder: npz(folder / "d.npz", other=X),
    "truncated_npz": lambda folder: _truncate(npz(folder / "d.npz", x=np.tile(X, (50, 1)))),
    "not_npz": lambda folder: _text(folder / "d.npz", "hello"),
    "pickled_object": lambda folder: _pickled(folder / "d.npz"),
    "damaged_member": lambda folder: _damaged(folder / "d.npz"),
    "missing": lambda folder: folder / "nowhere.npz",
    "empty_folder": lambda folder: _mkdir(folder / "data"),
}


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-300])
    return path


def _damaged(path):
    """A compressed archive whose headers are whole but whose array data is not (a bad CRC or deflate stream)."""
    with path.open("wb") as handle:
        np.savez_compressed(handle, x=np.tile(X, (2000, 1)))  # damage far past the header's first read
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 40] = bytes(b ^ 0xFF for b in data[middle : middle + 40])
    path.write_bytes(bytes(data))
    return path


def _text(path, text):
    path.write_text(text)
    return path


def _mkdir(path):
    path.mkdir()
    return path


def _pickled(path):
    return npz(path, x=np.array([{"a": 1}, None], dtype=object))


DATA_VERBS = {
    "convert": lambda model, data, folder: [
        "convert", str(model), "-o", str(folder / "out.onnx"), "--calib", str(data)
    ],
    "compare": lambda model, data, folder: ["compare", str(model), str(model), "--data", str(data)],
    "cast": lambda model, data, folder: ["cast", str(model), "-o", str(folder / "out.onnx"), "--data", str(data)],
    "bench": lambda model, data, folder: [
        "bench", str(model), "--data", str(data), "--iterations", "1", "--warmup", "0"
    ],
}  # fmt: skip

for _verb, _argv in DATA_VERBS.items():
    for _name, _data in BAD_DATA.items():
        if _verb == "bench" and _name in ("nan", "inf"):
            continue  # timing does not look at values

        def _build(folder, _argv=_argv, _data=_data):
            return _argv(good_model(folder), _data(folder), folder)

        case(f"{_verb}-data-{_name}")(_build)


@case("compare-nan-weights-candidate")
def _(folder):
    return ["compare", str(good_model(folder)), str(nan_weights(folder / "sub" if _mkdir(folder / "sub") else 0)),
            "--data", "random"]  # fmt: skip


for _damping in ("-1", "nan", "inf", "0"):

    @case(f"convert-damping-{_damping}")
    def _(folder, _damping=_damping):
        return ["convert", str(good_model(folder)), "-o", str(folder / "o.onnx"), "--calib", str(good_data(folder)),
                "--damping", _damping]  # fmt: skip


for _metric in ("os:sep", "json:nothing_here", "no_such_module_xyz:f", "justtext", "math:pi"):

    @case(f"compare-metric-{_metric.replace(':', '.')}")
    def _(folder, _metric=_metric):
        model = good_model(folder)
        return ["compare", str(model), str(model), "--data", "random", "--metric", _metric]


for _flag, _value in (
    ("--duration", "nan"),
    ("--duration", "inf"),
    ("--duration", "-1"),
    ("--iterations", "0"),
    ("--iterations", "-5"),
    ("--warmup", "-1"),
):

    @case(f"bench{_flag}-{_value}")
    def _(folder, _flag=_flag, _value=_value):
        return ["bench", str(good_model(folder)), _flag, _value]


for _batch in ("0", "-1", "1,x", "1.5"):

    @case(f"bench--batch-{_batch}")
    def _(folder, _batch=_batch):
        return ["bench", str(good_model(folder)), "--batch", _batch, "--iterations", "1"]


def embedding_model(folder: Path) -> Path:
    """ids[2,4] -> Gather from a 10-row table -> MatMul W[16,8]."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"]), helper.make_node("MatMul", ["e", "W"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "embed",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 8])],
        [
            numpy_helper.from_array(rng.standard_normal((10, 16)).astype(np.float32), "E"),
            numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "W"),
        ],
    )
    path = folder / "embed.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=IR_VERSION), path)
    return path


def _ids_out_of_range(folder):
    return npz(folder / "ids.npz", ids=np.full((2, 4), 1000, dtype=np.int64))


@case("compare-data-ids_out_of_range")
def _(folder):
    model = embedding_model(folder)
    return ["compare", str(model), str(model), "--data", str(_ids_out_of_range(folder))]


@case("convert-data-ids_out_of_range")
def _(folder):
    return ["convert", str(embedding_model(folder)), "-o", str(folder / "o.onnx"), "--calib",
            str(_ids_out_of_range(folder))]  # fmt: skip


@case("pipeline-out_is_a_file")
def _(folder):
    (folder / "afile").write_text("x")
    return ["pipeline", "-o", str(folder / "afile"), "--models", "digits"]


@case("pipeline-baselines_missing")
def _(folder):
    return ["pipeline", "-o", str(folder / "out"), "--baselines", str(folder / "nowhere")]


def _user_pipeline(folder: Path, *extra: str) -> list[str]:
    return ["pipeline", str(good_model(folder)), "--calib", str(good_data(folder)), "-o", str(folder / "out"), *extra]


@case("pipeline-user-data_wrong_input")
def _(folder):
    return _user_pipeline(folder, "--data", str(npz(folder / "w.npz", image=np.zeros((2, 16), np.float32))))


@case("pipeline-user-no_data")
def _(folder):
    return _user_pipeline(folder)


@case("pipeline-user-metric_unimportable")
def _(folder):
    return _user_pipeline(folder, "--data", str(good_data(folder)), "--metric", "no_such_module_xyz:f")


@case("pipeline-user-baselines_broken")
def _(folder):
    (folder / "b.toml").write_text("[[model\n")
    return _user_pipeline(folder, "--data", str(good_data(folder)), "--baselines", str(folder / "b.toml"))


@case("pipeline-user-flag_without_model")
def _(folder):
    return ["pipeline", "-o", str(folder / "out"), "--calib", str(good_data(folder))]


@case("pipeline-held_out_without_model")
def _(folder):
    return ["pipeline", "-o", str(folder / "out"), "--min-fidelity", "0.9", "--held-out", str(good_data(folder))]


def _held_out(folder: Path) -> Path:
    return npz(folder / "held.npz", x=np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32))


# Combinations convert refuses: the pipeline refuses them alike, before its first artefact.
PIPELINE_FLAGS = {
    "held_out_alone": lambda folder: ["--held-out", str(_held_out(folder))],
    "held_out_is_calib": lambda folder: ["--min-fidelity", "0.9", "--held-out", str(good_data(folder))],
    "held_out_random": lambda folder: ["--recover", "5", "--held-out", "random"],
    "held_out_wrong_input": lambda folder: [
        "--min-fidelity", "0.9", "--held-out", str(npz(folder / "h.npz", image=np.zeros((2, 16), np.float32)))
    ],
    "transposable_permute": lambda folder: ["--transposable", "--permute"],
    "fit_target_parallel": lambda folder: ["--fit-target", "layer", "--fit", "parallel"],
    "calib_batch_zero": lambda folder: ["--calib-batch", "0"],
}  # fmt: skip


def _pipeline_flags_case(flags):
    def build(folder):
        evaluation = _held_out(folder).rename(folder / "e.npz")
        return _user_pipeline(folder, "--data", str(evaluation), *flags(folder))

    return build


for _name, _flags in PIPELINE_FLAGS.items():
    case(f"pipeline-user-{_name}")(_pipeline_flags_case(_flags))


# -- recipes -----------------------------------------------------------------------------------------------------

BAD_RECIPES = {
    "numbers": "passes = [1, 2, 3]\n",
    "strings": 'passes = ["prune"]\n',
    "table": '[passes]\npass = "prune"\n',
    "empty": "",
    "unknown_pass": '[[passes]]\npass = "shrink"\n',
    "unknown_option": '[[passes]]\npass = "prune"\nratio = 0.5\n',
    "bad_pattern": '[[passes]]\npass = "prune"\npattern = "5:4"\n',
    "pattern_number": '[[passes]]\npass = "prune"\npattern = 24\n',
    "not_toml": "[[passes\n",
    "binary": "\udcff",
    "unknown_top": 'name = "x"\n[[passes]]\npass = "prune"\n',
    "precision_unknown": '[[passes]]\npass = "cast"\nprecision = "fp8"\n',
    "wrong_option_type": '[[passes]]\npass = "prune"\neligible_only = "yes"\n',
    "missing": None,
}

for _name, _text_ in BAD_RECIPES.items():

    @case(f"run-recipe-{_name}")
    def _(folder, _text_=_text_):
        recipe = folder / "recipe.toml"
        if _text_ is not None:
            recipe.write_bytes(_text_.encode("utf-8", "surrogateescape"))
        return ["run", str(recipe), str(good_model(folder)), "-o", str(folder / "out.onnx")]


# -- training configs ---------------------------------------------------------------------------------------------

TINY = '[task]\nname = "digits-cnn"\ntrain_size = 64\n\n[train]\nepochs = 1\nbatch_size = 64\n'


def config_file(folder: Path, extra: str, base: str = TINY) -> Path:
    path = folder / "config.toml"
    path.write_text(base + extra)
    return path


BAD_CONFIGS = {
    "lr_inf": (TINY.replace("batch_size = 64", "batch_size = 64\nlr = inf"), ""),
    "lr_nan": (TINY.replace("batch_size = 64", "batch_size = 64\nlr = nan"), ""),
    "weight_decay_inf": (TINY.replace("batch_size = 64", "batch_size = 64\nweight_decay = inf"), ""),
    "pattern_no_layer_takes": (TINY, '\n[sparsity]\nmethod = "srste"\npattern = "2:3"\n'),
    "include_nothing": (TINY, '\n[sparsity]\nmethod = "srste"\ninclude = "^nothing$"\n'),
    "unknown_task": ('[task]\nname = "imagenet"\n', ""),
    "unknown_key": (TINY + "speed = 3\n", ""),
    "epochs_zero": (TINY.replace("epochs = 1", "epochs = 0"), ""),
    "not_toml": ("[task\n", ""),
    "missing_task": ("[train]\nepochs = 1\n", ""),
    "method_unknown": (TINY, '\n[sparsity]\nmethod = "magic"\n'),
}

for _name, (_base, _extra) in BAD_CONFIGS.items():

    @case(f"train-config-{_name}")
    def _(folder, _base=_base, _extra=_extra):
        return ["train", str(config_file(folder, _extra, _base)), "-o", str(folder / "run"), "--no-progress"]


@case("train-config-missing")
def _(folder):
    return ["train", str(folder / "none.toml"), "-o", str(folder / "run"), "--no-progress"]


# -- checkpoints --------------------------------------------------------------------------------------------------

_CHECKPOINT: dict[str, bytes] = {}


def checkpoint_file(folder: Path, mutate: Callable[[dict], None] | None = None) -> Path:
    """A real checkpoint of a one-epoch SR-STE run (trained once per session), optionally damaged."""
    if "bytes" not in _CHECKPOINT:
        import tempfile

        with tempfile.TemporaryDirectory() as scratch:
            config = config_file(Path(scratch), '\n[sparsity]\nmethod = "srste"\n')
            assert main(["train", str(config), "-o", str(Path(scratch) / "run"), "--no-progress", "--json"]) == 0
            _CHECKPOINT["bytes"] = (Path(scratch) / "run" / "checkpoint.pt").read_bytes()
    path = folder / "checkpoint.pt"
    path.write_bytes(_CHECKPOINT["bytes"])
    if mutate is not None:
        payload = torch.load(path, weights_only=True)
        mutate(payload)
        torch.save(payload, path)
    path.chmod(0o644)
    return path


def _first_weight(payload):
    return next(k for k, v in payload["model"].items() if v.ndim >= 2)


class Opaque:
    """A class torch's weights_only loader refuses to rebuild."""


CHECKPOINT_DAMAGE = {
    "missing_model": lambda p: p.pop("model"),
    "missing_config": lambda p: p.pop("config"),
    "missing_sparsifier": lambda p: p.pop("sparsifier"),
    "missing_position": lambda p: p.pop("position"),
    "missing_weight": lambda p: p["model"].pop(_first_weight(p)),
    "wrong_shape": lambda p: p["model"].__setitem__(_first_weight(p), torch.zeros(3, 3)),
    "model_not_dict": lambda p: p.__setitem__("model", [1, 2]),
    "config_broken": lambda p: p.__setitem__("config", {"task": {"name": "nope"}}),
    "version": lambda p: p.__setitem__("version", 99),
    "nan_weight": lambda p: p["model"][_first_weight(p)].fill_(float("nan")),
}


def _opaque_checkpoint(folder):
    path = folder / "checkpoint.pt"
    torch.save({"format": "x", "payload": Opaque()}, path)
    return path


def _garbage_checkpoint(folder):
    path = folder / "checkpoint.pt"
    path.write_bytes(np.random.default_rng(5).bytes(3000))
    return path


def _empty_checkpoint(folder):
    path = folder / "checkpoint.pt"
    path.write_bytes(b"")
    return path


def _truncated_checkpoint(folder):
    path = checkpoint_file(folder)
    path.write_bytes(path.read_bytes()[:-500])
    return path


CHECKPOINTS = {
    **{name: (lambda f, damage=damage: checkpoint_file(f, damage)) for name, damage in CHECKPOINT_DAMAGE.items()},
    "opaque_object": _opaque_checkpoint,
    "garbage": _garbage_checkpoint,
    "empty": _empty_checkpoint,
    "truncated": _truncated_checkpoint,
}  # fmt: skip

for _name, _make in CHECKPOINTS.items():

    @case(f"export-checkpoint-{_name}")
    def _(folder, _make=_make):
        return ["export", str(_make(folder)), "-o", str(folder / "out.onnx")]

    if _name in ("missing_model", "missing_weight", "wrong_shape", "opaque_object", "garbage", "missing_sparsifier",
                 "missing_position", "model_not_dict"):  # fmt: skip

        @case(f"train-resume-{_name}")
        def _(folder, _make=_make):
            checkpoint = _make(folder)
            config = config_file(folder, '\n[sparsity]\nmethod = "srste"\n')
            return ["train", str(config), "-o", str(folder / "run"), "--resume", str(checkpoint), "--no-progress"]


# -- weight files for stats ----------------------------------------------------------------------------------------


def _safetensors(folder, tensors):
    from safetensors.torch import save_file

    path = folder / "weights.safetensors"
    save_file(tensors, str(path))
    return path


BAD_WEIGHTS = {
    "nan": lambda f: _safetensors(f, {"w": torch.full((8, 16), float("nan"))}),
    "inf": lambda f: _safetensors(f, {"w": torch.full((8, 16), float("inf"))}),
    "non_dividing": lambda f: _safetensors(f, {"w": torch.ones(8, 6)}),
    "only_vectors": lambda f: _safetensors(f, {"b": torch.ones(8)}),
    "truncated": lambda f: _truncate(_safetensors(f, {"w": torch.ones(64, 64)})),
    "garbage": lambda f: _text(f / "weights.safetensors", "not safetensors"),
    "empty": lambda f: _safetensors(f, {}),
    "state_dict_opaque": lambda f: _opaque_state_dict(f),
    "state_dict_garbage": lambda f: _text(f / "weights.pt", "garbage"),
    "missing": lambda f: f / "none.safetensors",
}


def _opaque_state_dict(folder):
    path = folder / "weights.pt"
    torch.save({"w": Opaque()}, path)
    return path


for _name, _make in BAD_WEIGHTS.items():

    @case(f"stats-{_name}")
    def _(folder, _make=_make):
        return ["stats", str(_make(folder))]


# -- baselines -----------------------------------------------------------------------------------------------------

BASELINE_MODEL = '[[model]]\nname = "m"\nreference = "model.onnx"\ncandidate = "model.onnx"\ndata = "random"\n'
BAD_BASELINES = {
    "empty": "",
    "not_toml": "[[model\n",
    "no_checks": BASELINE_MODEL,
    "unknown_metric": BASELINE_MODEL + "[model.accuracy.y]\nloudness = { baseline = 1.0, tolerance = 0.1 }\n",
    "negative_tolerance": BASELINE_MODEL + "[model.accuracy.y]\nmean_cosine = { baseline = 1.0, tolerance = -1 }\n",
    "missing_candidate": BASELINE_MODEL.replace('candidate = "model.onnx"', 'candidate = "gone.onnx"')
    + "[model.accuracy.y]\nmean_cosine = { baseline = 1.0, tolerance = 0.1 }\n",
    "broken_candidate": BASELINE_MODEL.replace('candidate = "model.onnx"', 'candidate = "broken.onnx"')
    + "[model.accuracy.y]\nmean_cosine = { baseline = 1.0, tolerance = 0.1 }\n",
    "unknown_output": BASELINE_MODEL + "[model.accuracy.nothing]\nmean_cosine = { baseline = 1.0, tolerance = 0.1 }\n",
    "latency_batch_zero": BASELINE_MODEL + "[model.latency]\nbatch = [0]\n[model.latency.p50_ratio]\n"
    "0 = { baseline = 1.0, tolerance = 0.5 }\n",
    "baseline_nan": BASELINE_MODEL + "[model.accuracy.y]\nmean_cosine = { baseline = nan, tolerance = 0.1 }\n",
    "metric_unimportable": BASELINE_MODEL + 'metric = "no_such_module_xyz:f"\n[model.accuracy.metric]\n'
    "value = { baseline = 1.0, tolerance = 0.1 }\n",
    "metric_unchecked": BASELINE_MODEL + 'metric = "json:dumps"\n[model.accuracy.y]\n'
    "mean_cosine = { baseline = 1.0, tolerance = 0.1 }\n",
    "metric_value_without_metric": BASELINE_MODEL + "[model.accuracy.metric]\n"
    "value = { baseline = 1.0, tolerance = 0.1 }\n",
    "latency_runs_zero": BASELINE_MODEL + "[model.latency]\nruns = 0\n[model.latency.p50_ratio]\n"
    "1 = { baseline = 1.0, tolerance = 0.5 }\n",
}

for _name, _text_ in BAD_BASELINES.items():

    @case(f"regress-{_name}")
    def _(folder, _text_=_text_):
        good_model(folder)
        (folder / "broken.onnx").write_bytes(b"\x00garbage")
        path = folder / "baselines.toml"
        path.write_text(_text_)
        return ["regress", str(path)]


def _init(folder: Path, *extra: str) -> list[str]:
    model = str(good_model(folder))
    return ["regress", "--init", str(folder / "new.toml"), "--reference", model, "--candidate", model, *extra]


@case("regress-init_exists")
def _(folder):
    (folder / "new.toml").write_text("# kept\n")
    return _init(folder, "--data", str(good_data(folder)))


@case("regress-init_bad_metric")
def _(folder):
    return _init(folder, "--data", str(good_data(folder)), "--metric", "no_such_module_xyz:f")


@case("regress-init_no_data")
def _(folder):
    return _init(folder)


@case("regress-missing-file")
def _(folder):
    return ["regress", str(folder / "none.toml")]


# -- the reason each case must give --------------------------------------------------------------------------------
# Keyed by the case id without its verb; a substring of the one error line. Without it a removed check goes unnoticed
# whenever a later check fails the same input with another message.

REASONS = {
    "location_absolute": "which is not a relative file name",
    "location_dotdot": "which escapes the model's folder",
    "location_dotdot_inside": "which escapes the model's folder",
    "location_symlink": "a link that leaves the model's folder",
    "location_folder_symlink": "a link that leaves the model's folder",
    "location_hub_other_repository": "a link that leaves the model's folder",
    "location_missing": "external data file 'nowhere.data' of tensor 'W1' is missing",
    "location_empty": "location '', which is not a relative file name",
    "location_folder": "'adir', which is not a regular file",
    "location_model_itself": "which is the model file itself",
    "data_truncated": "is shorter than tensor 'W1' needs",
    "offset_abc": "has offset 'abc', which is not a byte count",
    "offset_-4": "has offset '-4', which is not a byte count",
    "offset_1.5": "has offset '1.5', which is not a byte count",
    "offset_99999999999": "(100000001023 bytes at offset 99999999999)",
    "length_12": "gives length 12",
    "length_-1": "has length '-1', which is not a byte count",
    "location_repeated": "tensor 'W1' gives external data key 'location' more than once",
    "offset_repeated": "tensor 'W1' gives external data key 'offset' more than once",
    "key_basepath": "tensor 'W1' has external data key 'basepath', which ONNX does not define",
    "dims_overflow": "more than any real model holds",
    "dims_beyond_data": "dims [8, 4096] (131072 bytes) but its external data",
    "dims_negative": "has negative dims [-8, -32]",
    "inline_size_mismatch": "holds 2040 bytes but its dims [16, 32] need 2048",
    "empty_file": "not an ONNX model (no graph)",
    "truncated_model": "not a readable ONNX model",
    "garbage_model": "not a readable ONNX model",
    "text_model": "not a readable ONNX model",
    "missing_model": "missing.onnx: no such file",
    "folder_as_model": "is a folder, not an ONNX model",
    "cyclic_model": "the graph has a cycle",
    "nan_weights": "weight 'W1' contains NaN",
    "nothing_prunable": "nothing to",
    "custom_domain_op": "com.example:Mystery",
    "pattern-nothing-eligible": "not a multiple of 3",
    "include-matches-nothing": "matched the --include/--exclude filters",
    "out_is_folder": "is a folder; give a file path for the output",
    "out_under_file": "is not a folder; choose an output path in a folder",
    "out_is_model_without_in_place": "is the input model",
    "out_is_input_data_file": "which the input uses",
    "out_derives_input_data_name": "model.onnx.data is model.onnx.data, which the input uses",
    "out_is_hard_link_to_model": "link.onnx is model.onnx, which the input uses",
    "out_is_calibration_data": "data.npz is data.npz, which the input uses",
    "out_is_checkpoint": "checkpoint.pt is checkpoint.pt, which the input uses",
    "plot_is_folder": "plots.png is a folder",
    "plot_under_file": "afile is not a folder",
    "plot_is_the_model": "which the input uses",
    "data-zero_rows": "input 'x' has shape [0, 16]",
    "data-nan": "input 'x' contains NaN or infinite values",
    "data-inf": "input 'x' contains NaN or infinite values",
    "data-wrong_dtype": "input 'x' is float64",
    "data-wrong_shape": "input 'x' has shape [2, 8]",
    "data-missing_input": "no array for input 'x'",
    "data-truncated_npz": "not an .npz file (not a zip archive, or truncated)",
    "data-not_npz": "not an .npz file (not a zip archive, or truncated)",
    "data-pickled_object": "holds Python objects (pickled data)",
    "data-damaged_member": "member 'x.npy' cannot be read",
    "data-missing": "no such data file",
    "data-empty_folder": "folder holds no .npz files",
    "nan-weights-candidate": "the candidate model's output 'y' contains NaN",
    "damping--1": "--damping must be a positive number, not -1.0",
    "damping-nan": "--damping must be a positive number, not nan",
    "damping-inf": "--damping must be a positive number, not inf",
    "damping-0": "--damping must be a positive number, not 0.0",
    "metric-os.sep": "os has no function 'sep'",
    "metric-json.nothing_here": "json has no function 'nothing_here'",
    "metric-no_such_module_xyz.f": "cannot import 'no_such_module_xyz'",
    "metric-justtext": "must look like 'package.module:function'",
    "metric-math.pi": "math has no function 'pi'",
    "-duration-nan": "--duration must be a number of seconds, 0 or more, got nan",
    "-duration-inf": "--duration must be a number of seconds, 0 or more, got inf",
    "-duration--1": "--duration must be a number of seconds, 0 or more, got -1.0",
    "-iterations-0": "--iterations must be at least 1, got 0",
    "-iterations--5": "--iterations must be at least 1, got -5",
    "-warmup--1": "--warmup must not be negative, got -1",
    "-batch-0": "--batch '0': expected comma-separated positive integers",
    "-batch--1": "--batch '-1': expected comma-separated positive integers",
    "-batch-1,x": "--batch '1,x': expected comma-separated positive integers",
    "-batch-1.5": "--batch '1.5': expected comma-separated positive integers",
    "data-ids_out_of_range": "indices element out of data bounds",
    "out_is_a_file": "afile is not a folder",
    "baselines_missing": "no such folder",
    "user-data_wrong_input": "no array for input 'x'",
    "user-no_data": "pipeline MODEL needs --data",
    "user-metric_unimportable": "cannot import 'no_such_module_xyz'",
    "user-baselines_broken": "not valid TOML",
    "user-flag_without_model": "--calib is for your own model",
    "held_out_without_model": "--held-out is for your own model",
    "user-held_out_alone": "held-out data is read by --min-fidelity and --recover only",
    "user-held_out_is_calib": "shares files with the calibration data",
    "user-held_out_random": "held-out data 'random' judges fidelity on noise",
    "user-held_out_wrong_input": "no array for input 'x'",
    "user-transposable_permute": "--permute reorders the producers' output rows",
    "user-fit_target_parallel": "--fit-target chooses what the sequential fit matches",
    "user-calib_batch_zero": "calibration batch size must be at least 1, got 0",
    "recipe-numbers": "pass #1 is 1, not a table",
    "recipe-strings": "pass #1 is 'prune', not a table",
    "recipe-table": "a recipe needs a non-empty [[passes]] list",
    "recipe-empty": "a recipe needs a non-empty [[passes]] list",
    "recipe-unknown_pass": "names 'shrink'; known passes",
    "recipe-unknown_option": "unknown options ['ratio']",
    "recipe-bad_pattern": "N must be below M",
    "recipe-pattern_number": "expected a pattern string such as '2:4', got 24",
    "recipe-not_toml": "not valid TOML",
    "recipe-binary": "can't decode byte 0xff",
    "recipe-unknown_top": "unknown top-level keys ['name']",
    "recipe-precision_unknown": "unknown precision 'fp8'",
    "recipe-wrong_option_type": "eligible_only = 'yes' must be bool",
    "recipe-missing": "no recipe",
    "config-lr_inf": "lr must be a finite number, not inf",
    "config-lr_nan": "lr must be a finite number, not nan",
    "config-weight_decay_inf": "weight_decay must be a finite number, not inf",
    "config-pattern_no_layer_takes": "srste 2:3: no layer can take it",
    "config-include_nothing": "not matched by include '^nothing$'",
    "config-unknown_task": "name = 'imagenet' is not one of",
    "config-unknown_key": "unknown key in [train] 'speed'",
    "config-epochs_zero": "epochs must be at least 1, not 0",
    "config-not_toml": "not a readable TOML file",
    "config-missing_task": "missing [task] table",
    "config-method_unknown": "method = 'magic' is not one of",
    "config-missing": "no such config file",
    "checkpoint-missing_model": "holds no model state",
    "checkpoint-missing_config": "without a run configuration",
    "checkpoint-missing_sparsifier": "('sparsifier')",
    "checkpoint-missing_position": "no valid 'position' entry",
    "checkpoint-missing_weight": "does not fit the model its config builds",
    "checkpoint-wrong_shape": "does not fit the model its config builds",
    "checkpoint-model_not_dict": "holds no model state",
    "checkpoint-config_broken": "name = 'nope' is not one of",
    "checkpoint-version": "checkpoint version 99 is not 1",
    "checkpoint-nan_weight": "contains NaN or infinite values",
    "checkpoint-opaque_object": "holds Python objects other than tensors",
    "checkpoint-garbage": "it is damaged or not a torch file",
    "checkpoint-empty": "damaged, truncated or not a torch file",
    "checkpoint-truncated": "damaged, truncated or not a torch file",
    "resume-missing_model": "holds no model state",
    "resume-missing_weight": "does not fit the model its config builds",
    "resume-wrong_shape": "does not fit the model its config builds",
    "resume-opaque_object": "holds Python objects other than tensors",
    "resume-garbage": "it is damaged or not a torch file",
    "resume-missing_sparsifier": "('sparsifier')",
    "resume-missing_position": "no valid 'position' entry",
    "resume-model_not_dict": "holds no model state",
    "nan": "contains NaN or infinite values",
    "inf": "contains NaN or infinite values",
    "non_dividing": "needs the length of axis 1 to be a multiple of 4, got 6",
    "only_vectors": "no weight matrix to analyse",
    "truncated": "not fully covered",
    "garbage": "not a readable safetensors file",
    "state_dict_opaque": "holds Python objects other than tensors",
    "state_dict_garbage": "it is damaged or not a torch file",
    "missing": "none.safetensors: no such file",
    "not_toml": "not valid TOML",
    "no_checks": "no accuracy or latency baselines to check",
    "unknown_metric": "unknown accuracy metric 'loudness'",
    "negative_tolerance": "tolerance must not be negative",
    "missing_candidate": "gone.onnx does not exist",
    "broken_candidate": "broken.onnx: not a readable ONNX model",
    "unknown_output": "the model has no output 'nothing'",
    "latency_batch_zero": "latency.batch must be a list of positive integers",
    "baseline_nan": "must be finite numbers, not nan",
    "metric_unimportable": "cannot import 'no_such_module_xyz'",
    "metric_unchecked": "metric = 'json:dumps' is never checked",
    "metric_value_without_metric": "accuracy.metric.value needs the model's metric",
    "latency_runs_zero": "latency.runs must be a positive integer",
    "init_exists": "new.toml already exists",
    "init_bad_metric": "cannot import 'no_such_module_xyz'",
    "init_no_data": "--init needs --data",
    "missing-file": "no such baselines file",
}
REASONS_BY_ID = {
    "stats-empty": "no weight matrix to analyse",
    "regress-empty": "expected one or more [[model]] tables",
    "stats-missing": "none.safetensors: no such file",
}


def reason_of(case_id: str) -> str:
    """The substring the case's error line must hold: by its whole id, else by its id without the verb."""
    if case_id in REASONS_BY_ID:
        return REASONS_BY_ID[case_id]
    return REASONS[case_id.split("-", 1)[1]]


def test_every_case_names_the_reason_it_expects():
    assert all(reason_of(c.id) for c in CASES)


# -- the test ------------------------------------------------------------------------------------------------------


def folder_state(root: Path) -> dict[str, str]:
    """Every entry below ``root`` (hidden ones too): file contents and modes, links' targets, folders."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                state[key] = f"link -> {os.readlink(path)}"
            elif path.is_dir():
                state[key] = f"folder {path.stat().st_mode & 0o777:o}"
            else:
                state[key] = f"{path.stat().st_mode & 0o777:o} {hashlib.sha256(path.read_bytes()).hexdigest()}"
    return state


def test_the_corpus_is_large_and_covers_every_verb():
    assert len(CASES) >= 150
    assert len({c.id for c in CASES}) == len(CASES)
    verbs = {c.id.split("-")[0] for c in CASES}
    assert verbs >= {"inspect", "prune", "convert", "cast", "run", "compare", "bench", "export", "train", "stats",
                     "regress", "pipeline"}  # fmt: skip


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(bad, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "case"
    folder.mkdir()
    monkeypatch.chdir(folder)
    argv = bad.build(folder)
    before = folder_state(tmp_path)
    capsys.readouterr()

    code = main(argv)

    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, f"exit {code} for {bad.id}; stdout: {captured.out[-500:]}; stderr: {captured.err[-500:]}"
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    assert "weights_only" not in captured.err
    assert ".nmdeploy-" not in captured.err  # errors name the user's files, never temporaries
    assert lines[0].startswith(f"nmdeploy {argv[0]}: error: ")
    assert reason_of(bad.id) in lines[0].replace(f"{folder}/", ""), lines[0]  # paths relative to the case
    assert folder_state(tmp_path) == before


_OPENED: list[str] | None = None  # paths opened while a test records them (audit hooks cannot be removed)


def _record_opens(event: str, args: tuple) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


@pytest.mark.parametrize(
    "added",
    [
        [("location", "missing.data")],
        [("offset", "0")],
        [("length", "2048")],
        [("checksum", "0"), ("checksum", "0")],
        [("basepath", ".")],
    ],
    ids=["location", "offset", "length", "checksum", "basepath"],
)
def test_require_refuses_external_data_that_onnx_runtime_would_not_load(tmp_path, capsys, added):
    """A 2:4 model whose W1 repeats an external-data key ahead of its own (a first location naming a missing file) or
    has a key ONNX does not define: refused at load, so ``--require`` never passes a model ONNX Runtime cannot run."""
    pruned = tmp_path / "m" / "pruned.onnx"
    assert main(["prune", str(_model_in_subfolder(tmp_path)), "-o", str(pruned)]) == 0
    assert main(["inspect", str(pruned), "--require"]) == 0

    def add(tensor: onnx.TensorProto) -> None:
        entries = [onnx.StringStringEntryProto(key=k, value=v) for k, v in added] + list(tensor.external_data)
        tensor.ClearField("external_data")
        tensor.external_data.extend(entries)

    edit_tensor(pruned, "W1", add)
    capsys.readouterr()
    assert main(["inspect", str(pruned), "--require"]) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(error) == 1 and "tensor 'W1' " in error[0] and f"key '{added[0][0]}'" in error[0], error


def test_escaping_external_data_is_never_read(tmp_path, capsys):
    """The refusal comes before any read: Python's "open" audit event (raised by open(), os.open and numpy's
    fromfile alike, whatever the file system's access-time policy) never names the outside file. The same hook
    seeing numpy read it afterwards shows that it would have."""
    global _OPENED
    model = location_absolute(tmp_path)
    secret = tmp_path / "outside" / "secret.bin"
    sys.addaudithook(_record_opens)
    _OPENED = []
    try:
        assert main(["prune", str(model), "-o", str(tmp_path / "out.onnx")]) == 2
        refused = list(_OPENED)
        np.fromfile(secret, dtype=np.uint8, count=16)
        control = _OPENED[len(refused) :]
    finally:
        _OPENED = None
    assert f"'{secret}'" in capsys.readouterr().err
    assert str(model) in refused  # the model itself was read
    assert not [path for path in refused if Path(path).resolve() == secret]
    assert [path for path in control if Path(path).resolve() == secret]


@pytest.mark.parametrize("verb", ["inspect", "cast", "run"])
@pytest.mark.parametrize("damaged", [b"Relu", b"relu"])  # an op type, a node name
def test_a_name_that_is_not_utf8_is_one_line(tmp_path, capsys, verb, damaged):
    """protobuf hands invalid UTF-8 in an ONNX string field back as bytes: refused at load, whatever reads it."""
    data = mlp().SerializeToString()
    assert data.count(damaged) == 1
    model = tmp_path / "m.onnx"
    model.write_bytes(data.replace(damaged, damaged[:1] + b"\xff" + damaged[2:]))
    before = folder_state(tmp_path)
    out = str(tmp_path / "out.onnx")
    argv = {"inspect": ["inspect", str(model)], "cast": ["cast", str(model), "-o", out, "--no-check"],
            "run": ["run", "tensorrt-2of4", str(model), "-o", out]}[verb]  # fmt: skip
    assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "not UTF-8 text" in error[0]
    assert folder_state(tmp_path) == before


@pytest.mark.parametrize("verb", ["inspect", "cast"])
def test_a_domain_imported_twice_is_one_line(tmp_path, capsys, verb):
    """Two versions of the default domain (17 and 1): cast once wrote a model that type-checked under neither."""
    proto = mlp()
    proto.opset_import.add(domain="ai.onnx", version=1)
    model = tmp_path / "m.onnx"
    onnx.save(proto, model)
    before = folder_state(tmp_path)
    argv = ["inspect", str(model)] if verb == "inspect" else ["cast", str(model), "-o", str(tmp_path / "out.onnx")]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "imports operator domain 'ai.onnx' twice" in error[0]
    assert folder_state(tmp_path) == before


@pytest.mark.parametrize("fault", ["undefined", "twice"])
@pytest.mark.parametrize("verb", ["inspect", "prune", "cast"])
def test_a_value_defined_nowhere_or_twice_is_one_line(tmp_path, capsys, verb, fault):
    """W1 renamed, so MatMul reads a name nothing defines; or a copy of it stored under the name of a node output."""
    proto = mlp()
    if fault == "undefined":
        proto.graph.initializer[0].name = "zz"
    else:
        proto.graph.initializer.add().CopyFrom(proto.graph.initializer[0])
        proto.graph.initializer[-1].name = "h"
    model = tmp_path / "m.onnx"
    onnx.save(proto, model)
    before = folder_state(tmp_path)
    assert main([verb, str(model)] + ([] if verb == "inspect" else ["-o", str(tmp_path / "out.onnx")])) == 2
    error = capsys.readouterr().err.strip().splitlines()
    reason = "reads 'W1', which is neither" if fault == "undefined" else "'h' is defined twice"
    assert len(error) == 1 and reason in error[0]
    assert folder_state(tmp_path) == before


def test_an_npy_header_the_tokenizer_rejects_is_one_line(tmp_path, capsys):
    """numpy reads an .npy header's dict with Python's tokenizer: an unclosed bracket there is damage, not a crash."""
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 16), \n"
    member = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + bytes(128)
    calib = tmp_path / "calib.npz"
    with zipfile.ZipFile(calib, "w") as archive:
        archive.writestr("x.npy", member)
    model = tmp_path / "m.onnx"
    onnx.save(mlp(), model)
    before = folder_state(tmp_path)
    assert main(["convert", str(model), "-o", str(tmp_path / "out.onnx"), "--calib", str(calib)]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "is not a readable .npy array" in error[0]
    assert folder_state(tmp_path) == before
