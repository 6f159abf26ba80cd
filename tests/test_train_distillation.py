"""Layer-wise distillation (SquareHead) of a 2:4 causal language model from its dense teacher, in PyTorch: the tiny
LlamaForCausalLM of tests/decoder_model.py (GQA, RoPE, tied lm_head), sparsified with fixed masks and trained."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import decoder_model as dm  # noqa: E402

from nmdeploy.errors import InputError  # noqa: E402
from nmdeploy.masks import is_nm  # noqa: E402
from nmdeploy.masks.augmentation import TokenAugmentation  # noqa: E402
from nmdeploy.masks.distillation import next_token_divergence  # noqa: E402
from nmdeploy.train import finalize, sparsify  # noqa: E402
from nmdeploy.train.distillation import LayerDistillation  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def batches(count, seed):
    return [{"input_ids": torch.from_numpy(dm.token_rows(4, 16, seed=seed + i))} for i in range(count)]


def divergence(student, teacher, data):
    with torch.no_grad():
        return sum(float(next_token_divergence(student(**b).logits, teacher(**b).logits)) for b in data) / len(data)


def test_distillation_recovers_a_sparse_decoder_and_keeps_its_masks():
    teacher = dm.build_decoder(seed=0)
    student = copy.deepcopy(teacher)
    distill = LayerDistillation(teacher)
    assert float(distill(student, batches(1, 0)[0]).detach()) == pytest.approx(0.0, abs=1e-6)  # the same model

    sparsifier = sparsify(student, "2:4", method="fixed", init="magnitude")
    masks = {name: mask.clone() for name, mask in sparsifier.masks().items()}
    assert len(masks) == 2 * 7  # every block linear; the tied lm_head and the embedding stay dense
    train, unseen = batches(8, 100), batches(4, 900)
    before = divergence(student, teacher, unseen)
    optimizer = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    torch.manual_seed(0)
    for step in range(48):
        loss = distill(student, train[step % len(train)])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sparsifier.step()
        losses.append(float(loss.detach()))
    assert set(distill.last) == {"hidden", "logits"}
    assert sum(losses[-8:]) < 0.7 * sum(losses[:8])
    assert divergence(student, teacher, unseen) < 0.8 * before  # on rows it never trained on
    for name, mask in sparsifier.masks().items():
        assert torch.equal(mask, masks[name]), name  # fixed masks: training moved only the kept weights
    finalize(student)
    linears = [m for n, m in student.model.layers.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(is_nm(m.weight, "2:4", axis=1) for m in linears)


def test_distillation_refuses_a_model_without_hidden_states():
    class Plain(torch.nn.Module):
        def forward(self, input_ids, output_hidden_states=False):
            return torch.zeros(*input_ids.shape, 8)

    with pytest.raises(InputError, match="hidden_states and logits"):
        LayerDistillation(Plain())(Plain(), {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    with pytest.raises(InputError, match="not both 0"):
        LayerDistillation(Plain(), hidden_weight=0, logits_weight=0)


def test_augmentation_feeds_teacher_and_student_the_same_fresh_ids_of_trained_rows():
    teacher = dm.build_decoder(seed=0)
    table = teacher.get_input_embeddings().weight.detach().numpy()
    rows = batches(2, 0)
    augmentation = TokenAugmentation({"input_ids": table}, [{"input_ids": b["input_ids"].numpy()} for b in rows], 0.5)
    seen = {"teacher": [], "student": []}
    student = copy.deepcopy(teacher)
    for role, model in (("teacher", teacher), ("student", student)):
        model.register_forward_pre_hook(
            lambda module, args, kwargs, role=role: seen[role].append(kwargs["input_ids"].clone()), with_kwargs=True
        )
    distill = LayerDistillation(teacher, augmentation=augmentation, seed=3)
    assert float(distill(student, rows[0]).detach()) == pytest.approx(0.0, abs=1e-6)  # still the same model
    (fed,), (student_fed,) = seen["teacher"], seen["student"]
    assert torch.equal(fed, student_fed)  # the teacher labels exactly what the student sees
    replaced = fed != rows[0]["input_ids"]
    assert 0.25 < float(replaced.float().mean()) < 0.75  # half of 64 draws, within 4 standard deviations
    assert set(fed[replaced].tolist()) <= set(augmentation.pools["input_ids"].tolist())
    LayerDistillation(teacher, augmentation=augmentation, seed=3)(student, rows[0])
    assert torch.equal(seen["teacher"][-1], fed)  # seeded: the same draws again
