"""The jars of the embedded Apache Kafka broker, fetched once from Maven Central.

Apache Kafka is not on PyPI, and these machines reach no download site, so the
broker is assembled from Maven Central: ``deploy/broker/pom.xml`` names
``kafka_2.13`` and ``kafka-server`` (plus a log4j binding), and
``mvn dependency:copy-dependencies`` copies them with every runtime dependency
into one directory, which ``java -cp '<dir>/*'`` runs.

The directory is cached per Kafka version under ``$SLUICE_CACHE`` (default
``~/.cache/sluice``) as ``kafka-<version>/libs``.  Maven copies into a
temporary sibling that is renamed into place, and a marker file is written
last, so a fetch killed half-way is never mistaken for a complete one and two
processes fetching at once do not see each other's partial copies.  The
marker records the pom's SHA-256: editing the pom (a new dependency, another
Kafka version) makes the next start fetch again instead of running stale jars.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from sluice.core.errors import BrokerStartError

KAFKA_VERSION_DEFAULT = "4.4.0"

#: Written into ``libs/`` after Maven finished; its presence means "complete".
MARKER_NAME = ".sluice-complete"

#: Maven resolves ~45 jars in ~8 s from a cold local repository here; the
#: bound is for a slow mirror, not for the normal case.
FETCH_TIMEOUT_S = 600.0


def cache_root() -> Path:
    """``$SLUICE_CACHE`` if set, else ``~/.cache/sluice``."""
    configured = os.environ.get("SLUICE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "sluice"


def broker_pom() -> Path:
    """The pom that names the broker's jars.

    ``$SLUICE_BROKER_POM`` wins; otherwise the one in the source tree, found
    relative to this package (``services/broker`` -> ``deploy/broker/pom.xml``).
    """
    configured = os.environ.get("SLUICE_BROKER_POM")
    if configured:
        return Path(configured).expanduser().resolve()
    return Path(__file__).resolve().parents[2] / "deploy" / "broker" / "pom.xml"


def log4j_config() -> Path | None:
    """The log4j2 configuration that sits beside the pom, if there is one.

    Without it log4j falls back to ERROR-only console logging, which still
    works but leaves little to read when a broker fails to start.
    """
    candidate = broker_pom().parent / "log4j2.properties"
    return candidate if candidate.is_file() else None


def java_available() -> bool:
    """True when a ``java`` executable is on PATH."""
    return shutil.which("java") is not None


def mvn_available() -> bool:
    """True when a ``mvn`` executable is on PATH."""
    return shutil.which("mvn") is not None


def kafka_jars_dir(version: str = KAFKA_VERSION_DEFAULT, cache_dir: Path | None = None) -> Path:
    """Where the jars of ``version`` live (or will live) in the cache."""
    return (cache_dir if cache_dir is not None else cache_root()) / f"kafka-{version}" / "libs"


def kafka_jars_cached(version: str = KAFKA_VERSION_DEFAULT, cache_dir: Path | None = None) -> bool:
    """True when a complete copy of the jars, fetched with the current pom, is cached."""
    return _complete(kafka_jars_dir(version, cache_dir))


def _pom_digest(pom: Path) -> str | None:
    try:
        return hashlib.sha256(pom.read_bytes()).hexdigest()
    except OSError:
        return None


def _marker_text(version: str, digest: str | None) -> str:
    return f"kafka {version} pom-sha256 {digest}\n"


def _complete(libs: Path) -> bool:
    """The marker exists and names the pom as it is now (or the pom is gone).

    Without a pom (an installed, not editable, sluice) the cached jars are
    all there is, so they are taken as they are.
    """
    try:
        first_line = (libs / MARKER_NAME).read_text().splitlines()[0]
    except (OSError, IndexError):
        return False
    digest = _pom_digest(broker_pom())
    return digest is None or first_line.endswith(f" {digest}")


def kafka_available(version: str = KAFKA_VERSION_DEFAULT, cache_dir: Path | None = None) -> bool:
    """True when an embedded Apache Kafka can be started without error.

    It needs java, and either cached jars or Maven to fetch them.
    """
    return java_available() and (kafka_jars_cached(version, cache_dir) or mvn_available())


def ensure_kafka_jars(version: str = KAFKA_VERSION_DEFAULT, cache_dir: Path | None = None) -> Path:
    """Return a directory holding every jar the Kafka ``version`` broker needs.

    Fetches them with Maven on first use (progress goes to stderr) and reuses
    the cached copy afterwards.  Raises :class:`BrokerStartError` when java or
    Maven is missing, the pom cannot be found, or Maven fails.
    """
    if not java_available():
        raise BrokerStartError(
            "the embedded Apache Kafka broker needs a Java runtime (java on PATH); "
            "install OpenJDK 17 (Debian: apt-get install openjdk-17-jre-headless) "
            "or use the Tansu broker (--engine tansu)"
        )
    libs = kafka_jars_dir(version, cache_dir)
    if _complete(libs):
        return libs
    if not mvn_available():
        raise BrokerStartError(
            f"the Apache Kafka {version} jars are not cached in {libs} and Maven (mvn) "
            "is not on PATH to fetch them; install Maven (Debian: apt-get install maven) "
            "or use the Tansu broker (--engine tansu)"
        )
    pom = broker_pom()
    if not pom.is_file():
        raise BrokerStartError(
            f"cannot find the broker pom at {pom}; set SLUICE_BROKER_POM to deploy/broker/pom.xml"
        )
    _fetch(version, pom, libs)
    return libs


def class_archive(libs: Path) -> Path:
    """Where the class-data archive of a JVM running the jars in ``libs`` is kept: beside them, one per
    ``java`` on PATH (its resolved path and modification time), since an archive is only good for the JVM
    build that wrote it."""
    java = shutil.which("java")
    resolved = os.path.realpath(java) if java is not None else "java"
    try:
        stamp = os.stat(resolved).st_mtime_ns
    except OSError:
        stamp = 0
    key = hashlib.sha1(f"{resolved}:{stamp}".encode()).hexdigest()[:12]
    return libs.parent / f"classes-{key}.jsa"


def usable_class_archive(libs: Path) -> Path | None:
    """``class_archive(libs)`` when it exists and is newer than every jar (a jar replaced since would make
    the JVM refuse the archive, with a warning, and load every class itself); else None."""
    archive = class_archive(libs)
    try:
        written = archive.stat().st_mtime
        newest_jar = max((jar.stat().st_mtime for jar in libs.glob("*.jar")), default=0.0)
    except OSError:
        return None
    return archive if written >= newest_jar else None


def _fetch(version: str, pom: Path, libs: Path) -> None:
    """Copy the jars into a temporary sibling of ``libs``, then rename it in."""
    libs.parent.mkdir(parents=True, exist_ok=True)
    staging = libs.parent / f"libs.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    print(f"fetching Apache Kafka {version} jars from Maven Central… (into {libs})", file=sys.stderr, flush=True)
    started = time.monotonic()
    command = [
        "mvn", "-q", "-B", "-f", str(pom),
        f"-Dkafka.version={version}",
        "dependency:copy-dependencies",
        f"-DoutputDirectory={staging}",
        "-DincludeScope=runtime",
    ]  # fmt: skip
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise BrokerStartError(f"mvn did not finish fetching Kafka {version} within {FETCH_TIMEOUT_S:.0f} s") from exc
    jars = sorted(staging.glob("*.jar")) if staging.is_dir() else []
    if result.returncode != 0 or not jars:
        shutil.rmtree(staging, ignore_errors=True)
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-20:])
        raise BrokerStartError(
            f"mvn could not fetch the Apache Kafka {version} jars (exit {result.returncode}):\n{tail}"
        )
    marker = _marker_text(version, _pom_digest(pom)) + "".join(f"{jar.name}\n" for jar in jars)
    (staging / MARKER_NAME).write_text(marker)
    stale = libs.parent / f"libs.stale-{os.getpid()}"
    try:
        # A directory without a current marker is stale: an interrupted
        # fetch, or jars of an older pom.  It is moved aside rather than
        # deleted in place so that the path is missing only between two
        # renames; brokers already running keep their open jars either way.
        if libs.exists() and not _complete(libs):
            os.rename(libs, stale)
        os.rename(staging, libs)
        shutil.rmtree(stale, ignore_errors=True)
    except OSError:
        # Another process completed the same fetch first: keep its copy.
        shutil.rmtree(staging, ignore_errors=True)
        if not _complete(libs):
            raise
    elapsed_s = time.monotonic() - started
    print(f"fetched {len(jars)} jars in {elapsed_s:.1f} s", file=sys.stderr, flush=True)
