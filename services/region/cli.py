"""``sluice region -c FILE``: run one region-service instance in the foreground."""

from __future__ import annotations

import argparse
from typing import Any

from ..core.config import SiteConfig
from ..core.errors import InvalidRequest
from ..core.servicecli import add_service_parser, run_service, serve_http
from .http import create_app
from .service import RegionService

EXAMPLE = """\
example:
  sluice region -c deploy/sites/site-a.yaml --port 7071
  curl -s -XPOST localhost:7071/regions/orders/put -H 'content-type: application/json' \
       -d '{"key": "o-1", "value": {"qty": 3}}'
  curl -s localhost:7071/regions/orders/entries/o-1
  curl -s localhost:7071/buckets            # who owns which bucket
  open http://localhost:7071/docs           # the API, from its OpenAPI document

Start a second instance (another --port) and the buckets are shared between
them through Kafka's consumer group; a request to either is served.

With a local store, a restarted instance reads only what its buckets'
changelogs gained while it was away (one directory per instance):
  sluice region -c deploy/sites/site-a.yaml --port 7072 --store-dir /var/lib/sluice/a-1

Beyond loopback (--host 0.0.0.0, a pod IP) an instance starts only with
region_service.token and member_token set (or allow_unauthenticated: true);
clients then send `Authorization: Bearer <token>`.
"""


def add_parser(subparsers: Any) -> None:
    p = add_service_parser(
        subparsers, "region",
        help="run a region-service instance (bucket owner + HTTP API)",
        description="Run one region-service instance: owns buckets through the consumer group, applies "
        "operations in order, writes the region changelog and every attached queue.",
        example=EXAMPLE,
    )
    p.add_argument("--host", help="address to listen on (default: region_service.host)")
    p.add_argument("--port", type=int, help="port to listen on, 0 for any (default: region_service.port)")
    p.add_argument("--store-dir", help="this instance's local store of bucket state (default: "
                   "region_service.store_dir; none: state on the heap only)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_service("region", args, lambda cfg: _build(cfg, args), _serve)


def _build(cfg: SiteConfig, args: argparse.Namespace) -> RegionService:
    """The instance, its socket bound (so its URL is known before it starts)."""
    service = RegionService(cfg, host=args.host, port=args.port, store_dir=args.store_dir)
    try:
        service.bind()
    except OSError as exc:
        port = args.port if args.port is not None else cfg.region_service.port
        raise InvalidRequest("--port", port, f"cannot listen on {service.host}: {exc}") from exc
    return service


def _serve(service: RegionService, cfg: SiteConfig) -> int:
    def announce() -> None:
        print(f"region service {service.instance_id} on {service.url} (site {cfg.site}, dsid {cfg.dsid})",
              flush=True)

    return serve_http("region", service, create_app(service), service.bind(), announce)
