"""Embedded brokers as child processes, and the single-node Apache Kafka one.

A Sluice site needs a Kafka cluster.  For development, tests and the fault
runs, each simulated site gets a broker of its own, started here as a child
process on 127.0.0.1:

1. ``EmbeddedKafka`` writes a ``server.properties`` for one KRaft node that is
   both broker and controller (``process.roles=broker,controller``), or with
   ``separate_controller`` for a broker and a controller in JVMs of their own
   (what the fault harness uses, see the class), tuned for
   tests: one replica for the internal topics, few partitions, no initial
   rebalance delay, a 500 ms minimum session timeout so fast group joins are
   allowed, no topic auto-creation (Sluice creates its topics on purpose).
2. The first start formats the data directory with ``kafka.tools.StorageTool``
   (what ``kafka-storage.sh format`` runs).  A directory holding
   ``meta.properties`` is already formatted and is reused as it is, so a
   restart keeps topics, records and committed offsets.
3. ``java -cp '<jars>/*' kafka.Kafka server.properties`` runs the broker, its
   stdout and stderr appended to ``<data dir>.log`` beside the data directory.
4. ``start()`` returns once a Metadata request answered with one broker and
   our cluster id (so a foreign broker on the same port is not mistaken for
   ours), or raises :class:`BrokerStartError` quoting the end of the log.
5. ``stop()`` sends SIGTERM (a clean, controlled shutdown: ~1.6 s here) and
   SIGKILL after a deadline; ``kill()`` is the ``kill -9`` of fault tests;
   ``pause()``/``resume()`` are SIGSTOP/SIGCONT, a site that stops answering
   without closing a socket.

``BrokerProcess`` holds what the Apache Kafka and Tansu brokers share: the
lifecycle, the readiness probe and the signals.  The probe speaks the Kafka
wire protocol itself (a Metadata v4 request, the oldest that Kafka 4 still
serves) so that this package needs no Kafka client and librdkafka does not
fill stderr with "connection refused" while the broker is coming up.
"""

from __future__ import annotations

import base64
import enum
import os
import re
import signal
import socket
import struct
import subprocess
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from sluice.broker.jars import KAFKA_VERSION_DEFAULT, class_archive, ensure_kafka_jars, log4j_config, usable_class_archive
from sluice.core.processes import die_with_parent, stop_process
from sluice.core.errors import BrokerStartError, InvalidRequest

HOST = "127.0.0.1"

_SITE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")

#: How many lines of the broker log a BrokerStartError quotes.
LOG_TAIL_LINES = 25

#: Opens each start's section of the broker log.
_START_BANNER = "===== sluice: starting"

#: The node id of the controller of ``EmbeddedKafka(separate_controller=True)``; its broker is node 1.
CONTROLLER_NODE_ID = 3000

#: ``broker.session.timeout.ms`` of a separate controller by default: longer than the fault harness's
#: longest pause of a broker (10 s), so that a pause fences nothing; a killed broker is fenced this long
#: after the kill.
SEPARATE_SESSION_TIMEOUT_MS = 12_000

#: What the controller logs when it fences a broker that stopped sending heartbeats.
_FENCED_FOR_TIMEOUT = re.compile(rb"Fencing broker 1 at epoch \d+ because its session has timed out")


class BrokerState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"


def free_ports(count: int, host: str = HOST) -> list[int]:
    """Return ``count`` distinct TCP ports that were free a moment ago.

    All sockets are held open until every port is chosen so the ports differ.
    Another process may still take one before the broker binds it; the broker
    then fails to start with "Address already in use" in its log.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def default_data_dir(site: str, engine: str) -> Path:
    """``.sluice/sites/<site>/<engine>`` under the current directory."""
    return Path.cwd() / ".sluice" / "sites" / site / engine


def check_site_name(site: str) -> str:
    """Site names become directory names and cluster ids: keep them plain."""
    if not _SITE_NAME.fullmatch(site):
        raise InvalidRequest("site", site, "must start with a letter or digit and hold only letters, digits, '.', '_', '-'")
    return site


def probe_metadata(host: str, port: int, timeout_s: float = 1.0) -> tuple[int, str | None]:
    """Send one Metadata v4 request; return (number of brokers, cluster id).

    Raises OSError when nothing answers and ValueError when the answer is
    not a Metadata response.  Request: size, header v1 (api_key 3,
    api_version 4, correlation id, client id), then a null topic array (all
    topics) and allow_auto_topic_creation=false.
    """
    client_id = b"sluice-probe"
    correlation_id = 0x51C3
    request = struct.pack(">hhih", 3, 4, correlation_id, len(client_id)) + client_id + struct.pack(">i?", -1, False)
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(struct.pack(">i", len(request)) + request)
        (size,) = struct.unpack(">i", _recv_exactly(sock, 4))
        if not 0 < size < 64 * 1024 * 1024:
            raise ValueError(f"implausible Metadata response size {size}")
        body = _recv_exactly(sock, size)
    reader = _Reader(body)
    if reader.int32() != correlation_id:
        raise ValueError("Metadata response carries a foreign correlation id")
    reader.int32()  # throttle_time_ms
    broker_count = reader.int32()
    for _ in range(broker_count):
        reader.int32()  # node_id
        reader.string()  # host
        reader.int32()  # port
        reader.string()  # rack (nullable)
    return broker_count, reader.string()


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < count:
        chunk = sock.recv(count - len(chunks))
        if not chunk:
            raise ConnectionError("broker closed the connection mid-response")
        chunks += chunk
    return bytes(chunks)


class _Reader:
    """Reads the non-flexible (pre-KIP-482) encodings of the Kafka protocol."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._offset = 0

    def int32(self) -> int:
        if self._offset + 4 > len(self._data):
            raise ValueError("truncated Metadata response")
        (value,) = struct.unpack_from(">i", self._data, self._offset)
        self._offset += 4
        return int(value)

    def string(self) -> str | None:
        if self._offset + 2 > len(self._data):
            raise ValueError("truncated Metadata response")
        (length,) = struct.unpack_from(">h", self._data, self._offset)
        self._offset += 2
        if length < 0:
            return None
        raw = self._data[self._offset : self._offset + length]
        if len(raw) != length:
            raise ValueError("truncated Metadata response")
        self._offset += length
        return raw.decode("utf-8")


def _terminate(process: subprocess.Popen[bytes], timeout_s: float, paused: bool = False) -> None:
    """SIGTERM (a clean shutdown), and SIGKILL if the process has not exited ``timeout_s`` later."""
    process.send_signal(signal.SIGTERM)
    if paused:
        # A stopped process cannot act on SIGTERM until it runs again.
        process.send_signal(signal.SIGCONT)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


_die_with_parent_hook = die_with_parent  # SIGTERM the broker if its starter dies (see core/processes.py)


class BrokerProcess:
    """One broker child process on 127.0.0.1, with a lifecycle tests can drive.

    ::

        NEW ──start()──▶ RUNNING ◀──resume()── PAUSED
                           │   └────pause()────▶ │
                           │                     │
                  stop() / kill() / start failure │
                           ▼                     │
                        STOPPED ◀── stop()/kill()┘
                           │
                           └──start()──▶ RUNNING  (same ports, same data dir)

    Unlike a Sluice service, a broker handle may be started again after it
    stopped: fault tests kill a broker and bring it back on the same address
    so that clients reconnect by themselves.  ``stop()`` and ``kill()`` are
    idempotent.  Subclasses say how to prepare and run the process.
    """

    #: Short engine name used by the factory, the CLI and test reports.
    engine: str = ""

    def __init__(
        self,
        site: str,
        port: int,
        data_dir: Path | str | None,
        *,
        start_timeout_s: float,
        stop_timeout_s: float,
        die_with_parent: bool = True,
    ) -> None:
        self.site = check_site_name(site)
        self.port = port if port else free_ports(1)[0]
        #: None: the engine's folder under the site's (``default_data_dir``).
        chosen = Path(data_dir) if data_dir is not None else default_data_dir(self.site, self.engine)
        self.data_dir = chosen.expanduser().resolve()
        #: Broker stdout and stderr, appended across restarts.
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}.log"
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.die_with_parent = die_with_parent
        self._process: subprocess.Popen[bytes] | None = None
        self._state = BrokerState.NEW
        #: Seconds the last start() took until ready, including formatting
        #: (first start) and fetching jars (first use on this machine).
        self.last_start_s: float | None = None

    # -- what subclasses provide -------------------------------------------------

    @property
    def engine_label(self) -> str:
        """Human name and version, e.g. "Apache Kafka 4.4.0"."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for people: engine, address, where the data lives."""
        raise NotImplementedError

    def _prepare(self) -> None:
        """Work before the process is spawned (write config, format storage)."""

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _expected_cluster_id(self) -> str | None:
        """The cluster id the readiness probe must see, if known."""
        return None

    # -- lifecycle ---------------------------------------------------------------

    @property
    def state(self) -> BrokerState:
        running = self._state in (BrokerState.RUNNING, BrokerState.PAUSED)
        if running and self._process is not None and self._process.poll() is not None:
            self._state = BrokerState.STOPPED
        return self._state

    @property
    def bootstrap(self) -> str:
        """``bootstrap.servers`` for clients: "127.0.0.1:PORT"."""
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The broker's process id while it runs (or is paused), else None."""
        if self.state in (BrokerState.RUNNING, BrokerState.PAUSED) and self._process is not None:
            return self._process.pid
        return None

    @property
    def returncode(self) -> int | None:
        """Exit status of the last process once it exited (-9: SIGKILLed), else None."""
        return self._process.poll() if self._process is not None else None

    def start(self) -> Self:
        """Spawn the broker and wait until it answers a Metadata request.

        Raises :class:`BrokerStartError`, quoting the end of the broker log,
        when it exits or does not answer within ``start_timeout_s``; the
        process is killed then, so a failed start leaves nothing running.
        """
        if self.state in (BrokerState.RUNNING, BrokerState.PAUSED):
            raise BrokerStartError(f"{self.engine_label} of site {self.site!r} is already running (pid {self.pid})")
        started = time.monotonic()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._prepare()
        command = self._command()
        with open(self.log_path, "ab") as log:
            banner = f"{_START_BANNER} {self.engine_label} at {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(command)}"
            log.write(f"\n{banner}\n".encode())
            log.flush()
            self._process = self._spawn(command, log)
        self._state = BrokerState.RUNNING
        try:
            self._wait_ready(started + self.start_timeout_s)
        except BaseException:
            # Also on Ctrl-C or a test timeout: never leave a half-started broker.
            self.kill()
            raise
        self.last_start_s = time.monotonic() - started
        return self

    def _spawn(self, command: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
        # A session of its own keeps the terminal's Ctrl-C away from the broker:
        # the owner decides when and how it stops.
        try:
            return subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir.parent,
                start_new_session=True,
                # Safe despite threads: the hook only calls prctl (see its docstring).
                preexec_fn=_die_with_parent_hook if self.die_with_parent else None,  # noqa: PLW1509
            )
        except OSError as exc:
            raise BrokerStartError(f"cannot run {command[0]}: {exc}") from exc

    def _wait_ready(self, deadline: float) -> None:
        assert self._process is not None
        expected = self._expected_cluster_id()
        seen: str | None = None
        while True:
            code = self._process.poll()
            if code is not None:
                raise BrokerStartError(
                    f"{self.engine_label} of site {self.site!r} exited with code {code} while starting; "
                    f"end of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                broker_count, cluster_id = probe_metadata(HOST, self.port)
            except (OSError, ValueError):
                pass
            else:
                if broker_count >= 1 and (expected is None or cluster_id == expected):
                    return
                seen = f"{broker_count} broker(s), cluster id {cluster_id!r}"
            if time.monotonic() >= deadline:
                answer = f"; port {self.port} answered with {seen}, expected cluster id {expected!r}" if seen else ""
                raise BrokerStartError(
                    f"{self.engine_label} of site {self.site!r} did not answer on {self.bootstrap} "
                    f"within {self.start_timeout_s:.0f} s{answer}; end of {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop cleanly: SIGTERM, then SIGKILL after ``stop_timeout_s``.  Idempotent."""
        process = self._process
        if process is None or process.poll() is not None:
            if self._state is not BrokerState.NEW:
                self._state = BrokerState.STOPPED
            return
        _terminate(process, self.stop_timeout_s, paused=self._state is BrokerState.PAUSED)
        self._state = BrokerState.STOPPED

    def kill(self) -> None:
        """SIGKILL, as a crash would: no flush, no controlled shutdown.  Idempotent."""
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        if self._state is not BrokerState.NEW:
            self._state = BrokerState.STOPPED

    def pause(self) -> None:
        """SIGSTOP, returning once every thread of the broker has stopped: it keeps its sockets open
        but answers nothing."""
        if self.state is not BrokerState.RUNNING:
            raise BrokerStartError(f"cannot pause the broker of site {self.site!r}: it is {self.state.value}")
        assert self._process is not None
        stop_process(self._process.pid)
        self._state = BrokerState.PAUSED

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.state is not BrokerState.PAUSED:
            raise BrokerStartError(f"cannot resume the broker of site {self.site!r}: it is {self.state.value}")
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)
        self._state = BrokerState.RUNNING

    def rss_bytes(self) -> int | None:
        """Resident memory of the broker process (Linux /proc), or None."""
        pid = self.pid
        if pid is None:
            return None
        try:
            fields = Path(f"/proc/{pid}/statm").read_text().split()
        except OSError:
            return None
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """What a person needs from the log of the last start, for error messages.

        The first few ERROR/FATAL lines of that start, each with the line
        after it (Kafka puts the exception's message there), then its last
        ``lines`` lines.  The first error is quoted separately because a
        broker that fails logs a long, uninformative shutdown after it.
        """
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(0, log.tell() - 256 * 1024))
                text = log.read().decode("utf-8", errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        run = text.splitlines()
        for index in range(len(run) - 1, -1, -1):
            if run[index].startswith(_START_BANNER):
                run = run[index:]
                break
        errors: list[str] = []
        for index, line in enumerate(run):
            if len(errors) >= 6:
                break
            if " ERROR " in line or " FATAL " in line:
                errors.extend(run[index : index + 2])
        tail = "\n".join(run[-lines:])
        if not errors:
            return tail
        return "first errors:\n" + "\n".join(errors) + f"\n… last {lines} lines:\n" + tail

    def __enter__(self) -> Self:
        if self.state not in (BrokerState.RUNNING, BrokerState.PAUSED):
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} site={self.site!r} {self.bootstrap} {self.state.value} pid={self.pid}>"


def _write_properties(path: Path, props: Mapping[str, str]) -> None:
    body = "".join(f"{key}={value}\n" for key, value in props.items())
    path.write_text("# Written by sluice on each start; edits are overwritten.\n" + body)


def random_cluster_id() -> str:
    """A KRaft cluster id: a random UUID in unpadded base64url (22 chars).

    Like Kafka's ``Uuid.randomUuid()`` it never starts with "-", which the
    StorageTool's argument parser would read as an option.
    """
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode("ascii").rstrip("=")
        if not text.startswith("-"):
            return text


def read_meta_properties(data_dir: Path) -> dict[str, str]:
    """The ``key=value`` pairs of a formatted data directory's meta.properties."""
    pairs: dict[str, str] = {}
    for line in (data_dir / "meta.properties").read_text().splitlines():
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


class EmbeddedKafka(BrokerProcess):
    """A single-node Apache Kafka 4.x (KRaft, broker and controller in one JVM).

    With ``separate_controller`` the controller runs in a JVM of its own, as
    Kafka advises for production, and ``kill()``, ``pause()`` and
    ``resume()`` reach the broker only.  The fault harness needs that: Kafka
    4.4.0 drops the transaction markers meant for a partition that has no
    leader ("Couldn't find leader endpoint … likely deleted already"), so a
    changelog partition keeps an open transaction for ever when its only
    replica is fenced while the transaction coordinator completes a
    transaction.  One JVM makes that happen on a ``kill -9``: the restarted
    controller gives the killed incarnation a whole session before it fences
    it, and meanwhile the restarted broker, following its old registration,
    already completes transactions.  It also happens on a pause: the paused
    controller fences its own broker once it runs again.  Apart, the
    controller fences a killed broker while nothing runs, and ``start()``
    waits for that (``broker_session_timeout_ms``, 12 s unless told, so that a
    pause of up to 10 s fences nothing) before starting the broker again.

    Measured here (2 cores, OpenJDK 17, ``-Xmx384m``), with the class-data
    archive of ``write_class_archive``: format + first start answers Metadata
    in ~1.7 s (2.4 s of CPU), a restart on formatted storage in ~0.9 s (1.4 s
    of CPU); without it ~2.5 s (3.4 s) and ~2 s (2.6 s).  ~300–350 MB
    resident.  See tests/integration/test_brokers.py.
    """

    engine = "kafka"

    def __init__(
        self,
        site: str,
        port: int = 0,
        *,
        controller_port: int = 0,
        data_dir: Path | str | None = None,
        heap: str = "384m",
        version: str = KAFKA_VERSION_DEFAULT,
        jars_dir: Path | None = None,
        group_initial_rebalance_delay_ms: int = 0,
        group_min_session_timeout_ms: int = 500,
        group_max_session_timeout_ms: int | None = None,
        extra_config: Mapping[str, str] | None = None,
        separate_controller: bool = False,
        broker_session_timeout_ms: int = SEPARATE_SESSION_TIMEOUT_MS,
        start_timeout_s: float = 60.0,
        stop_timeout_s: float = 15.0,
        die_with_parent: bool = True,
    ) -> None:
        super().__init__(site, port, data_dir, start_timeout_s=start_timeout_s, stop_timeout_s=stop_timeout_s,
                         die_with_parent=die_with_parent)
        self.separate_controller = separate_controller
        #: How long a separate controller waits for the broker's heartbeat before it fences it: a pause of the
        #: broker shorter than this fences nothing (one JVM keeps Kafka's 9 s, see the class docstring).
        self.broker_session_timeout_ms = broker_session_timeout_ms
        #: The controller's own JVM (``separate_controller``); it outlives kills of the broker.
        self._controller: subprocess.Popen[bytes] | None = None
        self.controller_data_dir = self.data_dir.parent / f"{self.data_dir.name}-controller"
        self.controller_log_path = self.data_dir.parent / f"{self.data_dir.name}-controller.log"
        self.controller_properties_path = self.data_dir.parent / f"{self.data_dir.name}-controller.properties"
        #: Where the controller's log ended when the broker was killed: the next start waits for the
        #: controller to fence the killed incarnation, logged after that point.
        self._killed_at_log_size: int | None = None
        if controller_port:
            self.controller_port = controller_port
        else:
            self.controller_port = next(p for p in free_ports(2) if p != self.port)
        self.heap = heap
        self.version = version
        self.jars_dir = jars_dir
        self.group_initial_rebalance_delay_ms = group_initial_rebalance_delay_ms
        self.group_min_session_timeout_ms = group_min_session_timeout_ms
        self.group_max_session_timeout_ms = group_max_session_timeout_ms
        self.extra_config = dict(extra_config or {})
        self.properties_path = self.data_dir.parent / f"{self.data_dir.name}.properties"
        self._cluster_id: str | None = None
        #: Where the broker's JVM writes the classes it loaded when it exits (``write_class_archive``).
        self._archive_to: Path | None = None

    @property
    def engine_label(self) -> str:
        return f"Apache Kafka {self.version}"

    @property
    def cluster_id(self) -> str | None:
        """The KRaft cluster id, once the storage is formatted."""
        return self._cluster_id

    def describe(self) -> str:
        return f"site {self.site}: {self.engine_label} on {self.bootstrap} (data {self.data_dir})"

    def server_properties(self) -> dict[str, str]:
        """The broker configuration, written to ``properties_path`` on each start."""
        if self.separate_controller:
            # A broker-only node, its controller a voter of its own.
            roles = {
                "process.roles": "broker",
                "node.id": "1",
                "controller.quorum.voters": f"{CONTROLLER_NODE_ID}@{HOST}:{self.controller_port}",
                "listeners": f"PLAINTEXT://{HOST}:{self.port}",
            }
        else:
            # One KRaft node: broker and controller in one process, with a
            # static voter set (so the StorageTool must not get --standalone).
            roles = {
                "process.roles": "broker,controller",
                "node.id": "1",
                "controller.quorum.voters": f"1@{HOST}:{self.controller_port}",
                "listeners": f"PLAINTEXT://{HOST}:{self.port},CONTROLLER://{HOST}:{self.controller_port}",
            }
        props = roles | {
            "advertised.listeners": f"PLAINTEXT://{HOST}:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.data_dir),
            # Sluice creates every topic it uses, with explicit settings; a
            # typo must fail instead of creating a topic.
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
            "default.replication.factor": "1",
            # Internal topics on one node: one replica, few partitions (each
            # partition costs startup time and file handles).
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            # Fast classic-group joins: no 3 s wait for more members, and
            # clients may ask for session timeouts down to 500 ms.
            "group.initial.rebalance.delay.ms": str(self.group_initial_rebalance_delay_ms),
            "group.min.session.timeout.ms": str(self.group_min_session_timeout_ms),
            # The controller writes a no-op record to the metadata log when it has written nothing for this
            # long (default 500 ms), which the broker in the same JVM then fetches and applies.  One node has
            # no follower to tell it is alive: every 5 s, an idle broker uses 0.02 of a core instead of 0.037,
            # and a test run keeps up to a dozen of them.
            "metadata.max.idle.interval.ms": "5000",
            # Two or three brokers share two cores: few threads.
            "num.network.threads": "2",
            "num.io.threads": "2",
            "background.threads": "2",
            "num.recovery.threads.per.data.dir": "1",
            # Compaction that a test can observe: one cleaner thread with a
            # small dedupe buffer (the default 128 MB would take a third of
            # the heap) that looks for work every second, not every 15 s.
            "log.cleaner.threads": "1",
            "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
            "log.cleaner.backoff.ms": "1000",
        }
        if self.group_max_session_timeout_ms is not None:
            props["group.max.session.timeout.ms"] = str(self.group_max_session_timeout_ms)
        props.update(self.extra_config)
        return props

    def controller_properties(self) -> dict[str, str]:
        """The configuration of the separate controller (``separate_controller``).

        The broker's, less what only a broker reads, with the controller's
        role, listener and data directory; topic defaults stay, since the
        controller applies them to the topics it creates.
        """
        props = {key: value for key, value in self.server_properties().items()
                 if key not in ("advertised.listeners", "inter.broker.listener.name")}
        return props | {
            "process.roles": "controller",
            "node.id": str(CONTROLLER_NODE_ID),
            "listeners": f"CONTROLLER://{HOST}:{self.controller_port}",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.controller_data_dir),
            "broker.session.timeout.ms": str(self.broker_session_timeout_ms),
        }

    def _java(self, heap: str) -> list[str]:
        assert self.jars_dir is not None
        command = [
            "java",
            f"-Xmx{heap}",
            # Serial GC and the C1 compiler only: a broker of a test site
            # handles little load, and these start faster and use less memory.
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true",
        ]
        # The classes a broker loads, mapped from the archive `sluice broker --fetch-only` (make jars)
        # wrote (the class docstring has the figures).  Without it, or with one the JVM refuses, classes
        # load as usual; the broker writing the archive maps none.
        archive = None if self._archive_to is not None else usable_class_archive(self.jars_dir)
        if archive is not None:
            command.append(f"-XX:SharedArchiveFile={archive}")
        config = log4j_config()
        if config is not None:
            command.append(f"-Dlog4j2.configurationFile={config}")
        return [*command, "-cp", str(self.jars_dir / "*")]

    def _prepare(self) -> None:
        if self.jars_dir is None:
            self.jars_dir = ensure_kafka_jars(self.version)
        _write_properties(self.properties_path, self.server_properties())
        nodes = [(self.data_dir, self.properties_path)]
        if self.separate_controller:
            _write_properties(self.controller_properties_path, self.controller_properties())
            nodes.append((self.controller_data_dir, self.controller_properties_path))
        formatted = [read_meta_properties(d).get("cluster.id") for d, _ in nodes if (d / "meta.properties").is_file()]
        cluster_id = formatted[0] if formatted and formatted[0] else random_cluster_id()
        for data_dir, properties in nodes:
            if not (data_dir / "meta.properties").is_file():
                self._format(data_dir, properties, cluster_id)
        self._cluster_id = read_meta_properties(self.data_dir).get("cluster.id")
        if self.separate_controller:
            self._start_controller()
            self._await_fence_of_killed()

    def _format(self, data_dir: Path, properties: Path, cluster_id: str) -> None:
        """Format an empty data directory (``kafka-storage.sh format``)."""
        command = [
            *self._java("128m"),
            "kafka.tools.StorageTool",
            "format",
            "--cluster-id",
            cluster_id,
            "--config",
            str(properties),
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=self.start_timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            raise BrokerStartError(f"formatting {data_dir} took over {self.start_timeout_s:.0f} s") from exc
        if result.returncode != 0 or not (data_dir / "meta.properties").is_file():
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-LOG_TAIL_LINES:])
            raise BrokerStartError(f"formatting the Kafka storage in {data_dir} failed (exit {result.returncode}):\n{tail}")

    # -- the separate controller -------------------------------------------------

    def _start_controller(self) -> None:
        """Run the controller unless it runs; return once its listener takes connections."""
        if self._controller is not None and self._controller.poll() is None:
            return
        command = [*self._java("192m"), "kafka.Kafka", str(self.controller_properties_path)]
        with open(self.controller_log_path, "ab") as log:
            log.write(f"\n{_START_BANNER} controller at {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(command)}\n"
                      .encode())
            log.flush()
            self._controller = self._spawn(command, log)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            code = self._controller.poll()
            if code is not None:
                raise BrokerStartError(f"the controller of site {self.site!r} exited with code {code} while "
                                       f"starting; see {self.controller_log_path}")
            try:
                socket.create_connection((HOST, self.controller_port), timeout=1.0).close()
                return
            except OSError:
                if time.monotonic() >= deadline:
                    self._stop_controller()
                    raise BrokerStartError(f"the controller of site {self.site!r} did not listen on "
                                           f"{HOST}:{self.controller_port} within {self.start_timeout_s:.0f} s; "
                                           f"see {self.controller_log_path}") from None
                time.sleep(0.05)

    def _await_fence_of_killed(self) -> None:
        """After a kill, wait until the controller fenced the killed incarnation (see the class docstring).

        Bounded by the session timeout and 5 s more: an incarnation killed
        before it registered is never fenced.
        """
        mark, self._killed_at_log_size = self._killed_at_log_size, None
        if mark is None:
            return
        deadline = time.monotonic() + self.broker_session_timeout_ms / 1000 + 5
        while time.monotonic() < deadline:
            try:
                with open(self.controller_log_path, "rb") as log:
                    log.seek(mark)
                    if _FENCED_FOR_TIMEOUT.search(log.read()):
                        return
            except OSError:
                return
            time.sleep(0.1)

    def _stop_controller(self) -> None:
        controller, self._controller = self._controller, None
        if controller is not None and controller.poll() is None:
            _terminate(controller, self.stop_timeout_s)

    def kill(self) -> None:
        if self.separate_controller and self.pid is not None:
            try:
                self._killed_at_log_size = self.controller_log_path.stat().st_size
            except OSError:
                self._killed_at_log_size = 0
        super().kill()

    def stop(self) -> None:
        """Stop the broker cleanly, then its separate controller, if any.  Idempotent."""
        super().stop()
        self._stop_controller()

    def _command(self) -> list[str]:
        command = self._java(self.heap)
        if self._archive_to is not None:  # the broker's classes, not the storage tool's
            command.insert(1, f"-XX:ArchiveClassesAtExit={self._archive_to}")
        return [*command, "kafka.Kafka", str(self.properties_path)]

    def _expected_cluster_id(self) -> str | None:
        return self._cluster_id


def write_class_archive(version: str = KAFKA_VERSION_DEFAULT) -> Path | None:
    """The broker JVM's class-data archive for ``version``'s jars, written once if missing or older than
    the jars: a throw-away broker starts with ``-XX:ArchiveClassesAtExit`` and stops cleanly, and its JVM
    writes every class it loaded (~50 MB, ~4 s once).  None when the JVM wrote nothing (a JDK without
    dynamic archives): brokers then start without one."""
    import tempfile

    jars = ensure_kafka_jars(version)
    existing = usable_class_archive(jars)
    if existing is not None:
        return existing
    archive = class_archive(jars)
    partial = archive.with_name(f"{archive.name}.partial-{os.getpid()}")
    with tempfile.TemporaryDirectory(prefix="sluice-classes-") as tmp:
        broker = EmbeddedKafka("classes", data_dir=Path(tmp) / "kafka", version=version, jars_dir=jars)
        broker._archive_to = partial
        broker.start()
        broker.stop()
    if not partial.is_file():
        return None
    os.replace(partial, archive)  # brokers starting meanwhile see no archive or a whole one
    return archive
