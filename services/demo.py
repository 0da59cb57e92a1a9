"""``sluice demo``: one embedded site, a region with attached queues, and what reached them.

Starts an embedded broker (Apache Kafka, or Tansu where no JDK exists),
creates the site's topics, runs two region-service instances and an
async-event-queue dispatcher (SQL write-behind to SQLite) as processes of
their own, writes entries through both instances (puts, put_alls, destroys),
then reads back the region through the API, the queue topics straight from
Kafka and the write-behind table, and prints them as tables.  Exits non-zero
if what the queues or the table hold differs from what the region applied.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from .core.processes import DispatcherProcess, RegionProcess, ServiceProcess

EXAMPLE = """\
example:
  sluice demo                  # embedded Apache Kafka (Tansu when no JDK), 2 region instances
  sluice demo --events 5000    # more writes
  sluice demo --engine tansu   # on the second Kafka implementation
  sluice demo --keep-running   # leave it up; Ctrl-C stops everything
"""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the demo on embedded brokers",
        description=__doc__,
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--events", type=int, default=2000, help="entry operations to write (default 2000)")
    p.add_argument("--keys", type=int, default=200, help="distinct keys (default 200)")
    p.add_argument("--engine", choices=("auto", "kafka", "tansu"), default="auto", help="embedded broker")
    p.add_argument("--keep-running", action="store_true", help="leave the site up until Ctrl-C")
    p.add_argument("--seed", type=int, default=7, help="workload seed (default 7)")
    p.set_defaults(func=run)


def _site_file(path: Path, bootstrap: str, prefix: str) -> Path:
    data = {
        "site": "demo-a",
        "dsid": 1,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix,
                  "session_timeout_ms": 3000, "heartbeat_interval_ms": 500},
        "regions": [{"name": "orders", "buckets": 8, "gateway_senders": ["orders-to-b"],
                     "async_event_queues": ["orders-jdbc"]}],
        "gateway_senders": [{"id": "orders-to-b", "remote_dsid": 2, "parallel": True}],
        "async_event_queues": [{
            "id": "orders-jdbc", "parallel": False, "dispatcher_threads": 3,
            "listener": {"type": "sql", "settings": {"url": f"sqlite:///{path.parent / 'orders.db'}",
                                                     "table": "orders"}},
        }],
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run(args: argparse.Namespace) -> int:
    from .broker import start_broker
    from .client import RegionClient
    from .core.codec import get_codec
    from .core.config import load_config
    from .core.events import EntryEvent
    from .core.kafka import TopicPartition, make_consumer
    from .core.topics import apply_topics

    console = Console()
    if not console.is_terminal:
        console = Console(width=110)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-demo-"))
    procs: list[ServiceProcess] = []
    broker = None
    interrupted = False

    def on_sigterm(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with console.status("starting an embedded broker…"):
            broker = start_broker("demo-a", 0, args.engine, data_dir=workdir / "broker")
        console.print(f"[bold]site demo-a[/]: {broker.engine} broker on {broker.bootstrap}")
        prefix = f"demo{uuid.uuid4().hex[:6]}."
        site_path = _site_file(workdir / "site-a.yaml", broker.bootstrap, prefix)
        cfg = load_config(site_path)
        report = apply_topics(cfg)
        console.print(f"topics: {len(report.results)} ({sum(1 for r in report.results if r.action == 'created')} created)")

        try:
            for i in range(2):
                procs.append(RegionProcess(site_path, workdir / f"region-{i}.log"))
            urls = [p.url for p in procs]
            console.print(f"region service: 2 instances {', '.join(urls)}")
            procs.append(DispatcherProcess(site_path, "orders-jdbc", workdir / "dispatcher.log"))
        except RuntimeError as exc:
            console.print(f"[red]a service did not start[/]: {exc}")
            return 1
        console.print("async event queue orders-jdbc: a dispatcher writing behind to SQLite")

        client = RegionClient(urls, retry_for_s=60)
        with console.status("waiting for the instances to own every bucket…"):
            end = time.monotonic() + 60
            while time.monotonic() < end:
                rows = client.buckets()
                if all(r["status"] in ("ready", "remote") for r in rows):
                    break
                time.sleep(0.2)

        rng = random.Random(args.seed)
        expected: dict[str, Any] = {}
        applied = 0
        with Progress(console=console) as progress:
            task = progress.add_task("writing", total=args.events)
            done = 0
            while done < args.events:
                key = f"order-{rng.randrange(args.keys):04d}"
                roll = rng.random()
                if roll < 0.1 and done + 20 <= args.events:
                    batch = {f"order-{rng.randrange(args.keys):04d}": {"qty": rng.randrange(100)} for _ in range(20)}
                    client.put_all("orders", batch)
                    expected.update(batch)
                    done += len(batch)
                    applied += len(batch)
                elif roll < 0.15 and key in expected and expected[key] is not None:
                    client.destroy("orders", key)
                    del expected[key]
                    done += 1
                    applied += 1
                else:
                    value = {"qty": rng.randrange(100), "n": done}
                    client.put("orders", key, value)
                    expected[key] = value
                    done += 1
                    applied += 1
                progress.update(task, completed=done)

        region = client.get_all("orders", sorted(expected))
        mismatched = [k for k, v in expected.items() if (region.get(k) or {}).get("value") != v]
        table = Table(title="region orders (first 10 keys)")
        for col in ("key", "value", "entry version", "written by"):
            table.add_column(col)
        for key in sorted(expected)[:10]:
            e = region[key] or {}
            table.add_row(key, str(e.get("value")), str(e.get("version", {}).get("entry_version")),
                          str(e.get("event_id", {}).get("member_id")))
        console.print(table)
        console.print(f"region holds {len(client.keys('orders'))} keys; "
                      f"{len(expected) - len(mismatched)}/{len(expected)} match what the writer expects")

        codec = get_codec()
        consumer = make_consumer({"bootstrap.servers": broker.bootstrap}, None)
        qtable = Table(title="what reached the queues")
        for col in ("queue", "kind", "partitions", "records", "EventIDs", "possibleDuplicate", "operations"):
            qtable.add_column(col, no_wrap=col != "operations")
        problems = 0
        for q in cfg.attached_queues("orders"):
            ids: set[Any] = set()
            ops: dict[str, int] = {}
            records = dup = 0
            for p in range(q.partitions):
                low, high = consumer.get_watermark_offsets(TopicPartition(q.topic, p), timeout=10)
                if high <= low:
                    continue
                consumer.assign([TopicPartition(q.topic, p, low)])
                last = low - 1
                while last < high - 1:
                    for msg in consumer.consume(1000, 2.0):
                        last = msg.offset()
                        ev = EntryEvent.from_record(codec.decode_as("QueuedEvent", msg.value())["event"])
                        records += 1
                        dup += ev.possible_duplicate
                        ids.add(ev.event_id)
                        ops[ev.operation.value] = ops.get(ev.operation.value, 0) + 1
            kind = ("parallel " if q.parallel else "serial ") + ("sender" if q.kind == "gateway-sender" else "AEQ")
            qtable.add_row(q.id, kind, str(q.partitions), str(records), str(len(ids)), str(dup),
                           " ".join(f"{k.lower()}={v}" for k, v in sorted(ops.items())))
            if len(ids) != applied:
                problems += 1
        consumer.close()
        console.print(qtable)

        # The write-behind table, once the queue is drained, equals the region.
        from .admin.cli import queue_status

        with console.status("waiting for the write-behind to drain orders-jdbc…"):
            end = time.monotonic() + 60
            while time.monotonic() < end and sum(r.size for r in queue_status(cfg, "orders-jdbc")) > 0:
                time.sleep(0.3)
        import sqlite3

        with sqlite3.connect(workdir / "orders.db") as db:
            table = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM orders_live")}
        region_now = {k: e["value"] for k, e in client.get_all("orders", sorted(set(expected) | set(table))).items()
                      if e is not None}
        table_ok = table == region_now
        console.print(f"write-behind table orders (SQLite): {len(table)} rows; "
                      f"equal to the region: {'yes' if table_ok else 'no'}")
        ok = not mismatched and problems == 0 and table_ok
        console.print(f"[{'green' if ok else 'red'}]{'OK' if ok else 'DIVERGED'}[/]: {applied} operations applied, "
                      f"each in every attached queue: {'yes' if problems == 0 else 'no'}; "
                      f"region matches the writer: {'yes' if not mismatched else f'no ({len(mismatched)} keys)'}; "
                      f"write-behind table matches the region: {'yes' if table_ok else 'no'}")
        if args.keep_running:
            console.print(f"running; try: curl {urls[0]}/buckets   (Ctrl-C stops everything)")
            while True:
                time.sleep(1)
        return 0 if ok else 1
    except KeyboardInterrupt:
        interrupted = True
        return 130
    finally:
        for proc in procs:
            proc.stop(15)
        if broker is not None:
            broker.stop()
        if not interrupted:
            shutil.rmtree(workdir, ignore_errors=True)
