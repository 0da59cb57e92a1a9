"""`make demo` keeps working: a short demo run ends with its verification passing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_short_demo_run_verifies_region_and_queues() -> None:
    """`sluice demo --events 200` exits 0 and reports that region and queues agree."""
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "demo", "--events", "200"],
                          cwd=REPO, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = " ".join(done.stdout.split())  # the console wraps long lines
    assert "OK: 200 operations applied" in said
    assert "each in every attached queue: yes" in said
    assert "write-behind table matches the region: yes" in said
