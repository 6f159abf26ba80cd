"""Where each weight's GEMM input comes from, and its second moments accumulated chunk by chunk.

Fully connected uses: MatMul and Gemm with the weight on either side, any batch or token dimensions; the input
weight W of an LSTM, GRU or RNN, whose X(t) rows are the rows of the op's input X. Convolutions
(1-D and 2-D, one group): X holds the im2col patches in channel-fastest order (r, s, c), so that M consecutive
entries of a row are M input channels at one kernel position -- the groups a TensorRT-style N:M mask uses -- and
K = R * S * C. Patches are built band by band of output rows, so a batch never needs its whole patch matrix at once.
auto_pad SAME_UPPER / SAME_LOWER (Paddle and TF exports) pads each batch as ONNX defines it for that input size.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import torch

from nmdeploy.errors import InputError
from nmdeploy.graph.convolution import explicit_pads
from nmdeploy.graph.prunable import RECURRENT_GATES, RECURRENT_INPUT, PrunableWeight
from nmdeploy.masks.blockwise import BlockDiagonal

# Rows of X are produced in chunks of about this many elements (64 MB in fp32): products stay GEMM-sized while the
# im2col of a large feature map never exists whole.
CHUNK_ELEMENTS = 1 << 24


@dataclass
class InputStatistics:
    """Second moments of one weight's GEMM input: ``hessian`` = X^T X [K, K] over ``samples`` rows of X, in float32,
    or its diagonal blocks (:class:`~nmdeploy.masks.blockwise.BlockDiagonal`) where the memory budget wanted them.
    Weights reading the same input share one ``hessian`` (and ``cross``) object."""

    weight: PrunableWeight
    activation: str
    hessian: torch.Tensor | BlockDiagonal
    samples: int = 0
    cross: torch.Tensor | None = None  # X^T X_dense [K, K], where the inputs differ from the dense model's
    # X^T (X_dense W^T) [K, out]: the cross moments times the dense weight, collected instead of ``cross`` where the
    # weight is narrower than half its input (K * out products per row, twice, against K * K)
    cross_outputs: torch.Tensor | None = None

    @property
    def shifted(self) -> bool:
        """Whether the inputs differ from the dense model's (earlier weights have changed)."""
        return self.cross is not None or self.cross_outputs is not None


@dataclass(frozen=True)
class ConvGeometry:
    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilations: tuple[int, int]
    pads: tuple[int, int, int, int]  # left, right, top, bottom, the order torch's F.pad takes for the last two axes
    # SAME_UPPER / SAME_LOWER: the pads depend on each input's spatial size, so they are worked out per batch
    auto_pad: str = "NOTSET"

    def patch_chunks(self, x: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS) -> Iterator[torch.Tensor]:
        """im2col of [B, C, H, W] (or [B, C, L]) as rows [positions, R * S * C], channel fastest, in bands of output
        rows of about ``chunk_elements`` elements each (whole samples when they fit)."""
        for band in self._bands(x, chunk_elements):
            yield self._unfold(band)

    def output_chunks(
        self, x: torch.Tensor, matrix: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS
    ) -> Iterator[torch.Tensor]:
        """The convolution's outputs without bias, ``patches @ matrix.T`` for the [out, R * S * C] ``matrix``, in the
        rows and chunks of :meth:`patch_chunks`; computed as a convolution, so the patches never exist."""
        kh, kw = self.kernel
        kernel = matrix.reshape(matrix.shape[0], kh, kw, -1).permute(0, 3, 1, 2).to(x.dtype)
        for band in self._bands(x, chunk_elements):
            outputs = torch.nn.functional.conv2d(band, kernel, stride=self.strides, dilation=self.dilations)
            yield outputs.permute(0, 2, 3, 1).reshape(-1, outputs.shape[1])

    def _bands(self, x: torch.Tensor, chunk_elements: int) -> Iterator[torch.Tensor]:
        """The padded input in slices whose patch matrices hold about ``chunk_elements`` elements each."""
        if x.ndim == 3:
            x = x.unsqueeze(2)
        x = torch.nn.functional.pad(x, self._pads(x.shape[2:]))
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.strides, self.dilations
        batch, channels, height, width = x.shape
        out_h = (height - dh * (kh - 1) - 1) // sh + 1
        out_w = (width - dw * (kw - 1) - 1) // sw + 1
        if out_h <= 0 or out_w <= 0:
            return
        k = channels * kh * kw
        per_sample = out_h * out_w * k
        if per_sample <= chunk_elements:
            samples = max(1, chunk_elements // per_sample)
            for start in range(0, batch, samples):
                yield x[start : start + samples]
            return
        band = max(1, chunk_elements // (out_w * k))
        for sample in range(batch):
            for row in range(0, out_h, band):
                rows = min(band, out_h - row)
                top = row * sh
                bottom = top + (rows - 1) * sh + dh * (kh - 1) + 1
                yield x[sample : sample + 1, :, top:bottom]

    def _pads(self, sizes: tuple[int, int]) -> tuple[int, int, int, int]:
        """The pads of an input of spatial ``sizes`` (1-D convolutions as [1, L] with a [1, R] kernel)."""
        if self.auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
            return self.pads
        begin, end = explicit_pads(self.auto_pad, (), sizes, self.kernel, self.strides, self.dilations)
        return begin[1], end[1], begin[0], end[0]

    def _unfold(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == (1, 1):
            # A 1x1 patch is one pixel's channels: a strided view, one copy instead of unfold's two.
            x = x[:, :, :: self.strides[0], :: self.strides[1]]
            return x.permute(0, 2, 3, 1).reshape(-1, x.shape[1])
        columns = torch.nn.functional.unfold(x, self.kernel, dilation=self.dilations, stride=self.strides)
        batch, _, positions = columns.shape
        channels = x.shape[1]
        # unfold orders a column (c, r, s); the masks group channels at one kernel position, so (r, s, c).
        columns = columns.view(batch, channels, -1, positions).permute(0, 3, 2, 1)
        return columns.reshape(batch * positions, -1)


@dataclass(frozen=True)
class Tap:
    """Where a weight's GEMM input comes from and how to turn one batch of it into rows X [samples, K]."""

    activation: str
    reduce_last: bool = True  # K is the activation's last axis (else its second to last: the weight is the A operand)
    convolution: ConvGeometry | None = None

    def row_chunks(
        self,
        activation: np.ndarray | torch.Tensor,
        chunk_elements: int = CHUNK_ELEMENTS,
        device: torch.device | None = None,
    ) -> Iterator[torch.Tensor]:
        """The batch as rows [rows, K] in chunks, in fp32 (fp64 stays fp64), on ``device`` (None: where a tensor is,
        the CPU for an array): moments are summed per chunk in that precision and accumulated across chunks in fp64,
        at half the cost of fp64 products."""
        x = _rows_source(activation, device)
        if self.convolution is not None:
            yield from self.convolution.patch_chunks(x, chunk_elements)
            return
        if not self.reduce_last:
            x = x.transpose(-1, -2)
        rows = x.reshape(-1, x.shape[-1])
        step = max(1, chunk_elements // max(1, rows.shape[1]))
        for start in range(0, rows.shape[0], step):
            yield rows[start : start + step]

    def output_chunks(self, activation: np.ndarray | torch.Tensor, matrix: torch.Tensor) -> Iterator[torch.Tensor]:
        """The GEMM's outputs ``X @ matrix.T`` for the [out, K] ``matrix``, in the rows and chunks of
        :meth:`row_chunks`, on the matrix's device (a convolution runs as one, without building its patches)."""
        if self.convolution is None:
            for rows in self.row_chunks(activation, device=matrix.device):
                yield rows @ matrix.to(rows.dtype).T
            return
        yield from self.convolution.output_chunks(_rows_source(activation, matrix.device), matrix)


def _rows_source(activation: np.ndarray | torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A batch of activations as a float tensor on ``device`` (moved there explicitly; None: left where it is)."""
    if isinstance(activation, torch.Tensor):
        x = activation
    else:
        with warnings.catch_warnings():
            # Spilled activations are read-only memory maps; they are only ever read here.
            warnings.simplefilter("ignore", UserWarning)
            x = torch.from_numpy(np.ascontiguousarray(activation))
    if device is not None:
        x = x.to(device, non_blocking=True)
    return x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)


def accumulate(
    stats: list[InputStatistics],
    tap: Tap,
    values: np.ndarray | torch.Tensor,
    dense: np.ndarray | torch.Tensor | None,
    dense_weights: torch.Tensor | None = None,
) -> None:
    """Add one batch to the moments of every weight reading ``tap``: H += X^T X and, given the dense model's values
    of the same input, C += X^T X_dense, or, given ``dense_weights`` (the stats' dense [out, K] matrices stacked in
    order), C W^T += X^T (X_dense W^T) split over the stats' ``cross_outputs``. Weights reading the same input the
    same way share one set of products, added in place into each distinct moment buffer (no K x K temporary)."""
    device = stats[0].hessian.device  # the moments stay where they were made
    chunks = tap.row_chunks(values, device=device)
    dense_chunks = None
    if dense is not None:
        dense_chunks = (
            tap.row_chunks(dense, device=device) if dense_weights is None else tap.output_chunks(dense, dense_weights)
        )
    hessians = list({id(stat.hessian): stat.hessian for stat in stats}.values())
    crosses = list({id(stat.cross): stat.cross for stat in stats if stat.cross is not None}.values())
    projected = None  # X^T (X_dense W^T) of the whole group, [K, sum of out]: small
    rows = 0
    width = stats[0].hessian.shape[0]
    for x in chunks:
        if x.shape[1] != width:
            # An invalid model (a transB that contradicts the weight's shape, say) would fail in the product below.
            raise InputError(
                f"{tap.activation!r} gives rows of {x.shape[1]} values, but weight {stats[0].weight.name!r} reduces "
                f"over {width}: the model's shapes disagree (check the layer's attributes, e.g. Gemm transB)"
            )
        for hessian in hessians:
            if isinstance(hessian, BlockDiagonal):
                hessian.add(x)
            elif hessian.dtype == x.dtype:
                hessian.addmm_(x.T, x)
            else:  # small float64 statistics: products in the rows' precision, summed in float64
                hessian.add_(x.T @ x)
        if dense_chunks is not None:
            other = next(dense_chunks)
            if dense_weights is not None:
                product = (x.T @ other.to(x.dtype)).to(stats[0].cross_outputs.dtype)
                projected = product if projected is None else projected.add_(product)
            else:
                for cross in crosses:
                    if cross.dtype == x.dtype:
                        cross.addmm_(x.T, other.to(x.dtype))
                    else:
                        cross.add_(x.T @ other.to(x.dtype))
        rows += x.shape[0]
    offset = 0
    for stat in stats:
        if projected is not None and stat.cross_outputs is not None:
            width = stat.cross_outputs.shape[1]
            stat.cross_outputs += projected[:, offset : offset + width]
            offset += width
        stat.samples += rows


def as_matrix(weight: PrunableWeight, values: torch.Tensor) -> torch.Tensor:
    """The weight as the [out, K] matrix its GEMM multiplies, K ordered as the tap's rows (a view where the layout
    allows)."""
    if weight.uses[0].op_type == "Conv":
        return values.permute(0, *range(2, values.ndim), 1).reshape(values.shape[0], -1)
    if weight.recurrent:  # [directions, gates * hidden, K]: every row multiplies the same X(t)
        return values.reshape(-1, values.shape[-1])
    return values if weight.axis == 1 else values.T


def from_matrix(weight: PrunableWeight, matrix: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`as_matrix`: back to the stored layout."""
    if weight.uses[0].op_type == "Conv":
        k, c, *kernel = weight.shape
        return matrix.reshape(k, *kernel, c).permute(0, -1, *range(1, len(kernel) + 1))
    if weight.recurrent:
        return matrix.reshape(weight.shape)
    return matrix if weight.axis == 1 else matrix.T


def _conv_geometry(node: onnx.NodeProto, weight: PrunableWeight) -> ConvGeometry | str:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    spatial = len(weight.shape) - 2
    if spatial not in (1, 2):
        return f"{spatial}-D convolution (statistics cover 1-D and 2-D)"
    if attrs.get("group", 1) != 1:
        return "grouped convolution (per-group statistics are not collected)"
    auto_pad = attrs.get("auto_pad", b"NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        return f"auto_pad={auto_pad} (not an ONNX padding mode)"

    def pair(values: list[int], fill: int) -> tuple[int, int]:
        values = list(values) or [fill] * spatial
        return (fill, values[0]) if spatial == 1 else (values[0], values[1])

    kernel = pair(weight.shape[2:], 1)
    # The SAME modes' pads depend on the input size: zero here, worked out per batch.
    static = auto_pad if auto_pad in ("NOTSET", "VALID") else "VALID"
    begin, end = explicit_pads(static, attrs.get("pads", ()), (), [1] * spatial)
    if spatial == 1:
        begin, end = [0, *begin], [0, *end]
    return ConvGeometry(
        kernel=kernel,
        strides=pair(attrs.get("strides", []), 1),
        dilations=pair(attrs.get("dilations", []), 1),
        pads=(begin[1], end[1], begin[0], end[0]),
        auto_pad=auto_pad,
    )


def consumer(weight: PrunableWeight, main_positions: Mapping[int, int]) -> onnx.NodeProto | str:
    """The one main-graph node whose GEMM uses the weight, or why there is not exactly one; ``main_positions`` holds
    the main graph's node objects by id (the graph index's)."""
    if weight.uncalibrated:  # inside a branch, or read by several GEMMs
        return weight.uncalibrated
    use = weight.uses[0]
    if use.consumer is None or id(use.consumer) not in main_positions:
        return "consumer not found in the main graph"
    return use.consumer


def find_tap(weight: PrunableWeight, node: onnx.NodeProto | str) -> Tap | str:
    """Where a weight's activation comes from (``node`` is its consumer), or why it cannot be collected."""
    if isinstance(node, str):
        return node
    use = weight.uses[0]
    other = node.input[1 - use.input_index] if use.input_index < 2 else ""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if use.op_type == "MatMul":
        return Tap(other, reduce_last=use.input_index == 1)
    if use.op_type == "Gemm":
        transposed = attrs.get("transA", 0) if use.input_index == 1 else attrs.get("transB", 0)
        # Weight as B: the activation A is [M, K] (or [K, M] with transA); weight as A: B is [K, N] (or [N, K]).
        return Tap(other, reduce_last=(use.input_index == 1) != bool(transposed))
    if use.op_type in RECURRENT_GATES and use.input_index == RECURRENT_INPUT:
        # X is [sequence, batch, K] (or [batch, sequence, K] with layout=1): K last either way.
        return Tap(node.input[0])
    if use.op_type == "Conv" and use.input_index == 1:
        geometry = _conv_geometry(node, weight)
        return geometry if isinstance(geometry, str) else Tap(node.input[0], convolution=geometry)
    return f"{use.op_type} weights are not calibrated (convert covers MatMul, Gemm, Conv and recurrent W)"


def reduction_length(weight: PrunableWeight) -> int:
    """K of the weight's GEMM: the reduction axis, times the kernel positions for a convolution."""
    if weight.uses[0].op_type == "Conv":
        return math.prod(weight.shape[1:])
    return weight.shape[weight.axis]
