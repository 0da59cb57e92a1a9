"""The rules across sections, and the sweep that runs every rule on raw file data.

A model's own rules run only when all of its fields are valid.  So that a
user sees every problem of a file at once, ``_all_rule_problems`` runs every
section's rules (kept beside their models) and the rules across sections on
the raw data when validation failed anywhere.  The rules across sections
(``_site_problems``: unique ids, references from regions to senders and
queues, colocation of parallel queues, keys for every signing peer, topic
name collisions) work on plain, possibly invalid data: anything of the wrong
shape is skipped, because the field checks report it.  ``SiteConfig`` runs
them on its dump once every field is valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..topics import TopicNames
from .base import Problem, _as_int, _get, _join, _suggest
from .models.kafka import KafkaConfig, _connection_rules, _timing_rules
from .models.queues import _listener_rules, _queue_rules, _sender_rules
from .models.region import RegionConfig
from .secrets import _PUBLIC_KEY_MAPS, _dsid_key, _public_key_problems, _removed_problems, _secret_source_problems


def _all_rule_problems(data: Mapping[str, Any]) -> list[Problem]:
    """Every rule of every section of raw file data, with full field paths."""

    def under(prefix: str, problems: list[Problem]) -> list[Problem]:
        return [(_join(prefix, field), value, reason) for field, value, reason in problems]

    problems: list[Problem] = []
    kafka = data.get("kafka")
    if isinstance(kafka, Mapping):
        problems += under("kafka", _connection_rules(kafka) + _timing_rules(kafka))
    # The sources of the secrets read at load time (see ``secrets``).
    problems += _removed_problems(data)
    problems += _secret_source_problems(data, "gateway_private_key")
    problems += _public_key_problems(data)
    region_service = data.get("region_service")
    if isinstance(region_service, Mapping):
        problems += under("region_service", _secret_source_problems(region_service, "token")
                          + _secret_source_problems(region_service, "member_token"))
    subscriptions = data.get("subscriptions")
    if isinstance(subscriptions, Mapping):
        problems += under("subscriptions", _secret_source_problems(subscriptions, "token"))
    for i, sender in _entries(data, "gateway_senders"):
        problems += under(f"gateway_senders[{i}]", _sender_rules(sender))
        remote = sender.get("remote")
        if isinstance(remote, Mapping):
            problems += under(f"gateway_senders[{i}].remote", _connection_rules(remote))
    for i, queue in _entries(data, "async_event_queues"):
        problems += under(f"async_event_queues[{i}]", _queue_rules(queue))
        listener = queue.get("listener")
        if isinstance(listener, Mapping):
            problems += under(f"async_event_queues[{i}].listener", _listener_rules(listener))
    return problems + _site_problems(data)


# --- rules across sections, on plain data --------------------------------------


def _key_problems(data: Mapping[str, Any], dsid: int | None,
                  senders: list[tuple[int, Mapping[str, Any]]]) -> list[Problem]:
    """Signing is all or nothing for a site: once it has a private key or any other site's public key, it
    signs what it sends and verifies everything it takes, so every site it exchanges events with needs a key."""
    keys = {_dsid_key(d) for name in _PUBLIC_KEY_MAPS if isinstance(data.get(name), Mapping) for d in data[name]}
    private = any(data.get(f"gateway_private_key{s}") is not None for s in ("", "_file", "_env"))
    if not keys and not private:
        return []
    problems: list[Problem] = []
    if not private:
        problems.append(("gateway_private_key", None, "is required with gateway_public_keys: a site that "
                         "verifies others signs its own batches and acks (`sluice keys generate`)"))
    if dsid is not None and dsid in keys:
        problems.append((f"gateway_public_keys[{dsid}]", "...", "is this site's own dsid: list the other sites' "
                         "public keys; this site's own comes from gateway_private_key"))
    receiver = data.get("receiver")
    accepted = receiver.get("accepted_dsids") if isinstance(receiver, Mapping) else None
    missing = sorted({d for d in accepted if isinstance(d, int)} - keys) if isinstance(accepted, (list, tuple)) else []
    if missing:
        problems.append(("gateway_public_keys", sorted(keys), f"has no key for accepted dsid(s) {missing}: a "
                         "signing site verifies every batch it applies (receiver.accepted_dsids)"))
    for i, sender in senders:
        remote = _as_int(sender.get("remote_dsid"))
        if remote is not None and remote not in keys:
            problems.append((f"gateway_senders[{i}].remote_dsid", remote, f"has no key in gateway_public_keys: "
                             "a signing site verifies the acks of every site it sends to"))
    return problems


def _site_problems(data: Mapping[str, Any]) -> list[Problem]:
    """Problems that span sections.

    Works on raw, possibly invalid data (anything of the wrong shape is
    skipped; layer 1 reports it), so these checks run even when a field
    elsewhere is wrong.
    """
    problems: list[Problem] = []
    dsid = _as_int(data.get("dsid"))
    regions = _entries(data, "regions")
    senders = _entries(data, "gateway_senders")
    aeqs = _entries(data, "async_event_queues")

    problems += _key_problems(data, dsid, senders)

    first_region: dict[str, int] = {}
    for i, region in regions:
        name = region.get("name")
        if not isinstance(name, str):
            continue
        if name in first_region:
            problems.append((f"regions[{i}].name", name, f"duplicate region name (regions[{first_region[name]}] has it)"))
        else:
            first_region[name] = i

    # Sender and queue ids share one namespace: each becomes a topic name.
    owner: dict[str, str] = {}
    sender_ids: dict[str, Mapping[str, Any]] = {}
    aeq_ids: dict[str, Mapping[str, Any]] = {}
    for key, entries, by_id in (("gateway_senders", senders, sender_ids), ("async_event_queues", aeqs, aeq_ids)):
        for i, entry in entries:
            queue_id = entry.get("id")
            if not isinstance(queue_id, str):
                continue
            if queue_id in owner:
                problems.append(
                    (
                        f"{key}[{i}].id",
                        queue_id,
                        f"duplicate id ({owner[queue_id]} has it; sender and async event queue ids share "
                        "one namespace because each names a topic)",
                    )
                )
                continue
            owner[queue_id] = f"{key}[{i}]"
            by_id[queue_id] = entry

    for i, sender in senders:
        remote = _as_int(sender.get("remote_dsid"))
        if remote is not None and remote == dsid:
            problems.append(
                (f"gateway_senders[{i}].remote_dsid", remote, f"must differ from this site's dsid ({dsid})")
            )

    # References from regions, and which regions each parallel queue spans.
    spans: dict[str, list[tuple[int, str, int]]] = {}
    for i, region in regions:
        for key, known, other, kind, other_key in (
            ("gateway_senders", sender_ids, aeq_ids, "gateway sender", "async_event_queues"),
            ("async_event_queues", aeq_ids, sender_ids, "async event queue", "gateway_senders"),
        ):
            refs = region.get(key)
            if not isinstance(refs, (list, tuple)):
                continue
            seen: set[str] = set()
            for j, ref in enumerate(refs):
                if not isinstance(ref, str):
                    continue
                where = f"regions[{i}].{key}[{j}]"
                if ref in seen:
                    problems.append((where, ref, "listed twice"))
                    continue
                seen.add(ref)
                if ref in known:
                    if known[ref].get("parallel") is True:
                        buckets = _get(region, RegionConfig, "buckets")
                        if _as_int(buckets) is not None:
                            spans.setdefault(ref, []).append((i, str(region.get("name")), buckets))
                elif ref in other:
                    problems.append(
                        (where, ref, f"is {_article(other_key)}, not {_article(key)}: list it under {other_key}")
                    )
                else:
                    problems.append((where, ref, f"no {kind} has this id{_suggest(ref, list(known))}"))

    # Geode's colocation rule: a parallel queue's buckets are its regions'
    # buckets, so every region it serves must have the same number.
    for queue_id, regions_using in spans.items():
        first_i, first_name, first_buckets = regions_using[0]
        for i, name, buckets in regions_using[1:]:
            if buckets != first_buckets:
                problems.append(
                    (
                        f"regions[{i}].buckets",
                        buckets,
                        f"parallel queue {queue_id!r} also serves region {first_name!r} with {first_buckets} "
                        "buckets; regions sharing a parallel queue must have the same buckets (colocation, "
                        "as in Geode)",
                    )
                )

    receiver = data.get("receiver")
    if isinstance(receiver, Mapping):
        accepted = receiver.get("accepted_dsids")
        if isinstance(accepted, (list, tuple)):
            seen_dsids: set[int] = set()
            for k, value in enumerate(accepted):
                other_dsid = _as_int(value)
                if other_dsid is None:
                    continue
                if other_dsid == dsid:
                    problems.append((f"receiver.accepted_dsids[{k}]", other_dsid, "is this site's own dsid"))
                elif other_dsid in seen_dsids:
                    problems.append((f"receiver.accepted_dsids[{k}]", other_dsid, "listed twice"))
                seen_dsids.add(other_dsid)

    problems.extend(_topic_collisions(data, regions, senders, aeqs))
    return problems


def _topic_collisions(
    data: Mapping[str, Any],
    regions: list[tuple[int, Mapping[str, Any]]],
    senders: list[tuple[int, Mapping[str, Any]]],
    aeqs: list[tuple[int, Mapping[str, Any]]],
) -> list[Problem]:
    # Kafka refuses a topic whose name equals an existing one once '.' and
    # '_' are made the same (they collide in metric names): queue "a_dlq"
    # would clash with queue "a"'s dead-letter topic "…queue.a.dlq".
    kafka = data.get("kafka")
    prefix = _get(kafka if isinstance(kafka, Mapping) else {}, KafkaConfig, "topic_prefix")
    if not isinstance(prefix, str):
        return []
    names = TopicNames(prefix)
    claimed: dict[str, tuple[str, str]] = {}
    for fixed in (names.gateway_inbound(), names.gateway_acks(), names.region_dead_letter()):
        claimed[fixed.replace(".", "_")] = (fixed, "Sluice itself")
    problems: list[Problem] = []

    def claim(topics: list[str], field: str, value: str) -> None:
        for topic in topics:
            normal = topic.replace(".", "_")
            # Identical names are duplicates, reported as such above.
            if normal in claimed and claimed[normal][1] != field and claimed[normal][0] != topic:
                other_topic, other_field = claimed[normal]
                problems.append(
                    (
                        field,
                        value,
                        f"its topic {topic!r} collides with {other_topic!r} of {other_field} "
                        "(Kafka treats '.' and '_' in topic names as the same)",
                    )
                )
                return
            claimed.setdefault(normal, (topic, field))

    for i, region in regions:
        if isinstance(region.get("name"), str):
            claim([names.region_changelog(region["name"])], f"regions[{i}].name", region["name"])
    for key, entries in (("gateway_senders", senders), ("async_event_queues", aeqs)):
        for i, entry in entries:
            queue_id = entry.get("id")
            if isinstance(queue_id, str):
                topics = [names.queue(queue_id), names.removals(queue_id), names.dead_letter(queue_id)]
                claim(topics, f"{key}[{i}].id", queue_id)
    return problems


def _entries(data: Mapping[str, Any], key: str) -> list[tuple[int, Mapping[str, Any]]]:
    items = data.get(key)
    if not isinstance(items, (list, tuple)):
        return []
    return [(i, item) for i, item in enumerate(items) if isinstance(item, Mapping)]


def _article(key: str) -> str:
    return {"async_event_queues": "an async event queue", "gateway_senders": "a gateway sender"}[key]
