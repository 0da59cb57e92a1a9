"""The ``sluice`` command: one sub-command per service, each thin.

Every sub-command has ``--help`` with an example.
"""

from __future__ import annotations

import argparse
import importlib
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


#: The module that adds each sub-command (``add_parser``, or ``add_parsers`` for several), in the order
#: ``sluice --help`` lists them.  A command that runs imports only its own module: a receiver process
#: does not pay for the region's HTTP stack, the demo or the admin page (about 0.4 s of CPU at each
#: start, and the tests and the demo start hundreds of service processes).
COMMANDS: dict[str, str] = {
    "broker": "broker.cli",
    "config": "core.configcli",
    "keys": "core.configcli",
    "topics": "core.configcli",
    "region": "region.cli",
    "dispatcher": "dispatcher.cli",
    "receiver": "receiver.cli",
    "parallel-sender": "sender.cli",
    "serial-sender": "sender.cli",
    "subscriptions": "subscriptions.cli",
    "admin": "admin.cli",
    "pipeline": "pipelines.cli",
    "demo": "demo",
    "soak": "verify.soak",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``sluice`` parser: every sub-command, or only ``command``'s (the one about to run)."""
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="Sluice: Apache Geode's event distribution (async event queues, gateway senders and "
        "receivers, client subscriptions) on Kafka.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"sluice {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        module = importlib.import_module(f".{name}", __package__)
        add = getattr(module, "add_parsers", None) or module.add_parser
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None) or getattr(args, "run", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
