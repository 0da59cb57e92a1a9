"""`make demo` keeps working: a short two-site demo run ends with its verification passing, and with
`--traces FILE` it prints one trace from a put on a to its apply on b and a listener call."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.core import telemetry

REPO = Path(__file__).resolve().parents[2]


# The long tier (`make test-long`, CI): ~90 s of two whole sites proving that `make demo` runs; what the demo
# shows is proved in `make test` piece by piece (tests/README.md, "The long tier").
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_short_two_site_demo_run_verifies_everything_and_prints_one_trace(tmp_path: Path) -> None:
    """`sluice demo --events 600 --traces FILE` (two sites, a sender primary killed, a durable client away and
    back) exits 0, its verification, read from the sites, passes every check, and every service of both
    sites wrote its spans to FILE: one trace id goes from the put on a through the sender and receiver to
    the apply on b, and to a listener call."""
    spans_file = tmp_path / "spans.jsonl"
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "demo", "--events", "600",
                           "--traces", str(spans_file)], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    said = " ".join(done.stdout.replace("│", " ").split())  # the console wraps long lines and table cells
    assert "OK: " in said and "divergent keys 0; lost 0; applied twice 0" in said
    assert "kill -9 of an orders a→b sender" in said and "durable client back" in said
    assert "DIVERGED" not in said
    assert re.search(r"\d+\.\ds from kill -9 to the other sender owning all 8 .*partitions", said)

    found = re.search(r"trace id ([0-9a-f]{32}):", said)
    assert found, said[-3000:]
    trace_id = "0x" + found.group(1)
    spans = telemetry.read_spans(spans_file)
    assert trace_id in telemetry.wan_traces(spans, "a", "b")
    mine = {(telemetry.span_role(s), telemetry.span_site(s)) for s in spans if s["context"]["trace_id"] == trace_id}
    assert {("gateway.send", "a"), ("gateway.receive", "b"), ("region.apply_remote", "b")} <= mine
    assert any(role == "listener.process_events" for role, _ in mine)
    # The messaging spans print as `{operation} {destination}`: send and process, on gateway.inbound.
    for name in ("region.apply_remote", "send ", "process ", "gateway.inbound"):
        assert name in said
