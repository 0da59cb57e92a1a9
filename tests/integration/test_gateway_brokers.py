"""A→B through a parallel sender and a receiver, on the session's broker.

No longer in the Tansu smoke subset: the region service writes in Kafka transactions, and Tansu shows
aborted records to read_committed readers (tests/README.md)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from sluice.client import RegionClient
from sluice.core.processes import ReceiverProcess, RegionProcess, SenderProcess

from regionkit import remote, write_two_sites
from waiting import read_until

pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_to_b_on_this_broker(any_site, unique_prefix, tmp_path: Path):
    """Puts and destroys on A reach B.  B's region service listens on a fixed port, the address its receiver
    falls back to where the broker describes groups without their members (Tansu 0.6)."""
    prefix = any_site.topic_prefix(unique_prefix)
    port_b = _free_port()
    # Tansu joins groups slowly with short sessions (tests/README.md).
    two = write_two_sites(tmp_path, any_site.bootstrap, prefix, kafka={"session_timeout_ms": 6000,
                                                                        "heartbeat_interval_ms": 1000}, a={
        "regions": [{"name": "orders", "buckets": 4, "gateway_senders": ["to-b"]}],
        "gateway_senders": [{"id": "to-b", "remote_dsid": 2, "parallel": True, "batch_size": 20,
                             "batch_time_interval_ms": 20, "socket_read_timeout_ms": 10000,
                             "remote": remote(any_site.bootstrap, prefix, "b")}],
    }, b={
        "regions": [{"name": "orders", "buckets": 4}],
        "receiver": {"inbound_partitions": 2, "accepted_dsids": [1]},
        "region_service": {"host": "127.0.0.1", "port": port_b},
    })
    paths = {"a": two.path_a, "b": two.path_b}
    procs: list[Any] = []
    try:
        region_a = RegionProcess(paths["a"], tmp_path / "region-a.log")
        procs.append(region_a)
        procs.append(RegionProcess(paths["b"], tmp_path / "region-b.log", port=port_b))
        region_a.wait_ready(120)
        procs[-1].wait_ready(120)
        procs.append(ReceiverProcess(paths["b"], tmp_path / "receiver-b.log"))
        procs.append(SenderProcess(paths["a"], "to-b", tmp_path / "sender-a.log"))
        a, b = RegionClient([region_a.url]), RegionClient([f"http://127.0.0.1:{port_b}"])
        a.put_all("orders", {f"k{i}": {"n": i} for i in range(200)})
        for i in range(0, 200, 10):
            a.destroy("orders", f"k{i}")
        expected = {f"k{i}": {"n": i} for i in range(200) if i % 10}
        got = read_until(lambda: {k: e["value"] for k, e in b.get_all("orders", [f"k{i}" for i in range(200)]).items()
                                  if e}, lambda got: got == expected, timeout_s=120, poll_s=0.5)
        assert got == expected, f"B has {len(got)} of {len(expected)} entries; receiver log:\n{procs[2].log_tail()}"
    finally:
        for proc in reversed(procs):
            proc.stop()

