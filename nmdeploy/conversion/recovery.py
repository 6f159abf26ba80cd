"""Recovery after N:M conversion: fine-tune the kept weights on the ONNX graph by distilling the dense model.

The graph runs differentiably in torch, opened through the backend registry (the torch backend's graph runner over
the one interpreter, :mod:`nmdeploy.runtimes.interpreter`), every stored tensor fed by name with each run. The
trainable tensors are the converted weights (their masks fixed: gradients of pruned entries are zeroed, so Adam
leaves them at zero, and the mask is re-applied before every held-out check, so a pruned entry stays exactly +0.0), the
biases of MatMul/Gemm/Conv layers and the scales and shifts of normalisations. The loss matches the dense model's
outputs (squared error relative to the dense tensor's energy; a language model's logits by the KL divergence of its
next-token distributions from the dense model's, as distillation of language models trains) and, optionally, its
block outputs (normalisation outputs, or the converted layers' inputs where the graph has no normalisation). A
normalisation output's error is weighed per channel by the dense channel's spread: transformers carry a few channels
tens of times larger than the rest, and an error relative to the whole tensor's energy would spend the training on
those few. A held-out split of the calibration data decides early stopping and is reported before and after; the best
state is written back and checked in ONNX Runtime. Where the CPU multiplies bfloat16 natively, the training passes
(labels and the student's forward and backward) run under bfloat16 autocast: on MiniLM 1.66x faster with the same
fidelity to four digits, because Adam's normalised steps absorb the rounding; weights, optimiser state and every check
stay float32.

A few hundred calibration rows are few for the millions of weights being trained: models fed token ids therefore
train on copies of the rows with a share of the ids replaced by other tokens
(:mod:`nmdeploy.masks.augmentation`); the dense model labels every such batch.

Usage: ``session = Recovery.prepare(model, weights, data.split(options.split), options)`` before the weights
change (it records the dense targets), then ``session.run(model, converted)`` after.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import torch

from nmdeploy.calibration.data import CalibrationSplit, SplitSettings
from nmdeploy.errors import InputError
from nmdeploy.fidelity import (
    FidelityMetric,
    OutputSelection,
    follows_tokens,
    measure,
    metric_label,
    select_outputs,
)
from nmdeploy.files import private_temporary_folder
from nmdeploy.graph.inputs import token_vocabulary
from nmdeploy.graph.model import OnnxModel
from nmdeploy.graph.outputs import classifier_outputs, vocabulary_outputs
from nmdeploy.graph.prunable import PrunableWeight
from nmdeploy.graph.tensors import to_numpy, to_torch
from nmdeploy.graph.trainable import block_targets, embedding_inputs, stored_tensors, trainable_tensors
from nmdeploy.masks.augmentation import FIT_COPIES, TokenAugmentation, host_tensors
from nmdeploy.masks.distillation import next_token_divergence, relative_squared_error
from nmdeploy.progress import progress_bar
from nmdeploy.rows import ReportRow
from nmdeploy.runtimes.backends import graph_backend, open_runner
from nmdeploy.runtimes.torch import training_precision

DEFAULT_STEPS, DEFAULT_BATCH = 1000, 8
AUGMENTED_LR, PLAIN_LR = 3e-4, 1e-4
PRECISIONS = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RecoveryOptions:
    """How recovery fine-tunes: ``steps`` Adam steps from ``lr`` down a cosine schedule, on mini-batches of
    ``batch_size`` rows. ``lr`` None picks 3e-4 where token augmentation gives fresh rows every step and 1e-4 where
    the same rows come back every epoch (measured: 3e-4 gains most on MiniLM and nothing on the PaddleOCR detector,
    which gains at 1e-4).

    ``held_out`` is the fraction of calibration mini-batches kept for early stopping (checked every ``eval_every``
    steps; training stops after ``patience`` checks without improvement, counted in the second half of the schedule:
    the first half, at a high learning rate, may dip below the starting point before it gains). ``blocks`` adds
    block-output matching.
    ``augment`` is the share of token ids replaced by random tokens in each training batch of a model fed token ids.
    ``seed`` fixes the split and the batch order, so two runs give the same bytes (on one machine).
    ``outputs`` are the outputs judged (None: every output that is not a copy of an input, as
    :func:`nmdeploy.fidelity.select_outputs` decides) and, the float ones, trained toward: integer outputs (labels)
    are judged by agreement, never trained toward.
    ``precision`` of the training passes (the dense model's labels, the student's forward and backward): bfloat16
    matrix products under autocast, float32 weights and optimiser state; "auto" picks bfloat16 where the CPU
    multiplies it natively (AVX512-BF16 or AMX) and float32 elsewhere (emulated bfloat16 is slower). The held-out
    checks, the reported fidelity and the written weights are float32 whatever the choice.
    """

    steps: int = DEFAULT_STEPS
    lr: float | None = None
    batch_size: int = DEFAULT_BATCH
    held_out: float = 0.2
    eval_every: int = 25
    patience: int = 4
    blocks: bool = True
    augment: float = 0.5
    seed: int = 0
    metric: FidelityMetric = "auto"
    precision: str = "auto"
    outputs: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise InputError(f"recovery precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}")
        if self.steps < 0:
            raise InputError(f"--recover {self.steps}: the number of steps must be 0 or more")
        if not 0 <= self.augment < 1:
            raise InputError(f"augmentation share {self.augment} must be in [0, 1)")
        if not 0 < self.held_out < 1:
            raise InputError(f"held-out fraction {self.held_out} must be between 0 and 1")
        if self.batch_size < 1:
            raise InputError(f"--recover-batch {self.batch_size}: a recovery step needs 1 row or more")
        if self.eval_every < 1 or self.patience < 1 or not (self.lr is None or self.lr > 0):
            raise InputError("recovery's evaluation interval, patience and learning rate must be positive")

    @property
    def split(self) -> SplitSettings:
        """The fit / held-out split recovery trains and stops on."""
        return SplitSettings(self.batch_size, self.held_out, self.seed)


@dataclass
class RecoveryReport(ReportRow):
    """What recovery did: held-out fidelity before and after, the steps, what it trained, and the largest
    difference between the torch interpreter and ONNX Runtime on the written model (None: nothing was written)."""

    step: str = field(default="recover", init=False)
    held_out_before: float
    held_out_after: float
    metric: str
    steps_run: int
    best_step: int
    trained_tensors: int
    masked_tensors: int
    block_targets: int
    train_batches: int
    held_out_batches: int
    onnxruntime_max_error: float | None
    seconds: float
    precision: str = "float32"
    logits: list[str] = field(default_factory=list)  # outputs trained by next-token KL (a language model's)
    outputs: list[str] = field(default_factory=list)  # the outputs judged (the float ones trained toward)
    batch_rows: int = DEFAULT_BATCH  # calibration rows per step


def _values(model: OnnxModel, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every stored tensor of the main graph as a torch tensor on ``device`` (fp16/bf16 widened to fp32 for
    training).

    Constant nodes' values are among them: the interpreter takes a value given by name over the Constant node
    that would produce it, so a trained copy replaces the stored one.
    """
    values = {}
    for name, tensor in stored_tensors(model.proto).items():
        value = to_torch(model.read(tensor)).reshape(tuple(tensor.dims))
        value = value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
        values[name] = value.to(device)
    return values


def _computation(model: onnx.ModelProto) -> onnx.ModelProto:
    """The main graph's nodes and outputs without the stored tensors: every run feeds them by name (the dense
    model's, the converted model's, the ones training), so neither initializers nor the Constant nodes holding weights
    need a copy inside the program."""
    stored = set(stored_tensors(model))
    computation = onnx.ModelProto(ir_version=model.ir_version)
    computation.opset_import.extend(model.opset_import)
    computation.graph.node.extend(
        node for node in model.graph.node if not (node.op_type == "Constant" and node.output[0] in stored)
    )
    computation.graph.output.extend(model.graph.output)
    return computation


def _feeds(batch: dict[str, np.ndarray], device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.ascontiguousarray(array)).to(device) for name, array in batch.items()}


def _to(values: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: value.to(device, non_blocking=True) for name, value in values.items()}


def _host(values: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Tensors as numpy arrays on the host (one explicit copy each from a device)."""
    return {name: value.detach().cpu().numpy() for name, value in values.items()}


def _trained_outputs(
    arrays: dict[str, np.ndarray], feeds: dict[str, np.ndarray], requested: Sequence[str] | None
) -> OutputSelection:
    """The outputs recovery judges (``arrays``: the dense model's on one batch); it trains toward the float ones (a
    loss has no gradient toward an integer output), so at least one must be judged."""
    selection = select_outputs(arrays, feeds, requested)
    if not selection.trainable:
        name = selection.judged[0]
        raise InputError(
            f"--recover trains toward float outputs, and every judged output is integer ('{name}' is "
            f"{arrays[name].dtype.name}); name a float output with --outputs"
        )
    return selection


def language_model_logits(
    model: OnnxModel, outputs: dict[str, np.ndarray], feeds: dict[str, np.ndarray]
) -> tuple[str, ...]:
    """The ``outputs`` that are a language model's logits: scores over the token vocabulary
    (:func:`vocabulary_outputs`, on the shapes this run produced) with a row per token of the fed token input. (A
    token encoder's embeddings follow the tokens too, but are as wide as the model, not the vocabulary.)"""
    vocabulary = token_vocabulary(model.index)
    if vocabulary is None or vocabulary.input not in feeds:
        return ()
    scores = vocabulary_outputs(model.proto, model.index, {name: np.shape(values) for name, values in outputs.items()})
    ids = {vocabulary.input: feeds[vocabulary.input]}
    return tuple(name for name in outputs if name in scores and follows_tokens(np.shape(outputs[name]), 0, ids))


def warmup_cosine(step: int, steps: int) -> float:
    """Learning-rate factor: a linear warm-up over the first tenth of the steps, then a cosine decay to zero.
    Without the warm-up the first full-rate steps on few rows undo more than they fix (the held-out fidelity
    dips below the one-shot result, and early stopping may end the run there)."""
    warm = max(1, steps // 10)
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


class ChannelSpread:
    """Standard deviation of every channel along ``axis``, accumulated tensor by tensor (float64 sums), so the dense
    block outputs of every calibration batch need not be held at once."""

    def __init__(self, axis: int) -> None:
        self.axis, self.count = axis, 0
        self.total: torch.Tensor | None = None
        self.squares: torch.Tensor | None = None
        self.rank = 0

    def add(self, tensor: torch.Tensor) -> None:
        moved = tensor.movedim(self.axis, -1).reshape(-1, tensor.shape[self.axis]).double()
        total, squares = moved.sum(dim=0), moved.pow(2).sum(dim=0)
        self.total = total if self.total is None else self.total + total
        self.squares = squares if self.squares is None else self.squares + squares
        self.count += moved.shape[0]
        self.rank = tensor.ndim

    def value(self) -> torch.Tensor:
        """The spreads shaped to broadcast against the tensors, floored at 1 % of their mean so that a constant
        channel does not dominate."""
        mean = self.total / self.count
        spread = (self.squares / self.count - mean.pow(2)).clamp_min(0.0).sqrt()
        spread = spread.clamp_min(1e-2 * float(spread.mean()) + 1e-12).float()
        shape = [1] * self.rank
        shape[self.axis] = -1
        return spread.reshape(shape)


class Recovery:
    """One recovery run: the split, the dense targets, then fine-tuning of the converted model."""

    def __init__(
        self,
        model: OnnxModel,
        split: CalibrationSplit,
        options: RecoveryOptions,
        blocks: dict[str, int | None],
        device: str = "cpu",
    ):
        self.options, self.split, self.blocks = options, split, tuple(blocks)
        self.device = torch.device(device)
        self.precision = training_precision(options.precision, self.device)
        open_program = partial(
            graph_backend("torch", str(self.device)).open_graph,
            _computation(model.proto),
            device=str(self.device),
            label="the model --recover trains",
            differentiable=True,  # the checks below run it under no_grad: their values may meet the loss
        )
        self.checking = open_program()  # float32, the graph's outputs: the held-out split and every check
        self.training = open_program(outputs=self.blocks, precision=self.precision)
        labelling = self.training if self.precision == "float32" else open_program(outputs=self.blocks)
        dense = _values(model, self.device)
        tables = embedding_inputs(model.proto)
        # Replacement ids per token input: rows of its embedding table that look trained (drawn on the host).
        self.augmentation = TokenAugmentation(
            {name: dense[table].cpu().numpy() for name, table in tables.items()} if options.augment else {},
            split.train,
            options.augment,
        )
        self.dense = dense if self.augmentation else {}  # the teacher labels every augmented batch
        # The splits move to the device once; a model fed token ids draws new ids on the host at every step.
        self.train_feeds = [_feeds(b, self.device) for b in split.train]
        self.held_out_feeds = [_feeds(b, self.device) for b in split.held_out]
        spreads = {name: ChannelSpread(axis) for name, axis in blocks.items() if axis is not None}
        self.train_targets: list[dict[str, torch.Tensor]] = []
        with torch.no_grad():
            for feeds in self.train_feeds:
                targets = labelling.run({**dense, **feeds})
                for name, spread in spreads.items():
                    spread.add(targets[name])
                if not self.augmentation:  # the same rows come back every epoch: labelled once, kept
                    self.train_targets.append(targets)
            held = [self.checking.run({**dense, **feeds}) for feeds in self.held_out_feeds]
        self.spread = {name: spread.value() for name, spread in spreads.items()}
        self.held_out_reference = [_host(outputs) for outputs in held]
        self.selection = _trained_outputs(self.held_out_reference[0], split.held_out[0], options.outputs)
        judged = {name: self.held_out_reference[0][name] for name in self.selection.judged}
        self.logits = language_model_logits(model, judged, split.held_out[0])
        self.classifiers = classifier_outputs(model.proto)
        self.figures: list = []  # each judged output's figure in the last held-out measurement

    def _output_error(
        self, name: str, actual: torch.Tensor, expected: torch.Tensor, feeds: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Next-token KL divergence for a language model's logits, else the relative squared error."""
        if name not in self.logits:
            return relative_squared_error(actual, expected)
        mask = feeds.get("attention_mask")
        return next_token_divergence(
            actual, expected, mask if mask is not None and mask.shape == actual.shape[:2] else None
        )

    def _block_error(self, name: str, actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
        """Squared error weighed per channel by the dense spread where the block has channels, else relative."""
        spread = self.spread.get(name)
        if spread is None:
            return relative_squared_error(actual, expected)
        return ((actual - expected.to(actual.dtype)) / spread).pow(2).mean()

    @classmethod
    def prepare(
        cls,
        model: OnnxModel,
        weights: Sequence[PrunableWeight],
        split: CalibrationSplit,
        options: RecoveryOptions,
        device: str = "cpu",
    ) -> Recovery:
        """Check the interpreter can run the model and record the dense targets on ``split`` (the calibration
        data's, made with ``options.split``)."""
        from nmdeploy.runtimes.interpreter import unsupported_nodes

        missing = unsupported_nodes(model.proto)
        if missing:
            raise InputError(
                f"--recover: the torch interpreter cannot run node {missing[0][1]}; convert without --recover"
            )
        blocks = block_targets(model.proto, weights) if options.blocks else {}
        return cls(model, split, options, blocks, device)

    def held_out_fidelity(self, values: dict[str, torch.Tensor]) -> float:
        """The metric of the model with ``values`` against the dense model, on the held-out mini-batches."""
        with torch.no_grad():
            candidates = [self.checking.run({**values, **feeds}) for feeds in self.held_out_feeds]
        meter = measure(
            (
                (reference, _host(candidate), batch)
                for reference, candidate, batch in zip(
                    self.held_out_reference, candidates, self.split.held_out, strict=True
                )
            ),
            self.options.metric,
            self.selection.judged,
            self.classifiers,
        )
        self.figures = meter.figures()  # what judged each output, for the report
        return meter.value()

    def run(self, model: OnnxModel, converted: Sequence[str], progress: bool | None = False) -> RecoveryReport:
        """Fine-tune ``model`` (converted in place) and write the best held-out state back; a report row."""
        start = time.perf_counter()
        options = self.options
        torch.manual_seed(options.seed)
        generator = torch.Generator().manual_seed(options.seed)
        values = _values(model, self.device)
        names = trainable_tensors(model.proto, converted)
        parameters = {name: values[name].clone().requires_grad_(True) for name in names}
        pruned = {name: parameters[name].detach() == 0 for name in converted if name in parameters}
        for name, zeros in pruned.items():
            # Zero gradients keep Adam's moments and step at exactly zero there (no weight decay), so a pruned
            # entry stays +0.0 between the checks below that re-apply the mask.
            kept = (~zeros).to(parameters[name].dtype)
            parameters[name].register_hook(lambda grad, kept=kept: grad * kept)
        lr = options.lr or (AUGMENTED_LR if self.augmentation else PLAIN_LR)
        # One fused update over all tensors: on the CPU the per-tensor loop spends as long as the backward pass.
        optimizer = torch.optim.Adam(parameters.values(), lr=lr, fused=True)
        # float16 products underflow small gradients: the loss is scaled (bfloat16 has float32's range).
        scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "float16")
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(warmup_cosine, steps=options.steps))
        before = best = self.held_out_fidelity(values)
        best_state = {name: p.detach().clone() for name, p in parameters.items()}
        best_step, checks_without_gain, step = 0, 0, 0
        outputs = self.selection.trainable
        with progress_bar(options.steps, desc="recover", unit="step", enabled=progress is not False) as bar:
            bar.set_postfix(held_out=f"{before:.4f}")
            order = torch.randperm(len(self.split.train), generator=generator)
            while step < options.steps:
                index = int(order[step % len(order)])
                if (step + 1) % len(order) == 0:
                    order = torch.randperm(len(self.split.train), generator=generator)
                batch, targets = self._training_pair(index, generator)
                result = self.training.run({**values, **parameters, **batch})
                loss = sum(self._output_error(name, result[name], targets[name], batch) for name in outputs)
                loss = loss / len(outputs)
                if self.blocks:
                    blocks = sum(self._block_error(n, result[n], targets[n]) for n in self.blocks)
                    loss = loss + blocks / len(self.blocks)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                schedule.step()
                step += 1
                bar.update()
                if step % options.eval_every and step != options.steps:
                    continue
                with torch.no_grad():
                    for name, zeros in pruned.items():
                        parameters[name].masked_fill_(zeros, 0.0)  # +0.0 exactly, whatever the optimiser did
                score = self.held_out_fidelity({**values, **{k: p.detach() for k, p in parameters.items()}})
                bar.set_postfix(held_out=f"{score:.4f}")
                if score > best:
                    best, best_step, checks_without_gain = score, step, 0
                    best_state = {name: p.detach().clone() for name, p in parameters.items()}
                else:
                    checks_without_gain += 2 * step > options.steps
                    if checks_without_gain >= options.patience:
                        break
        for name, zeros in pruned.items():
            if bool(best_state[name][zeros].any()):
                raise AssertionError(f"recovery filled a pruned entry of '{name}'")
        verified = None  # nothing written, nothing to check: the converted model stands as it was
        if best_step:
            tensors = stored_tensors(model.proto)
            for name, value in best_state.items():
                stored = model.read(tensors[name])
                model.write(tensors[name], to_numpy(value.to("cpu", to_torch(stored).dtype).contiguous(), stored))
            verified = self._verify_in_onnxruntime(model)
        return RecoveryReport(
            held_out_before=before,
            held_out_after=best,
            metric=metric_label(options.metric, self.selection, self.figures),
            steps_run=step,
            best_step=best_step,
            trained_tensors=len(parameters),
            masked_tensors=len(pruned),
            block_targets=len(self.blocks),
            train_batches=len(self.split.train),
            held_out_batches=len(self.split.held_out),
            onnxruntime_max_error=verified,
            seconds=time.perf_counter() - start,
            precision=self.precision,
            logits=list(self.logits),
            outputs=list(self.selection.judged),
            batch_rows=options.batch_size,
        )

    def _training_pair(
        self, index: int, generator: torch.Generator
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One training batch and the dense model's tensors on it (token ids randomised when augmenting)."""
        if not self.augmentation:
            return self.train_feeds[index], self.train_targets[index]
        batch = _to(self.augmentation.augmented(host_tensors(self.split.train[index]), generator), self.device)
        with torch.no_grad():
            return batch, self.training.run({**self.dense, **batch})

    def fitting_batches(self, copies: int = FIT_COPIES) -> list[dict[str, np.ndarray]]:
        """The batches the conversion fits on: the training split, plus ``copies`` augmented copies of it for a
        model fed token ids (measured on MiniLM: the one-shot fit keeps 0.02 more cosine on text of another kind
        than its calibration text, and recovery starts from there)."""
        batches = self.split.train_batches()
        if not self.augmentation:
            return batches
        copied = self.augmentation.copies(batches, copies, self.options.seed + 1)
        return batches + copied

    def _verify_in_onnxruntime(self, model: OnnxModel) -> float:
        """The written model runs in ONNX Runtime as in the interpreter (relative max error returned)."""
        batch = self.split.held_out[0]
        with torch.no_grad():
            expected = _host(self.checking.run({**_values(model, self.device), **_feeds(batch, self.device)}))
        low_precision = any(
            t.data_type in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
            for t in stored_tensors(model.proto).values()
        )
        tolerance = 3e-2 if low_precision else 1e-3  # the interpreter widens fp16/bf16 weights to fp32
        with private_temporary_folder("recover") as folder:
            path = model.save(Path(folder) / "recovered.onnx")
            with open_runner("ort", path) as runner:
                actual = runner.infer(batch)
        worst = 0.0
        for name, reference in expected.items():
            reference = reference.astype(np.float64)
            scale = max(float(np.abs(reference).max(initial=0.0)), 1e-6)
            worst = max(worst, float(np.abs(actual[name].astype(np.float64) - reference).max(initial=0.0)) / scale)
        if not math.isfinite(worst) or worst > tolerance:
            raise InputError(
                f"the recovered model's outputs in ONNX Runtime differ from the torch interpreter's by {worst:.3g} "
                "(relative); convert without --recover and report the model"
            )
        return worst
