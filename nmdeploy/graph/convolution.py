"""Convolution and pooling geometry as ONNX defines it: the padding that ``auto_pad`` implies."""

from __future__ import annotations

from collections.abc import Sequence


def explicit_pads(
    auto_pad: str,
    pads: Sequence[int],
    sizes: Sequence[int],
    kernel: Sequence[int],
    strides: Sequence[int] = (),
    dilations: Sequence[int] = (),
) -> tuple[list[int], list[int]]:
    """(begin, end) pads per spatial axis of an input whose spatial ``sizes`` are given: ``pads`` for NOTSET, none
    for VALID, and for SAME_UPPER / SAME_LOWER the total that keeps ceil(size / stride) outputs, split in two with
    the odd pixel at the end (UPPER) or the beginning (LOWER)."""
    spatial = len(kernel)
    if auto_pad == "VALID":
        return [0] * spatial, [0] * spatial
    if auto_pad == "NOTSET":
        given = list(pads) or [0] * (2 * spatial)
        return given[:spatial], given[spatial:]
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise ValueError(f"auto_pad={auto_pad!r} is not one of NOTSET, VALID, SAME_UPPER, SAME_LOWER")
    strides = list(strides) or [1] * spatial
    dilations = list(dilations) or [1] * spatial
    begin, end = [], []
    for size, k, stride, dilation in zip(sizes, kernel, strides, dilations, strict=True):
        total = max(0, (-(-size // stride) - 1) * stride + (k - 1) * dilation + 1 - size)
        small, large = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else large)
        end.append(large if auto_pad == "SAME_UPPER" else small)
    return begin, end
