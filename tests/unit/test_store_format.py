"""The local store (services/region/store.py): what it keeps, and what it refuses to trust."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.core.errors import ConfigError
from sluice.core.events import EventID
from sluice.region.state import BucketState, Op
from sluice.region.store import KEY_INLINE_MAX, LocalStore, StoreCorrupt, check, pack, store_key, unpack

IDENTITY = {"max_mb": 64, "buffer_entries": 16, "buckets": 4, "site": "a", "dsid": 1}


def open_store(path: Path, cluster_id: str = "cluster-1") -> LocalStore:
    return LocalStore(str(path), cluster_id=cluster_id, **IDENTITY)


def filled(store: LocalStore, n: int = 100, topic_id: str = "topic-1") -> BucketState:
    state = BucketState("orders", 0, 1, "m1", store.fresh("orders", 0, topic_id))
    for i in range(n):
        state.prepare(Op.PUT, f"k{i}", f"v{i}".encode(), EventID("writer", 7, i), 1_000 + i)
    state.prepare(Op.DESTROY, "k3", None, EventID("writer", 7, n), 5_000)
    return state


def test_an_entry_reads_back_as_written_long_keys_included():
    for key in ("k", "ü" * 10, "x" * (KEY_INLINE_MAX + 50)):
        state = BucketState("orders", 0, 1, "m1")
        state.prepare(Op.PUT, key, b"value", EventID("writer", 1, 1), 42)
        entry = state.entries[key]
        lkey = store_key(key)
        raw = pack(lkey, key, entry)
        assert len(lkey) <= 401 and check(lkey, raw) > 0
        assert unpack(lkey, raw) == (key, entry)
        with pytest.raises(StoreCorrupt):
            check(lkey, raw[:-1] + bytes([raw[-1] ^ 1]))


def test_a_clean_store_resumes_with_its_entries_streams_and_position(tmp_path: Path):
    store = open_store(tmp_path)
    state = filled(store)
    assert state.entries.buffered() < 16 < len(state.entries)  # most of them written to the store already
    state.entries.checkpoint(1234, state.streams, state.stream_seen_ms)
    live = sorted(state.keys())
    store.close()

    store = open_store(tmp_path)
    resumed = store.resume("orders", 0, "topic-1")
    assert resumed is not None
    entries, checkpoint = resumed
    assert checkpoint.position == 1234
    assert checkpoint.streams == {("writer", 7): 100}
    again = BucketState("orders", 0, 1, "m1", entries)
    assert again.get("k5").value == b"v5" and again.get("k3") is None and entries["k3"].destroyed
    assert sorted(again.keys()) == live and again.size() == 99
    store.close()


def test_a_store_written_past_its_checkpoint_is_not_used(tmp_path: Path):
    store = open_store(tmp_path)
    state = filled(store)
    state.entries.checkpoint(10, state.streams, state.stream_seen_ms)
    state.prepare(Op.PUT, "late", b"not committed yet", EventID("writer", 7, 500), 9_000)
    state.entries.flush()
    assert store.resume("orders", 0, "topic-1") is None
    assert store.stats["store_rebuilt"] == 1


def test_another_topic_or_cluster_or_site_is_never_trusted(tmp_path: Path):
    store = open_store(tmp_path)
    state = filled(store)
    state.entries.checkpoint(10, state.streams, state.stream_seen_ms)
    assert store.resume("orders", 0, "topic-2") is None  # the changelog topic was created again
    store.close()
    store = open_store(tmp_path, cluster_id="cluster-2")  # another Kafka cluster: the whole store goes
    assert store.resume("orders", 0, "topic-1") is None
    store.close()


def test_a_changed_byte_a_missing_entry_or_a_damaged_file_means_a_rebuild(tmp_path: Path):
    store = open_store(tmp_path)
    state = filled(store)
    state.entries.checkpoint(10, state.streams, state.stream_seen_ms)
    store.close()
    data = tmp_path / "lmdb" / "data.mdb"
    raw = bytearray(data.read_bytes())
    at = raw.find(b"v42")
    while at >= 0:  # every copy of the value's page (LMDB writes pages anew), the live one among them
        raw[at + 1] ^= 0x01
        at = raw.find(b"v42", at + 1)
    data.write_bytes(bytes(raw))
    store = open_store(tmp_path)
    assert store.resume("orders", 0, "topic-1") is None
    store.close()

    store = open_store(tmp_path / "two")
    state = filled(store)
    state.entries.checkpoint(10, state.streams, state.stream_seen_ms)
    with store.env.begin(write=True) as txn:  # an entry lost behind the checkpoint's back
        txn.delete(store_key("k7"), db=store._db(b"orders/0"))
    assert store.resume("orders", 0, "topic-1") is None
    store.close()

    (tmp_path / "three" / "lmdb").mkdir(parents=True)
    (tmp_path / "three" / "lmdb" / "data.mdb").write_bytes(b"not an LMDB file at all" * 1000)
    store = open_store(tmp_path / "three")
    assert store.resume("orders", 0, "topic-1") is None
    assert filled(store).get("k5").value == b"v5"
    store.close()


def test_a_state_given_to_another_load_stops_writing(tmp_path: Path):
    store = open_store(tmp_path)
    old = filled(store)
    new = BucketState("orders", 0, 1, "m1", store.fresh("orders", 0, "topic-1"))
    old.prepare(Op.PUT, "stale", b"x", EventID("writer", 7, 900), 9_000)
    old.entries.checkpoint(99, old.streams, old.stream_seen_ms)
    new.entries.checkpoint(5, new.streams, new.stream_seen_ms)
    resumed = store.resume("orders", 0, "topic-1")
    assert resumed is not None and len(resumed[0]) == 0 and resumed[1].position == 5


def test_one_instance_per_store_directory(tmp_path: Path):
    store = open_store(tmp_path)
    with pytest.raises(ConfigError, match="in use by another running instance"):
        open_store(tmp_path)
    store.close()


def test_a_full_store_keeps_the_writes_in_memory_and_its_last_checkpoint(tmp_path: Path):
    store = LocalStore(str(tmp_path), cluster_id="cluster-1", **{**IDENTITY, "max_mb": 16})
    state = filled(store, 10)
    state.entries.checkpoint(10, state.streams, state.stream_seen_ms)
    big = b"x" * 4000
    for i in range(6000):  # ~24 MB of values into a 16 MiB store
        state.prepare(Op.PUT, f"big{i}", big, EventID("writer", 7, 100 + i), 9_000)
    assert store.stats["store_write_errors"] >= 1 and "MDB_MAP_FULL" in store.last_error
    assert state.get("big5999").value == big and state.get("k5").value == b"v5"
    # What was written before the store filled up made it dirty: never trusted.
    assert store.resume("orders", 0, "topic-1") is None
