"""The fault harness in CI: two real sites (embedded Apache Kafka, every service a process) under load, a
kill -9 of every service type, a paused broker, a killed broker, a restarted site, a hanging receiver and
corrupt records, then the convergence check, read from the sites: nothing lost, nothing applied twice."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from sluice.broker import resolve_engine
from sluice.verify.sites import SESSION_TIMEOUT_MS
from sluice.verify.soak import KILLS, run_soak

pytestmark = pytest.mark.skipif(resolve_engine("auto", notice=False) != "kafka",
                                reason="the fault harness needs the embedded Apache Kafka (a JDK): Tansu lists "
                                       "no group members, so instances cannot take over each other's work")

#: Seconds after the writers start → fault.  Every kill -9 type first, then the broker and site faults.
PLAN = [
    (4, "kill-parallel"), (10, "kill-region"), (16, "kill-serial"), (22, "kill-receiver"),
    (28, "kill-dispatcher"), (34, "kill-subscriptions"), (40, "pause-broker"), (50, "corrupt"),
    (53, "kill-broker"), (66, "restart-site"), (79, "hang-receiver"),
]


# The long tier (`make test-long`, CI, and `make soak` for longer), alone after its parallel part: most faults
# it injects are proved in `make test` by a test of their own; tests/README.md ("The long tier") names which,
# and those only this run injects.
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.serial  # bounds in seconds on every failover: runs alone (make test)
def test_every_fault_under_load_loses_nothing_and_applies_nothing_twice(tmp_path: Path) -> None:
    console = Console(width=160, record=True, force_terminal=False)
    report = run_soak(seed=11, minutes=1.5, faults=[f for _, f in PLAN], interval_s=6, plan=PLAN,
                      listener_failures=0.1, rate_per_s=100, console=console, workdir=tmp_path)
    shown = console.export_text()
    f = report.figures
    print(shown[-6000:])

    injected = [item["fault"] for item in report.faults]
    assert injected == [fault for _, fault in PLAN]
    assert report.crashed == [], report.crashed
    assert f["operations_acknowledged"] > 1000
    # Nothing lost, nothing applied twice or out of order, no key different between the sites, judged per key
    # by the history checker over both changelogs and the ledger listener.
    assert (f["lost"], f["applied_twice"], f["reordered"], f["divergent_keys"]) == (0, 0, 0, 0), shown[-6000:]
    assert report.ok, report.problems
    # The listener failed on purpose, and the queue offered those batches again.
    assert f["listener_failures_injected"] > 0
    assert f["delivered_to_listeners"]["orders-ledger (ledger listener)"] > 1000
    # Every corrupt record was dead-lettered with its reason, and nothing else was.
    assert f["corrupt_injected"] == 3 and f["corrupt_not_dead_lettered"] == 0
    assert f["dead_lettered"] >= 3
    # The one written into an inbound topic carries no signature, and is refused for that before it is read.
    assert {d["error_class"] for d in report.dead_lettered} <= {"MalformedRecord", "BadSignature"}, \
        report.dead_lettered
    assert sum(d["count"] for d in report.dead_lettered if d["error_class"] == "BadSignature") <= 1, \
        report.dead_lettered
    # Each kill -9 of a primary: its work resumed elsewhere; the time is reported.
    kills = [item for item in report.failovers]
    assert len(kills) == len(KILLS)
    assert all(item["seconds"] is not None for item in kills), kills
    assert f["failover_max_s"] < SESSION_TIMEOUT_MS / 1000 + 12, kills
