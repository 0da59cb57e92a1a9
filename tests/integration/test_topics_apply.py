"""``apply_topics`` and the two commands against a real broker.

Each test loads the example site A pointed at the ``site_a`` broker with a
fresh topic prefix, so tests never see each other's topics.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from sluice.core.config import SiteConfig, load_config
from sluice.core.configcli import run_config_check, run_topics_apply
from sluice.core.kafka import AdminClient, ConfigResource, NewTopic, ResourceType, make_admin, wait_futures
from sluice.core.topics import apply_topics, plan_topics

from waiting import wait_for

#: How long a deleted topic may stay listed.
DELETION_S = 15

if TYPE_CHECKING:
    from conftest import Site

ROOT = Path(__file__).resolve().parents[2]
SITE_A = ROOT / "deploy" / "sites" / "site-a.yaml"


@pytest.fixture
def cfg(site_a: Site, unique_prefix: str) -> SiteConfig:
    """Site A on the test broker, with topics no other test uses."""
    return load_config(
        SITE_A,
        overrides={"kafka": {"bootstrap_servers": site_a.bootstrap, "topic_prefix": site_a.topic_prefix(unique_prefix)}},
    )


@pytest.fixture
def admin(site_a: Site) -> AdminClient:
    return make_admin(site_a.client_config())


def topic_state(admin: AdminClient, prefix: str) -> dict[str, tuple[int, str]]:
    """(partitions, cleanup.policy) of every topic whose name starts with ``prefix``."""
    topics = admin.list_topics(timeout=10).topics
    names = [name for name in topics if name.startswith(prefix)]
    if not names:
        return {}
    futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, n) for n in names], request_timeout=10)
    described = wait_futures(futures, "describing", 10)
    return {
        resource.name: (len(topics[resource.name].partitions), entries["cleanup.policy"].value)
        for resource, entries in described.items()
    }


def create_topic(admin: AdminClient, name: str, partitions: int, config: dict[str, str] | None = None) -> None:
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1, config=config or {})])
    wait_futures(futures, "creating", 15)


def apply_args(config: Path, **changes: Any) -> argparse.Namespace:
    """The namespace `topics apply -c CONFIG` parses to, with ``changes``."""
    values: dict[str, Any] = {"config": str(config), "dry_run": False, "bootstrap": None, "timeout": 10.0}
    values.update(changes)
    return argparse.Namespace(**values)


def test_apply_creates_every_planned_topic_and_is_idempotent(cfg: SiteConfig, admin: AdminClient) -> None:
    """A first apply creates every planned topic as planned; a second creates nothing and reports all "exists"."""
    plan = plan_topics(cfg)
    first = apply_topics(cfg)
    assert first.ok
    assert [(r.name, r.action) for r in first.results] == [(s.name, "created") for s in plan]

    state = topic_state(admin, cfg.kafka.topic_prefix)
    assert state == {s.name: (s.partitions, s.cleanup_policy) for s in plan}

    second = apply_topics(cfg, admin=admin)
    assert second.ok
    assert {r.action for r in second.results} == {"exists"}
    assert topic_state(admin, cfg.kafka.topic_prefix) == state


def test_dry_run_creates_nothing(cfg: SiteConfig, admin: AdminClient) -> None:
    """--dry-run reports "would create" for missing topics and leaves the cluster untouched."""
    report = apply_topics(cfg, admin=admin, dry_run=True)
    assert report.ok and report.dry_run
    assert {r.action for r in report.results} == {"would create"}
    assert topic_state(admin, cfg.kafka.topic_prefix) == {}


def test_wrong_partition_count_is_reported_and_left_alone(cfg: SiteConfig, admin: AdminClient) -> None:
    """An existing topic with another partition count is a mismatch (ok False), never altered; the rest are created."""
    changelog = cfg.topics.region_changelog("orders")
    create_topic(admin, changelog, partitions=3, config={"cleanup.policy": "compact"})

    report = apply_topics(cfg, admin=admin)
    assert not report.ok
    result = report[changelog]
    assert result.action == "mismatch"
    (mismatch,) = result.mismatches
    assert (mismatch.topic, mismatch.field, mismatch.expected, mismatch.actual) == (changelog, "partitions", 8, 3)
    assert "partitions is 3, configuration needs 8" in result.detail
    assert {r.action for r in report.results if r.name != changelog} == {"created"}

    assert topic_state(admin, cfg.kafka.topic_prefix)[changelog] == (3, "compact")
    # Still a mismatch the next time: nothing was "fixed" behind the user's back.
    assert not apply_topics(cfg, admin=admin).ok


def test_wrong_cleanup_policy_is_reported(cfg: SiteConfig, admin: AdminClient) -> None:
    """A removals topic that is not compacted is a mismatch on cleanup.policy and keeps its policy."""
    removals = cfg.topics.removals("orders-jdbc")
    create_topic(admin, removals, partitions=1, config={"cleanup.policy": "delete"})

    report = apply_topics(cfg, admin=admin)
    assert not report.ok
    assert [(m.field, m.expected, m.actual) for m in report[removals].mismatches] == [
        ("cleanup.policy", "compact", "delete")
    ]
    assert topic_state(admin, cfg.kafka.topic_prefix)[removals] == (1, "delete")


def write_site(tmp_path: Path, cfg: SiteConfig) -> Path:
    """Site A's file, pointed at the test broker and prefix (what `topics apply -c` reads)."""
    text = SITE_A.read_text()
    text = text.replace('bootstrap_servers: "127.0.0.1:9092"', f'bootstrap_servers: "{cfg.kafka.bootstrap_servers}"')
    text = text.replace('topic_prefix: "site-a."', f'topic_prefix: "{cfg.kafka.topic_prefix}"')
    path = tmp_path / "site-a.yaml"
    path.write_text(text)
    assert load_config(path) == cfg
    return path


def test_topics_apply_command_exit_status(
    cfg: SiteConfig, admin: AdminClient, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`topics apply` exits 0 when every topic matches and 1 on a mismatch, printing the topics as a table."""
    path = write_site(tmp_path, cfg)
    inbound = cfg.topics.gateway_inbound()
    create_topic(admin, inbound, partitions=2)

    assert run_topics_apply(apply_args(path)) == 1
    out = capsys.readouterr().out
    assert inbound in out and "mismatch" in out and "MISMATCH" in out

    admin.delete_topics([inbound], operation_timeout=15)[inbound].result(timeout=15)
    _wait_gone(admin, inbound)
    assert run_topics_apply(apply_args(path)) == 0
    out = capsys.readouterr().out
    assert "created" in out and "ok" in out


def _wait_gone(admin: AdminClient, topic: str) -> None:
    wait_for(lambda: topic not in admin.list_topics(timeout=10).topics, timeout_s=DELETION_S,
             what=f"{topic} no longer listed after its deletion")


def test_topics_apply_command_unreachable_kafka(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`topics apply` exits 2 with a message naming the bootstrap when Kafka cannot be reached."""
    assert run_topics_apply(apply_args(SITE_A, bootstrap="127.0.0.1:1", timeout=2.0)) == 2
    err = capsys.readouterr().err
    assert "cannot reach Kafka at 127.0.0.1:1" in err


BAD_SITE = """\
    site: site-a
    dsid: 1
    kafka:
      bootstrap_servers: "127.0.0.1:9092"
    regions:
      - name: orders
        gateway_senders: [to-b]
    gateway_senders:
      - id: to-b
        remote_dsid: 2
        batch_size: 0
    """


def test_config_check_reports_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`config check` on a bad file exits 1 and prints the field, value and reason; on a good one, 0 and a summary."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent(BAD_SITE))
    assert run_config_check(argparse.Namespace(file=str(bad))) == 1
    out = capsys.readouterr().out
    assert "gateway_senders[0].batch_size" in out and "must be >= 1" in out and "1 problem" in out

    assert run_config_check(argparse.Namespace(file=str(SITE_A))) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "orders-to-site-b" in out and "orders-jdbc" in out


def test_config_check_in_a_subprocess(tmp_path: Path) -> None:
    """The command, run as a separate process, exits 1 on a bad file and prints the field."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent(BAD_SITE))
    code = (
        "import sys; from sluice.core.configcli import main; "
        f"sys.exit(main(['config', 'check', {str(bad)!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    assert "gateway_senders[0].batch_size" in done.stdout
