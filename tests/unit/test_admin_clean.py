"""``sluice admin start SENDER --clean-queues`` before it touches Kafka: confirmation, and flags out of place."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from sluice.admin.clean import CleanPlan, PartitionPlan, confirmed
from sluice.cli import main as sluice_main
from sluice.core.errors import InvalidRequest
from sluice.core.queueclean import CleanRequest


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def plan() -> CleanPlan:
    partitions = [PartitionPlan(0, 3, 10, 7), PartitionPlan(1, 0, 80_000, None)]
    return CleanPlan("to-b", "gateway-sender", partitions, CleanRequest.new([10, 80_000], "ops"))


def test_a_clean_start_goes_on_only_when_confirmed() -> None:
    """--yes confirms; at a terminal only "yes" does; without a terminal and without --yes it is refused, naming
    --yes; the question says how many events go (an upper bound where a partition was not counted)."""
    console = Console(file=io.StringIO(), width=200)
    assert confirmed(console, plan(), yes=True, stdin=io.StringIO(""))
    assert confirmed(console, plan(), yes=False, stdin=Terminal("yes\n"))
    assert not confirmed(console, plan(), yes=False, stdin=Terminal("y\n"))
    assert "Drop up to 80007 events of gateway sender to-b" in console.file.getvalue()  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequest) as refused:
        confirmed(console, plan(), yes=False, stdin=io.StringIO("yes\n"))
    assert refused.value.field == "--yes"


@pytest.mark.parametrize("args", [["stop", "to-b", "--clean-queues"], ["start", "to-b", "--yes"],
                                  ["pause", "to-b", "--clean-queues", "--yes"],
                                  ["start", "--receiver", "--clean-queues", "--yes"]])
def test_clean_queues_and_yes_go_with_start_of_a_queue_only(tmp_path: Path, args: list[str],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--clean-queues with another command, --yes without it, or with --receiver: exit 2 before anything is read."""
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump({
        "site": "a", "dsid": 1, "kafka": {"bootstrap_servers": "127.0.0.1:9"},
        "regions": [{"name": "orders", "buckets": 2, "gateway_senders": ["to-b"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2}], "receiver": {"accepted_dsids": [2]},
    }))
    assert sluice_main(["admin", "-c", str(path), *args]) == 2
    assert "--clean-queues goes with start QUEUE" in capsys.readouterr().err
