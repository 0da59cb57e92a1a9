"""Step 0 of a batch's story (service.py): each inbound partition this receiver is assigned has a lane, a
thread that handles its batches one after another, in order, while the lanes of other partitions work at
the same time (a sender partition always writes to the same inbound partition, so per-key order holds).
The receiver's loop pauses the partition of a lane more than ``LANE_DEPTH`` batches behind, and resumes it
at ``LANE_RESUME`` or fewer (``ReceiverService._tend_lanes``)."""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING

from ..core.errors import Stopping
from ..core.kafka import Message
from .protocol import InboundPartition

if TYPE_CHECKING:
    from .service import ReceiverService

log = logging.getLogger("sluice.receiver")

#: Inbound records the receiver's loop reads per turn at most.
RECEIVE_MAX_RECORDS = 100
#: A lane this many batches behind pauses its partition; it resumes at ``LANE_RESUME`` or fewer.
LANE_DEPTH = 8
LANE_RESUME = 2
#: A lane's inbox holds at most this many records: the loop pauses the partition at ``LANE_DEPTH``,
#: after a turn that may have brought ``RECEIVE_MAX_RECORDS`` more, so a put never waits.
LANE_QUEUE_MAX = LANE_DEPTH + RECEIVE_MAX_RECORDS
#: How long a put into a full lane waits before it looks again whether the lane is still alive.
LANE_PUT_WAIT_S = 0.1
#: How long a lane may take to finish the batch in hand once closed.
LANE_CLOSE_DEADLINE_S = 30.0


class Lane:
    """The batches of one inbound partition, handled in order by one thread.

    ``part`` is the partition's state in the protocol (protocol.py) for this ownership: its figures are
    replaced whole, under the protocol's lock, once what they count is durable; the main thread only
    reads them."""

    def __init__(self, partition: int, receiver: ReceiverService, part: InboundPartition) -> None:
        self.partition = partition
        self.queue: queue.Queue[Message | None] = queue.Queue(maxsize=LANE_QUEUE_MAX + 1)  # + the closing None
        self.stop = threading.Event()  # set on revoke or shutdown
        self.paused = False
        self.error: BaseException | None = None
        self.handled_yet = False  # a batch of this partition was handled since the lane began
        self.part = part
        self.thread = threading.Thread(target=self._run, args=(receiver,), daemon=True,
                                       name=f"receiver-lane-{partition}")
        self.thread.start()

    def _run(self, receiver: ReceiverService) -> None:
        try:
            while not self.stop.is_set():
                msg = self.queue.get()
                if msg is None or self.stop.is_set():
                    return
                receiver._handle(msg, self)
                if not self.handled_yet:
                    # The end of a failover, as an operator (and `sluice soak`) measures it.
                    self.handled_yet = True
                    log.info("receiver %s: first batch handled on inbound partition %d since taking it",
                             receiver.member_id, self.partition)
        except Stopping:
            return  # in the middle of a batch: it is neither acked nor committed
        except BaseException as exc:  # top of a thread: the service's loop re-raises it
            self.error = exc

    def put(self, msg: Message) -> None:
        """Loop thread: hand the lane a record.  Full only when the broker handed over more than
        ``LANE_QUEUE_MAX`` at once: wait for room, unless the lane stopped or died meanwhile (the
        record is then dropped uncommitted: whoever handles the partition next reads it)."""
        while True:
            try:
                self.queue.put(msg, timeout=LANE_PUT_WAIT_S)
                return
            except queue.Full:
                if self.stop.is_set() or self.error is not None or not self.thread.is_alive():
                    return

    def close(self, timeout_s: float = LANE_CLOSE_DEADLINE_S) -> None:
        """Stop after the batch in hand (its retries cut short); what is queued is dropped, not committed."""
        self.stop.set()
        _drop_queued(self.queue)
        self.queue.put(None)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.warning("receiver lane %d still busy after %.0f s", self.partition, timeout_s)


def _drop_queued(inbox: "queue.Queue[Message | None]") -> None:
    """Empty a stopped lane's inbox, so the closing ``None`` always fits."""
    while True:
        try:
            inbox.get_nowait()
        except queue.Empty:
            return
