"""/healthz, /readyz and /metrics of a service process, on their own small HTTP server.

The Helm chart probes and scrapes every pod on one port (``SLUICE_METRICS_PORT``,
9464 by default, the container port named ``metrics``):

- ``GET /healthz``: 200 while the process runs and its loop has not crashed
  (states NEW, RUNNING, STOPPING); 503 otherwise, with the state and the crash.
- ``GET /readyz``: 200 only when the service runs, its Kafka clients are
  connected and its assignments (partitions, buckets, tables) are loaded;
  503 otherwise, with a JSON body naming each thing not ready.
- ``GET /metrics``: the OpenTelemetry metrics in Prometheus' text format.

What is probed is any object with a ``state`` (``ServiceState``) and,
optionally, ``crash`` and ``readiness() -> dict[str, str]`` (what is not
ready, and why; empty when ready).  The server runs in daemon threads and
never touches the service's Kafka clients: ``readiness()`` reads flags the
service's own threads keep.
"""

from __future__ import annotations

import http.server
import logging
import threading
from typing import Any

import orjson

from .lifecycle import ServiceState

log = logging.getLogger("sluice.health")

ALIVE = (ServiceState.NEW, ServiceState.RUNNING, ServiceState.STOPPING)


def liveness(service: Any) -> tuple[bool, dict[str, Any]]:
    state = service.state
    body: dict[str, Any] = {"state": state.value}
    crash = getattr(service, "crash", None)
    if crash is not None:
        body["crash"] = repr(crash)
    return state in ALIVE, body


def readiness(service: Any) -> tuple[bool, dict[str, Any]]:
    state = service.state
    not_ready: dict[str, str] = {}
    if state is not ServiceState.RUNNING:
        not_ready["state"] = f"the service is {state.value}"
    else:
        check = getattr(service, "readiness", None)
        if callable(check):
            not_ready.update(check())
    body: dict[str, Any] = {"ready": not not_ready, "state": state.value}
    if not_ready:
        body["not_ready"] = not_ready
    return not not_ready, body


class HealthServer:
    """Serves /healthz, /readyz and /metrics for ``service``; ``port`` 0 picks a free one."""

    def __init__(self, service: Any, port: int, host: str = "0.0.0.0", registry: Any = None) -> None:
        self.service = service
        self.registry = registry
        handler = _handler_for(self)
        self._server = http.server.ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="health-http", daemon=True)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> "HealthServer":
        self._thread.start()
        log.info("health and metrics on %s (/healthz, /readyz, /metrics)", self.url,
                 extra={"metrics_port": self.port})
        return self

    def stop(self) -> None:
        """Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def metrics_text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        if self.registry is None:
            return b"", CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def __enter__(self) -> "HealthServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _handler_for(server: HealthServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                ok, body = liveness(server.service)
                self._json(200 if ok else 503, body)
            elif path == "/readyz":
                ok, body = readiness(server.service)
                self._json(200 if ok else 503, body)
            elif path == "/metrics":
                data, content_type = server.metrics_text()
                self._send(200, data, content_type)
            else:
                self._json(404, {"error": "NotFound", "message": f"no {path}: /healthz, /readyz or /metrics"})

        def _json(self, status: int, body: dict[str, Any]) -> None:
            self._send(status, orjson.dumps(body, default=str), "application/json")

        def _send(self, status: int, data: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            pass  # probes every few seconds would drown the service's own log

    return Handler


__all__ = ["HealthServer", "liveness", "readiness"]
