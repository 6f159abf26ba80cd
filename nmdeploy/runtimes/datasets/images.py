"""Image files -> float shards for a model's image input, through Pillow.

Each image is converted to RGB (or grayscale for a one-channel input), resized to the size asked for with bilinear
resampling (stretched: the aspect ratio is not kept, nothing is cropped), scaled and normalised as
``(pixel / scale - mean) / std`` per channel, and laid out NCHW or NHWC. An image that cannot be read is an error
naming the file, not a skip: calibration on a silently smaller set would be hard to notice.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from nmdeploy.errors import InputError, first_line
from nmdeploy.imports import require
from nmdeploy.runtimes.base import InputSpec
from nmdeploy.runtimes.data import graph_inputs
from nmdeploy.runtimes.datasets.shards import DataSetReport, check_output_folder, rows_per_shard, write_shards

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"})
LAYOUTS = ("NCHW", "NHWC")


def _pillow():
    return require("PIL.Image", purpose="nmdeploy data images", package="Pillow")


def image_files(folder: Path) -> list[Path]:
    """The image files of ``folder`` (by suffix, not hidden), in name order; none is an error."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: no such folder; give a folder of image files")
    files = sorted(
        path
        for path in folder.iterdir()
        if path.suffix.lower() in IMAGE_SUFFIXES and not path.name.startswith(".") and path.is_file()
    )
    if not files:
        raise InputError(f"{folder}: holds no image files ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return files


def image_layout(spec: InputSpec, layout: str | None) -> tuple[str, int]:
    """(layout, channels) of an image input: ``layout`` when given (checked against a fixed channel dim), else the
    one its shape allows (a channel dim of 1 or 3 at position 1 or 3, but not both)."""
    if len(spec.shape) != 4:
        raise InputError(f"input '{spec.name}' ({spec.describe()}) is not an image batch [N, C, H, W] or [N, H, W, C]")
    channel_dim = {"NCHW": spec.shape[1], "NHWC": spec.shape[3]}
    if layout is None:
        fits = [name for name, dim in channel_dim.items() if dim in (1, 3)]
        if len(fits) != 1:
            raise InputError(f"cannot tell the layout of input {spec.describe()}; give --layout NCHW or NHWC")
        layout = fits[0]
    elif layout not in LAYOUTS:
        raise InputError(f"--layout must be NCHW or NHWC, not {layout!r}")
    channels = channel_dim[layout]
    if channels is None:
        channels = 3
    if channels not in (1, 3):
        raise InputError(
            f"input {spec.describe()} has {channels} channels in {layout}; images give 1 (gray) or 3 (RGB)"
        )
    return layout, channels


def image_size(spec: InputSpec, layout: str, size: tuple[int, int] | None) -> tuple[int, int]:
    """(height, width): ``size``, which must match the model's fixed dims, or those dims when not given."""
    fixed = (spec.shape[2], spec.shape[3]) if layout == "NCHW" else (spec.shape[1], spec.shape[2])
    if size is None:
        if None in fixed:
            raise InputError(f"input {spec.describe()} has a free image size; give --size HxW")
        return fixed[0], fixed[1]
    if any(f is not None and f != s for f, s in zip(fixed, size, strict=True)):
        raise InputError(f"--size {size[0]}x{size[1]} does not fit input {spec.describe()}")
    if min(size) < 1:
        raise InputError(f"--size must be positive, got {size[0]}x{size[1]}")
    return size


def _per_channel(values: Sequence[float] | None, channels: int, default: float, flag: str) -> np.ndarray:
    if values is None:
        return np.full(channels, default, dtype=np.float32)
    if len(values) not in (1, channels):
        raise InputError(f"{flag} takes 1 or {channels} values for a {channels}-channel input, got {len(values)}")
    array = np.broadcast_to(np.asarray(values, dtype=np.float32), (channels,)).copy()
    if not np.isfinite(array).all():
        raise InputError(f"{flag} values must be finite numbers")
    return array


def load_image(path: Path, size: tuple[int, int], channels: int) -> np.ndarray:
    """One image as float32 [H, W, C] in 0..255, or an InputError naming the file."""
    Image = _pillow()
    try:
        with Image.open(path) as image:
            converted = image.convert("L" if channels == 1 else "RGB")
            resized = converted.resize((size[1], size[0]), Image.Resampling.BILINEAR)
            array = np.asarray(resized, dtype=np.float32)
    except Exception as error:  # Pillow raises many types for damaged or unsupported files
        reason = first_line(error, 200)
        raise InputError(f"{path}: not a readable image ({reason}); remove or replace it") from None
    return array.reshape(size[0], size[1], channels)


def image_batches(
    files: Sequence[Path],
    spec: InputSpec,
    layout: str,
    size: tuple[int, int],
    channels: int,
    mean: np.ndarray,
    std: np.ndarray,
    scale: float,
    rows: int,
    whole_only: bool,
) -> Iterator[dict[str, np.ndarray]]:
    """Feed dicts of ``rows`` images each (only whole ones when ``whole_only``: a fixed batch size)."""
    end = len(files) - len(files) % rows if whole_only else len(files)
    for start in range(0, end, rows):
        pixels = np.stack([load_image(path, size, channels) for path in files[start : start + rows]])
        normalised = (pixels / scale - mean) / std
        if layout == "NCHW":
            normalised = normalised.transpose(0, 3, 1, 2)
        yield {spec.name: np.ascontiguousarray(normalised).astype(spec.dtype)}


def build_image_set(
    model: str | Path,
    folder: str | Path,
    output: str | Path,
    *,
    size: tuple[int, int] | None = None,
    layout: str | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    scale: float = 255.0,
    rows: int = 32,
) -> DataSetReport:
    """Load, resize and normalise the images of ``folder`` for ``model``'s one image input; write shards."""
    from nmdeploy.graph import dtypes
    from nmdeploy.graph.model import OnnxModel

    check_output_folder(Path(output), [Path(folder), Path(model)])
    inputs = graph_inputs(OnnxModel.load(model).proto)
    if len(inputs) != 1 or not dtypes.is_float_dtype(inputs[0].dtype):
        described = ", ".join(spec.describe() for spec in inputs)
        raise InputError(f"{model} has inputs {described}; images feed a model with one float input")
    (spec,) = inputs
    layout, channels = image_layout(spec, layout)
    height, width = image_size(spec, layout, size)
    mean_values = _per_channel(mean, channels, 0.0, "--mean")
    std_values = _per_channel(std, channels, 1.0, "--std")
    if not (np.isfinite(scale) and scale > 0) or (std_values == 0).any():
        raise InputError("--scale and every --std value must be non-zero (scale positive)")
    files = image_files(Path(folder))
    per_shard = rows_per_shard(inputs, rows)
    whole_only = spec.shape[0] is not None
    if whole_only and len(files) < per_shard:
        raise InputError(f"{model} takes batches of {per_shard} images; {folder} holds only {len(files)}")
    batches = image_batches(
        files, spec, layout, (height, width), channels, mean_values, std_values, scale, per_shard, whole_only
    )
    report = write_shards(Path(output), str(folder), inputs, batches, per_shard)
    report.image_size = [height, width]
    if whole_only and len(files) % per_shard:
        report.dropped_rows = len(files) % per_shard
    return report
