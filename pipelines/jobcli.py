"""What every pipeline job's command line shares: Spark options, site files, exit statuses, progress.

Each job (``lake``, ``reconcile``, ``queue_health``) has ``add_arguments``,
``run(args) -> int`` and ``main(argv)``; ``sluice pipeline JOB`` and
``spark-submit pipelines/JOB.py`` both end in ``run``.  ``run_job`` wraps it
so that every job answers trouble the same way:

====  ==========================================================================
exit  meaning
====  ==========================================================================
0     done (reconcile: the sites agree)
1     reconcile only: the sites diverge
2     bad input: a site file, a region or queue name, an option, a missing topic
3     the job could not run or failed: no Spark or Java, Kafka unreachable, a query failed
====  ==========================================================================
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable
from typing import TextIO

from rich.console import Console

from sluice.core.config import SiteConfig, load_config
from sluice.core.errors import ConfigError, InvalidRequest, SluiceError, TopicMissing
from sluice.core.kafka import make_admin, translate
from sluice.pipelines.session import DEFAULT_MASTER

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_DIVERGED",
    "EXIT_FAILED",
    "EXIT_OK",
    "Progress",
    "add_spark_options",
    "console",
    "load_site",
    "require_topics",
    "run_job",
]

EXIT_OK = 0
EXIT_DIVERGED = 1
EXIT_BAD_INPUT = 2
EXIT_FAILED = 3

EXIT_STATUS_HELP = """\
exit status: 0 done; 2 bad input (site file, names, options, missing topics);
3 the job failed (Spark, Java or Kafka trouble)."""


def add_spark_options(parser: argparse.ArgumentParser) -> None:
    """``--master``, ``--conf`` and ``--log-level``: where and how Spark runs."""
    spark = parser.add_argument_group("Spark")
    spark.add_argument("--master", metavar="URL",
                       help=f"Spark master (default {DEFAULT_MASTER}: a local Spark on every core; "
                       "ignored under spark-submit, which sets its own)")
    spark.add_argument("--conf", action="append", metavar="KEY=VALUE", default=[],
                       help="a Spark setting for the job's session, e.g. spark.driver.memory=2g (repeatable)")
    spark.add_argument("--log-level", default="WARNING", help="Python log level: DEBUG, INFO, WARNING (default)")


def load_site(path: str, bootstrap: str | None) -> SiteConfig:
    """A site file, with ``--bootstrap`` applied when given; raises ``ConfigError``."""
    cfg = load_config(path)
    if bootstrap:
        cfg = cfg.with_overrides({"kafka": {"bootstrap_servers": bootstrap}})
    return cfg


def require_topics(cfg: SiteConfig, topics: list[str], timeout_s: float = 15.0) -> None:
    """Raise ``TopicMissing`` for the first of ``topics`` the site's cluster does not have.

    Checked before Spark starts reading: its Kafka source would wait on a
    missing topic without saying why.  ``BrokerUnavailable`` when the cluster
    does not answer within ``timeout_s``.
    """
    from sluice.core.kafka import KafkaException

    admin = make_admin(cfg.kafka.client_settings())
    try:
        listed = admin.list_topics(timeout=timeout_s).topics
    except KafkaException as exc:
        raise translate(exc, f"listing the topics of site {cfg.site} on {cfg.kafka.bootstrap_servers}") from exc
    for topic in topics:
        if topic not in listed or listed[topic].error is not None:
            raise TopicMissing(topic)


def console() -> Console:
    """Where a job prints its results: stdout, 160 columns wide when it is not a terminal (a CI log, a
    file), where rich would assume 80 and squeeze the tables."""
    out = Console(soft_wrap=True)
    return out if out.is_terminal else Console(soft_wrap=True, width=160)


class Progress:
    """Progress lines on stderr (stdout carries a job's results), prefixed with the time and the job."""

    def __init__(self, job: str, stream: TextIO | None = None) -> None:
        self.job = job
        self.stream = stream
        self.started = time.monotonic()

    def __call__(self, text: str) -> None:
        stream = self.stream or sys.stderr
        print(f"{time.strftime('%H:%M:%S')} {self.job}: {text}", file=stream, flush=True)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started


def run_job(command: str, args: argparse.Namespace, body: Callable[[argparse.Namespace], int]) -> int:
    """Run a job's ``body`` and map what it raises to the exit statuses in the module docstring."""
    logging.basicConfig(level=str(args.log_level).upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        return body(args)
    except (ConfigError, InvalidRequest, TopicMissing) as exc:
        print(f"sluice pipeline {command}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SluiceError as exc:
        print(f"sluice pipeline {command}: failed: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:
        # Spark's own errors (a query that failed, Kafka unreachable from the
        # JVM) arrive as PySparkException; anything else is our bug and keeps
        # its traceback.
        if not _is_spark_error(exc):
            raise
        print(f"sluice pipeline {command}: failed in Spark: {type(exc).__name__}: {_first_lines(str(exc))}",
              file=sys.stderr)
        return EXIT_FAILED


def standalone_main(prog: str, description: str, example: str,
                    add_arguments: Callable[[argparse.ArgumentParser], None],
                    run: Callable[[argparse.Namespace], int], argv: list[str] | None) -> int:
    """A job run as its own script (``spark-submit pipelines/lake.py …``): its parser, then ``run``."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=example,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _is_spark_error(exc: BaseException) -> bool:
    try:
        from pyspark.errors import PySparkException
    except ImportError:
        return False
    return isinstance(exc, PySparkException)


def _first_lines(text: str, lines: int = 8) -> str:
    """The head of a JVM error (its stack trace can run to hundreds of lines)."""
    head = text.strip().splitlines()[:lines]
    return "\n".join(head)
