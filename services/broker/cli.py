"""``sluice broker``: run one site's embedded broker in the foreground.

The command prints one line saying what runs where, then waits.  SIGTERM or
SIGINT (Ctrl-C) stops the broker cleanly and the command exits 0; if the
broker dies by itself the command exits 1 and prints the end of its log.
``--fetch-only`` downloads the Apache Kafka jars, writes the broker JVM's
class-data archive beside them, and exits (``make`` uses it so that the first
test run pays for neither Maven nor the archive).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import Any

from sluice.broker import ENGINES, resolve_engine
from sluice.broker.jars import KAFKA_VERSION_DEFAULT, ensure_kafka_jars, usable_class_archive
from sluice.broker.kafka import BrokerProcess, BrokerState, EmbeddedKafka, write_class_archive
from sluice.broker.tansu import EmbeddedTansu
from sluice.core.errors import BrokerStartError, InvalidRequest

#: How often the foreground loop checks that the broker is still alive.
WATCH_INTERVAL_S = 0.5

EPILOG = """\
examples:
  # site "london" on port 9092, Apache Kafka if java+mvn exist, else Tansu
  sluice broker --site london --port 9092

  # a second site beside it, always Apache Kafka, data in ./data/tokyo
  sluice broker --site tokyo --port 9192 --engine kafka --data-dir ./data/tokyo

  # only download the Apache Kafka jars into the cache (~/.cache/sluice), with the class-data archive
  sluice broker --fetch-only

Data lives in .sluice/sites/SITE/ENGINE unless --data-dir is given; the
broker log is written beside it (ENGINE.log).  Apache Kafka keeps its data
across restarts; Tansu (memory storage) starts empty each time.
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``broker`` command to an ``argparse`` subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "broker",
        help="run the embedded Kafka broker of one site in the foreground",
        description="Run the embedded Kafka-protocol broker of one site in the foreground "
        "until SIGTERM or Ctrl-C.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--site", help="site name (a directory name: letters, digits, '.', '_', '-')")
    parser.add_argument("--port", type=int, default=9092, help="listener port on 127.0.0.1 (default 9092; 0 = any free port)")
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="auto",
        help="kafka = Apache Kafka (java+mvn), tansu = Tansu (memory storage), auto (default) = kafka if possible",
    )
    parser.add_argument("--data-dir", help="data directory (default .sluice/sites/SITE/ENGINE)")
    parser.add_argument("--kafka-version", default=KAFKA_VERSION_DEFAULT, help=f"Apache Kafka version (default {KAFKA_VERSION_DEFAULT})")
    parser.add_argument("--heap", default="384m", help="JVM heap of the Apache Kafka broker (default 384m)")
    parser.add_argument("--fetch-only", action="store_true", help="download the Apache Kafka jars, write the broker JVM's class-data archive, and exit")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Run ``sluice broker``; returns the process exit code."""
    if args.fetch_only:
        try:
            libs = ensure_kafka_jars(args.kafka_version)
        except BrokerStartError as exc:
            print(f"sluice broker: {exc}", file=sys.stderr)
            return 1
        print(f"Apache Kafka {args.kafka_version} jars in {libs}")
        if not usable_class_archive(libs):
            print("writing the broker JVM's class-data archive (once; each broker start then loads its classes "
                  "from it)…", flush=True)
        try:
            archive = write_class_archive(args.kafka_version)
        except BrokerStartError as exc:  # brokers still start, loading their classes themselves
            print(f"sluice broker: no class-data archive: {exc}", file=sys.stderr)
            return 0
        print(f"class-data archive: {archive}" if archive is not None
              else "class-data archive: this JVM wrote none (brokers load their classes themselves)")
        return 0
    if not args.site:
        print("sluice broker: --site is required (unless --fetch-only)", file=sys.stderr)
        return 2
    try:
        broker: BrokerProcess
        if resolve_engine(args.engine) == "kafka":
            broker = EmbeddedKafka(args.site, args.port, data_dir=args.data_dir, heap=args.heap, version=args.kafka_version)
        else:
            broker = EmbeddedTansu(args.site, args.port, data_dir=args.data_dir)
    except (BrokerStartError, InvalidRequest) as exc:
        print(f"sluice broker: {exc}", file=sys.stderr)
        return 2
    return _run_foreground(broker)


def _run_foreground(broker: BrokerProcess) -> int:
    """Start ``broker``, wait for a stop signal, stop it; handlers restored after."""
    stop_requested = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop_requested.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            broker.start()
        except BrokerStartError as exc:
            print(f"sluice broker: {exc}", file=sys.stderr)
            return 1
        print(broker.describe(), flush=True)
        while not stop_requested.wait(WATCH_INTERVAL_S):
            if broker.state is BrokerState.STOPPED:
                print(
                    f"sluice broker: the broker of site {broker.site!r} exited by itself; "
                    f"end of {broker.log_path}:\n{broker.log_tail()}",
                    file=sys.stderr,
                )
                return 1
        return 0
    finally:
        broker.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
