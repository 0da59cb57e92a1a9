"""What every service command shares: the site-file options, logging, the site file itself."""

from __future__ import annotations

import argparse
import logging
import sys

from .config import SiteConfig, load_config


def add_site_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", required=True, help="site configuration file (YAML or TOML)")
    parser.add_argument("--bootstrap", help="override kafka.bootstrap_servers")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING (default INFO)")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")


def load_site(args: argparse.Namespace) -> SiteConfig:
    """The site file named by ``-c``, with ``--bootstrap`` applied; raises ConfigError."""
    cfg = load_config(args.config)
    if args.bootstrap:
        cfg = cfg.with_overrides({"kafka": {"bootstrap_servers": args.bootstrap}})
    return cfg
