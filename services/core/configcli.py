"""``sluice config check``, ``sluice config reference``, ``sluice keys generate`` and ``sluice topics apply``.

Thin commands over ``config.load_config`` and ``topics.apply_topics``: they
parse arguments, call one function, and print its result as a table.
``config reference`` prints the site file's reference in Markdown, generated
from the configuration model itself (every field's type, default,
constraints, description and Geode or Kafka name), which is what
docs/configuration.md holds.  ``add_parsers`` adds them to the CLI's
subparsers; each parser's ``func`` default is the function that runs it and
returns the exit status.

Exit status: 0 all good; 1 the site file is invalid, or a topic disagrees
with it; 2 Kafka cannot be reached.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rich.console import Console
from rich.table import Table
from rich.text import Text

from . import sitekeys
from .config import _PATTERN_REASONS, SITE_PATTERN, SiteConfig, load_config
from .errors import BrokerUnavailable, ConfigError, KafkaFatal
from .kafka import make_admin
from .topics import TopicReport, apply_topics

__all__ = ["add_parsers", "config_reference", "main", "run_config_check", "run_config_reference", "run_keys_generate",
           "run_topics_apply"]

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

_REFERENCE_EXAMPLE = """\
examples:
  sluice config reference                        # print it
  sluice config reference -o docs/configuration.md

  Every key of a site file, section by section: its type, default,
  constraints, description and the Geode attribute (or Kafka client
  setting) it stands for, in Markdown:

    | key | type | default | constraints | Geode / Kafka | description |
    |---|---|---|---|---|---|
    | `batch_size` | integer | `100` | >= 1 | `batch-size` | a batch is sent when ... |

  `make docs` regenerates docs/configuration.md with it.
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
    reference = config_sub.add_parser(
        "reference",
        help="print the site file reference (Markdown)",
        description="Print the reference of every site file key, generated from the configuration model, "
        "as Markdown (docs/configuration.md).",
        epilog=_REFERENCE_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    reference.add_argument("-o", "--output", metavar="FILE", help="write it to FILE instead of standard output")
    reference.set_defaults(func=run_config_reference)

    keys = subparsers.add_parser("keys", help="make a site's gateway key pair",
                                 description="Make a site's Ed25519 key pair for signing gateway batches and acks.")
    keys_sub = keys.add_subparsers(dest="keys_command", metavar="COMMAND", required=True)
    generate = keys_sub.add_parser(
        "generate",
        help="write a new key pair: SITE.key (private, mode 0600) and SITE.pub",
        description="Write a new Ed25519 key pair: DIR/SITE.key, the private key (gateway_private_key_file of "
        "this site's file, mode 0600), and DIR/SITE.pub, the public key (gateway_public_keys_file of every other "
        "site's file). Refuses to overwrite an existing key.",
        epilog=_KEYS_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    generate.add_argument("--site", required=True, metavar="NAME", help="the site's name: names the two files")
    generate.add_argument("--out-dir", default=".", metavar="DIR", help="where to write them (default: .)")
    generate.set_defaults(func=run_keys_generate)

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
    # Where each secret comes from, never its value.
    for field, source in cfg.secret_sources():
        console.print(Text(f"secret {field}: from {source}"))


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


# --- the site file reference (sluice config reference) ------------------------

_REFERENCE_INTRO = """\
# Site file reference

<!-- Generated by `sluice config reference` from services/core/config/.
     Do not edit by hand: change the model, then run `make docs`. -->

One file per site, YAML (`.yaml`, `.yml`) or TOML (`.toml`); `sluice config
check FILE` validates one and names every problem with its field, value and
reason. Keys use `_`; unknown keys are errors. Values are strict: a quoted
`"8"` is not a number and `yes` is not a boolean. Relative file paths are
taken from the site file's folder. What is left out takes its default, which
is Geode's wherever Geode has the setting (the **Geode / Kafka** column names
Geode's cache.xml attribute, or the Kafka client setting the key becomes).
`deploy/sites/site-a.yaml` and `site-b.yaml` are commented examples.

## Secrets

Every secret — `kafka.sasl_password`, `kafka.ssl_key_password` (and the same
in a gateway sender's `remote`), `region_service.token`,
`region_service.member_token`, `subscriptions.token`, `gateway_private_key` —
can be given in one of three ways, at most one at a time:

| form | example | notes |
|---|---|---|
| the value, `X` | `sasl_password: "s3cret"` | keep the site file itself secret (the chart's `siteFileStorage: Secret`) |
| a file, `X_file` | `sasl_password_file: /etc/sluice/kafka/password` | e.g. a mounted Kubernetes secret; its content without the trailing newline |
| an environment variable, `X_env` | `sasl_password_env: KAFKA_PASSWORD` | the variable's name, e.g. set from a Kubernetes secret (`env[].valueFrom.secretKeyRef`); it must be set and not empty |

The Kafka passwords are read from their file or variable each time a Kafka
client is made, so a rotated mounted secret reaches the next client; the
tokens and the private key are read once, when the site file is loaded (a
service loads it when it starts). A file or variable that is missing or
empty is an error naming the field and the file or variable, never the
value: secrets appear in no output of `sluice`, no error message and no log
(`**********` stands for them).

The other sites' public keys are not secret: `gateway_public_keys` maps a
dsid to a key, and `gateway_public_keys_file` maps a dsid to a file holding
one; each dsid's key is in one of the two. `sluice keys generate --site NAME`
makes a site's key pair. docs/security.md says who holds which credential.

```yaml
kafka:
  security_protocol: SASL_SSL
  sasl_mechanism: SCRAM-SHA-512
  sasl_username: sluice-site-a
  sasl_password_env: KAFKA_PASSWORD
region_service:
  token_env: REGION_TOKEN
  member_token_env: REGION_MEMBER_TOKEN
receiver:
  accepted_dsids: [2]
gateway_private_key_file: /etc/sluice/keys/site-a.key
gateway_public_keys_file: {2: /etc/sluice/keys/site-b.pub}
```
"""

_SCALARS = {bool: "boolean", int: "integer", float: "number", str: "string", SecretStr: "secret"}


def config_reference() -> str:
    """The reference of every site file key, in Markdown, generated from ``SiteConfig`` and its sections."""
    sections = _sections(SiteConfig, "")
    lines = [_REFERENCE_INTRO, "## Sections", ""]
    lines += [f"- [{_heading(path)}](#{_slug(_heading(path))}): {_docstring(model)}" for path, model in sections]
    for path, model in sections:
        lines += ["", f"## {_heading(path)}", "", _docstring(model), ""]
        lines += ["| key | type | default | constraints | Geode / Kafka | description |", "|---|---|---|---|---|---|"]
        for name, field in model.model_fields.items():
            cells = [
                f"`{name}`",
                _type_name(field.annotation, path, name),
                _default(field),
                _constraints(field),
                _foreign_name(field),
                field.description or "",
            ]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _sections(model: type[BaseModel], path: str) -> list[tuple[str, type[BaseModel]]]:
    """``model`` and every section inside it, depth first, each with its path in the file."""
    out = [(path, model)]
    for name, field in model.model_fields.items():
        inner = _model_in(field.annotation)
        if inner is not None:
            where = f"{path}.{name}" if path else name
            out += _sections(inner, where + ("[]" if _is_list(field.annotation) else ""))
    return out


def _heading(path: str) -> str:
    return f"`{path}`" if path else "Top level"


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _docstring(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def _type_name(annotation: Any, path: str, name: str) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _type_name(args[0], path, name) if len(args) == 1 else " or ".join(
            _type_name(a, path, name) for a in args)
    if origin is typing.Annotated:
        inner, *metadata = typing.get_args(annotation)
        limits = _limits([m for info in metadata if isinstance(info, FieldInfo) for m in info.metadata])
        return _type_name(inner, path, name) + (f" ({limits})" if limits else "")
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{choice}`" for choice in typing.get_args(annotation))
    if origin is tuple:
        return "list of " + _type_name(args[0], path, name).replace("[section]", "[sections]")
    if origin is dict:
        key, value = typing.get_args(annotation)
        if value is Any:
            return "mapping"
        return f"map of {_type_name(key, path, name)} → {_type_name(value, path, name)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        where = f"{path}.{name}" if path else name
        if _is_list(annotation):
            where += "[]"
        return f"[section](#{_slug(_heading(where))})"
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is tuple


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
        return "see the section" if isinstance(value, BaseModel) else _literal(value)
    return "unset" if field.default is None or field.default is PydanticUndefined else _literal(field.default)


def _literal(value: Any) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, (tuple, list)):
        return "`[]`" if not value else f"`{list(value)}`"
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{value}`"


def _constraints(field: FieldInfo) -> str:
    return _limits(field.metadata, unit="items" if _is_list(field.annotation) else "characters")


def _limits(metadata: list[Any], unit: str = "characters") -> str:
    """Human words for pydantic's constraints (annotated_types' Ge, Le, MinLen …, and patterns)."""
    bounds: dict[str, Any] = {}
    words: list[str] = []
    for item in metadata:
        for attribute in ("ge", "gt", "le", "lt", "min_length", "max_length"):
            if getattr(item, attribute, None) is not None:
                bounds[attribute] = getattr(item, attribute)
        pattern = getattr(item, "pattern", None)
        if pattern is not None:
            words.append(_PATTERN_REASONS.get(pattern, f"matches `{pattern}`"))
    if "ge" in bounds and "le" in bounds:
        words.insert(0, f"{bounds.pop('ge')} to {bounds.pop('le')}")
    templates = {"ge": ">= {}", "gt": "> {}", "le": "<= {}", "lt": "< {}",
                 "min_length": "at least {} {}", "max_length": "at most {} {}"}
    shown = [templates[name].format(value, unit if value != 1 else unit.removesuffix("s"))
             for name, value in bounds.items()]
    return "; ".join(shown + words)


def _foreign_name(field: FieldInfo) -> str:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    names = []
    if "geode" in extra:
        geode = str(extra["geode"])
        names.append(geode if " " in geode else f"`{geode}`")
    if "kafka" in extra:
        names.append(f"Kafka `{extra['kafka']}`")
    return ", ".join(names)


_KEYS_EXAMPLE = """\
example:
  sluice keys generate --site site-a --out-dir keys/
  # keys/site-a.key  ->  site-a's file:  gateway_private_key_file: keys/site-a.key
  # keys/site-a.pub  ->  site-b's file:  gateway_public_keys_file: {1: keys/site-a.pub}
"""


def run_keys_generate(args: argparse.Namespace) -> int:
    """``sluice keys generate --site NAME [--out-dir DIR]``: 0, or 1 when a key file is already there."""
    if not re.match(SITE_PATTERN, args.site):
        _console(stderr=True).print(f"--site {args.site!r}: {_PATTERN_REASONS[SITE_PATTERN]}")
        return EXIT_INVALID
    folder = Path(args.out_dir)
    private_path, public_path = folder / f"{args.site}.key", folder / f"{args.site}.pub"
    for path in (private_path, public_path):
        if path.exists():
            _console(stderr=True).print(f"{path}: already exists; a key is never overwritten (remove it first)")
            return EXIT_INVALID
    folder.mkdir(parents=True, exist_ok=True)
    private, public = sitekeys.generate()
    # Created 0600 from the start: the private key is never readable by others, not even for a moment.
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(private + "\n")
    public_path.write_text(public + "\n", encoding="ascii")
    print(f"private key: {private_path} (mode 0600; this site's gateway_private_key_file)")
    print(f"public key:  {public_path} (the other sites' gateway_public_keys_file)")
    print(f"public key:  {public}")
    return EXIT_OK


def run_config_reference(args: argparse.Namespace) -> int:
    """``sluice config reference [-o FILE]``: print (or write) the site file reference; always 0."""
    text = config_reference()
    if getattr(args, "output", None):
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Run these commands on their own: ``python -m sluice.core.configcli config check FILE``."""
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice site configuration and topics.")
    add_parsers(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
