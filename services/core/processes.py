"""Sluice services as child processes: for ``sluice demo``, the tests and the benchmarks.

``ServiceProcess`` runs ``python -m sluice.cli <command> …`` in a session of
its own (so a terminal's Ctrl-C reaches only the parent, which stops it), with
its stderr in a log file, and SIGTERMs it should the parent die, even by
SIGKILL (``die_with_parent``).  The service announces itself with one line on
stdout (``region service ID on URL …``, ``dispatcher MEMBER of queue …``);
the constructor waits for that line, so a returned process is up.

Many services share one machine here, so each child serves /healthz, /readyz
and /metrics on a free port of 127.0.0.1 (``SLUICE_METRICS_PORT=0``) unless
the caller's ``env`` says otherwise or the environment turns it off; the
service prints ``metrics on URL`` before its banner, read into ``metrics_url``.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]


def stop_process(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped: the signal is delivered
    asynchronously, and a thread still running on another core could answer a request meanwhile.
    Where /proc does not say (not Linux), returns after the signal."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped {timeout_s} s after SIGSTOP")
        time.sleep(0.005)


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return sys.platform != "linux" or not os.path.exists(f"/proc/{pid}")
    for tid in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # a thread that ended
        # "tid (comm) S …": the state follows the last ')' (comm may hold one).
        if stat[stat.rindex(")") + 2] not in "TtZX":
            return False
    return True


def _resolve_prctl() -> Callable[..., int] | None:
    if sys.platform != "linux":
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


_PRCTL = _resolve_prctl()


def die_with_parent() -> None:
    """``preexec_fn`` for children: SIGTERM them when the parent dies.

    Without it a run killed with SIGKILL leaves its services and 300 MB JVMs
    behind on a 2-core machine.  The signal fires when the *thread* that forked
    exits, so start children from a thread that outlives them.  It runs between
    fork and exec, so it only calls a function resolved beforehand.
    """
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


class ServiceProcess:
    """One ``sluice`` service in a child process; a context manager."""

    #: The start of the line the service prints on stdout once it runs.
    banner = ""
    #: Whether the running service prints every thread's stack to its log on SIGUSR1
    #: (``sluice region|dispatcher|sender|receiver|subscriptions`` register it before their banner).
    dumps_stacks = False

    def __init__(self, args: Sequence[str], log_path: Path, *, start_timeout_s: float = 60.0,
                 extra_path: Sequence[str] = (), env: dict[str, str] | None = None, wait: bool = True) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        pythonpath = [*extra_path, *filter(None, [os.environ.get("PYTHONPATH")])]
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **_service_env(), **(env or {})}
        if pythonpath:
            child_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        self.started_wall = time.time()
        self.started = time.monotonic()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sluice.cli", *args],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._log, env=child_env, cwd=REPO,
                start_new_session=True,
                preexec_fn=die_with_parent,  # noqa: PLW1509 - only calls prctl
            )
        except BaseException:
            self._log.close()
            raise
        #: The service's banner line, once :meth:`wait_started` has read it.
        self.announcement = ""
        #: Where its /healthz, /readyz and /metrics answer ("" when it serves none).
        self.metrics_url = ""
        #: Seconds from spawn to the banner.
        self.ready_s: float | None = None
        if wait:
            self.wait_started(start_timeout_s)

    def wait_started(self, timeout_s: float = 60.0) -> "ServiceProcess":
        """Wait for the banner (the service runs); stops the process and raises RuntimeError if it does not come.

        With ``wait=False`` several services start side by side: spawn them all, then wait for each.
        """
        if self.announcement:
            return self
        try:
            self.announcement = self._read_banner(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - self.started
        self._announced()
        return self

    def _announced(self) -> None:
        """Read what the subclass needs from ``announcement`` (its member id, its URL)."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_banner(self, timeout_s: float) -> str:
        """The banner line; a ``metrics on URL`` line before it sets ``metrics_url``.

        The pipe is read with ``os.read`` and split here: two lines that arrive in one
        read must not leave the second in a buffer that ``select`` cannot see."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        pending = b""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            while b"\n" in pending:
                raw, pending = pending.split(b"\n", 1)
                line = raw.decode(errors="replace")
                if line.startswith("metrics on "):
                    self.metrics_url = line.split()[2]
                elif line.startswith(self.banner):
                    return line.strip()
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                pending += chunk
            elif self.proc.poll() is not None:
                break
        raise RuntimeError(f"{self.banner.strip() or 'service'} did not start (exit {self.proc.poll()}); "
                           f"log:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """kill -9: no revoke, no flush, no commit."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP, returning once it holds: the process keeps its sockets but answers nothing,
        heartbeats included."""
        stop_process(self.proc.pid)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def dump_stacks(self, settle_s: float = 0.5) -> bool:
        """Have the running service print every thread's stack to its log (SIGUSR1); False if it cannot."""
        if not (self.dumps_stacks and self.announcement) or self.proc.poll() is not None:
            return False
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGUSR1)
        time.sleep(settle_s)
        return True

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the service leaves its group and flushes), SIGKILL after ``timeout_s``.  Idempotent.

        Stopped while an exception propagates (a test's ``finally`` after a failed check), the
        service first prints its threads' stacks to its log, so a hang can be read afterwards."""
        if self.proc.poll() is None:
            if sys.exc_info()[0] is not None:
                self.dump_stacks()
            self.proc.send_signal(signal.SIGCONT)
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

    def __enter__(self) -> "ServiceProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _service_env() -> dict[str, str]:
    """Any free port on 127.0.0.1 for a child's health and metrics server, unless turned off;
    text logs, which the harnesses read (failover times)."""
    env = {"SLUICE_LOG_FORMAT": "text"}
    if os.environ.get("SLUICE_METRICS_PORT", "").strip().lower() in ("off", "none", "-1"):
        return env
    return {**env, "SLUICE_METRICS_PORT": "0", "SLUICE_METRICS_HOST": "127.0.0.1"}


def probe(url: str, timeout_s: float = 2.0) -> tuple[int, dict[str, Any]]:
    """GET a health endpoint: (status, JSON body)."""
    response = httpx.get(url, timeout=timeout_s)
    return response.status_code, dict(response.json())


class RegionProcess(ServiceProcess):
    """``sluice region -c FILE --port N [--store-dir DIR]`` (any free port by default); ``url`` is where it
    listens."""

    banner = "region service "
    dumps_stacks = True

    def __init__(self, config_path: Path, log_path: Path, *, port: int = 0, store_dir: Path | None = None,
                 **kwargs: Any) -> None:
        self.config_path = config_path
        self.url = ""
        store = [] if store_dir is None else ["--store-dir", str(store_dir)]
        super().__init__(["region", "-c", str(config_path), "--port", str(port), *store], log_path, **kwargs)

    def _announced(self) -> None:
        self.url = self.announcement.split(" on ", 1)[1].split(" ", 1)[0]

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


class DispatcherProcess(ServiceProcess):
    """``sluice dispatcher -c FILE --queue ID``; ``member_id`` is its group member name."""

    banner = "dispatcher "
    dumps_stacks = True

    def __init__(self, config_path: Path, queue_id: str, log_path: Path, **kwargs: Any) -> None:
        self.member_id = ""
        super().__init__(["dispatcher", "-c", str(config_path), "--queue", queue_id], log_path, **kwargs)

    def _announced(self) -> None:
        self.member_id = self.announcement.split()[1]


class ReceiverProcess(ServiceProcess):
    """``sluice receiver -c FILE``."""

    banner = "receiver "
    dumps_stacks = True

    def __init__(self, config_path: Path, log_path: Path, **kwargs: Any) -> None:
        self.member_id = ""
        super().__init__(["receiver", "-c", str(config_path)], log_path, **kwargs)

    def _announced(self) -> None:
        self.member_id = self.announcement.split()[1]


class SenderProcess(ServiceProcess):
    """``sluice parallel-sender|serial-sender -c FILE --sender ID``."""

    banner = "sender "
    dumps_stacks = True

    def __init__(self, config_path: Path, sender_id: str, log_path: Path, *, parallel: bool = True,
                 **kwargs: Any) -> None:
        command = "parallel-sender" if parallel else "serial-sender"
        self.member_id = ""
        super().__init__([command, "-c", str(config_path), "--sender", sender_id], log_path, **kwargs)

    def _announced(self) -> None:
        self.member_id = self.announcement.split()[1]


class SubscriptionsProcess(ServiceProcess):
    """``sluice subscriptions -c FILE``."""

    banner = "subscriptions "
    dumps_stacks = True

    def __init__(self, config_path: Path, log_path: Path, **kwargs: Any) -> None:
        self.member_id = ""
        super().__init__(["subscriptions", "-c", str(config_path)], log_path, **kwargs)

    def _announced(self) -> None:
        self.member_id = self.announcement.split()[1]
