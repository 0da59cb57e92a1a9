"""`make demo` keeps working: a short two-site demo run ends with its verification passing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_short_two_site_demo_run_verifies_everything() -> None:
    """`sluice demo --events 600` (two sites, a sender primary killed, a durable client away and back)
    exits 0, and its verification, read from the sites, passes every check."""
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "demo", "--events", "600"],
                          cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    said = " ".join(done.stdout.replace("│", " ").split())  # the console wraps long lines and table cells
    assert "OK: " in said and "divergent keys 0; lost 0; applied twice 0" in said
    assert "kill -9 of an orders a→b sender" in said and "durable client back" in said
    assert "DIVERGED" not in said
    assert re.search(r"\d+\.\ds from kill -9 to the other sender owning all 8 .*partitions", said)
