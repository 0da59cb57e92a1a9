"""A site logs in to a real Apache Kafka broker with SASL/OAUTHBEARER, both ways Sluice offers.

The embedded broker gets a second listener, SASL_PLAINTEXT with OAUTHBEARER only, beside its
PLAINTEXT one (which the readiness probe and the controller use):

* with Kafka's unsecured validator, a site file with ``sasl_oauthbearer_method: unsecured_jwt``;
* with Kafka's OIDC validator (``OAuthBearerValidatorCallbackHandler``), which checks each token's
  RS256 signature against a JWKS endpoint; a small identity provider served by this test issues the
  tokens at its token endpoint (client credentials, HTTP Basic) and the key set at its JWKS endpoint,
  and a site file with ``sasl_oauthbearer_method: oidc`` logs in through it: librdkafka fetches the
  token with the client id and the secret read from a file, and the broker accepts it.

Each site passes `sluice config check`, `sluice topics apply` creates its topics through the SASL
listener, and a record goes through a producer and a consumer made from the site's settings.  A
connection without the login, and an OIDC login with a wrong secret, get nothing from the listener.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from sluice.broker import BrokerProcess, free_ports
from sluice.core.config import load_config
from sluice.core.kafka import TopicPartition, close_consumer, close_producer, make_admin, make_consumer, make_producer

HOST = "127.0.0.1"
CLIENT_ID = "sluice-london"
CLIENT_SECRET = "oidc-live-secret-41d9"
UNSECURED_VALIDATOR = ("org.apache.kafka.common.security.oauthbearer.internals.unsecured."
                       "OAuthBearerUnsecuredValidatorCallbackHandler")
OIDC_VALIDATOR = "org.apache.kafka.common.security.oauthbearer.OAuthBearerValidatorCallbackHandler"
LOGIN_MODULE = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required;"


def sasl_listener(port: int, sasl_port: int, controller_port: int, **oauthbearer: str) -> dict[str, str]:
    """Broker settings adding a SASL_PLAINTEXT/OAUTHBEARER listener on ``sasl_port``."""
    prefix = "listener.name.sasl_plaintext.oauthbearer."
    return {
        "listeners": f"PLAINTEXT://{HOST}:{port},SASL_PLAINTEXT://{HOST}:{sasl_port},CONTROLLER://{HOST}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{HOST}:{port},SASL_PLAINTEXT://{HOST}:{sasl_port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT",
        "sasl.enabled.mechanisms": "OAUTHBEARER",
        "listener.name.sasl_plaintext.sasl.enabled.mechanisms": "OAUTHBEARER",
        prefix + "sasl.jaas.config": LOGIN_MODULE,
        **{prefix + key: value for key, value in oauthbearer.items()},
    }


def site_file(folder: Path, bootstrap: str, login: dict[str, Any]) -> Path:
    prefix = f"login{uuid.uuid4().hex[:8]}."
    data = {
        "site": "london", "dsid": 1,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix, **login},
        "regions": [{"name": "orders", "buckets": 2, "async_event_queues": ["q"]}],
        "async_event_queues": [{"id": "q", "parallel": True, "listener": {"type": "python", "class_path": "x:Y"}}],
    }
    path = folder / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice.cli", *args], capture_output=True, text=True, timeout=120,
                          check=False)


def round_trip(path: Path) -> None:
    """config check, topics apply through the listener, then one record produced and read back."""
    checked = sluice("config", "check", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert CLIENT_SECRET not in checked.stdout + checked.stderr
    applied = sluice("topics", "apply", "-c", str(path))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    cfg = load_config(path)
    topic = cfg.topics.dead_letter("q")  # one of the topics `topics apply` made, through the listener
    assert topic in make_admin(cfg.kafka.client_settings()).list_topics(timeout=30).topics
    producer = make_producer(cfg.kafka.client_settings())
    value = uuid.uuid4().bytes
    producer.produce(topic, value=value, key=b"k", partition=0)
    assert producer.flush(30) == 0
    close_producer(producer, 5)
    consumer = make_consumer(cfg.kafka.client_settings(), None)
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + 30
        seen: list[bytes] = []
        while value not in seen and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None:
                seen.append(message.value())
        assert value in seen
    finally:
        close_consumer(consumer, "login test reader")


def unreachable(settings: dict[str, Any]) -> bool:
    """True when an admin client with ``settings`` gets no metadata from the listener within 8 s."""
    admin = make_admin({**settings, "log_level": 0})
    try:
        admin.list_topics(timeout=8)
    except Exception:  # noqa: BLE001 (any failure: timed out, or refused by the broker)
        return True
    return False


def test_unsecured_jwt_login_against_kafkas_unsecured_validator(
        broker_factory: Callable[..., BrokerProcess], tmp_path: Path) -> None:
    """unsecured_jwt reaches a real OAUTHBEARER listener: check, topics apply, produce and consume."""
    port, sasl_port, controller_port = free_ports(3)
    broker_factory(site="oauth", port=port, controller_port=controller_port, extra_config=sasl_listener(
        port, sasl_port, controller_port, **{"sasl.server.callback.handler.class": UNSECURED_VALIDATOR}))
    login = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "OAUTHBEARER",
             "sasl_oauthbearer_method": "unsecured_jwt", "sasl_oauthbearer_config": "principal=sluice-london"}
    path = site_file(tmp_path, f"{HOST}:{sasl_port}", login)
    round_trip(path)
    # The listener wants the login: a plain connection to it gets nothing.
    assert unreachable({"bootstrap.servers": f"{HOST}:{sasl_port}", "security.protocol": "PLAINTEXT"})


# --- a small OIDC identity provider -----------------------------------------------------------------


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class IdentityProvider:
    """A token endpoint (client credentials, HTTP Basic) issuing RS256 JWTs, and their JWKS."""

    def __init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.kid = uuid.uuid4().hex
        self.token_requests: list[dict[str, str]] = []
        self.server = ThreadingHTTPServer((HOST, 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.server.server_address[1]}"

    def jwks(self) -> dict[str, Any]:
        numbers = self.key.public_key().public_numbers()
        return {"keys": [{"kty": "RSA", "kid": self.kid, "use": "sig", "alg": "RS256",
                          "n": b64url(numbers.n.to_bytes((numbers.n.bit_length() + 7) // 8, "big")),
                          "e": b64url(numbers.e.to_bytes(3, "big"))}]}

    def token(self, subject: str, scope: str) -> str:
        now = int(time.time())
        header = {"alg": "RS256", "typ": "JWT", "kid": self.kid}
        claims = {"sub": subject, "iss": self.url, "aud": "kafka", "iat": now, "nbf": now, "exp": now + 3600,
                  "scope": scope}
        signing_input = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(claims).encode())}"
        signature = self.key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing_input}.{b64url(signature)}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self._answer(200, provider.jwks()) if self.path == "/jwks" else self._answer(404, {})

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length") or 0)
                form = dict(pair.split("=", 1) for pair in self.rfile.read(length).decode().split("&") if "=" in pair)
                basic = self.headers.get("Authorization", "").removeprefix("Basic ")
                user, _, secret = base64.b64decode(basic or b"").decode().partition(":")
                provider.token_requests.append({**form, "client_id": user})
                if self.path != "/token" or form.get("grant_type") != "client_credentials":
                    self._answer(400, {"error": "unsupported_grant_type"})
                elif (user, secret) != (CLIENT_ID, CLIENT_SECRET):
                    self._answer(401, {"error": "invalid_client"})
                else:
                    scope = form.get("scope", "")
                    self._answer(200, {"access_token": provider.token(user, scope), "token_type": "Bearer",
                                       "expires_in": 3600})

        return Handler

    def __enter__(self) -> IdentityProvider:
        self.thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def identity_provider() -> Iterator[IdentityProvider]:
    with IdentityProvider() as provider:
        yield provider


def test_oidc_login_through_an_identity_provider_against_kafkas_oidc_validator(
        broker_factory: Callable[..., BrokerProcess], tmp_path: Path, identity_provider: IdentityProvider,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """sasl_oauthbearer_method oidc: librdkafka asks the token endpoint with the client id and the secret
    from its file (and the scope), the broker checks the token's signature against the JWKS, and the site
    works through the listener; the same site with a wrong secret gets no token and nothing from Kafka."""
    jwks = f"{identity_provider.url}/jwks"
    # Kafka 4 fetches OAuth URLs only when the JVM allows them (KIP-1139).
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", f"-Dorg.apache.kafka.sasl.oauthbearer.allowed.urls={jwks}")
    port, sasl_port, controller_port = free_ports(3)
    broker_factory(site="oidc", port=port, controller_port=controller_port, extra_config=sasl_listener(
        port, sasl_port, controller_port, **{"sasl.server.callback.handler.class": OIDC_VALIDATOR,
                                             "sasl.oauthbearer.jwks.endpoint.url": jwks,
                                             "sasl.oauthbearer.expected.audience": "kafka",
                                             "sasl.oauthbearer.expected.issuer": identity_provider.url}))
    (tmp_path / "client-secret").write_text(CLIENT_SECRET + "\n")
    login = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "OAUTHBEARER", "sasl_oauthbearer_method": "oidc",
             "sasl_oauthbearer_client_id": CLIENT_ID, "sasl_oauthbearer_client_secret_file": "client-secret",
             "sasl_oauthbearer_token_endpoint_url": f"{identity_provider.url}/token",
             "sasl_oauthbearer_scope": "kafka"}
    path = site_file(tmp_path, f"{HOST}:{sasl_port}", login)
    round_trip(path)
    assert identity_provider.token_requests
    assert all(r["client_id"] == CLIENT_ID and r.get("scope") == "kafka" for r in identity_provider.token_requests)

    (tmp_path / "client-secret").write_text("not-the-secret\n")
    asked = len(identity_provider.token_requests)
    assert unreachable(load_config(path).kafka.client_settings())
    assert len(identity_provider.token_requests) > asked  # it was asked, and said no
