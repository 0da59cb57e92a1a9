"""The errors the pipeline jobs raise, under Sluice's root ``SluiceError``.

::

    SluiceError                      (sluice.core.errors)
    ├── InvalidRequest               bad input: a region, queue or option that is wrong (field, value, reason)
    ├── TopicMissing                 a topic the site file implies does not exist yet
    └── PipelineError                a job cannot run, or its Spark query failed
        ├── SparkUnavailable         PySpark or a Java runtime is missing
        └── MissingSparkPackage      the Kafka source or the Avro functions are not on Spark's class path

Bad input is reported with ``InvalidRequest`` and ``TopicMissing`` from
``sluice.core.errors``, so the CLI answers them as every other command does
(exit status 2).
"""

from __future__ import annotations

from sluice.core.errors import SluiceError

__all__ = ["MissingSparkPackage", "PipelineError", "SparkUnavailable"]


class PipelineError(SluiceError):
    """A pipeline job cannot run, or one of its Spark queries failed.  ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class SparkUnavailable(PipelineError):
    """PySpark is not installed, or Spark cannot start its JVM (no ``java``)."""


class MissingSparkPackage(PipelineError):
    """A Spark package the jobs need is not on the session's class path.

    Happens under ``spark-submit`` (which resolves packages itself, before the
    job's code runs) when ``--packages`` was not given.
    """

    def __init__(self, what: str, coordinates: str, all_coordinates: str) -> None:
        self.what = what
        self.coordinates = coordinates
        super().__init__(
            f"{what} is not on Spark's class path (package {coordinates}); with spark-submit, "
            f"add --packages {all_coordinates}"
        )
