"""What a prunable weight is, as every verb reads it: the stored tensor and each GEMM use of it with its reduction
axis (:class:`PrunableWeight`, :class:`WeightUse`), what could not be traced (:class:`UntracedWeight`), and the
reasons prune, convert, the budgets and inspect all give for leaving a weight dense.

``graph/weights.py`` finds them (:func:`~nmdeploy.graph.weights.find_prunable_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

# ONNX's recurrent ops and their gate count. W is [directions, gates * hidden, input] and R is [directions,
# gates * hidden, hidden]: both reduce over their last axis, each direction's gates stacked along the middle one.
RECURRENT_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
RECURRENT_INPUT, RECURRENT_STATE = 1, 2  # the input positions of W and R
HIDDEN_STATE_REASON = (
    "recurrent weight R multiplies the hidden state, made inside the {op} (no graph value holds it): no calibration "
    "sees its input, so prune and convert both leave it dense"
)

SUBGRAPH_REASON = (
    "used inside {graph}, whose values the calibration run cannot read (it runs the main graph; a branch's values "
    "exist only while ONNX Runtime runs the If): convert and --min-fidelity leave it dense, prune (magnitude, no "
    "calibration) reaches it"
)

SHARED_REASON = (
    "read by {count} GEMMs ({nodes}): its fit would need every reader's input at once, and a later reader's input "
    "can depend on the weight itself (a tied or unrolled layer), which calibration stage by stage cannot order: "
    "convert and --min-fidelity leave it dense, prune (magnitude, no calibration) reaches it"
)


@dataclass(frozen=True)
class WeightUse:
    """One consumer of a weight: which node, which input, and the reduction axis in stored-tensor coordinates."""

    node: str
    op_type: str
    input_index: int
    axis: int
    path: tuple[str, ...]  # ops walked from the stored tensor to the consumer, e.g. ("Transpose", "Cast")
    graph: str
    operand_shape: tuple[int, ...]
    operand_dtype: str
    """The weight as this consumer reads it, after the ops on ``path`` (a Reshape, an Unsqueeze, a Cast): TensorRT
    folds them into one constant, so its rules for sparse weights apply to this shape and dtype (onnx's lower-case
    name; Q/DQ keep the stored one, which TensorRT's quantized kernels read)."""
    consumer: onnx.NodeProto | None = field(default=None, compare=False, repr=False)  # the node itself


@dataclass(frozen=True)
class Dequantization:
    """The DequantizeLinear right after an integer weight: pruning must set pruned positions to the zero point."""

    scale: onnx.TensorProto
    zero_point: onnx.TensorProto | None
    axis: int  # the per-channel axis of scale and zero point, in stored-tensor coordinates


@dataclass(frozen=True)
class PrunableWeight:
    """A stored weight tensor and every GEMM-like use of it."""

    name: str
    kind: str  # "initializer" or "constant" (the output of a Constant node)
    graph: str  # "main", a subgraph path such as "main/If_0:then_branch", or "function:domain.name"
    shape: tuple[int, ...]
    dtype: str
    uses: tuple[WeightUse, ...]
    tensor: onnx.TensorProto = field(compare=False, repr=False)  # the stored proto itself, for reading and writing
    dequantization: Dequantization | None = field(default=None, compare=False, repr=False)
    embedding_lookups: tuple[str, ...] = ()
    """Gather nodes that read the same stored tensor as their table: a token embedding tied to this GEMM weight."""
    vocabulary_scores: str | None = None
    """The graph output this weight's GEMM computes when it scores a token vocabulary (an lm_head), else None."""

    @property
    def dense_by_default(self) -> str | None:
        """Why every verb leaves this weight dense unless asked (``--sparse-lm-head``), or None.

        A tied lm_head (the logits MatMul reads Transpose(embedding table)) stores the token embeddings too: its N:M
        mask would zero every token's embedding at the same positions, a change no GEMM fit sees or compensates.
        An untied lm_head is the one layer whose error reaches the logits with nothing after it to absorb it, and
        the widest weight of a decoder (vocabulary x hidden), so its fit sets the conversion's peak memory: on
        Qwen2.5-0.5B its 2:4 fit cost 7 % perplexity and 4 GB. llm-compressor and SparseGPT leave it dense too.
        """
        tied = self.tied_embedding
        if tied is not None:
            return f"{tied}: left dense"
        if self.vocabulary_scores is not None:
            return f"the lm_head, scoring the vocabulary in '{self.vocabulary_scores}': left dense"
        return None

    @property
    def tied_embedding(self) -> str | None:
        """Where embedding lookups read this table, the words "tied to the token embedding that Gather ... reads"
        (else None): a change to this weight (a mask, a scale, Q/DQ) changes every token's embedding too."""
        if not self.embedding_lookups:
            return None
        lookups = ", ".join(f"'{name}'" for name in self.embedding_lookups[:2])
        return f"tied to the token embedding that Gather {lookups} reads"

    @property
    def axes(self) -> tuple[int, ...]:
        """The distinct reduction axes of the uses, in order of first appearance."""
        return tuple(dict.fromkeys(use.axis for use in self.uses))

    @property
    def axis(self) -> int | None:
        """The reduction axis when all uses agree; None when they need different axes (see needs_transposable)."""
        return self.axes[0] if len(self.axes) == 1 else None

    @property
    def needs_transposable(self) -> bool:
        """Shared by consumers that reduce over different axes (tied embeddings, shared projections)."""
        return len(self.axes) > 1

    @property
    def recurrent(self) -> str | None:
        """The recurrent op (LSTM, GRU, RNN) reading the weight as its W or R, else None."""
        return next((use.op_type for use in self.uses if use.op_type in RECURRENT_GATES), None)

    @property
    def kept_dense(self) -> str | None:
        """Why every verb leaves this weight dense (prune, convert, the budget and inspect say the same), or None.

        A recurrent op's R reads the hidden state at step t - 1, which exists only inside the op: magnitude pruning
        it would be blind to what it multiplies, and TensorRT runs it dense anyway (see graph/eligibility.py).
        """
        for use in self.uses:
            if use.op_type in RECURRENT_GATES and use.input_index == RECURRENT_STATE:
                return HIDDEN_STATE_REASON.format(op=use.op_type)
        return None

    @property
    def uncalibrated(self) -> str | None:
        """Why the calibrated fit cannot reach this weight (convert, the budgets, prune and inspect say the same), or
        None: a use inside an If, Loop or Scan branch or a function body, or several GEMMs reading it."""
        inside = next((use.graph for use in self.uses if use.graph != "main"), None)
        if inside is None and self.graph != "main":
            inside = self.graph
        if inside is not None:
            return SUBGRAPH_REASON.format(graph=inside)
        if len(self.uses) > 1:
            nodes = list(dict.fromkeys(use.node for use in self.uses))
            named = ", ".join(f"'{node}'" for node in nodes[:3]) + (" ..." if len(nodes) > 3 else "")
            return SHARED_REASON.format(count=len(self.uses), nodes=named)
        return None

    @property
    def node_label(self) -> str:
        """The layer as users know it (the name ``inspect`` shows): the first consumer node's name, with " (+N)"
        for N more consumer nodes; the weight's own name where that node has none."""
        nodes = list(dict.fromkeys(use.node for use in self.uses))
        first = nodes[0] if nodes and nodes[0] else self.name
        return first + (f" (+{len(nodes) - 1})" if len(nodes) > 1 else "")


@dataclass(frozen=True)
class UntracedWeight:
    """A constant GEMM operand whose stored tensor or axis could not be determined, and why."""

    node: str
    op_type: str
    input_index: int
    graph: str
    reason: str
    foldable: str | None = None  # the value to fold into an initializer when it is computed from constants only
    value: str = ""  # the operand the node reads
    axis: int | None = None  # the reduction axis in the node's coordinates (negative: from the end)
    weight: bool = False
    """Whether a stored tensor stands behind the operand as the node's weight, which TensorRT folds into one constant
    weight whatever computes it (False: nothing to prune, such as a depthwise convolution's)."""


@dataclass(frozen=True)
class WeightReport:
    weights: tuple[PrunableWeight, ...]
    untraced: tuple[UntracedWeight, ...]
