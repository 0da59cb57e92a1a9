"""``sluice receiver -c FILE``: one gateway-receiver instance of a site."""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys
from typing import Any

from ..core.errors import ConfigError, SluiceError
from ..core.servicecli import add_site_options, load_site, setup_logging
from .service import ReceiverService, ServiceState

EXAMPLE = """\
example:
  sluice receiver -c deploy/sites/site-b.yaml

Applies the batches remote sites' gateway senders write into this site's
inbound topic (only from receiver.accepted_dsids), through the local region
service, and acknowledges each.  Run several: they share the inbound
topic's partitions through a consumer group.
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "receiver",
        help="run a gateway receiver (applies batches from remote sites)",
        description="Apply gateway batches from remote sites through the local region service and acknowledge "
        "them: duplicates discarded, WAN conflicts resolved, per-event exceptions reported.",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_site_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        cfg = load_site(args)
        service = ReceiverService(cfg)
        service.start()
    except ConfigError as exc:
        print(f"sluice receiver: {exc}", file=sys.stderr)
        return 2
    except SluiceError as exc:
        print(f"sluice receiver: cannot start: {exc}", file=sys.stderr)
        return 1

    def on_signal(signum: int, _frame: Any) -> None:
        service.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    print(f"receiver {service.member_id} of site {cfg.site} (dsid {cfg.dsid})", flush=True)
    try:
        service.run()
    except SluiceError as exc:
        print(f"sluice receiver: crashed: {exc}", file=sys.stderr)
        return 1
    return 1 if service.state is ServiceState.CRASHED else 0
