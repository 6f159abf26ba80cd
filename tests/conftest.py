import sys
from pathlib import Path

import pytest
import torch

# Test modules share small model builders (for example test_onnx_prune.build_mlp).
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models train fastest on one thread, and far faster than two when other work shares the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
