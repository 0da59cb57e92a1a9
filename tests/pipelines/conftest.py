"""Fixtures of the pipeline tests: one local Spark for the whole session.

Starting Spark takes ~10 s on the 2-core machines (the first run also
fetches the Kafka and Avro packages from Maven Central into Ivy's cache), so
every test of this folder shares one ``local[2]`` session.  A job run
in-process (``sluice.cli.main([...])``) finds it active and uses it; a job
the test must kill runs in a process of its own.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from pipelinekit import DRIVER_JAVA_OPTIONS

#: Settings of the shared session: small shuffles for small data, no UI (no port to find), and a driver JVM
#: that starts and compiles cheaply (``DRIVER_JAVA_OPTIONS``).
TEST_CONF = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.driver.extraJavaOptions": DRIVER_JAVA_OPTIONS,
}


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """The session's local Spark (``local[2]``), with the Kafka source and the Avro functions."""
    if shutil.which("java") is None:
        pytest.skip("no java on PATH: Spark needs a Java 17 runtime")
    pytest.importorskip("pyspark", reason="PySpark is not installed (pip install -e '.[test]')")
    from sluice.pipelines.session import spark_session

    session = spark_session("sluice-pipeline-tests", "local[2]", TEST_CONF)
    try:
        yield session.spark
    finally:
        session.stop()
