"""A Confluent-compatible schema registry for tests: Apicurio Registry, built once from Maven Central.

The Confluent serializer (``sluice.core.registry``) is tested against a real
registry.  Confluent's own is not on Maven Central and Karapace is not on
PyPI; Apicurio Registry (Apache-2.0) is, as an application jar of a Quarkus
app, with a Confluent-compatible API (``/apis/ccompat/v6``).  So:

1. ``ensure_registry`` copies ``deploy/registry/`` (a pom and one config
   file) to a temporary sibling of the cache directory and runs ``mvn
   package`` there: Maven fetches the registry and its dependencies, the
   registry's own ``application.properties`` is unpacked from its jar, and
   Quarkus's build step assembles a runnable ``*-runner.jar`` with ``lib/``.
   The result is renamed into ``$SLUICE_CACHE/apicurio-registry-<version>``
   (default ``~/.cache/sluice``) with a marker naming the pom's SHA-256,
   written last, so a build killed half-way is never taken for a complete
   one and an edited pom builds again.  About 3 minutes the first time here.
2. ``EmbeddedRegistry.start()`` runs it on 127.0.0.1 with in-memory storage
   (H2), its log in ``registry.log`` beside its working directory, and
   returns once ``GET /apis/ccompat/v6/subjects`` answers; ``stop()`` sends
   SIGTERM, then SIGKILL after a deadline.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Self

from sluice.broker.jars import cache_root, java_available, mvn_available
from sluice.broker.kafka import HOST, free_ports
from sluice.core.errors import BrokerStartError
from sluice.core.processes import die_with_parent

REGISTRY_VERSION = "2.1.5.Final"
#: The Confluent-compatible API under the registry's root.
CCOMPAT_PATH = "/apis/ccompat/v6"
MARKER_NAME = ".sluice-complete"
#: Maven fetches ~250 jars and Quarkus builds; ~3 minutes from a cold local repository on 2 cores.
BUILD_TIMEOUT_S = 1200.0
#: The registry answered after ~55 s on a loaded 2-core machine; the bound is for a slower one.
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 20.0
LOG_TAIL_LINES = 25


def registry_project() -> Path:
    """``$SLUICE_REGISTRY_PROJECT``, else ``deploy/registry`` in the source tree."""
    configured = os.environ.get("SLUICE_REGISTRY_PROJECT")
    if configured:
        return Path(configured).expanduser().resolve()
    return Path(__file__).resolve().parents[2] / "deploy" / "registry"


def registry_dir(cache_dir: Path | None = None) -> Path:
    """Where the built registry lives (or will live) in the cache."""
    return (cache_dir if cache_dir is not None else cache_root()) / f"apicurio-registry-{REGISTRY_VERSION}"


def _project_digest(project: Path) -> str | None:
    """SHA-256 over the project's files, so editing any of them builds again."""
    if not project.is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in project.rglob("*") if p.is_file() and "target" not in p.parts):
        digest.update(str(path.relative_to(project)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _runner(directory: Path) -> Path | None:
    found = sorted(directory.glob("*-runner.jar"))
    return found[0] if found else None


def _complete(directory: Path) -> bool:
    try:
        first_line = (directory / MARKER_NAME).read_text().splitlines()[0]
    except (OSError, IndexError):
        return False
    digest = _project_digest(registry_project())
    return _runner(directory) is not None and (digest is None or first_line.endswith(f" {digest}"))


def registry_available(cache_dir: Path | None = None) -> str | None:
    """None when a registry can be started here; otherwise why not (java or Maven missing)."""
    if not java_available():
        return "Apicurio Registry needs a Java runtime (java on PATH)"
    if not _complete(registry_dir(cache_dir)) and not mvn_available():
        return f"Apicurio Registry {REGISTRY_VERSION} is not built in {registry_dir(cache_dir)} and mvn is not on PATH"
    return None


def ensure_registry(cache_dir: Path | None = None) -> Path:
    """The runnable registry jar, built on first use (step 1).  ``BrokerStartError`` says why it cannot be."""
    missing = registry_available(cache_dir)
    if missing:
        raise BrokerStartError(missing)
    target = registry_dir(cache_dir)
    if _complete(target):
        runner = _runner(target)
        assert runner is not None
        return runner
    project = registry_project()
    if not (project / "pom.xml").is_file():
        raise BrokerStartError(f"cannot find the registry's build at {project}; set SLUICE_REGISTRY_PROJECT to "
                               "deploy/registry")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f"{target.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(project, staging / "project", ignore=shutil.ignore_patterns("target"))
    print(f"building Apicurio Registry {REGISTRY_VERSION} from Maven Central… (into {target})", file=sys.stderr,
          flush=True)
    started = time.monotonic()
    command = ["mvn", "-q", "-B", "-f", str(staging / "project" / "pom.xml"), "package", "-DskipTests"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise BrokerStartError(f"mvn did not build Apicurio Registry within {BUILD_TIMEOUT_S:.0f} s") from exc
    built = staging / "project" / "target"
    runner = _runner(built) if built.is_dir() else None
    if result.returncode != 0 or runner is None:
        shutil.rmtree(staging, ignore_errors=True)
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-20:])
        raise BrokerStartError(f"mvn could not build Apicurio Registry {REGISTRY_VERSION} (exit "
                               f"{result.returncode}):\n{tail}")
    # Only the runnable part is kept: the runner jar and its lib/.
    out = staging / "registry"
    out.mkdir()
    shutil.move(str(runner), out / runner.name)
    shutil.move(str(built / "lib"), out / "lib")
    (out / MARKER_NAME).write_text(f"apicurio-registry {REGISTRY_VERSION} project-sha256 "
                                   f"{_project_digest(project)}\n")
    stale = target.parent / f"{target.name}.stale-{os.getpid()}"
    try:
        if target.exists() and not _complete(target):
            os.rename(target, stale)
        os.rename(out, target)
    except OSError:
        if not _complete(target):  # another process finished the same build first: keep its copy
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)
    print(f"built Apicurio Registry in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    runner = _runner(target)
    assert runner is not None
    return runner


class EmbeddedRegistry:
    """One Apicurio Registry process on 127.0.0.1 with in-memory storage (step 2); a context manager."""

    def __init__(self, work_dir: Path, port: int = 0, *, cache_dir: Path | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.work_dir = Path(work_dir)
        self.port = port or free_ports(1)[0]
        self.cache_dir = cache_dir
        self.start_timeout_s = start_timeout_s
        self.log_path = self.work_dir / "registry.log"
        self._process: subprocess.Popen[bytes] | None = None
        #: Seconds from start() to the first answer of the Confluent-compatible API.
        self.last_start_s: float | None = None

    @property
    def url(self) -> str:
        """The base URL of the Confluent-compatible API (what ``schema_registry.url`` takes)."""
        return f"http://{HOST}:{self.port}{CCOMPAT_PATH}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> Self:
        """Build if needed, run, and wait for the API; ``BrokerStartError`` quoting the log if it does not come up."""
        runner = ensure_registry(self.cache_dir)
        started = time.monotonic()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        command = [
            "java", "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            f"-Dquarkus.http.port={self.port}", f"-Dquarkus.http.host={HOST}",
            # No metrics, no UI, no logins: a test registry on the loopback.
            "-Dregistry.auth.enabled=false", "-Dquarkus.oidc.tenant-enabled=false",
            "-jar", str(runner),
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             cwd=self.work_dir, start_new_session=True,
                                             preexec_fn=die_with_parent)  # noqa: PLW1509
        try:
            self._wait_ready(started + self.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.last_start_s = time.monotonic() - started
        return self

    def _wait_ready(self, deadline: float) -> None:
        assert self._process is not None
        while True:
            code = self._process.poll()
            if code is not None:
                raise BrokerStartError(f"Apicurio Registry exited with code {code} while starting; end of "
                                       f"{self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/subjects", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() >= deadline:
                raise BrokerStartError(f"Apicurio Registry did not answer on {self.url} within "
                                       f"{self.start_timeout_s:.0f} s; end of {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``.  Idempotent."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
