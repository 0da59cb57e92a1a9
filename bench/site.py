"""Site files for benchmarks: ``write_site`` writes one and creates its topics.

Services run through ``sluice.core.processes`` (``RegionProcess``,
``DispatcherProcess``): children in sessions of their own, SIGTERMed should
the runner die.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from sluice.core.config import SiteConfig, load_config
from sluice.core.topics import apply_topics



def write_site(
    path: Path,
    *,
    bootstrap: str,
    prefix: str,
    region: str = "orders",
    buckets: int = 8,
    parallel_senders: int = 1,
    async_event_queues: int = 0,
) -> SiteConfig:
    """A site with one region and its attached queues; creates the topics.

    The queues are parallel gateway senders (``to-site-N``, co-partitioned
    with the region) and serial async event queues (``writer-N``, 3 dispatcher
    threads).  Other settings are the defaults a deployment starts from.
    """
    senders = [f"to-site-{i + 2}" for i in range(parallel_senders)]
    queues = [f"writer-{i + 1}" for i in range(async_event_queues)]
    data: dict[str, Any] = {
        "site": "bench",
        "dsid": 1,
        "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": prefix},
        "regions": [
            {
                "name": region,
                "buckets": buckets,
                "gateway_senders": senders,
                "async_event_queues": queues,
            }
        ],
        "gateway_senders": [{"id": s, "remote_dsid": i + 2, "parallel": True} for i, s in enumerate(senders)],
        "async_event_queues": [{"id": q, "parallel": False, "dispatcher_threads": 3} for q in queues],
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = load_config(path)
    report = apply_topics(cfg)
    if not report.ok:
        raise RuntimeError(f"creating the topics of {path} failed: {report}")
    return cfg
