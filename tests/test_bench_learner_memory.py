"""``bench/learner_memory.py`` at its smallest: two lengths, both logprob paths, and one
``Policy.train_step`` on a trajectory; its table parses. Marked slow: every cell is a
fresh interpreter (~5-15 s each on the 2 shared cores)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_learner_memory_bench_runs():
    cmd = [sys.executable, str(ROOT / "bench" / "learner_memory.py"), "--lengths", "128,256", "--trajectory", "640"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    head = "| tokens | chunked peak MiB | chunked MiB per 1k more tokens | chunked s/step | dense peak MiB |"
    assert proc.stdout.count(head) == 1, proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 256 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    values = [float(c.replace(",", "")) for c in cells[1:]]  # peak, slope, s/step per path
    assert len(values) == 6 and all(v >= 0 for i, v in enumerate(values) if i % 3 != 1), row
    assert "Policy.train_step on one trajectory of 640 tokens (" in proc.stdout, proc.stdout
