"""The ``sluice`` command: one sub-command per service, each thin.

Every sub-command has ``--help`` with an example.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from . import __version__

EXAMPLE = """\
examples:
  sluice broker --site a --port 9092           # an embedded Apache Kafka for site a
  sluice config check deploy/sites/site-a.yaml  # validate a site file
  sluice topics apply -c deploy/sites/site-a.yaml
  sluice region -c deploy/sites/site-a.yaml --port 7071
  sluice dispatcher -c deploy/sites/site-a.yaml --queue orders-jdbc
  sluice subscriptions -c deploy/sites/site-b.yaml
  sluice admin -c deploy/sites/site-a.yaml status
  sluice demo                                   # the whole thing on embedded brokers
"""


def build_parser() -> argparse.ArgumentParser:
    from . import demo
    from .admin import cli as admin_cli
    from .broker import cli as broker_cli
    from .core import configcli
    from .dispatcher import cli as dispatcher_cli
    from .pipelines import cli as pipeline_cli
    from .receiver import cli as receiver_cli
    from .sender import cli as sender_cli
    from .region import cli as region_cli
    from .subscriptions import cli as subscriptions_cli
    from .verify import soak

    parser = argparse.ArgumentParser(
        prog="sluice",
        description="Sluice: Apache Geode's event distribution (async event queues, gateway senders and "
        "receivers, client subscriptions) on Kafka.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sluice {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    broker_cli.add_parser(sub)
    configcli.add_parsers(sub)
    region_cli.add_parser(sub)
    dispatcher_cli.add_parser(sub)
    receiver_cli.add_parser(sub)
    sender_cli.add_parser(sub)
    subscriptions_cli.add_parser(sub)
    admin_cli.add_parser(sub)
    pipeline_cli.add_parser(sub)
    demo.add_parser(sub)
    soak.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None) or getattr(args, "run", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
