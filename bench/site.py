"""Site files and region-service processes for benchmarks.

Copied in spirit from ``tests/integration/regionkit.py`` (bench must not
import tests): ``write_site`` writes a site file and creates its topics;
``RegionProcess`` runs ``python -m sluice.cli region -c FILE --port 0`` as a
child of its own, in a session of its own (the terminal's Ctrl-C reaches the
runner, which stops it), SIGTERMed should the runner die.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from sluice.core.config import SiteConfig, load_config
from sluice.core.topics import apply_topics

from .harness import REPO, die_with_parent


def write_site(
    path: Path,
    *,
    bootstrap: str,
    prefix: str,
    region: str = "orders",
    buckets: int = 8,
    parallel_senders: int = 1,
    async_event_queues: int = 0,
) -> SiteConfig:
    """A site with one region and its attached queues; creates the topics.

    The queues are parallel gateway senders (``to-site-N``, co-partitioned
    with the region) and serial async event queues (``writer-N``, 3 dispatcher
    threads).  Other settings are the defaults a deployment starts from.
    """
    senders = [f"to-site-{i + 2}" for i in range(parallel_senders)]
    queues = [f"writer-{i + 1}" for i in range(async_event_queues)]
    data: dict[str, Any] = {
        "site": "bench",
        "dsid": 1,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix},
        "regions": [
            {
                "name": region,
                "buckets": buckets,
                "gateway_senders": senders,
                "async_event_queues": queues,
            }
        ],
        "gateway_senders": [{"id": s, "remote_dsid": i + 2, "parallel": True} for i, s in enumerate(senders)],
        "async_event_queues": [{"id": q, "parallel": False, "dispatcher_threads": 3} for q in queues],
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = load_config(path)
    report = apply_topics(cfg)
    if not report.ok:
        raise RuntimeError(f"creating the topics of {path} failed: {report}")
    return cfg


class RegionProcess:
    """One region-service instance in a process of its own.  Use as a context manager."""

    def __init__(self, config_path: Path, log_path: Path, start_timeout_s: float = 30.0) -> None:
        self.config_path = config_path
        self.log_path = log_path
        self._log = open(log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sluice.cli", "region", "-c", str(config_path), "--port", "0"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=self._log,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                cwd=REPO,
                start_new_session=True,
                preexec_fn=die_with_parent,  # noqa: PLW1509 - only calls prctl
            )
        except BaseException:
            self._log.close()
            raise
        try:
            self.url = self._read_url(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_url(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            line = self.proc.stdout.readline().decode()
            if not line:
                break
            if line.startswith("region service "):
                return line.split(" on ", 1)[1].split(" ", 1)[0]
        raise RuntimeError(f"region service did not start; log:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 60.0) -> float:
        """Wait until /readyz answers 200 (every owned bucket loaded); returns the seconds waited."""
        started = time.monotonic()
        end = started + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"region service exited ({self.proc.returncode}); log:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.url} not ready in {timeout_s}s; log:\n{self.log_tail()}")

    def stats(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/stats", timeout=10).json())

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM (the service flushes and leaves its group), SIGKILL after ``timeout_s``.  Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "RegionProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
