"""``python -m bench.first_record BOOTSTRAP TOPIC``: the start-up baseline of ``dispatcher.noop.startup``.

The least a Python process does before it holds the first record of a
queue topic: start the interpreter, import the Kafka client, join a consumer
group of its own on TOPIC (as a dispatcher joins its queue's group) and read
from the beginning.  It prints ``first`` once it has a record and exits; the
benchmark times from spawning it to that line.  It imports nothing of the
benchmark runner, so that its start is not charged with the runner's imports.
"""

from __future__ import annotations

import sys
import time
import uuid

from sluice.core.kafka import Consumer

#: Seconds to wait for the first record before giving up.
FIRST_RECORD_TIMEOUT_S = 60.0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m bench.first_record BOOTSTRAP TOPIC", file=sys.stderr)
        return 2
    bootstrap, topic = argv
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": f"bench-first-{uuid.uuid4().hex[:8]}",
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "enable.partition.eof": False,
    })
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + FIRST_RECORD_TIMEOUT_S
        while time.monotonic() < deadline:
            msg = consumer.poll(0.1)
            if msg is None:
                continue
            if msg.error() is not None:
                print(f"reading {topic}: {msg.error()}", file=sys.stderr)
                return 1
            print("first", flush=True)
            return 0
        print(f"no record of {topic} in {FIRST_RECORD_TIMEOUT_S:.0f}s", file=sys.stderr)
        return 1
    finally:
        consumer.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
