"""The one Kafka error boundary (``core.kafka.kafka_errors``), the stop signal, and every retry loop
deciding by ``retriable`` alone: a failure that is not retriable is raised (or refused) at once, a
retriable one is tried again.  No broker: Kafka's clients are stand-ins raising what librdkafka raises."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
from confluent_kafka import KafkaError, KafkaException

from sluice.core import errors as errors_module
from sluice.core import kafka
from sluice.core.errors import (
    BrokerUnavailable,
    CodecError,
    DeliveryRefused,
    InvalidRequest,
    KafkaCallFailed,
    KafkaFatal,
    NotOwner,
    RegionError,
    RegionUnavailable,
    SluiceError,
    Stopping,
    TransactionAbortable,
)
from sluice.core.kafka import kafka_errors, produce_durably, until_answered

SERVICES = Path(__file__).resolve().parents[2] / "services"


def raised(exc: BaseException, what: str = "reading the acks") -> BaseException:
    """What leaves ``with kafka_errors(what)`` when ``exc`` is raised inside."""
    try:
        with kafka_errors(what):
            raise exc
    except BaseException as out:  # noqa: BLE001 - the test looks at whatever came out
        return out
    raise AssertionError("nothing raised")


def kafka_exception(code: int, **flags: bool) -> KafkaException:
    return KafkaException(KafkaError(code, "injected", **flags))


# --- 1. kafka_errors: librdkafka's classification, the cause, the call named, the code kept -------------

@pytest.mark.parametrize(("exc", "kind", "retriable", "code"), [
    (kafka_exception(KafkaError._FENCED, fatal=True), KafkaFatal, False, KafkaError._FENCED),
    (kafka_exception(KafkaError._TIMED_OUT, retriable=True), BrokerUnavailable, True, KafkaError._TIMED_OUT),
    # librdkafka flags retriable() only on its transactional calls' errors: a broker away is retriable by its code.
    (kafka_exception(KafkaError._TRANSPORT), BrokerUnavailable, True, KafkaError._TRANSPORT),
    (kafka_exception(KafkaError.NOT_ENOUGH_REPLICAS), BrokerUnavailable, True, KafkaError.NOT_ENOUGH_REPLICAS),
    (kafka_exception(KafkaError.TOPIC_AUTHORIZATION_FAILED), BrokerUnavailable, False,
     KafkaError.TOPIC_AUTHORIZATION_FAILED),
    (kafka_exception(KafkaError.INVALID_TXN_STATE, txn_requires_abort=True), TransactionAbortable, False,
     KafkaError.INVALID_TXN_STATE),
    (kafka_exception(KafkaError.TOPIC_ALREADY_EXISTS), BrokerUnavailable, False, KafkaError.TOPIC_ALREADY_EXISTS),
    (BufferError("Local: Queue full"), BrokerUnavailable, True, KafkaError._QUEUE_FULL),
])
def test_kafka_errors_maps_each_failure_to_its_typed_error(exc: BaseException, kind: type, retriable: bool,
                                                          code: int) -> None:
    out = raised(exc)
    assert type(out) is kind and isinstance(out, KafkaCallFailed)
    assert out.retriable is retriable
    assert out.code == code
    assert out.__cause__ is exc
    assert str(out).startswith("reading the acks: ")


def test_a_fatal_error_stays_fatal_even_when_librdkafka_also_flags_it_abortable() -> None:
    out = raised(kafka_exception(KafkaError._FENCED, fatal=True, txn_requires_abort=True))
    assert type(out) is KafkaFatal and not out.retriable


def test_kafka_errors_leaves_everything_else_as_it_is() -> None:
    """A Sluice error raised inside keeps its own message; a bug stays a bug; no exception, nothing."""
    own = NotOwner("orders", 3)
    assert raised(own) is own
    bug = KeyError("x")
    assert raised(bug) is bug
    with kafka_errors("nothing wrong"):
        pass


def test_kafka_errors_can_be_made_once_and_entered_again_and_again() -> None:
    """A hot loop keeps one: each failure is translated on its own."""
    writing = kafka_errors("writing to a client queue")
    for code in (KafkaError._TRANSPORT, KafkaError.TOPIC_AUTHORIZATION_FAILED):
        with pytest.raises(BrokerUnavailable) as caught:
            with writing:
                raise kafka_exception(code)
        assert caught.value.code == code


def test_no_module_of_the_services_but_core_kafka_catches_or_imports_kafka_exception() -> None:
    """The boundary is one: ``KafkaException`` appears in no ``except`` clause and no import outside it,
    and nothing else imports confluent_kafka but core/registry.py, the schema registry's own boundary (HTTP,
    whose errors it translates), which imports only confluent_kafka's schema_registry and serialization."""
    offenders = []
    for path in sorted(SERVICES.rglob("*.py")):
        if path == SERVICES / "core" / "kafka.py":
            continue
        if path == SERVICES / "core" / "registry.py":
            imported = {node.module for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
                        and (node.module or "").startswith("confluent_kafka")}
            assert imported <= {"confluent_kafka.schema_registry", "confluent_kafka.schema_registry.avro",
                                "confluent_kafka.serialization"}, imported
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                names = [n.id if isinstance(n, ast.Name) else getattr(n, "attr", "")
                         for n in ast.walk(node.type) if isinstance(n, (ast.Name, ast.Attribute))]
            elif isinstance(node, ast.ImportFrom):
                names = [alias.name for alias in node.names] + ["KafkaException"] * (
                    (node.module or "").startswith("confluent_kafka"))
            elif isinstance(node, ast.Import):
                names = ["KafkaException" for alias in node.names if alias.name.startswith("confluent_kafka")]
            if "KafkaException" in names:
                offenders.append(f"{path.relative_to(SERVICES)}:{node.lineno}")
    assert offenders == []


def test_every_error_class_of_the_services_lives_in_core_errors() -> None:
    """An exception class defined elsewhere is private to its module (a leading underscore, never
    raised past it) or a tool's own (verify/)."""
    found = []
    for path in sorted(SERVICES.rglob("*.py")):
        if path == SERVICES / "core" / "errors.py" or path.parent.name == "verify":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if any(b.endswith(("Error", "Exception")) or _is_exception(getattr(errors_module, b, None))
                       for b in bases):
                    found.append(f"{path.relative_to(SERVICES)}: {node.name}")
    assert found == []


def _is_exception(found: Any) -> bool:
    return isinstance(found, type) and issubclass(found, BaseException)


def test_every_error_says_whether_it_is_retriable() -> None:
    classes = [c for c in vars(errors_module).values() if isinstance(c, type) and issubclass(c, SluiceError)]
    assert len(classes) > 30
    assert all(isinstance(c.retriable, bool) for c in classes)
    assert {c.__name__ for c in classes if c.retriable} >= {
        "NotOwner", "BucketUnavailable", "OwnershipUnconfirmed", "BrokerUnavailable", "TablesBehind",
        "DeliveryRefused", "RegionUnavailable", "NoServersAvailable"}


# --- 2. the stop signal -------------------------------------------------------------------------------

def test_except_exception_does_not_swallow_a_stop() -> None:
    def careless() -> None:
        try:
            raise Stopping("waiting for the broker")
        except Exception:  # noqa: BLE001 - the careless handler the stop must pass
            pytest.fail("a stop was taken for a failure")

    with pytest.raises(Stopping, match="waiting for the broker"):
        careless()
    assert not issubclass(Stopping, Exception)


class Producer:
    """A producer stand-in: ``refusals`` are raised by produce() in turn, ``reports`` handed to the
    delivery callbacks in turn (None: delivered)."""

    def __init__(self, refusals: list[BaseException] | None = None, reports: list[KafkaError | None] | None = None):
        self.refusals = list(refusals or [])
        self.reports = list(reports or [])
        self.produced = 0
        self._pending: list[Callable[[Any, Any], None]] = []

    def produce(self, topic: str, value: bytes, key: bytes | None, on_delivery: Any = None, **_: Any) -> None:
        self.produced += 1
        if self.refusals:
            raise self.refusals.pop(0)
        self._pending.append(on_delivery)

    def flush(self, _timeout: float = 0) -> int:
        pending, self._pending = self._pending, []
        for report in pending:
            report(self.reports.pop(0) if self.reports else None, None)
        return 0

    def poll(self, _timeout: float = 0) -> int:
        return 0


@pytest.fixture()
def no_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka, "WRITE_RETRY_BACKOFF_S", 0.0)
    monkeypatch.setattr(kafka, "ASK_AGAIN_AFTER_S", 0.0)


def test_a_stop_ends_a_durable_write_through_a_handler_of_exceptions(no_pauses: None) -> None:
    """produce_durably waiting on a full producer queue, the service stopping: ``Stopping`` reaches the
    top of the thread even past an ``except Exception`` in between."""
    stopping = threading.Event()
    stopping.set()
    producer = Producer(refusals=[BufferError("Local: Queue full")])

    def worker() -> None:
        try:
            produce_durably(producer, "t", b"v", None, what="an ack", stopping=stopping)  # type: ignore[arg-type]
        except Exception:  # noqa: BLE001
            pytest.fail("the stop was swallowed")

    with pytest.raises(Stopping, match="an ack"):
        worker()


# --- 3. every retry loop: not retriable → at once; retriable → again ---------------------------------

def test_until_answered_asks_again_only_while_the_failure_is_retriable(no_pauses: None) -> None:
    """Kafka's failures are translated first; a Sluice error raised by the read counts as it says."""
    for failure, asked in ((NotOwner("orders", 1), 3), (CodecError("not a RemovalRecord"), 1),
                           (kafka_exception(KafkaError._TRANSPORT), 3),
                           (kafka_exception(KafkaError.TOPIC_AUTHORIZATION_FAILED), 1)):
        calls: list[int] = []

        def ask() -> str:
            calls.append(1)
            if len(calls) < 3:
                raise failure
            return "read"

        if asked == 1:
            with pytest.raises(SluiceError):
                until_answered(ask, "reading", stopping=threading.Event())
        else:
            assert until_answered(ask, "reading", stopping=threading.Event()) == "read"
        assert len(calls) == asked, failure


@pytest.mark.parametrize(("producer", "produced"), [
    (Producer(refusals=[kafka_exception(KafkaError._UNKNOWN_PARTITION)]), 2),
    (Producer(refusals=[kafka_exception(KafkaError.TOPIC_AUTHORIZATION_FAILED)]), 1),
    (Producer(reports=[KafkaError(KafkaError._MSG_TIMED_OUT)]), 2),
    (Producer(reports=[KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)]), 1),
])
def test_a_durable_write_is_produced_again_only_after_a_retriable_failure(no_pauses: None, producer: Producer,
                                                                         produced: int) -> None:
    """Refused by produce() or by its delivery report: retriable, produced again until written; not
    retriable, raised after the one try."""
    write = lambda: produce_durably(producer, "t", b"v", None, what="a dead letter",  # noqa: E731
                                    stopping=threading.Event())  # type: ignore[arg-type]
    if produced == 1:
        with pytest.raises(BrokerUnavailable, match="a dead letter") as caught:
            write()
        assert not caught.value.retriable
    else:
        write()
    assert producer.produced == produced


def test_the_region_client_retries_only_what_the_answer_calls_retriable() -> None:
    """RegionClient's tenacity loop: a 400 is raised after one request; a 503 marked retriable is asked
    again until the service answers."""
    from sluice.core.regionclient import RegionClient

    answers: list[httpx.Response] = []
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return answers.pop(0)

    client = RegionClient("http://region", retry_for_s=30)
    client._http = httpx.Client(transport=httpx.MockTransport(handler))
    answers[:] = [httpx.Response(400, json={"error": "InvalidRequest", "message": "key: too long"})]
    with pytest.raises(RegionError) as refused:
        client.put("orders", "k", 1)
    assert refused.value.status == 400 and not refused.value.retriable and len(seen) == 1

    seen.clear()
    later = {"error": "BucketUnavailable", "message": "loading", "retriable": True}
    answers[:] = [httpx.Response(503, json=later), httpx.Response(503, json=later),
                  httpx.Response(200, json={"status": "ok"})]
    assert client.put("orders", "k", 1) == {"status": "ok"}
    assert len(seen) == 3 and client.retries == 2
    client.close()


def test_the_receiver_refuses_an_event_failing_for_good_instead_of_retrying_it_for_ever(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request failing with an error that is not retriable and is no refusal of the region service (a
    record that cannot be written) is refused like a 400: halved until the failing event stands alone,
    an exception of the ack; the others applied.  Before, every SluiceError was retried: the lane wedged."""
    from test_remote_batch import event, handed, keys_in

    from sluice.receiver import routing as routing_module

    monkeypatch.setattr(routing_module, "APPLY_BACKOFF_FIRST_S", 0.0)
    keys = keys_in("http://x", 3)
    requests: list[list[str]] = []

    def answer(url: str, ks: list[str]) -> Exception | dict[str, Any]:
        requests.append(ks)
        if len(requests) > 20:
            raise AssertionError(f"asked {len(requests)} times: retried for ever")
        return CodecError("events[0]: cannot be written") if keys[1] in ks else {}

    applied, _, _, _ = handed([event(k, i) for i, k in enumerate(keys)], {b: "http://x" for b in range(8)}, answer)
    assert {i: e["exception_class"] for i, e in applied.exceptions.items()} == {1: "CodecError"}
    assert (applied.applied, applied.last_index) == (2, 2)
    assert requests.count([keys[1]]) == 1, "the failing event was tried once"

    requests.clear()
    moved = {"n": 0}

    def unanswered_then_applied(url: str, ks: list[str]) -> Exception | dict[str, Any]:
        moved["n"] += 1
        return RegionUnavailable("http://x: ConnectError") if moved["n"] < 3 else {}

    applied, _, _, _ = handed([event(k, i) for i, k in enumerate(keys)], {b: "http://x" for b in range(8)},
                              unanswered_then_applied)
    assert moved["n"] == 3 and applied.exceptions == {} and applied.applied == 3


def queue_loop(tmp_path: Path, deliver: Callable[[int], int]) -> Any:
    """A queue primary (test_queueloop's stand-ins) whose ``deliver_group`` is ``deliver(attempt)``."""
    from test_queueloop import Loop, entry, make_loop, record

    class Offering(Loop):
        attempts = 0

        def deliver_group(self, part: Any, batches: list[Any]) -> int:
            self.attempts += 1
            return deliver(self.attempts)

    loop = make_loop(tmp_path, Offering)
    loop._pool.shutdown(wait=True)
    loop.backoff_max_s = 0.0
    monkeypatched_backoff = lambda attempts: 0.0  # noqa: E731
    loop._backoff_s = monkeypatched_backoff
    from test_queueloop import FakeMessage

    loop._read([FakeMessage(record(entry("k", 0)), 0, 0)], now_ms=0)
    return loop


def offered(loop: Any) -> list[tuple[str, Any]]:
    part = loop._partitions[0]
    group = [part.batcher.take(0, force=True)]
    loop._offer(part, group)
    results = []
    while not loop._inbox.empty():
        results.append(loop._inbox.get_nowait())
    return results


@pytest.mark.parametrize("failure", [DeliveryRefused("no ack"), RuntimeError("the listener's own"),
                                     BrokerUnavailable("remote site unreachable")])
def test_a_queue_offers_a_batch_again_after_a_retriable_failure(tmp_path: Path, failure: Exception) -> None:
    """A refusal, a listener's own exception (Geode offers a batch again whose processEvents threw) and a
    retriable error: offered again until delivered."""
    def deliver(attempt: int) -> int:
        if attempt < 3:
            raise failure
        return 1

    loop = queue_loop(tmp_path, deliver)
    results = offered(loop)
    assert loop.attempts == 3
    [(kind, done)] = results
    assert kind == "done" and done.accepted == 1 and done.attempts == 3


class Runaway(BaseException):
    """Ends a loop that would offer for ever (no handler of the loop's catches it)."""


@pytest.mark.parametrize("first", [True, False])
def test_a_queue_stops_as_crashed_on_a_failure_no_retry_can_mend(tmp_path: Path, first: bool) -> None:
    """A failure that is not retriable (here a dead-letter topic refusing writes), on the first offer or a
    later one: not offered again; the loop raises it (the queue stops as crashed), the batch kept."""
    fatal = BrokerUnavailable("dead letter: Broker: Topic authorization failed", retriable=False)

    def deliver(attempt: int) -> int:
        if attempt > 20:
            raise Runaway(f"offered {attempt} times: retried for ever")
        if first or attempt > 1:
            raise fatal
        raise DeliveryRefused("no ack")

    loop = queue_loop(tmp_path, deliver)
    results = offered(loop)
    assert loop.attempts == (1 if first else 2)
    assert [kind for kind, _ in results] == ["failed", "done"]
    assert results[0][1] is fatal and results[1][1].accepted == 0
    loop._inbox.put(results[0])
    loop._drain_inbox()
    with pytest.raises(BrokerUnavailable, match="authorization"):
        loop._raise_failed_offer()


def gateway_sender(tmp_path: Path) -> Any:
    from test_queue_settings import primed, site

    from sluice.sender.service import GatewaySenderService

    sender = primed(GatewaySenderService(site(tmp_path), "to-b"))
    sender._pool.shutdown(wait=True)
    sender._inbound_partitions = 4
    sender._batch_versions = {p: 3 for p in range(4)}
    return sender


class RemoteProducer:
    def __init__(self, refusal: BaseException) -> None:
        self.refusal = refusal
        self.produced = 0

    def produce(self, *_: Any, **__: Any) -> None:
        self.produced += 1
        raise self.refusal


def test_a_sender_refuses_for_now_what_is_retriable_and_raises_what_is_not(tmp_path: Path) -> None:
    """deliver_group: a write the remote producer refuses retriably (its queue full) is a refusal (0: the
    batches are offered again); one it refuses for good is raised (the sender stops as crashed)."""
    from test_queueloop import FakeMessage, entry, record

    for refusal, retriable in ((BufferError("Local: Queue full"), True),
                               (kafka_exception(KafkaError.TOPIC_AUTHORIZATION_FAILED), False)):
        sender = gateway_sender(tmp_path)
        sender._remote_producer = RemoteProducer(refusal)
        sender._read([FakeMessage(record(entry("k", 0)), 0, 0)], now_ms=0)
        part = sender._partitions[0]
        group = [part.batcher.take(0, force=True)]
        if retriable:
            assert sender.deliver_group(part, group) == 0
        else:
            with pytest.raises(BrokerUnavailable, match="writing to b.gateway.inbound at dsid 2: injected") as caught:
                sender.deliver_group(part, group)
            assert not caught.value.retriable
        assert sender._remote_producer.produced == 1 and not sender._in_flight


class AckReader:
    """The sender's ack reader: list_topics raises ``failures`` in turn, then the test stops the sender."""

    def __init__(self, failures: list[BaseException], stopping: Any) -> None:
        self.failures = failures
        self.stopping = stopping
        self.asked = 0
        self.closed = False

    def list_topics(self, *_: Any, **__: Any) -> Any:
        self.asked += 1
        if self.failures:
            raise self.failures.pop(0)
        self.stopping.set()
        raise kafka_exception(KafkaError._TRANSPORT)

    def close(self) -> None:
        self.closed = True


def test_the_senders_ack_thread_reads_again_while_retriable_and_fails_the_sender_when_not(tmp_path: Path) -> None:
    from test_queueloop import FakeMessage, entry, record

    sender = gateway_sender(tmp_path)
    sender._stopping = Waits()
    sender._ack_reader = AckReader([kafka_exception(KafkaError._TRANSPORT)] * 2, sender._stopping)
    sender._read_acks()
    assert sender._ack_reader.asked == 3 and sender._acks_failed is None and sender._ack_reader.closed

    sender = gateway_sender(tmp_path)
    sender._ack_reader = AckReader([kafka_exception(KafkaError.TOPIC_AUTHORIZATION_FAILED)], sender._stopping)
    sender._read_acks()
    assert sender._ack_reader.asked == 1 and isinstance(sender._acks_failed, BrokerUnavailable)
    sender._remote_producer = RemoteProducer(BufferError("Local: Queue full"))  # alone, a refusal for now
    sender._read([FakeMessage(record(entry("k", 0)), 0, 0)], now_ms=0)
    part = sender._partitions[0]
    with pytest.raises(BrokerUnavailable, match="reading b.gateway.acks: injected"):
        sender.deliver_group(part, [part.batcher.take(0, force=True)])


class Waits:
    """A ``_stopping`` event that never waits, set after ``turns`` waits."""

    def __init__(self, turns: int = 1_000) -> None:
        self.turns = turns

    def is_set(self) -> bool:
        return self.turns <= 0

    def wait(self, _seconds: float = 0) -> bool:
        self.turns -= 1
        return self.turns <= 0

    def set(self) -> None:
        self.turns = 0


def region_engine() -> Any:
    from test_region_settings import engine

    return engine()


def test_the_region_loader_tries_a_bucket_again_only_after_a_retriable_failure() -> None:
    """A load failing retriably (a broker away) is queued again and loads; one that cannot succeed ends
    the loader thread at once (its crash stops the engine), not retried for ever."""
    region = region_engine()
    region._stopping = Waits()
    region._new_readers = lambda: (Closing(), Closing())
    tried: list[int] = []

    def load(reader: Any, high_reader: Any, region_name: str, bucket: int, epoch: int) -> None:
        tried.append(bucket)
        if len(tried) == 1:
            raise BrokerUnavailable("changelog a.region.orders[0] stopped at 3 before 9")
        region._loads.put(None)

    region._load = load
    region._loads.put(("orders", 0, 1))
    region._load_loop()
    assert tried == [0, 0]

    region = region_engine()
    region._stopping = Waits()
    region._new_readers = lambda: (Closing(), Closing())
    tried.clear()

    def refused(reader: Any, high_reader: Any, region_name: str, bucket: int, epoch: int) -> None:
        tried.append(bucket)
        raise BrokerUnavailable("reading the changelog: Broker: Topic authorization failed", retriable=False)

    region._load = refused
    region._loads.put(("orders", 0, 1))
    region._loads.put(None)
    with pytest.raises(BrokerUnavailable, match="authorization"):
        region._load_loop()
    assert tried == [0]


class Closing:
    def close(self, *_: Any) -> None:
        pass


class Writer:
    def __init__(self) -> None:
        self.producer = Closing()
        self.replaced: list[Any] = []

    def replace_producer(self, producer: Any, wedged: bool) -> None:
        self.replaced.append(producer)
        self.producer = producer


def test_the_transactional_producer_is_built_again_only_while_its_failure_is_retriable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.region import engine as engine_module

    monkeypatch.setattr(engine_module, "close_producer", lambda *_: None)
    for failures, outcome in (([BrokerUnavailable("coordinator away"), BrokerUnavailable("coordinator away")],
                               "built"),
                              ([KafkaFatal("initializing transactions: Broker: Transactional Id authorization "
                                           "failed")], KafkaFatal)):
        region = region_engine()
        region._stopping = Waits()
        region._writer = Writer()
        built = Closing()
        tries: list[int] = []

        def new_producer(failures: list[Exception] = failures) -> Any:
            tries.append(1)
            if failures:
                raise failures.pop(0)
            return built

        region._new_producer = new_producer
        if outcome == "built":
            region._rebuild_producer(None)
            assert len(tries) == 3 and region._writer.producer is built
        else:
            with pytest.raises(KafkaFatal):
                region._rebuild_producer(None)
            assert len(tries) == 1


def test_the_window_commit_is_asked_again_only_while_retriable() -> None:
    """fanout.WindowWriter._commit: a non-retriable commit failure is not made again (the window is aborted);
    test_fanout has the retriable and the abortable cases."""
    from test_fanout import FakeTransactionalProducer, a_window, kafka_error, write

    producer = FakeTransactionalProducer(fail={"commit": kafka_error(KafkaError.TOPIC_AUTHORIZATION_FAILED)})
    outcome = write(producer, a_window())
    assert producer.calls[-2:] == ["commit", "abort"] and producer.calls.count("commit") == 1
    assert outcome.committed is None and outcome.error is not None


def test_the_standby_reader_starts_again_after_a_retriable_failure_and_ends_on_another(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.core.codec import get_codec
    from sluice.region import standby as standby_module

    made: list[Closing] = []

    def make_consumer(*_: Any, **__: Any) -> Closing:
        made.append(Closing())
        return made[-1]

    monkeypatch.setattr(standby_module, "make_consumer", make_consumer)
    for failure, consumers in ((kafka_exception(KafkaError._TRANSPORT), 2),
                               (kafka_exception(KafkaError.TOPIC_AUTHORIZATION_FAILED), 1)):
        made.clear()
        keeper = standby_module.StandbyKeeper(kafka_settings={}, client_id="c", changelog_topics={"orders": "t"},
                                              dsid=1, member_id="m", codec=get_codec())
        keeper._stopping = Waits()
        failures = [failure]

        def reconcile(consumer: Any) -> None:
            if failures:
                raise failures.pop(0)
            keeper._stopping.set()

        keeper._reconcile = reconcile
        if consumers == 1:
            with pytest.raises(BrokerUnavailable, match="standby reader: injected"):
                keeper._run()
        else:
            keeper._run()
        assert len(made) == consumers


def test_a_wan_copy_batch_refused_for_good_is_asked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """region/wancopy's retry loop: a retriable refusal is asked again, another fails the copy after one try."""
    from test_wancopy import SimulatedOwners, bucket_keys, run_copy

    from sluice.region.wancopy import CopyState

    failing = SimulatedOwners(bucket_keys(1, 5), refusals=[InvalidRequest("sender_id", "x", "gone")] * 5)
    copy = run_copy(failing)
    assert copy.state is CopyState.FAILED and len(failing.refusals) == 4


def test_a_client_queue_write_refused_on_the_hot_path_goes_through_the_slow_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """subscriptions: a full producer queue at a delivery is waited out and the record written; a queue the
    producer knows is gone is noted and not written; anything else not retriable stops the fill."""
    from test_subscription_queue_bound import BOUND, Producer as QueueProducer, _fill, _primary

    from sluice.core.config import parse_config

    cfg = parse_config({"site": "s", "dsid": 1, "kafka": {"bootstrap_servers": "k:9092", "topic_prefix": "x."},
                        "regions": [{"name": "orders", "buckets": 1}],
                        "subscriptions": {"registry_partitions": 1, "maximum_message_count": BOUND}})

    class Refusing(QueueProducer):
        def __init__(self, refusals: list[BaseException]) -> None:
            super().__init__()
            self.refusals = refusals

        def produce(self, topic: str, value: bytes | None = None, *args: Any, **kwargs: Any) -> None:
            if self.refusals:
                raise self.refusals.pop(0)
            super().produce(topic, value, *args, **kwargs)

    service, client, _, _ = _primary(cfg, queue_end=0, acked=0)
    queue = client.record["queue_topic"]
    service._producer = producer = Refusing([BufferError("Local: Queue full")])
    _fill(service, 0, 2)
    assert len(producer.to(queue)) == 2 and client.filled == 2

    service, client, _, _ = _primary(cfg, queue_end=0, acked=0)
    service._producer = producer = Refusing([kafka_exception(KafkaError._UNKNOWN_TOPIC)] * 4)  # 2 tries each
    _fill(service, 0, 2)
    assert producer.to(queue) == [] and service._missing_queues == {queue}

    service, client, _, _ = _primary(cfg, queue_end=0, acked=0)
    service._producer = Refusing([kafka_exception(KafkaError.TOPIC_AUTHORIZATION_FAILED)] * 2)
    with pytest.raises(BrokerUnavailable, match=f"writing to {queue}: injected"):
        _fill(service, 0, 1)


def test_watermarks_ask_again_while_a_new_partition_has_no_leader_and_not_past_a_refusal_for_good(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A topic created a moment ago answers 'Not leader for partition' until its leader is elected: asked
    again (it failed an admin page's request once); a topic it may not read is raised at once; a leader that never
    comes is raised at the deadline."""
    from confluent_kafka import TopicPartition
    from test_subscriptions_protocol import _Tables as Watermarks  # fails with the errors given, then (0, 5)

    def refused(*codes: int) -> list[KafkaException]:
        return [KafkaException(KafkaError(code)) for code in codes]

    monkeypatch.setattr(kafka, "WATERMARKS_RETRY_PAUSE_S", 0.0)
    tp = TopicPartition("t", 0)
    consumer = Watermarks(*refused(KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE))
    assert kafka.watermarks(consumer, tp) == (0, 5) and consumer.calls == 3  # type: ignore[arg-type]

    forbidden = Watermarks(*refused(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    with pytest.raises(KafkaException):
        kafka.watermarks(forbidden, tp)  # type: ignore[arg-type]
    assert forbidden.calls == 1

    monkeypatch.setattr(kafka, "WATERMARKS_RETRY_DEADLINE_S", 0.0)
    never = Watermarks(*refused(*[KafkaError.NOT_LEADER_FOR_PARTITION] * 5))
    with pytest.raises(KafkaException):
        kafka.watermarks(never, tp)  # type: ignore[arg-type]
    assert never.calls == 1
