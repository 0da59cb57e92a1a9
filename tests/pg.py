"""A real PostgreSQL server for tests: the session fixture ``postgres``.

The server is chosen once per session, first match wins:

1. ``SLUICE_POSTGRES_URL`` set: that server (``postgresql://user@host:port/db``);
   it is neither started nor stopped here.
2. ``initdb`` and ``pg_ctl`` found (on PATH, else the newest
   ``/usr/lib/postgresql/*/bin``): a private server, started below.
3. A Docker engine answers: a testcontainers ``postgres:15`` container.
   Written to run wherever Docker exists; the development machines have none.
4. Otherwise Debian's ``postgresql`` package is installed (``apt-get update``,
   ``apt-get install -y postgresql``: CI runs as root on a fresh machine)
   and path 2 is taken.  The tests skip, with the reason, only if that fails.

The private server (path 2): ``initdb -A trust`` and ``pg_ctl`` refuse to
run as root, so as root they run as the ``postgres`` user (``runuser -u
postgres --``) on a data directory it owns under /tmp (pytest's own
temporary directories are root's, mode 0700).  It listens on 127.0.0.1 at a
free port, with its unix socket in the same directory and ``fsync=off``;
``pg_ctl -m immediate stop`` and the directory's removal end the session.

Use it as ``postgres.url`` (``postgresql://postgres@127.0.0.1:PORT/postgres``)
or ``postgres.connect()`` (an autocommit psycopg connection).  Tests share
the database, so each names its own tables (``postgres.unique_name()``).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

URL_ENV = "SLUICE_POSTGRES_URL"
IMAGE = os.environ.get("SLUICE_POSTGRES_IMAGE", "postgres:15")
DOCKER_URL = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
INSTALL_TIMEOUT_S = 600
START_TIMEOUT_S = 60
START_ATTEMPTS = 3  # another process may take the free port before the server binds it


class PostgresInstallFailed(Exception):
    """PostgreSQL is absent and could not be installed: the tests skip, saying why."""


class PostgresStartError(Exception):
    """The server is there but would not start: a real failure, never a skip."""


@dataclass
class PostgresServer:
    """A running PostgreSQL server: where it is and how it was had."""

    url: str
    engine: str  # "external", "local" or "testcontainers"
    describe: str
    start_s: float = 0.0
    _stop: Callable[[], None] = field(default=lambda: None, repr=False)

    def connect(self, **kwargs: Any) -> Any:
        """A new psycopg connection, autocommit unless ``autocommit=False`` is passed."""
        import psycopg

        kwargs.setdefault("autocommit", True)
        return psycopg.connect(self.url, **kwargs)

    def unique_name(self, prefix: str = "t") -> str:
        """A table name no other test uses."""
        return f"{prefix}_{uuid.uuid4().hex[:10]}"

    def stop(self) -> None:
        stop, self._stop = self._stop, lambda: None
        stop()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_pg_bin() -> Path | None:
    """The directory holding initdb and pg_ctl, or None."""
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb and pg_ctl:
        return Path(os.path.realpath(initdb)).parent
    candidates = [Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin")
                  if (Path(p) / "initdb").exists() and (Path(p) / "pg_ctl").exists()]
    if not candidates:
        return None
    return max(candidates, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)


def install_postgresql() -> None:
    """Install Debian's postgresql package; raise PostgresInstallFailed if that fails."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise PostgresInstallFailed("no initdb/pg_ctl, and no root apt-get to install Debian's postgresql")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "postgresql"]):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PostgresInstallFailed(f"{' '.join(command)} failed: {exc}") from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise PostgresInstallFailed(f"{' '.join(command)} exited {done.returncode}: {' | '.join(tail)}")


def _docker_answers() -> bool:
    try:
        import docker  # A dependency of testcontainers (the test extra).
    except ImportError:
        return False
    try:
        client = docker.DockerClient(base_url=DOCKER_URL, timeout=2)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (docker.errors.DockerException, OSError):
        return False


class LocalPostgres:
    """A private server from initdb/pg_ctl in a directory of its own under /tmp."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.as_root = os.geteuid() == 0
        self.root = Path(tempfile.mkdtemp(prefix="sluice-pg-", dir="/tmp"))
        self.data_dir = self.root / "data"
        self.log_file = self.root / "server.log"
        self.port = 0

    def _run(self, *args: str, timeout_s: float = START_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=self.root)

    def _check(self, done: subprocess.CompletedProcess[str], what: str) -> None:
        if done.returncode != 0:
            log = self.log_file.read_text(errors="replace")[-2000:] if self.log_file.exists() else ""
            output = done.stderr.strip() or done.stdout.strip()
            raise PostgresStartError(f"{what} exited {done.returncode}: {output} {log}")

    def start(self) -> str:
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self._check(self._run("initdb", "-D", str(self.data_dir), "-A", "trust", "-U", "postgres",
                              "-E", "UTF8", "--locale=C", "--no-sync"), "initdb")
        for attempt in range(START_ATTEMPTS):
            self.port = _free_port()
            options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                       f"-c max_connections=200")
            done = self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_file), "-w",
                             "-t", str(START_TIMEOUT_S), "-o", options, "start", timeout_s=START_TIMEOUT_S + 10)
            if done.returncode == 0:
                return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
            if attempt == START_ATTEMPTS - 1:
                self._check(done, "pg_ctl start")
        raise AssertionError("unreachable")

    def stop(self) -> None:
        try:
            if (self.data_dir / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def start_postgres() -> PostgresServer:
    """A server per the order in the module docstring.

    Raises PostgresInstallFailed when there is none to be had, PostgresStartError
    when one would not start.
    """
    external = os.environ.get(URL_ENV, "").strip()
    if external:
        return PostgresServer(external, "external", f"{URL_ENV}={external}")
    begin = time.monotonic()
    bin_dir = find_pg_bin()
    installed = ""
    if bin_dir is None and _docker_answers():
        from testcontainers.community.postgres import PostgresContainer

        container = PostgresContainer(IMAGE, driver=None).start()
        return PostgresServer(container.get_connection_url(), "testcontainers", f"testcontainers {IMAGE}",
                              time.monotonic() - begin, container.stop)
    if bin_dir is None:
        install_postgresql()
        bin_dir = find_pg_bin()
        if bin_dir is None:
            raise PostgresInstallFailed("installed Debian's postgresql, but found no initdb/pg_ctl")
        installed = f", installed in {time.monotonic() - begin:.1f} s"
    server = LocalPostgres(bin_dir)
    begin = time.monotonic()
    try:
        url = server.start()
    except BaseException:
        server.stop()
        raise
    start_s = time.monotonic() - begin
    return PostgresServer(url, "local", f"local {bin_dir} on port {server.port}{installed}, ready in {start_s:.2f} s",
                          start_s, server.stop)


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server for the session (see the module docstring); stopped at the end."""
    try:
        server = start_postgres()
    except PostgresInstallFailed as exc:
        pytest.skip(f"no PostgreSQL server: {exc}")
    try:
        yield server
    finally:
        server.stop()
