"""``sluice parallel-sender`` / ``sluice serial-sender -c FILE --sender ID``."""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
from typing import Any

from ..core.errors import ConfigError, InvalidRequest, SluiceError
from ..core.servicecli import add_site_options, load_site, setup_logging
from .service import GatewaySenderService, ServiceState

EXAMPLE = """\
example:
  sluice {command} -c deploy/sites/site-a.yaml --sender {sender}
  sluice admin -c deploy/sites/site-a.yaml status {sender}

Run it on several machines: they share the queue's partitions through its
consumer group ({what}); a secondary takes over when a primary dies.
"""


def add_parser(subparsers: Any) -> None:
    for command, parallel, sender, what in (
        ("parallel-sender", True, "orders-to-site-b", "one primary per bucket"),
        ("serial-sender", False, "customers-to-site-b", "one primary per dispatcher thread's partition"),
    ):
        p = subparsers.add_parser(
            command,
            help=f"run a {'parallel' if parallel else 'serial'} gateway sender (batches to a remote site)",
            description="Send a gateway sender's queue in batches to the remote site's receiver, through Kafka, "
            "and remove each batch once the remote site acknowledged it.",
            epilog=EXAMPLE.format(command=command, sender=sender, what=what),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_site_options(p)
        p.add_argument("--sender", required=True, metavar="ID", help="gateway sender id from the site file")
        p.set_defaults(func=run, parallel=parallel, command=command)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        cfg = load_site(args)
        if cfg.sender(args.sender).parallel is not args.parallel:
            kind = "parallel" if cfg.sender(args.sender).parallel else "serial"
            raise InvalidRequest("--sender", args.sender, f"is a {kind} sender: run it with `sluice {kind}-sender`")
        service = GatewaySenderService(cfg, args.sender)
        service.start()
    except (ConfigError, InvalidRequest) as exc:
        print(f"sluice {args.command}: {exc}", file=sys.stderr)
        return 2
    except SluiceError as exc:
        print(f"sluice {args.command}: cannot start: {exc}", file=sys.stderr)
        return 1

    def on_signal(signum: int, _frame: Any) -> None:
        service.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    print(f"sender {service.member_id} of gateway sender {args.sender} to dsid {service.remote_dsid} "
          f"(site {cfg.site})", flush=True)
    try:
        service.run()
    except SluiceError as exc:
        print(f"sluice {args.command}: crashed: {exc}", file=sys.stderr)
        return 1
    return 1 if service.state is ServiceState.CRASHED else 0
