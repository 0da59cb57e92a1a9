"""`sluice demo --traces FILE`: every service of both sites writes its spans to FILE, and the run
ends by printing one trace id that goes from a put on a to its apply on b and a listener call."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.core import telemetry

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_demo_prints_one_trace_from_a_put_on_a_to_the_apply_on_b(tmp_path: Path) -> None:
    spans_file = tmp_path / "spans.jsonl"
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "demo", "--events", "300", "--no-faults",
                           "--traces", str(spans_file)], cwd=REPO, capture_output=True, text=True, timeout=280)
    said = " ".join(done.stdout.replace("│", " ").split())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "OK: " in said
    found = re.search(r"trace id ([0-9a-f]{32}):", said)
    assert found, said[-3000:]
    trace_id = "0x" + found.group(1)

    spans = telemetry.read_spans(spans_file)
    assert trace_id in telemetry.wan_traces(spans, "a", "b")
    mine = {(s["name"], telemetry.span_site(s)) for s in spans if s["context"]["trace_id"] == trace_id}
    assert {("gateway.send", "a"), ("gateway.receive", "b"), ("region.apply_remote", "b")} <= mine
    assert any(name == "listener.process_events" for name, _ in mine)
    for name in ("region.apply_remote", "gateway.receive", "gateway.send", "listener.process_events"):
        assert name in said
