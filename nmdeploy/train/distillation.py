"""Recovery of a sparse language model by distilling its dense teacher, layer by layer: SquareHead (Kurtic et al.,
2023, the loss Sparse-Llama recovered with): each decoder layer's output matched by its squared error relative to
the teacher's energy there, plus KL(teacher || student) of the next-token distributions. The losses are the ones ONNX
recovery trains with (:mod:`nmdeploy.masks.distillation`).

    teacher = copy.deepcopy(model)   # before sparsify
    sparsifier = sparsify(model, "2:4", method="fixed", init="sparsegpt", calibration=batches)
    distill = LayerDistillation(teacher)
    for batch in data:
        loss = distill(model, batch)
        loss.backward(); optimizer.step(); optimizer.zero_grad(); sparsifier.step()

Any model whose forward takes ``output_hidden_states=True`` and returns ``hidden_states`` and ``logits`` works
(transformers' causal language models).

A few hundred calibration rows are few for millions of weights: ``augmentation`` (a
:class:`~nmdeploy.masks.augmentation.TokenAugmentation` of the ``input_ids``) gives every step fresh rows, a share of
their tokens replaced by other trained tokens, labelled by the teacher, as ``convert --recover`` trains. Measure it:
on SmolLM2-135M it lifted the ONNX route and not this one (BENCHMARKS.md, "Decoder LMs").
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from nmdeploy.errors import InputError
from nmdeploy.masks.augmentation import TokenAugmentation
from nmdeploy.masks.distillation import next_token_divergence, relative_squared_error


class LayerDistillation:
    """The SquareHead loss of a student against ``teacher`` (frozen here, in eval mode): ``hidden_weight`` times the
    mean over layers of each layer output's relative squared error, plus ``logits_weight`` times the next-token KL.
    ``augmentation`` replaces a share of every batch's token ids first (drawn from a generator seeded ``seed``)."""

    def __init__(
        self,
        teacher: nn.Module,
        hidden_weight: float = 1.0,
        logits_weight: float = 1.0,
        augmentation: TokenAugmentation | None = None,
        seed: int = 0,
    ) -> None:
        if hidden_weight < 0 or logits_weight < 0 or hidden_weight + logits_weight == 0:
            raise InputError("distillation weights must be 0 or more, and not both 0")
        self.teacher = teacher.eval().requires_grad_(False)
        self.hidden_weight, self.logits_weight = hidden_weight, logits_weight
        self.augmentation = augmentation if augmentation else None
        self.generator = torch.Generator().manual_seed(seed)
        self.last: dict[str, float] = {}  # the parts of the last loss, for logging

    def __call__(self, student: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.augmentation is not None:  # ids are drawn on the host, then go where the batch was
            host = {name: value.cpu() for name, value in batch.items()}
            batch = {
                name: value.to(batch[name].device)
                for name, value in self.augmentation.augmented(host, self.generator).items()
            }
        with torch.no_grad():
            expected = self.teacher(**batch, output_hidden_states=True)
        actual = student(**batch, output_hidden_states=True)
        hidden_states = getattr(actual, "hidden_states", None)
        if hidden_states is None or getattr(actual, "logits", None) is None:
            raise InputError(
                "LayerDistillation needs a model that returns hidden_states and logits for output_hidden_states=True "
                "(a transformers causal language model)"
            )
        # Entry 0 is the token embeddings, which stay dense: the layers' outputs follow it.
        pairs = list(zip(hidden_states[1:], expected.hidden_states[1:], strict=True))
        hidden = torch.stack([relative_squared_error(a, e) for a, e in pairs]).mean()
        logits = next_token_divergence(actual.logits, expected.logits, batch.get("attention_mask"))
        self.last = {"hidden": float(hidden.detach()), "logits": float(logits.detach())}
        return self.hidden_weight * hidden + self.logits_weight * logits
