"""``stop_process`` returns only once every thread of the process is stopped (SIGSTOP is asynchronous)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.core.processes import stop_process

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

#: A process of several threads, each busy, so that one still runs on another core when the signal is sent.
BUSY_THREADS = "import threading\nfor _ in range(4):\n    threading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()\n"


def _states(pid: int) -> set[str]:
    states = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        states.add(stat[stat.rindex(")") + 2])
    return states


def test_every_thread_is_stopped_when_it_returns_and_runs_again_after_sigcont() -> None:
    child = subprocess.Popen([sys.executable, "-c", BUSY_THREADS])
    try:
        for _ in range(20):
            stop_process(child.pid)
            assert _states(child.pid) <= {"T", "t"}, _states(child.pid)
            child.send_signal(signal.SIGCONT)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_a_process_that_has_ended_raises() -> None:
    # Reaped: its pid names nothing, and the caller learns it rather than waiting for a stop.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(ProcessLookupError):
        stop_process(child.pid)
