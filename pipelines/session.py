"""Spark for the pipeline jobs: the session, the packages it needs, and how it reaches a site's Kafka.

The jobs read Sluice topics with Spark's own Kafka source
(``spark-sql-kafka-0-10``) and decode the records with Spark's Avro functions
(``spark-avro``).  Both are Spark packages of the same version as the
installed PySpark, resolved from Maven Central through
``spark.jars.packages`` on first use and cached by Ivy (``~/.ivy2.5.2``), as
any Spark user would get them.

``spark_session`` gives a job its session, in one of three ways:

1. a session already active in this process (tests, a notebook): that one,
   untouched, and the caller must not stop it;
2. started by ``spark-submit`` (``PYSPARK_GATEWAY_PORT`` is set): the JVM
   already runs, so the master and the packages are what spark-submit was
   given; ``require_packages`` names the ``--packages`` to add when they are
   missing, instead of failing later on a class name;
3. otherwise a new session on ``master`` (``local[*]`` by default: a local
   Spark on every core), with the packages set.  The same code runs on any
   cluster with ``--master`` or under spark-submit.

``kafka_options`` turns a site file's ``kafka`` section (written for
librdkafka) into the Kafka source's ``kafka.*`` options for the Java client,
TLS and SASL included.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sluice.core.config import KafkaConnection
from sluice.pipelines.errors import MissingSparkPackage, SparkUnavailable

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = [
    "DEFAULT_MASTER",
    "JobSession",
    "kafka_options",
    "packages_hint",
    "parse_conf",
    "read_topics",
    "require_packages",
    "spark_packages",
    "spark_session",
]

log = logging.getLogger("sluice.pipelines")

#: Spark 4 is built for Scala 2.13 only, so the packages' Scala suffix is fixed.
SCALA_BINARY_VERSION = "2.13"
DEFAULT_MASTER = "local[*]"

#: Settings every job's new session gets (``conf`` given to ``spark_session`` wins).
BASE_CONF: dict[str, str] = {
    # Lake partitions (``date``) and every printed time are UTC, whatever the machine's zone.
    "spark.sql.session.timeZone": "UTC",
    # The jobs print their own progress lines; Spark's console bar would overwrite them.
    "spark.ui.showConsoleProgress": "false",
    # Key material and JAAS settings travel as Kafka source options: keep them out of plans and logs.
    # (Spark already redacts values that mention a password.)
    "spark.sql.redaction.options.regex": r"(?i)url|kafka\.ssl\.keystore\.key|kafka\.sasl\.jaas\.config",
}

#: (class that must load, what it is, artifact) for each package the jobs need.
_PACKAGE_CLASSES = (
    ("org.apache.spark.sql.kafka010.KafkaSourceProvider", "Spark's Kafka source", "spark-sql-kafka-0-10"),
    ("org.apache.spark.sql.avro.functions", "Spark's Avro functions (from_avro)", "spark-avro"),
)


def pyspark_version() -> str:
    """The installed PySpark's version (read without importing it); ``SparkUnavailable`` without PySpark."""
    try:
        return importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError as exc:
        raise SparkUnavailable(
            "PySpark is not installed: pip install 'sluice[pipelines]' (or `make install` for a checkout)"
        ) from exc


def packages_hint() -> str:
    """The ``--packages`` value for spark-submit, for help texts (a placeholder without PySpark)."""
    try:
        return ",".join(spark_packages())
    except SparkUnavailable:
        return "org.apache.spark:spark-sql-kafka-0-10_2.13:VERSION,org.apache.spark:spark-avro_2.13:VERSION"


def spark_packages(version: str | None = None) -> list[str]:
    """Maven coordinates of the packages the jobs need, matching PySpark ``version`` (default: installed)."""
    version = version or pyspark_version()
    return [f"org.apache.spark:{artifact}_{SCALA_BINARY_VERSION}:{version}" for _, _, artifact in _PACKAGE_CLASSES]


def parse_conf(pairs: list[str] | None) -> dict[str, str]:
    """``["k=v", …]`` from ``--conf`` options as a dict; ``InvalidRequest`` names a pair without ``=``."""
    from sluice.core.errors import InvalidRequest

    conf: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise InvalidRequest("--conf", pair, "must be KEY=VALUE, e.g. spark.driver.memory=2g")
        conf[key.strip()] = value
    return conf


@dataclass
class JobSession:
    """A job's Spark session, and whether the job started it (then it stops it at the end)."""

    spark: SparkSession
    owned: bool

    def stop(self) -> None:
        """Stop the session if this job started it; a session someone else made stays up."""
        if self.owned:
            self.spark.stop()


def spark_session(app_name: str, master: str | None = None, conf: Mapping[str, str] | None = None) -> JobSession:
    """The job's session (see the module docstring for which one), with the packages checked.

    ``conf`` (e.g. from ``--conf``) is applied to a new session; ``master``
    defaults to ``local[*]``.  Raises ``SparkUnavailable`` without PySpark or
    Java, ``MissingSparkPackage`` when the packages are not on the class path.
    """
    version = pyspark_version()
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        require_packages(active)
        return JobSession(active, owned=False)
    # Executors (and Python workers, should a job use any) run the driver's
    # interpreter: the venv's, with the same packages (KAFKA-NOTES).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    settings = dict(BASE_CONF)
    if not submitted:
        # Under spark-submit the JVM has resolved its packages already; setting them here would be ignored.
        settings["spark.jars.packages"] = ",".join(spark_packages(version))
        master = master or DEFAULT_MASTER
        builder = builder.master(master)
        if master.startswith("local"):
            # Spark's 200 shuffle partitions are sized for clusters; on one machine each is a task to
            # schedule for a few rows.  A cluster keeps its own setting.
            settings["spark.sql.shuffle.partitions"] = str(max(8, 2 * (os.cpu_count() or 1)))
    elif master:
        log.warning("--master %s ignored: spark-submit chose the master", master)
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # noqa: BLE001 - PySpark raises plain exceptions when the JVM cannot start
        if "JAVA_GATEWAY_EXITED" in str(exc) or isinstance(exc, FileNotFoundError):
            raise SparkUnavailable(
                f"Spark could not start its JVM ({exc}); it needs Java 17 or later on PATH (or JAVA_HOME), "
                "and, on first use, Maven Central to resolve " + ", ".join(spark_packages(version))
            ) from exc
        raise
    spark.sparkContext.setLogLevel("WARN")
    require_packages(spark)
    return JobSession(spark, owned=True)


def require_packages(spark: SparkSession) -> None:
    """Raise ``MissingSparkPackage`` unless the Kafka source and the Avro functions can be loaded."""
    from py4j.java_gateway import JavaClass

    jvm = spark.sparkContext._jvm
    assert jvm is not None, "a classic (non-Connect) session has a JVM"
    coordinates = spark_packages(spark.version)
    for (class_name, what, _), package in zip(_PACKAGE_CLASSES, coordinates):
        # py4j answers a class it cannot load with a JavaPackage (PySpark's own from_avro checks the same way).
        if not isinstance(getattr(jvm, class_name), JavaClass):
            raise MissingSparkPackage(what, package, ",".join(coordinates))


def kafka_options(connection: KafkaConnection) -> dict[str, str]:
    """The Kafka source's ``kafka.*`` options for a site's cluster (Java client settings).

    The site file is written for librdkafka, which reads PEM files; the Java
    client reads them too (KIP-651): the CA bundle as a PEM trust store, the
    client certificate and key as PEM strings.  SASL credentials become a
    JAAS line.  Java reads private keys in PKCS#8 form only, so a PKCS#1 key
    (``BEGIN RSA PRIVATE KEY``, which librdkafka accepts) is refused here,
    with the command that converts it.
    """
    settings = connection.client_settings()
    options = {
        "kafka.bootstrap.servers": settings["bootstrap.servers"],
        "kafka.security.protocol": settings["security.protocol"],
    }
    mechanism = settings.get("sasl.mechanism")
    if mechanism is not None:
        options["kafka.sasl.mechanism"] = mechanism
        module = ("org.apache.kafka.common.security.plain.PlainLoginModule" if mechanism == "PLAIN"
                  else "org.apache.kafka.common.security.scram.ScramLoginModule")
        username = _jaas_quote(settings.get("sasl.username", ""))
        password = _jaas_quote(settings.get("sasl.password", ""))
        options["kafka.sasl.jaas.config"] = f'{module} required username="{username}" password="{password}";'
    ca = settings.get("ssl.ca.location")
    if ca is not None:
        options["kafka.ssl.truststore.type"] = "PEM"
        options["kafka.ssl.truststore.location"] = ca
    certificate = settings.get("ssl.certificate.location")
    key = settings.get("ssl.key.location")
    if certificate is not None and key is not None:
        key_pem = Path(key).read_text()
        if "BEGIN RSA PRIVATE KEY" in key_pem or "BEGIN EC PRIVATE KEY" in key_pem:
            from sluice.core.errors import InvalidRequest

            raise InvalidRequest(
                "kafka.ssl_key_location", key,
                "Spark's Kafka client (Java) reads PKCS#8 keys only; convert it with "
                f"`openssl pkcs8 -topk8 -in {key} -out key.pk8.pem` (add -nocrypt for a key without password)",
            )
        options["kafka.ssl.keystore.type"] = "PEM"
        options["kafka.ssl.keystore.certificate.chain"] = Path(certificate).read_text()
        options["kafka.ssl.keystore.key"] = key_pem
        if "ssl.key.password" in settings:
            options["kafka.ssl.key.password"] = settings["ssl.key.password"]
    return options


def read_topics(
    spark: SparkSession,
    connection: KafkaConnection,
    topics: list[str],
    *,
    stream: bool,
    starting_timestamp_ms: int | None = None,
    options: Mapping[str, str] | None = None,
) -> DataFrame:
    """The records of ``topics`` through Spark's Kafka source, from their earliest offsets.

    ``stream=False``: a batch DataFrame of what the topics hold now (up to
    the latest offsets when the read starts).  ``stream=True``: a streaming
    DataFrame; its checkpoint, not this call, says where a restarted query
    goes on.  ``starting_timestamp_ms`` starts every partition at the first
    record at or after that time instead.  Columns: Spark's Kafka schema
    (``key``, ``value``, ``topic``, ``partition``, ``offset``, ``timestamp``…).
    """
    reader = (spark.readStream if stream else spark.read).format("kafka")
    settings = kafka_options(connection)
    settings.update({
        "subscribe": ",".join(topics),
        # As the services read (sluice.core.kafka.make_consumer): records of
        # aborted or open transactions are not events.
        "kafka.isolation.level": "read_committed",
        # Fewer, larger fetches: Spark's consumer seeks and polls once per fetch, and with the Java
        # client's defaults (1 MiB, 500 records) reading was ~20% slower on the lake benchmark.
        "kafka.max.partition.fetch.bytes": str(8 * 1024 * 1024),
        "kafka.max.poll.records": "10000",
        # Changelogs and removals are compacted (offsets have gaps by design)
        # and a dead-letter topic's retention deletes its oldest records: a
        # job behind them must go on with what is there, not stop.  Spark
        # logs each gap it skips.
        "failOnDataLoss": "false",
    })
    if starting_timestamp_ms is None:
        settings["startingOffsets"] = "earliest"
    else:
        settings["startingTimestamp"] = str(starting_timestamp_ms)
        # A partition with nothing at or after the time starts at its end.
        settings["startingOffsetsByTimestampStrategy"] = "latest"
    if not stream:
        settings["endingOffsets"] = "latest"
    settings.update(options or {})
    return reader.options(**settings).load()


def _jaas_quote(value: str) -> str:
    """A value inside a JAAS line's double quotes: backslash and quote escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"')
