"""`make bench` keeps working: a quick run measures, checks its data and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_quick_bench_run_writes_results_with_ratios(tmp_path: Path) -> None:
    """`python -m bench --quick` exits 0 and writes every figure with its same-run baseline and ratio."""
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--output", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=220,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {"machine", "time", "results"} <= set(data)
    names = {r["name"] for r in data["results"]}
    assert {"region.put_all.ingest", "region.put.latency.p50", "region.put.latency.p99"} <= names
    for r in data["results"]:
        assert r["value"] > 0 and r["baseline_value"] > 0, r
        assert r["ratio"] == pytest.approx(r["value"] / r["baseline_value"])
