"""The site file reference (docs/configuration.md) is generated from the configuration model and kept current."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from sluice.core.config import SiteConfig
from sluice.core.configcli import config_reference

ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / "docs" / "configuration.md"


def sections(text: str) -> dict[str, str]:
    """The reference's ``## `path` `` sections by path ("" for the top level)."""
    out: dict[str, str] = {}
    for match in re.finditer(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S):
        heading = match.group(1)
        if heading == "Top level":
            out[""] = match.group(2)
        elif heading.startswith("`"):
            out[heading.strip("`")] = match.group(2)
    return out


def model_sections(model: type[BaseModel], path: str = "") -> list[tuple[str, type[BaseModel]]]:
    """Every section of the site file by its path, walked independently of the generator."""
    out = [(path, model)]
    for name, field in model.model_fields.items():
        annotation = field.annotation
        inner = [a for a in (annotation, *getattr(annotation, "__args__", ()))
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if inner:
            where = f"{path}.{name}" if path else name
            is_list = getattr(annotation, "__origin__", None) is tuple
            out += model_sections(inner[0], where + ("[]" if is_list else ""))
    return out


def test_checked_in_reference_is_what_the_command_generates_now() -> None:
    """docs/configuration.md equals `sluice config reference`'s output; a model change needs `make docs`."""
    generated = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "config", "reference"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert generated == config_reference()
    assert CHECKED_IN.is_file(), "docs/configuration.md is missing: run `make docs` and commit it"
    assert CHECKED_IN.read_text(encoding="utf-8") == generated, (
        "docs/configuration.md is out of date with services/core/config/: run `make docs` and commit the result"
    )


def test_every_field_of_every_section_has_a_row_with_a_description() -> None:
    """Each model field appears in its section's table, described, with its default and Geode/Kafka name."""
    found = sections(config_reference())
    expected = model_sections(SiteConfig)
    assert [path for path, _ in expected] == list(found)
    for path, model in expected:
        for name, field in model.model_fields.items():
            rows = [line for line in found[path].splitlines() if line.startswith(f"| `{name}` |")]
            assert len(rows) == 1, f"{path or 'top level'}.{name} has no row in the reference"
            assert field.description, f"{path or 'top level'}.{name} has no description in the model"
            assert rows[0].rstrip(" |").endswith(field.description.replace("|", "\\|"))


def test_geode_and_kafka_names_come_from_the_model() -> None:
    """The Geode attribute names live in the model (json_schema_extra) and reach the reference's rows."""
    rows = {}
    for path, text in sections(config_reference()).items():
        for line in text.splitlines():
            match = re.match(r"^\| `(\w+)` \|", line)
            if match:
                rows[f"{path}.{match.group(1)}" if path else match.group(1)] = line
    for key, name in (
        ("dsid", "`distributed-system-id`"),
        ("gateway_senders[].batch_size", "`batch-size`"),
        ("gateway_senders[].batch_time_interval_ms", "`batch-time-interval`"),
        ("gateway_senders[].remote_dsid", "`remote-distributed-system-id`"),
        ("async_event_queues[].batch_time_interval_ms", "`batch-time-interval`"),
        ("regions[].buckets", "`total-num-buckets`"),
        ("subscriptions.durable_client_timeout_s", "`durable-client-timeout`"),
        ("subscriptions.maximum_time_between_pings_ms", "`maximum-time-between-pings`"),
        ("kafka.session_timeout_ms", "Kafka `session.timeout.ms`"),
    ):
        assert name in rows[key], key
    assert "| `5` |" in rows["async_event_queues[].batch_time_interval_ms"]  # Geode's AEQ default, not the sender's
    assert "| `1000` |" in rows["gateway_senders[].batch_time_interval_ms"]
    assert "| 1 to 255 |" in rows["dsid"]


def test_links_to_sections_point_at_headings() -> None:
    """Every in-page link names an anchor GitHub makes from one of the headings."""
    text = config_reference()
    anchors = {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
               for heading in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    links = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert links and links <= anchors, links - anchors


def test_reference_command_writes_the_file_and_has_an_example(tmp_path: Path) -> None:
    """`sluice config reference -o FILE` writes the same text; its --help shows an example."""
    out = tmp_path / "configuration.md"
    subprocess.run([sys.executable, "-m", "sluice.cli", "config", "reference", "-o", str(out)], cwd=ROOT, check=True)
    assert out.read_text(encoding="utf-8") == config_reference()
    usage = subprocess.run([sys.executable, "-m", "sluice.cli", "config", "reference", "--help"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout
    assert "examples:" in usage and "make docs" in usage
