"""``sluice config check`` and ``sluice topics apply``.

Thin commands over ``config.load_config`` and ``topics.apply_topics``: they
parse arguments, call one function, and print its result as a table.
``add_parsers`` adds both to the CLI's subparsers; each parser's ``func``
default is the function that runs it and returns the exit status.

Exit status: 0 all good; 1 the site file is invalid, or a topic disagrees
with it; 2 Kafka cannot be reached.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .config import SiteConfig, load_config
from .errors import BrokerUnavailable, ConfigError, KafkaFatal
from .kafka import make_admin
from .topics import TopicReport, apply_topics

__all__ = ["add_parsers", "main", "run_config_check", "run_topics_apply"]

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_UNREACHABLE = 2

_CHECK_EXAMPLE = """\
examples:
  sluice config check deploy/sites/site-a.yaml

  A valid file prints a summary of the site (regions, their buckets and
  attached queues, senders, async event queues) and exits 0.  An invalid one
  prints every problem, one per row, and exits 1:

    field                           value  reason
    gateway_senders[0].batch_size   0      must be >= 1
"""

_APPLY_EXAMPLE = """\
examples:
  sluice topics apply -c deploy/sites/site-a.yaml --dry-run
  sluice topics apply -c deploy/sites/site-a.yaml
  sluice topics apply -c deploy/sites/site-a.yaml --bootstrap 127.0.0.1:29092

  Creates the topics the site file implies that are missing.  An existing
  topic whose partition count or cleanup.policy differs is reported as a
  mismatch and never changed.  Running it twice is harmless.

exit status: 0 every topic matches; 1 the file is invalid or a topic
mismatches; 2 Kafka cannot be reached.
"""


def add_parsers(subparsers: Any) -> None:
    """Add ``config check`` and ``topics apply`` to an argparse subparsers object."""
    config = subparsers.add_parser("config", help="work with site files", description="Work with site files.")
    config_sub = config.add_subparsers(dest="config_command", metavar="COMMAND", required=True)
    check = config_sub.add_parser(
        "check",
        help="validate a site file",
        description="Validate a site file (YAML or TOML) and show every problem, or a summary of the site.",
        epilog=_CHECK_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("file", metavar="FILE", help="site file (.yaml, .yml or .toml)")
    check.set_defaults(func=run_config_check)

    topics = subparsers.add_parser("topics", help="manage a site's Kafka topics", description="Manage a site's topics.")
    topics_sub = topics.add_subparsers(dest="topics_command", metavar="COMMAND", required=True)
    apply = topics_sub.add_parser(
        "apply",
        help="create the topics a site file implies",
        description="Create the Kafka topics a site file implies; report, never alter, ones that disagree.",
        epilog=_APPLY_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    apply.add_argument("-c", "--config", required=True, metavar="FILE", help="site file (.yaml, .yml or .toml)")
    apply.add_argument("--dry-run", action="store_true", help="show what would be created, create nothing")
    apply.add_argument(
        "--bootstrap", metavar="HOST:PORT", help="use these bootstrap servers instead of the file's kafka.bootstrap_servers"
    )
    apply.add_argument(
        "--timeout", type=float, metavar="SECONDS", help="how long to wait for Kafka (default: kafka.request_timeout_ms)"
    )
    apply.set_defaults(func=run_topics_apply)


def _console(stderr: bool = False) -> Console:
    # Built per call, on the current sys.stdout/stderr, so redirection and
    # test capture see the output.  Wide enough that field paths never wrap.
    return Console(file=sys.stderr if stderr else sys.stdout, width=max(_width(), 100), highlight=False)


def _width() -> int:
    return shutil.get_terminal_size((120, 24)).columns


def print_problems(error: ConfigError, console: Console | None = None) -> None:
    """Print a ConfigError's problems as a table: field | value | reason."""
    console = console or _console()
    count = len(error.problems)
    console.print(Text(f"{error.source or 'configuration'}: {count} problem{'s' if count != 1 else ''}", style="bold red"))
    table = Table(show_lines=False, header_style="bold")
    table.add_column("field", no_wrap=True, min_width=max((len(f) for f, _, _ in error.problems), default=5))
    table.add_column("value", overflow="fold", max_width=40)
    table.add_column("reason", overflow="fold")
    for field, value, reason in error.problems:
        table.add_row(Text(field or "(file)"), Text(_show(value)), Text(reason))
    console.print(table)


def _show(value: Any) -> str:
    if value is None:
        return "—"
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def print_summary(cfg: SiteConfig, source: str, console: Console | None = None) -> None:
    """Print what a valid site file describes."""
    console = console or _console()
    console.print(
        Text(
            f"{source}: valid — site {cfg.site} (dsid {cfg.dsid}), Kafka {cfg.kafka.bootstrap_servers} "
            f"({cfg.kafka.security_protocol}), topic prefix {cfg.kafka.topic_prefix!r}",
            style="bold green",
        )
    )
    regions = Table(title="regions", title_justify="left", header_style="bold")
    regions.add_column("region")
    regions.add_column("buckets", justify="right")
    regions.add_column("attached queues (partitions)")
    for region in cfg.regions:
        queues = ", ".join(
            f"{q.id} ({'sender' if q.kind == 'gateway-sender' else 'AEQ'}, "
            f"{'parallel' if q.parallel else 'serial'}, {q.partitions})"
            for q in cfg.attached_queues(region.name)
        )
        regions.add_row(Text(region.name), str(region.buckets), Text(queues or "—"))
    console.print(regions)

    if cfg.gateway_senders:
        senders = Table(title="gateway senders", title_justify="left", header_style="bold")
        for column in ("id", "remote dsid", "mode", "batch size", "batch interval ms", "dispatchers", "order", "regions"):
            senders.add_column(column)
        for s in cfg.gateway_senders:
            senders.add_row(
                Text(s.id),
                str(s.remote_dsid),
                "parallel" if s.parallel else "serial",
                str(s.batch_size),
                str(s.batch_time_interval_ms),
                str(s.dispatcher_threads),
                s.order_policy,
                Text(", ".join(r.name for r in cfg.regions_of(s.id)) or "— (none attached)"),
            )
        console.print(senders)

    if cfg.async_event_queues:
        queues = Table(title="async event queues", title_justify="left", header_style="bold")
        for column in ("id", "mode", "batch size", "batch interval ms", "dispatchers", "order", "listener", "regions"):
            queues.add_column(column)
        for q in cfg.async_event_queues:
            listener = "—"
            if q.listener is not None:
                listener = q.listener.type + (f" {q.listener.class_path}" if q.listener.class_path else "")
            queues.add_row(
                Text(q.id),
                "parallel" if q.parallel else "serial",
                str(q.batch_size),
                str(q.batch_time_interval_ms),
                str(q.dispatcher_threads),
                q.order_policy,
                Text(listener),
                Text(", ".join(r.name for r in cfg.regions_of(q.id)) or "— (none attached)"),
            )
        console.print(queues)

    if cfg.receiver is not None:
        accepted = ", ".join(str(d) for d in cfg.receiver.accepted_dsids) or "none"
        console.print(
            Text(f"receiver: {cfg.receiver.inbound_partitions} inbound partitions, accepts dsids {accepted}")
        )
    else:
        console.print(Text("receiver: none (this site takes no events from other sites)"))
    rs = cfg.region_service
    console.print(Text(f"region service: {rs.host}:{rs.port}"))


_ACTION_STYLE = {"created": "green", "exists": "dim", "mismatch": "bold red", "would create": "yellow"}


def print_report(report: TopicReport, console: Console | None = None) -> None:
    """Print a TopicReport as a table with a one-line summary."""
    console = console or _console()
    table = Table(header_style="bold")
    table.add_column("topic", no_wrap=True, min_width=max((len(r.name) for r in report.results), default=5))
    table.add_column("partitions", justify="right")
    table.add_column("cleanup")
    table.add_column("action", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for r in report.results:
        table.add_row(
            Text(r.name),
            str(r.spec.partitions),
            r.spec.cleanup_policy,
            Text(r.action, style=_ACTION_STYLE[r.action]),
            Text(r.detail),
        )
    console.print(table)
    counts: dict[str, int] = {}
    for r in report.results:
        counts[r.action] = counts.get(r.action, 0) + 1
    summary = ", ".join(f"{n} {action}" for action, n in counts.items())
    style = "bold green" if report.ok else "bold red"
    verdict = "ok" if report.ok else "MISMATCH: existing topics disagree with the file and were left unchanged"
    console.print(Text(f"{report.bootstrap}: {len(report.results)} topics ({summary}) — {verdict}", style=style))


def run_config_check(args: argparse.Namespace) -> int:
    """``sluice config check FILE``: 0 when valid (summary printed), 1 with every problem printed."""
    try:
        cfg = load_config(args.file)
    except ConfigError as error:
        print_problems(error)
        return EXIT_INVALID
    print_summary(cfg, args.file)
    return EXIT_OK


def run_topics_apply(args: argparse.Namespace) -> int:
    """``sluice topics apply -c FILE``: 0 all match, 1 invalid file or mismatch, 2 Kafka unreachable."""
    overrides = {"kafka": {"bootstrap_servers": args.bootstrap}} if getattr(args, "bootstrap", None) else None
    try:
        cfg = load_config(args.config, overrides=overrides)
    except ConfigError as error:
        print_problems(error)
        return EXIT_INVALID
    bootstrap = cfg.kafka.bootstrap_servers
    try:
        # log_level 2 keeps librdkafka's own connection-refused lines off the
        # terminal; the failure is reported once, below, in our words.
        admin = make_admin({**cfg.kafka.client_settings(), "log_level": 2})
        report = apply_topics(cfg, admin=admin, dry_run=args.dry_run, timeout_s=getattr(args, "timeout", None))
    except (BrokerUnavailable, KafkaFatal) as exc:
        _console(stderr=True).print(
            Text(f"cannot reach Kafka at {bootstrap} (kafka.bootstrap_servers of {args.config}): {exc}", style="bold red")
        )
        return EXIT_UNREACHABLE
    print_report(report)
    return EXIT_OK if report.ok else EXIT_INVALID


def main(argv: list[str] | None = None) -> int:
    """Run the two commands on their own: ``python -m sluice.core.configcli config check FILE``."""
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice site configuration and topics.")
    add_parsers(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
