"""Input data for running models: .npz files (input name -> batched array), a folder of them, or random inputs; the
one reader of data files every verb and calibration use.

Batches are streamed one file at a time, so memory is bounded by a file, not by the data set; calibration reads a
file in batches of rows (:func:`npz_batches`), so a file of any size costs one batch. The archive itself (its
untrusted headers, its arrays as streams) is :mod:`nmdeploy.runtimes.npz`'s. Every batch is checked against the
model's inputs up front, with a message naming the input and the shape it expects.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from nmdeploy.errors import InputError
from nmdeploy.graph import dtypes
from nmdeploy.graph.inputs import index_bound, indexed_tables
from nmdeploy.runtimes.base import InputSpec
from nmdeploy.runtimes.batch_axes import BatchAxes, model_batch_axes
from nmdeploy.runtimes.npz import NpzArchive
from nmdeploy.runtimes.prefill import decoder_roles, prefill_feed

RANDOM = "random"
MAX_RANDOM_BYTES = 1 << 30  # one random feed; larger inputs are fed from files
LEGACY_ID_BOUND = 100  # random integer ids when the model is not known


def data_files(source: str | Path) -> list[Path]:
    """The .npz files of ``source`` (a file, or a folder read in name order)."""
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.npz"))
        if not files:
            raise InputError(f"{path}: folder holds no .npz files")
        return files
    if not path.is_file():
        raise InputError(f"{path}: no such data file; give an .npz (input name -> batched array) or a folder of them")
    return [path]


def load_batches(source: str | Path, inputs: Sequence[InputSpec]) -> Iterator[dict[str, np.ndarray]]:
    """Yield one feed dict per .npz file, checked against ``inputs``."""
    for path in data_files(source):
        yield from npz_batches(path, inputs)


RowCount = Callable[[Mapping[str, tuple[int, ...]]], int]
"""Rows per batch, from the shapes of a file's arrays."""


def npz_batches(
    path: Path, inputs: Sequence[InputSpec], rows: RowCount | None = None, axes: BatchAxes | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """The arrays of ``inputs`` in the .npz ``path``, each batch checked against them: the whole file as one batch
    (``rows`` None), or batches of ``rows(shapes)`` rows along ``axes`` (default: the first axis of each input) where
    the file can be cut (:func:`cut_batch`). Rows on the first axis of C-ordered arrays are read as streams, so the
    file costs one batch of memory; other files are read whole, then cut."""
    axes = axes or BatchAxes({})
    with NpzArchive(path) as archive:
        missing = [spec.name for spec in inputs if spec.name not in archive.arrays]
        if missing:
            expected = ", ".join(spec.describe() for spec in inputs)
            raise InputError(f"{path}: no array for input '{missing[0]}'; the model expects {expected}")
        streams = {}
        try:
            for spec in inputs:
                streams[spec.name] = archive.open(spec.name)
            shapes = {name: stream.shape for name, stream in streams.items()}
            on_first_axis = all(axes.axis(spec.name) == 0 and spec.shape for spec in inputs)
            fortran = any(stream.fortran for stream in streams.values())
            if rows is None or not on_first_axis or fortran or not axes.cuttable(inputs, shapes):
                batch = check_batch({name: stream.read_all() for name, stream in streams.items()}, inputs, str(path))
                yield from [batch] if rows is None else cut_batch(batch, inputs, rows, axes)
                return
            total = next(iter(streams.values())).length
            size = rows(shapes)
            for start in range(0, max(total, 1), size):
                count = min(size, total - start)
                yield check_batch(
                    {name: stream.read_rows(count) for name, stream in streams.items()}, inputs, str(path)
                )
        finally:
            for stream in streams.values():
                stream.close()


def cut_batch(
    batch: dict[str, np.ndarray], inputs: Sequence[InputSpec], rows: RowCount, axes: BatchAxes
) -> Iterator[dict[str, np.ndarray]]:
    """``batch`` in pieces of ``rows(shapes)`` rows along ``axes``, where every input it cuts has a free batch axis
    and the arrays agree on its length; otherwise whole, as the model's fixed shapes demand."""
    shapes = {name: array.shape for name, array in batch.items()}
    if not axes.cuttable(inputs, shapes):
        yield batch
        return
    yield from axes.pieces(batch, rows(shapes))


def random_batches(
    inputs: Sequence[InputSpec],
    batch_size: int = 4,
    count: int = 2,
    seed: int = 0,
    *,
    model: onnx.ModelProto | str | Path | None = None,
    axes: BatchAxes | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """Seeded random inputs for functional comparisons only: normal floats; integer inputs that index a stored table
    (token ids) drawn below its row count; every other integer or bool input (attention masks, flags, lengths) all
    ones, the value that keeps every position valid. Without ``model`` the tables are unknown: integers are drawn
    in 0..99 (inputs named like a mask all ones).

    A free batch axis (``axes``, else the one the model's graph gives, else axis 0) is ``batch_size`` rows, every
    other free dimension 16. A decoder with a KV cache gets the feed of a first pass over random token rows
    (:mod:`nmdeploy.runtimes.prefill`: mask of ones, positions 0..L-1, the cache empty), the only feed whose mask,
    positions and cache lengths agree.
    """
    proto = model if model is None or isinstance(model, onnx.ModelProto) else load_graph(Path(model))
    bounds = {spec.name: LEGACY_ID_BOUND for spec in inputs} if proto is None else index_bounds(proto, inputs)
    axes = axes or model_batch_axes(proto)
    rng = np.random.default_rng(seed)
    shapes = {
        spec.name: tuple(
            batch_size if d is None and i == axes.axis(spec.name) else (d if d is not None else 16)
            for i, d in enumerate(spec.shape)
        )
        for spec in inputs
    }
    roles = decoder_roles(inputs)
    for _ in range(count):
        if roles is None:
            yield random_feed(inputs, shapes, bounds, rng)
            continue
        tokens = next(spec for spec in inputs if roles[spec.name] == "token ids")
        check_random_size([tokens], {tokens.name: shapes[tokens.name]})
        bound = bounds.get(tokens.name) or LEGACY_ID_BOUND
        yield prefill_feed(rng.integers(0, bound, shapes[tokens.name]).astype(np.int64), inputs, roles)


def check_random_size(inputs: Sequence[InputSpec], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse random feeds larger than MAX_RANDOM_BYTES before drawing them: a model whose input declares 10^9 rows
    needs real data, not a random batch of that size."""
    total = sum(math.prod(shapes[spec.name]) * spec.dtype.itemsize for spec in inputs)
    if total > MAX_RANDOM_BYTES:
        largest = max(inputs, key=lambda spec: math.prod(shapes[spec.name]) * spec.dtype.itemsize)
        raise InputError(
            f"random inputs would take {total} bytes (input '{largest.name}' has shape "
            f"{list(shapes[largest.name])}), more than {MAX_RANDOM_BYTES >> 20} MiB; give real data as an .npz instead"
        )


def random_feed(
    inputs: Sequence[InputSpec],
    shapes: Mapping[str, tuple[int, ...]],
    bounds: Mapping[str, int],
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """One random feed of the given ``shapes``: normal floats, ids below ``bounds`` (from :func:`index_bounds`) for
    inputs that index a table, ones for masks and every other integer or bool input."""
    check_random_size(inputs, shapes)
    batch = {}
    for spec in inputs:
        shape, bound = shapes[spec.name], bounds.get(spec.name)
        if dtypes.is_float_dtype(spec.dtype):
            batch[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif bound is not None and spec.dtype != np.bool_ and "mask" not in spec.name.lower():
            batch[spec.name] = rng.integers(0, bound, shape).astype(spec.dtype)
        else:
            batch[spec.name] = np.ones(shape, dtype=spec.dtype)
    return batch


def index_bounds(model: onnx.ModelProto | str | Path, inputs: Sequence[InputSpec]) -> dict[str, int]:
    """Input name -> how many ids are valid, for the inputs that index a stored table (a Gather on an embedding,
    through casts and reshapes): the fewest rows among the tables it indexes; 1 (only id 0) when it indexes only
    computed data."""
    proto = model if isinstance(model, onnx.ModelProto) else load_graph(Path(model))
    if proto is None:
        return {}
    bounds = {}
    for name, reads in indexed_tables(proto, [spec.name for spec in inputs]).items():
        if reads:
            bound = index_bound(reads)
            bounds[name] = 1 if bound is None else bound
    return bounds


def load_graph(path: Path) -> onnx.ModelProto | None:
    """The graph of an ONNX file without its external data (the weights' values are not needed), or None for a file
    that is not one: its runner reports that with a better message."""
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception:  # protobuf raises several unrelated types for a file that is not a model
        return None


def check_batch(batch: dict[str, np.ndarray], inputs: Sequence[InputSpec], where: str) -> dict[str, np.ndarray]:
    """The batch restricted to the model's inputs, or an InputError naming the input and its expected shape."""
    expected = ", ".join(spec.describe() for spec in inputs)
    missing = [spec.name for spec in inputs if spec.name not in batch]
    if missing:
        raise InputError(f"{where}: no array for input '{missing[0]}'; the model expects {expected}")
    for spec in inputs:
        array = batch[spec.name]
        if array.dtype != spec.dtype:
            raise InputError(f"{where}: input '{spec.name}' is {array.dtype.name}, the model expects {spec.describe()}")
        if array.ndim != len(spec.shape) or any(
            d is not None and d != a for d, a in zip(spec.shape, array.shape, strict=True)
        ):
            raise InputError(
                f"{where}: input '{spec.name}' has shape {list(array.shape)}, the model expects {spec.describe()}"
            )
        if array.ndim and array.shape[0] == 0:
            raise InputError(f"{where}: input '{spec.name}' has no rows; give at least one sample per input")
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            raise InputError(f"{where}: input '{spec.name}' contains NaN or infinite values; clean the data first")
    return {spec.name: batch[spec.name] for spec in inputs}


def graph_inputs(proto) -> tuple[InputSpec, ...]:
    """The model's real inputs (initializers listed as inputs excluded), read from the protobuf."""
    initializers = {t.name for t in proto.graph.initializer}
    specs = []
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        # Paddle's exporter writes -1 for a dynamic dimension (ONNX Runtime accepts any size there).
        dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tensor.shape.dim)
        try:
            dtype = dtypes.numpy_dtype(tensor.elem_type)
        except dtypes.UnknownDtypeError as error:
            raise dtypes.UnknownDtypeError(f"input '{value.name}': {error}") from None
        specs.append(InputSpec(value.name, dtype, dims))
    return tuple(specs)


def batches_for(
    source: str | Path, inputs: Sequence[InputSpec], *, model: onnx.ModelProto | str | Path | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """Batches from an .npz/folder, or seeded random ones for ``"random"`` (valid ids for ``model``'s tables)."""
    return random_batches(inputs, model=model) if str(source) == RANDOM else load_batches(source, inputs)
