"""Build the bundled regression example: a small MLP trained on scikit-learn's digits, its 2:4 version, test data.

    python models/mlp/build.py [FOLDER]     # default: this folder; then: nmdeploy regress models/mlp/baselines.toml

Everything is seeded, so the figures in baselines.toml are reproducible up to float rounding across machines.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from nmdeploy.graph.model import OnnxModel
from nmdeploy.passes import PrunePass

HERE = Path(__file__).resolve().parent
TEST_SAMPLES = 297  # the last 297 of scikit-learn's 1797 digits are held out


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    return (images / 16.0).astype(np.float32), labels.astype(np.int64)


def train(images: np.ndarray, labels: np.ndarray, steps: int = 200) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


def build(folder: str | Path = HERE, pattern: str = "2:4") -> dict[str, Path]:
    """Write dense.onnx, sparse-<pattern>.onnx (magnitude N:M of every Linear) and digits-test.npz into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    images, labels = digits()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster, and stays fast on a busy machine
    try:
        model = train(images[:-TEST_SAMPLES], labels[:-TEST_SAMPLES])
    finally:
        torch.set_num_threads(threads)
    dense = folder / "dense.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice: it is fast and embeds weights
        torch.onnx.export(
            model,
            (torch.from_numpy(images[:2]),),
            str(dense),
            dynamo=False,
            opset_version=17,
            input_names=["pixels"],
            output_names=["logits"],
            dynamic_axes={"pixels": {0: "batch"}, "logits": {0: "batch"}},
        )
    sparse = folder / f"sparse-{pattern.replace(':', 'of')}.onnx"
    onnx_model = OnnxModel.load(dense)
    PrunePass(pattern=pattern)(onnx_model)
    onnx_model.save(sparse)
    data = folder / "digits-test.npz"
    np.savez(data, pixels=images[-TEST_SAMPLES:])
    return {"dense": dense, "sparse": sparse, "data": data}


if __name__ == "__main__":
    for name, path in build(sys.argv[1] if len(sys.argv) > 1 else HERE).items():
        print(f"{name}: {path}")
