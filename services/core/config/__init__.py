"""The site configuration: one declarative file per site (DESIGN §5).

``load_config(path)`` reads a YAML (``.yaml``/``.yml``) or TOML (``.toml``)
file and returns a frozen ``SiteConfig``; ``parse_config(data)`` does the same
for a mapping already in memory.  A bad file never half-loads: the result is
a ``ConfigError`` whose ``problems`` list *every* problem found, each as
``(dotted field path, value, reason)``, for example::

    gateway_senders[0].batch_size: must be >= 1 (got 0)

Validation happens in three layers, and all three report in that shape:

1. per field (types, ranges, patterns, unknown keys with a "did you mean"),
   done by pydantic and translated by ``problems``;
2. per section (Geode's own rules, e.g. a parallel sender cannot use the
   THREAD order policy), raised by the section's model as a list of problems;
3. across sections (unique ids, references from regions to senders and
   queues, colocation of parallel queues, topic name collisions), done by
   ``rules`` on plain data, so it runs even when layer 1 failed elsewhere in
   the file and the user sees everything at once.

Defaults are Geode's (see GEODE-FACTS.md) except where Kafka needs its own
(consumer-group timeouts tuned for fast failover).  Values are strict: a
quoted ``"8"`` is not a number and ``yes`` is not a boolean, because a site
file that says something other than what it means is worse than one that
does not load.

Where each concern lives::

    base.py        the strict base model, name patterns and their reasons,
                   the shape of a problem and how a section raises one
    secrets.py     secret sources (value, X_file, X_env), public keys,
                   removed settings; secrets never shown
    models/        one module per section of the file, each model with the
                   rules between its own fields:
      kafka.py          the cluster connection and client timing
      queues.py         gateway senders, async event queues, listeners
      region.py         regions and the region service
      receiver.py       the gateway receiver
      subscriptions.py  client subscription queues
      site.py           the whole site, and lookups over it
    rules.py       the rules across sections, and the sweep of every rule
                   over raw data
    problems.py    pydantic's errors translated into problems
    loading.py     reading YAML and TOML, overrides, load_config/parse_config
"""

# Besides __all__, other modules import the name patterns, the refusal reasons,
# _problems_from_validation and _shown from here.
from .base import (
    _PATTERN_REASONS,
    ENV_NAME_PATTERN,
    NAME_PATTERN,
    SITE_PATTERN,
    TOPIC_PREFIX_PATTERN,
    Problem,
    check_import_path,
)
from .loading import load_config, parse_config
from .models.kafka import KafkaConfig, KafkaConnection, RemoteSiteConfig
from .models.queues import (
    EXPIRATION_REFUSED,
    PERSISTENT_REFUSED,
    AsyncEventQueueConfig,
    GatewaySenderConfig,
    ListenerConfig,
    OrderPolicy,
)
from .models.receiver import ReceiverConfig
from .models.region import RegionConfig, RegionServiceConfig
from .models.site import AttachedQueue, SiteConfig
from .models.subscriptions import SubscriptionsConfig
from .problems import _problems_from_validation
from .secrets import _shown

__all__ = [
    "AsyncEventQueueConfig",
    "AttachedQueue",
    "GatewaySenderConfig",
    "KafkaConfig",
    "KafkaConnection",
    "ListenerConfig",
    "OrderPolicy",
    "Problem",
    "ReceiverConfig",
    "RegionConfig",
    "RegionServiceConfig",
    "RemoteSiteConfig",
    "SiteConfig",
    "SubscriptionsConfig",
    "check_import_path",
    "load_config",
    "parse_config",
]
