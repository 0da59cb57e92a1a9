"""What every service command shares: the site-file options, logging, the site file itself."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys
from typing import Any, Callable

from .config import SiteConfig, load_config
from .errors import ConfigError, InvalidRequest, SluiceError


def add_site_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", required=True, help="site configuration file (YAML or TOML)")
    parser.add_argument("--bootstrap", help="override kafka.bootstrap_servers")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # One line per HTTP request between services (receiver → region service) drowns what matters.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))


def load_site(args: argparse.Namespace) -> SiteConfig:
    """The site file named by ``-c``, with ``--bootstrap`` applied; raises ConfigError."""
    cfg = load_config(args.config)
    if args.bootstrap:
        cfg = cfg.with_overrides({"kafka": {"bootstrap_servers": args.bootstrap}})
    return cfg


def run_loop_service(command: str, args: argparse.Namespace, build: Callable[[SiteConfig], Any],
                     banner: Callable[[Any, SiteConfig], str]) -> int:
    """Start a loop service (``start()``, ``run()``, ``stop()``), announce it with one line on
    stdout, and run it until SIGTERM or Ctrl-C.  Exit status: 0 stopped, 1 crashed or could not
    start, 2 bad configuration."""
    setup_logging(args.log_level)
    try:
        cfg = load_site(args)
        service = build(cfg)
        service.start()
    except (ConfigError, InvalidRequest) as exc:
        print(f"sluice {command}: {exc}", file=sys.stderr)
        return 2
    except SluiceError as exc:
        print(f"sluice {command}: cannot start: {exc}", file=sys.stderr)
        return 1

    def on_signal(signum: int, _frame: Any) -> None:
        service.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # `kill -USR1 PID` prints every thread's stack to stderr, for operators.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    print(banner(service, cfg), flush=True)
    try:
        service.run()
    except SluiceError as exc:
        print(f"sluice {command}: crashed: {exc}", file=sys.stderr)
        return 1
    return 1 if service.state.value == "crashed" else 0
