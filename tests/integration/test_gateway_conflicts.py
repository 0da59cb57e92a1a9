"""A↔B conflicting writes to the same keys: both sites converge on the winner the rule or the resolver picks."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from sluice.admin.cli import set_state
from sluice.client import RegionClient
from sluice.core.processes import ReceiverProcess, RegionProcess, SenderProcess

from regionkit import write_two_way_sites
from waiting import read_until, wait_for

pytestmark = pytest.mark.timeout(300)

#: How long both sites may take to converge once the senders run.
CONVERGE_S = 90

HERE = str(Path(__file__).resolve().parent)


def _sites(tmp_path: Path, bootstrap: str, prefix: str, resolver: str | None) -> dict[str, tuple[Path, Any]]:
    extra = {"gateway_conflict_resolver": resolver} if resolver else {}
    two = write_two_way_sites(tmp_path, bootstrap, prefix, buckets=4, a=extra, b=extra,
                              sender={"batch_size": 20, "batch_time_interval_ms": 20, "socket_read_timeout_ms": 10000})
    return {"a": (two.path_a, two.cfg_a), "b": (two.path_b, two.cfg_b)}


@pytest.mark.parametrize("resolver", [None, "conflict_resolvers:MaxOrMerge"], ids=["timestamp-rule", "resolver"])
def test_conflicting_writes_converge_on_the_winner_of_the_rule(resolver, site_a, unique_prefix, tmp_path: Path):
    """Both senders paused, A then B write every key; resumed, both sites hold, per key, B's value (the later
    timestamp) under Geode's rule, and with the resolver the higher n, or the union of the tags."""
    sites = _sites(tmp_path, site_a.bootstrap, unique_prefix, resolver)
    procs: list[Any] = []
    try:
        regions = {n: RegionProcess(p, tmp_path / f"region-{n}.log", extra_path=[HERE]) for n, (p, _) in sites.items()}
        procs += regions.values()
        for r in regions.values():
            r.wait_ready()
        for name, other in (("a", "b"), ("b", "a")):
            set_state(sites[name][1], f"to-{other}", "PAUSED", issued_by="test")
            procs.append(ReceiverProcess(sites[name][0], tmp_path / f"receiver-{name}.log"))
            procs.append(SenderProcess(sites[name][0], f"to-{other}", tmp_path / f"sender-{name}.log"))
        clients = {n: RegionClient([r.url]) for n, r in regions.items()}

        rng = random.Random(7)
        numbered = [f"k{i}" for i in range(40)]
        tagged = [f"t{i}" for i in range(10)]
        written: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
        for site in ("a", "b"):  # B writes after A: B's timestamps are the later ones
            values = {k: {"n": rng.randrange(1000)} for k in numbered}
            values |= {k: {"tags": [site, f"{site}-{k}"]} for k in tagged}
            clients[site].put_all("orders", values)
            written[site] = values
            written_ms = time.time_ns() // 1_000_000
            wait_for(lambda: time.time_ns() // 1_000_000 > written_ms, timeout_s=1.0,
                     what="the clock past the millisecond of the last write", poll_s=0.001)
        for name, other in (("a", "b"), ("b", "a")):
            set_state(sites[name][1], f"to-{other}", "RUNNING", issued_by="test")

        keys = numbered + tagged
        if resolver is None:
            expected = written["b"]
        else:
            expected = {k: max((written["a"][k], 1), (written["b"][k], 2), key=lambda v: (v[0]["n"], v[1]))[0]
                        for k in numbered}
            expected |= {k: {"tags": sorted(set(written["a"][k]["tags"]) | set(written["b"][k]["tags"]))}
                         for k in tagged}
        got = read_until(lambda: {n: {k: (e or {}).get("value") for k, e in c.get_all("orders", keys).items()}
                                  for n, c in clients.items()},
                         lambda got: got["a"] == got["b"] == expected, timeout_s=CONVERGE_S, poll_s=0.5)
        for site in ("a", "b"):
            wrong = {k: (got[site][k], expected[k]) for k in keys if got[site][k] != expected[k]}
            assert not wrong, f"site {site}: {len(wrong)} keys not the winner, e.g. {list(wrong.items())[:3]}"
        overridden = sum(1 for k in numbered if expected[k] == written["a"][k] and written["a"][k] != written["b"][k])
        if resolver is not None:
            assert overridden > 0, "no key where the resolver picked other than the timestamp rule"
        print(f"\n{len(keys)} contested keys converged ({resolver or 'timestamp rule'}); "
              f"{overridden} kept the earlier write by the resolver")
    finally:
        for proc in reversed(procs):
            proc.stop()
