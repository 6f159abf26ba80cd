"""torch.compile of a sparsified model: the mask updates between steps write buffers in place, so the compiled
forward and backward keep one graph (no graph break, no recompilation) while masks are recomputed every step; only
a method's change of phase (structure decay's fixed mask, LBC's frozen scores) compiles once more. Counted with
dynamo's compile counter on the aot_eager backend (the same graphs inductor would get, compiled in a fraction of
the time); speed is measured by benchmarks/train_step.py."""

import pytest
import torch
from torch import nn

from nmdeploy.train import sparsify

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 6
# method -> (options, graphs expected over STEPS steps: one per phase the forward goes through)
METHODS = {
    "ste": ({"method": "ste"}, 1),
    "srste": ({"method": "srste"}, 1),
    "fixed": ({"method": "fixed"}, 1),
    "mask-decay": ({"method": "mask-decay", "decay_steps": 3}, 1),
    "structure-decay": ({"method": "structure-decay", "decay_steps": 3}, 2),  # straight-through, then fixed
    "lbc": ({"method": "lbc", "removal_end": 3}, 2),  # learnable scores, then frozen
}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


def train(options, compiler=None):
    model = mlp()
    sparsifier = sparsify(model, keep_dense="none", mask_interval=1, **options)
    forward = model if compiler is None else torch.compile(model, backend=compiler)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    losses, flips = [], 0
    for _ in range(STEPS):
        x, y = torch.randn(32, 16, generator=generator), torch.randint(0, 8, (32,), generator=generator)
        before = {name: mask.clone() for name, mask in sparsifier.masks().items()}
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        optimizer.step()
        sparsifier.step()
        losses.append(float(loss.detach()))
        flips += sum(int((before[k] != mask).sum()) for k, mask in sparsifier.masks().items())
    return losses, flips, model


@pytest.mark.parametrize("method", METHODS)
def test_compiled_training_keeps_its_graphs_while_masks_change(method):
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    options, graphs = METHODS[method]
    counter = CompileCounterWithBackend("aot_eager")
    losses, flips, model = train(options, counter)
    eager_losses, eager_flips, eager_model = train(options)
    assert not dict(counters["graph_break"]), dict(counters["graph_break"])
    assert counter.frame_count == graphs
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    if method not in ("fixed",):
        assert flips > 0, "masks were recomputed and changed between steps"
    assert flips == eager_flips
    for a, b in zip(model.state_dict().values(), eager_model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
