"""The local store: bucket state on disk, with the changelog offset it is current to.

Geode's persistent members recover their buckets from their own disk stores,
and Kafka Streams keeps state in a local store with a checkpoint file of
changelog offsets; a region instance with ``region_service.store_dir`` does
both.  Each bucket this instance owns, or keeps a standby copy of, has its
entries in an LMDB database of its own; a few thousand recent writes wait in
memory (``store_buffer_entries``) and are then written together.  So an
instance's memory is bounded by its configuration, not by the region's size:
the store is memory-mapped, and its pages are the operating system's cache.

The changelog stays the truth.  A bucket's store is *clean* at a changelog
position P when it holds exactly the state of the partition's records below
P: after a load, when a bucket is handed over, and whenever every write of a
bucket has been committed (the checkpoints of engine.py and standby.py).
Entries written while writes are still open make it *dirty*.  A starting
load uses the store only when it is clean at a P within the partition's
bounds; it then replays the records from P on, not the whole partition.
Anything else, and the bucket is rebuilt from the changelog into an emptied
store, as Kafka Streams does after an unclean stop under exactly-once.

Never trusted: the store names the Kafka cluster, site and format it was
written for (another cluster's or site's store, or an older format, is wiped
whole), and each bucket names its changelog topic's id (a topic deleted and
created again has a new one).  Every entry carries a CRC-32 of its key and
body, and each bucket keeps its count and the sum of those CRCs: the load
that resumes a bucket reads every entry once and rebuilds the bucket on any
mismatch.  A file LMDB cannot open is removed and started again.

One process per store directory: a lock file refuses a second instance.

Threads: any, under the store's lock; LMDB serializes writers itself.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import struct
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import lmdb
import orjson

from ..core.errors import ConfigError, StoreCorrupt
from .state import Entry

log = logging.getLogger("sluice.region.store")

#: The layout of entries and checkpoints; a store of another format is wiped.
FORMAT = 1
#: How long a bucket whose write to the store failed waits before trying again.
WRITE_RETRY_S = 5.0
#: Keys longer than this many UTF-8 bytes are stored under their SHA-256 (LMDB keys are at most 511 bytes).
KEY_INLINE_MAX = 400
#: The database of checkpoints: one record per bucket, named as the bucket's database, and the store's own.
_META_DB = b"~meta"
_STORE_META = b"~store"
#: crc, dsid, timestamp, entry version, thread id, sequence id, flags, and the lengths of the version's
#: member id, the EventID's member id and the full key (0 when the key is stored inline).
_HEAD = struct.Struct("<IqqqqqBHHH")
_DESTROYED, _HAS_VALUE = 1, 2
_MASK64 = (1 << 64) - 1
_members: dict[bytes, str] = {}


def store_key(key: str) -> bytes:
    raw = key.encode()
    return b"k" + raw if len(raw) <= KEY_INLINE_MAX else b"h" + hashlib.sha256(raw).digest()


def pack(lkey: bytes, key: str, entry: Entry) -> bytes:
    """An entry's stored bytes, its CRC first (over ``lkey`` and the rest)."""
    value, dsid, timestamp, entry_version, vmember, emember, thread_id, sequence_id, destroyed = entry
    vm, em = vmember.encode(), emember.encode()
    full = key.encode() if lkey[:1] == b"h" else b""
    flags = (_DESTROYED if destroyed else 0) | (_HAS_VALUE if value is not None else 0)
    body = _HEAD.pack(0, dsid, timestamp, entry_version, thread_id, sequence_id, flags, len(vm), len(em),
                      len(full))[4:] + vm + em + full + (value or b"")
    return struct.pack("<I", zlib.crc32(body, zlib.crc32(lkey))) + body


def crc_of(raw: bytes) -> int:
    return struct.unpack_from("<I", raw)[0]


def check(lkey: bytes, raw: bytes) -> int:
    """The entry's CRC, when its bytes match it; StoreCorrupt otherwise."""
    if len(raw) < _HEAD.size:
        raise StoreCorrupt(f"entry {lkey[:40]!r}: {len(raw)} bytes, shorter than its header")
    crc = crc_of(raw)
    if zlib.crc32(memoryview(raw)[4:], zlib.crc32(lkey)) != crc:
        raise StoreCorrupt(f"entry {lkey[:40]!r}: its bytes do not match their CRC")
    return crc


def _member(raw: bytes) -> str:
    member = _members.get(raw)
    if member is None:
        if len(_members) > 100_000:
            _members.clear()
        member = _members[raw] = sys.intern(raw.decode())
    return member


def unpack(lkey: bytes, raw: bytes) -> tuple[str, Entry]:
    """The key and entry of stored bytes (not checked against their CRC: ``check`` does that)."""
    (_, dsid, timestamp, entry_version, thread_id, sequence_id, flags, vlen, elen, klen) = _HEAD.unpack_from(raw)
    at = _HEAD.size
    vmember = _member(raw[at:at + vlen])
    at += vlen
    emember = _member(raw[at:at + elen])
    at += elen
    key = raw[at:at + klen].decode() if klen else lkey[1:].decode()
    at += klen
    value = raw[at:] if flags & _HAS_VALUE else None
    return key, tuple.__new__(Entry, (value, dsid, timestamp, entry_version, vmember, emember, thread_id,
                                      sequence_id, bool(flags & _DESTROYED)))


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A bucket's store is clean at ``position``: every changelog record below it, and none after."""

    position: int
    streams: dict[tuple[str, int], int]
    stream_seen_ms: dict[tuple[str, int], int]


class LocalStore:
    """One instance's store directory (one LMDB environment, a database per bucket)."""

    def __init__(self, path: str, *, max_mb: int, buffer_entries: int, buckets: int, cluster_id: str,
                 site: str, dsid: int) -> None:
        self.path = path
        self.buffer_entries = buffer_entries
        self._identity = {"format": FORMAT, "cluster_id": cluster_id, "site": site, "dsid": dsid}
        self._max_bytes = max_mb * 1024 * 1024
        self._max_dbs = buckets + 8
        self._lock = threading.Lock()
        self._generation: dict[bytes, int] = {}
        self._dbs: dict[bytes, Any] = {}
        self.stats = {"store_resumed": 0, "store_rebuilt": 0, "store_flushes": 0, "store_checkpoints": 0,
                      "store_write_errors": 0}
        #: The last write that failed, for /stats (None: none has).
        self.last_error: str | None = None
        os.makedirs(path, exist_ok=True)
        self._lock_file = open(os.path.join(path, "instance.lock"), "w")  # noqa: SIM115 - held for the store's life
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.close()
            raise ConfigError([("region_service.store_dir", path, "is in use by another running instance; give "
                                "each instance a directory of its own (--store-dir)")]) from None
        self.env = self._open()
        self.meta_db = self.env.open_db(_META_DB)

    def _data_dir(self) -> str:
        return os.path.join(self.path, "lmdb")

    def _open(self) -> Any:
        data = self._data_dir()
        for attempt in (1, 2):
            try:
                env = lmdb.open(data, map_size=self._max_bytes, max_dbs=self._max_dbs, subdir=True, sync=False,
                                metasync=False, readahead=False, lock=True, max_readers=256)
                meta_db = env.open_db(_META_DB)
                with env.begin(write=True, db=meta_db) as txn:
                    raw = txn.get(_STORE_META)
                    identity = None if raw is None else orjson.loads(raw)
                    if identity != self._identity:
                        if identity is not None:
                            log.warning("the store in %s was written for %s, not %s: starting it again", data,
                                        identity, self._identity)
                            env.close()
                            self._wipe()
                            continue
                        txn.put(_STORE_META, orjson.dumps(self._identity))
                return env
            except (lmdb.Error, orjson.JSONDecodeError, ValueError) as exc:
                if attempt == 2:
                    raise
                log.warning("the store in %s cannot be opened (%s): starting it again", data, exc)
                self._wipe()
        raise AssertionError("unreachable")

    def _wipe(self) -> None:
        shutil.rmtree(self._data_dir(), ignore_errors=True)
        self.stats["store_rebuilt"] += 1

    def close(self) -> None:
        with self._lock:
            self.env.close()
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()

    def _db(self, name: bytes) -> Any:
        db = self._dbs.get(name)
        if db is None:
            db = self._dbs[name] = self.env.open_db(name)
        return db

    def _claim(self, name: bytes) -> int:
        generation = self._generation.get(name, 0) + 1
        self._generation[name] = generation
        return generation

    def current(self, name: bytes, generation: int) -> bool:
        return self._generation.get(name) == generation

    def fresh(self, region: str, bucket: int, topic_id: str) -> StoredEntries:
        """The bucket's store emptied, for a load from the changelog; earlier holders of it stop writing."""
        name = f"{region}/{bucket}".encode()
        with self._lock:
            db = self._db(name)
            with self.env.begin(write=True) as txn:
                txn.drop(db, delete=False)
                txn.put(name, orjson.dumps({"clean": False, "topic_id": topic_id}), db=self.meta_db)
            return StoredEntries(self, name, db, self._claim(name), topic_id, 0)

    def resume(self, region: str, bucket: int, topic_id: str) -> tuple[StoredEntries, Checkpoint] | None:
        """The bucket's store and where it is clean, once every entry was read and matched its CRC, the
        count and the sum; None (and the bucket's store emptied on the next ``fresh``) otherwise."""
        name = f"{region}/{bucket}".encode()
        with self._lock:
            db = self._db(name)
            with self.env.begin() as txn:
                raw = txn.get(name, db=self.meta_db)
                problem = _meta_problem(raw, topic_id)
                meta = orjson.loads(raw) if problem is None else {}
                if problem is None:
                    problem = _scan_problem(txn, db, meta)
            if problem is not None:
                if raw is not None:
                    log.warning("the store of %s[%d] is not used: %s; the bucket is read from its changelog",
                                region, bucket, problem)
                    self.stats["store_rebuilt"] += 1
                return None
            self.stats["store_resumed"] += 1
            entries = StoredEntries(self, name, db, self._claim(name), topic_id, meta["digest"])
            streams = {(m, t): s for m, t, s, _ in meta["streams"]}
            seen = {(m, t): at for m, t, _, at in meta["streams"]}
            return entries, Checkpoint(meta["position"], streams, seen)

    def bytes_used(self) -> int:
        info, stat = self.env.info(), self.env.stat()
        return (info["last_pgno"] + 1) * stat["psize"]


def _meta_problem(raw: bytes | None, topic_id: str) -> str | None:
    if raw is None:
        return "nothing stored"
    try:
        meta = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "its checkpoint cannot be read"
    if not isinstance(meta, dict) or not meta.get("clean"):
        return "not clean (written while writes were still open: the instance stopped without handing it over)"
    if meta.get("topic_id") != topic_id:
        return f"written for changelog topic id {meta.get('topic_id')}, not {topic_id}"
    if not all(isinstance(meta.get(k), int) for k in ("position", "count", "digest")) or not isinstance(
            meta.get("streams"), list):
        return "its checkpoint is incomplete"
    return None


def _scan_problem(txn: Any, db: Any, meta: dict[str, Any]) -> str | None:
    count, digest = 0, 0
    try:
        for lkey, raw in txn.cursor(db):
            digest += check(lkey, raw)
            count += 1
    except (StoreCorrupt, lmdb.Error) as exc:
        return str(exc)
    if count != meta["count"] or digest & _MASK64 != meta["digest"]:
        return (f"it holds {count} entries summing to {digest & _MASK64}, its checkpoint says {meta['count']} "
                f"summing to {meta['digest']}")
    return None


class StoredEntries:
    """A bucket's entries (``BucketState.entries``): recent writes in memory, the rest in the store.

    Reads look in memory, then in the store.  The writes held in memory are written to the store when
    there are ``buffer_entries`` of them (the store is then dirty), or by ``checkpoint``.
    """

    __slots__ = ("_store", "_name", "_db", "_generation", "_topic_id", "_digest", "_buffer", "_count", "_retry_at")

    def __init__(self, store: LocalStore, name: bytes, db: Any, generation: int, topic_id: str, digest: int) -> None:
        self._store = store
        self._name = name
        self._db = db
        self._generation = generation
        self._topic_id = topic_id
        self._digest = digest
        self._buffer: dict[str, Entry] = {}
        #: After a failed write (the store full, the disk failing): when to try again (monotonic).
        self._retry_at = 0.0
        with store.env.begin() as txn:
            self._count = txn.stat(db)["entries"]

    def _stored(self, key: str) -> bytes | None:
        with self._store.env.begin(db=self._db) as txn:
            return txn.get(store_key(key))

    def get(self, key: str, default: Entry | None = None) -> Entry | None:
        entry = self._buffer.get(key)
        if entry is not None:
            return entry
        raw = self._stored(key)
        return default if raw is None else unpack(store_key(key), raw)[1]

    def __getitem__(self, key: str) -> Entry:
        entry = self.get(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def __setitem__(self, key: str, entry: Entry) -> None:
        self._buffer[key] = entry
        if len(self._buffer) >= self._store.buffer_entries and time.monotonic() >= self._retry_at:
            self.flush()

    def __len__(self) -> int:
        """Entries, tombstones included (as a dict's): the store's, and the buffered keys it lacks."""
        with self._store.env.begin(db=self._db) as txn:
            return self._count + sum(1 for key in self._buffer if txn.get(store_key(key)) is None)

    def items(self) -> Iterator[tuple[str, Entry]]:
        buffered = dict(self._buffer)
        yield from buffered.items()
        with self._store.env.begin(db=self._db) as txn:
            for lkey, raw in txn.cursor():
                key, entry = unpack(lkey, raw)
                if key not in buffered:
                    yield key, entry

    def values(self) -> Iterator[Entry]:
        return (entry for _, entry in self.items())

    def buffered(self) -> int:
        return len(self._buffer)

    def flush(self) -> None:
        """Write the buffered entries: the store is dirty until the next checkpoint."""
        self._write(None)

    def checkpoint(self, position: int, streams: dict[tuple[str, int], int],
                   stream_seen_ms: dict[tuple[str, int], int]) -> None:
        """The buffered entries, and the store clean at ``position``: the caller's state is exactly the
        changelog below it."""
        self._write({"position": position, "streams": [[m, t, s, stream_seen_ms.get((m, t), 0)]
                                                       for (m, t), s in streams.items()]})

    def _write(self, clean: dict[str, Any] | None) -> None:
        store = self._store
        with store._lock:
            if not store.current(self._name, self._generation):
                return  # the bucket was emptied or resumed for someone else since: this state is gone
            digest = self._digest
            try:
                with store.env.begin(write=True, db=self._db) as txn:
                    for key, entry in self._buffer.items():
                        lkey = store_key(key)
                        raw = pack(lkey, key, entry)
                        old = txn.replace(lkey, raw)
                        digest += crc_of(raw) - (0 if old is None else crc_of(old))
                    digest &= _MASK64
                    count = txn.stat(self._db)["entries"]
                    meta: dict[str, Any] = {"clean": clean is not None, "topic_id": self._topic_id, "count": count,
                                            "digest": digest}
                    if clean is not None:
                        meta.update(clean)
                    txn.put(self._name, orjson.dumps(meta), db=store.meta_db)
            except lmdb.Error as exc:
                # Nothing written (the transaction is aborted): the entries stay in memory, correct, and
                # the store's last checkpoint stays what it was.  Tried again in WRITE_RETRY_S.
                self._retry_at = time.monotonic() + WRITE_RETRY_S
                store.stats["store_write_errors"] += 1
                store.last_error = f"{self._name.decode()}: {exc}"
                log.error("writing %d entries of %s to the local store failed (%s); they stay in memory, and "
                          "the bucket is read from its changelog on the next start", len(self._buffer),
                          self._name.decode(), exc)
                return
            self._digest, self._count = digest, count
            self._buffer.clear()
            store.stats["store_checkpoints" if clean is not None else "store_flushes"] += 1
