"""``sluice pipeline {lake|reconcile|queue-health}``: the Spark jobs, one sub-command each.

Each sub-command's options, example and exit statuses are in its module
(``lake``, ``reconcile``, ``queue_health``); this module only puts them under
``sluice pipeline``.  Nothing here imports PySpark: ``sluice --help`` works
without it, and a job says how to install it when it is missing.
"""

from __future__ import annotations

import argparse
from typing import Any

from sluice.pipelines import lake, queue_health, reconcile

__all__ = ["add_parser"]

EXAMPLE = """\
examples:
  sluice pipeline lake -c deploy/sites/site-a.yaml --lake /data/lake --available-now
  sluice pipeline reconcile --site-a deploy/sites/site-a.yaml --site-b deploy/sites/site-b.yaml --output /data/recon
  sluice pipeline queue-health -c deploy/sites/site-a.yaml --output /data/health --since 2h

Every job runs on a local Spark by default (--master local[*]) and on any
cluster with --master or spark-submit (see pipelines/README.md).  Spark's
Kafka and Avro packages come from Maven Central on first use.
"""


def add_parser(subparsers: Any) -> None:
    """Add ``pipeline`` and its jobs to the ``sluice`` command's subparsers."""
    parser = subparsers.add_parser(
        "pipeline",
        help="Spark jobs over a site's topics: event lake, cross-site reconciliation, queue health",
        description="The Sluice data pipeline on Spark (PySpark): an event lake kept by Structured Streaming, "
        "a reconciliation of two sites' regions, and a queue health report.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    jobs = parser.add_subparsers(dest="pipeline_command", metavar="JOB", required=True)
    for name, module, help_text in (
        ("lake", lake, "keep the event lake (Parquet) from the changelogs and dead letters, exactly once"),
        ("reconcile", reconcile, "compare two sites' regions key by key; exit 1 when they diverge"),
        ("queue-health", queue_health, "events enqueued and removed per minute and their waits, per queue "
         "and partition: a table and a PNG chart"),
    ):
        job = jobs.add_parser(name, help=help_text, description=module.DESCRIPTION, epilog=module.EXAMPLE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(job)
        job.set_defaults(func=module.run)
