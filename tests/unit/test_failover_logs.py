"""Failover times read from service logs (sluice.verify.failover), and the soak's fault schedule."""

from __future__ import annotations

import random
import time
from pathlib import Path

from sluice.verify.failover import held, measure, percentile
from sluice.verify.soak import FAULTS, schedule


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f",{int(t * 1000) % 1000:03d}"


def _log(path: Path, lines: list[tuple[float, str]]) -> Path:
    path.write_text("".join(f"{_stamp(t)} INFO sluice.queue {msg}\n" for t, msg in lines)
                    + "%4|1795395325.409|SESSTMOUT|librdkafka line without a stamp\n")
    return path


def test_a_killed_sender_s_partitions_resume_when_the_last_one_is_dispatched_elsewhere(tmp_path: Path) -> None:
    t0 = 1_800_000_000.0
    victim = _log(tmp_path / "victim.log", [
        (t0 + 1, "queue q: primary for partitions [0, 1, 2, 3]"),
        (t0 + 2, "queue q: revoked partitions [0, 1, 2, 3]"),
        (t0 + 3, "queue q: primary for partitions [2, 3]"),
    ])
    killed = t0 + 10
    successor = _log(tmp_path / "successor.log", [
        (t0 + 4, "queue q[0]: first batch dispatched since taking the partition (batch 1)"),  # before the kill
        (killed + 3.2, "queue q[2]: first batch dispatched since taking the partition (batch 9)"),
        (killed + 3.9, "queue q[3]: first batch dispatched since taking the partition (batch 9)"),
    ])
    assert held("sender", victim, killed) == {"2", "3"}
    f = measure("sender", "q#0@a", victim, [successor], killed)
    assert f.held == ("2", "3") and f.seconds is not None and abs(f.seconds - 3.9) < 0.01


def test_a_part_that_never_resumes_leaves_the_failover_unmeasured(tmp_path: Path) -> None:
    t0 = 1_800_000_000.0
    victim = _log(tmp_path / "victim.log", [(t0, "assigned orders[0], orders[1]")])
    successor = _log(tmp_path / "successor.log", [
        (t0 + 5, "loaded orders[0]: 3 keys from offsets 0..9 (read in 0.01s), 0 re-enqueued, 0.01s in all")])
    f = measure("region", "region#0@a", victim, [successor], t0 + 1)
    assert f.held == ("orders[0]", "orders[1]") and f.seconds is None


def test_percentile_by_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 10.0], 1.0) == 10.0


def test_the_schedule_runs_every_fault_once_per_round_and_leaves_the_end_quiet() -> None:
    plan = schedule(list(FAULTS), minutes=10, interval_s=20, rng=random.Random(1))
    names = [f for _, f in plan]
    first_round = names[:len(FAULTS)]
    assert sorted(first_round) == sorted(FAULTS)
    assert all(at < 10 * 60 * 0.85 for at, _ in plan)
    assert [at for at, _ in plan] == sorted(at for at, _ in plan)
    assert plan == schedule(list(FAULTS), minutes=10, interval_s=20, rng=random.Random(1))
