# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The compiled twin of the per-event readers of ``eventwire`` and ``kafka.murmur2``.

``eventwire`` and ``kafka`` use these when the module is built (``make``
builds it; ``SLUICE_PURE_PYTHON=1`` turns it off) and their own Python
functions otherwise; those stay the reference the unit tests compare these
with (tests/unit/test_eventwire_compiled.py).  Every function here either
returns exactly what its Python twin returns or returns ``None``: on a body
the Python reader would refuse, the caller runs the Python reader, which
raises ``MalformedRecord`` with its reason.  Nothing here decides what is an
error.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject_GenericSetAttr
from libc.string cimport memcmp, memcpy
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

from .events import EntryEvent, EventID, Operation, VersionTag

cdef tuple _OPERATIONS = tuple(Operation)
cdef Py_ssize_t _N_OPERATIONS = len(_OPERATIONS)
cdef object _EntryEvent = EntryEvent
cdef object _EventID = EventID
cdef object _VersionTag = VersionTag

# Set by ``eventwire`` once it is imported (it imports this module): its EntryLayout, its
# ``_visited_after`` and its ``_cached_int_array`` (both remembered), so that neither is written twice.
cdef object _EntryLayout = None
cdef object _visited_after = None
cdef object _int_array_bytes = None


def bind(entry_layout, visited_after, cached_int_array):
    """Called once by ``eventwire``: the Python pieces this module builds its answers with."""
    global _EntryLayout, _visited_after, _int_array_bytes
    _EntryLayout = entry_layout
    _visited_after = visited_after
    _int_array_bytes = cached_int_array


# The event's values are frozen dataclasses: their __init__ sets each field through
# ``object.__setattr__``.  These fill the slots of a new instance directly (the generic setattr, which
# the frozen classes' own __setattr__ would refuse), the same fields in the same order; the unit tests
# compare every event made here with the Python reader's.

cdef inline object _event_id(object member, int64_t thread, int64_t sequence):
    obj = _EventID.__new__(_EventID)
    PyObject_GenericSetAttr(obj, "member_id", member)
    PyObject_GenericSetAttr(obj, "thread_id", thread)
    PyObject_GenericSetAttr(obj, "sequence_id", sequence)
    return obj


cdef inline object _version(int64_t dsid, int64_t timestamp, int64_t entry_version, object member):
    obj = _VersionTag.__new__(_VersionTag)
    PyObject_GenericSetAttr(obj, "dsid", dsid)
    PyObject_GenericSetAttr(obj, "timestamp", timestamp)
    PyObject_GenericSetAttr(obj, "entry_version", entry_version)
    PyObject_GenericSetAttr(obj, "member_id", member)
    return obj


cdef object _entry_event(object region, object key, object operation, object value, object event_id,
                         object version, int64_t origin, int64_t bucket, int64_t event_time, object callback,
                         bint duplicate, object visited, object encoding, object transaction):
    obj = _EntryEvent.__new__(_EntryEvent)
    PyObject_GenericSetAttr(obj, "region", region)
    PyObject_GenericSetAttr(obj, "key", key)
    PyObject_GenericSetAttr(obj, "operation", operation)
    PyObject_GenericSetAttr(obj, "value", value)
    PyObject_GenericSetAttr(obj, "event_id", event_id)
    PyObject_GenericSetAttr(obj, "version", version)
    PyObject_GenericSetAttr(obj, "origin_dsid", origin)
    PyObject_GenericSetAttr(obj, "bucket", bucket)
    PyObject_GenericSetAttr(obj, "event_time", event_time)
    PyObject_GenericSetAttr(obj, "callback_argument", callback)
    PyObject_GenericSetAttr(obj, "possible_duplicate", True if duplicate else False)
    PyObject_GenericSetAttr(obj, "visited_dsids", visited)
    PyObject_GenericSetAttr(obj, "value_encoding", encoding)
    PyObject_GenericSetAttr(obj, "transaction", transaction)
    return obj


cdef struct Cursor:
    const unsigned char* buf
    Py_ssize_t size
    Py_ssize_t pos
    bint bad


cdef inline void _open(Cursor* c, bytes body) noexcept:
    """The cursor at the first byte of ``body``."""
    c.buf = <const unsigned char*>PyBytes_AS_STRING(body)
    c.size = PyBytes_GET_SIZE(body)
    c.pos = 0
    c.bad = False


cdef inline int64_t _long(Cursor* c) noexcept:
    """The zig-zag varint at the cursor; ``bad`` set where ``eventwire.read_long`` would fail."""
    cdef uint64_t n = 0
    cdef uint64_t b
    cdef int shift = 0
    while True:
        if c.pos >= c.size:
            c.bad = True
            return 0
        b = c.buf[c.pos]
        c.pos += 1
        if shift == 63 and (b & 0x7F) > 1:
            c.bad = True  # beyond 64 bits
            return 0
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return <int64_t>((n >> 1) ^ (-(n & 1)))
        shift += 7
        if shift > 63:
            c.bad = True  # more than 10 bytes
            return 0


cdef inline int64_t _int(Cursor* c) noexcept:
    cdef int64_t n = _long(c)
    if n < -2147483648 or n > 2147483647:
        c.bad = True
    return n


cdef inline Py_ssize_t _span(Cursor* c) noexcept:
    """A length-prefixed value: its length, the cursor left at its first byte; -1 when bad."""
    cdef int64_t n = _long(c)
    if c.bad or n < 0 or n > c.size - c.pos:
        c.bad = True
        return -1
    return <Py_ssize_t>n


cdef object _string(Cursor* c):
    """A UTF-8 string, or None with ``bad`` set (a truncated or invalid one)."""
    cdef Py_ssize_t n = _span(c)
    if c.bad:
        return None
    cdef Py_ssize_t start = c.pos
    c.pos += n
    try:
        return PyUnicode_DecodeUTF8(<const char*>c.buf + start, n, NULL)
    except UnicodeDecodeError:
        c.bad = True
        return None


cdef object _bytes(Cursor* c, bytes body):
    cdef Py_ssize_t n = _span(c)
    if c.bad:
        return None
    cdef Py_ssize_t start = c.pos
    c.pos += n
    return body[start:start + n]


cdef inline int64_t _branch(Cursor* c) noexcept:
    cdef int64_t b = _long(c)
    if b != 0 and b != 1:
        c.bad = True
    return b


cdef tuple _int_array(Cursor* c):
    cdef list items = []
    cdef int64_t count, i
    while True:
        count = _long(c)
        if c.bad:
            return None
        if count == 0:
            return tuple(items)
        if count < 0:
            count = -count
            _long(c)
            if c.bad:
                return None
        if count > c.size - c.pos:  # each item takes a byte at least
            c.bad = True
            return None
        for i in range(count):
            items.append(_int(c))
            if c.bad:
                return None


cdef tuple _decode(bytes body, object visited_added, bint force_duplicate):
    """(event, layout) of a whole body, or None.  With ``visited_added`` not None (a gateway
    batch's event): (event, body) as ``eventwire.batch_event_body`` makes them, the sender's
    changes merged into both."""
    cdef Cursor c
    _open(&c, body)
    region = _string(&c)
    if c.bad:
        return None
    key = _string(&c)
    if c.bad:
        return None
    cdef int64_t op_index = _long(&c)
    if c.bad or op_index < 0 or op_index >= _N_OPERATIONS:
        return None
    value = None
    if _branch(&c):
        value = _bytes(&c, body)
    if c.bad:
        return None
    encoding = _string(&c)
    if c.bad:
        return None
    callback = None
    if _branch(&c):
        callback = _string(&c)
    if c.bad or c.pos >= c.size:
        return None
    cdef Py_ssize_t duplicate_at = c.pos
    cdef bint duplicate = c.buf[c.pos] != 0
    c.pos += 1
    member = _string(&c)
    if member is not None:
        # Interned (as the Python reader does): a region holds an EventID and a version tag per entry,
        # and their member ids are a few strings, not one per entry.
        member = intern(member)
    cdef int64_t thread = _long(&c)
    cdef int64_t sequence = _long(&c)
    cdef int64_t dsid = _int(&c)
    cdef int64_t timestamp = _long(&c)
    cdef int64_t entry_version = _long(&c)
    if c.bad:
        return None
    version_member = _string(&c)
    if version_member is not None:
        version_member = intern(version_member)
    cdef int64_t origin = _int(&c)
    if c.bad:
        return None
    cdef Py_ssize_t visited_start = c.pos
    visited = _int_array(&c)
    if c.bad:
        return None
    cdef Py_ssize_t visited_end = c.pos
    cdef int64_t bucket = _int(&c)
    cdef Py_ssize_t bucket_end = c.pos
    cdef int64_t event_time = _long(&c)
    transaction = None
    if c.bad:
        return None
    if _branch(&c):
        tx_id = _string(&c)
        if c.bad or c.pos >= c.size:
            return None
        transaction = (tx_id, c.buf[c.pos] != 0)
        c.pos += 1
    if c.bad or c.pos != c.size:
        return None
    event_id = _event_id(member, thread, sequence)
    version = _version(dsid, timestamp, entry_version, version_member)
    operation = _OPERATIONS[op_index]
    if visited_added is None:
        return (_entry_event(region, key, operation, value, event_id, version, origin, bucket, event_time,
                             callback, duplicate, visited, encoding, transaction),
                _EntryLayout(duplicate_at, visited_start, visited_end, bucket_end))
    merged = _visited_after(visited, visited_added, origin)
    cdef bint merged_duplicate = duplicate or force_duplicate
    event = _entry_event(region, key, operation, value, event_id, version, origin, bucket, event_time,
                         callback, merged_duplicate, merged, encoding, transaction)
    if merged == visited and merged_duplicate == duplicate:
        return (event, body)
    return (event, _spliced(body, duplicate_at, merged_duplicate, visited_start, visited_end, merged))


cdef bytes _spliced(bytes body, Py_ssize_t duplicate_at, bint duplicate, Py_ssize_t visited_start,
                    Py_ssize_t visited_end, tuple visited):
    """``eventwire.splice_entry(body, layout, possible_duplicate=duplicate, visited_dsids=visited)``."""
    cdef bytes array = _int_array_bytes(visited)
    cdef Py_ssize_t size = PyBytes_GET_SIZE(body)
    cdef Py_ssize_t n_array = PyBytes_GET_SIZE(array)
    cdef Py_ssize_t total = size - (visited_end - visited_start) + n_array
    cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
    cdef char* dst = PyBytes_AS_STRING(out)
    cdef const char* src = PyBytes_AS_STRING(body)
    memcpy(dst, src, visited_start)
    dst[duplicate_at] = 1 if duplicate else 0
    memcpy(dst + visited_start, PyBytes_AS_STRING(array), n_array)
    memcpy(dst + visited_start + n_array, src + visited_end, size - visited_end)
    return out


def decode_entry(body):
    """``eventwire.decode_entry(body)``, or None for a body it refuses (run it for the reason)."""
    if type(body) is not bytes:
        return None
    return _decode(<bytes>body, None, False)


def batch_event_body(view, Py_ssize_t index):
    """``eventwire.batch_event_body(view, index)``, or None for a body it refuses."""
    body = view.bodies[index]
    if type(body) is not bytes:
        return None
    # The region comes first: read it to find the sites the sender adds for it.
    cdef Cursor c
    _open(&c, <bytes>body)
    event_region = _string(&c)
    if c.bad:
        return None
    added = view.visited_added.get(event_region)
    added = (view.source_dsid,) if added is None else tuple(added)
    force = bool(view.possible_duplicate) or index in view.duplicate_events
    return _decode(<bytes>body, added, force)


def murmur2(data):
    """``kafka.murmur2(data)``: Kafka's murmur2 (seed 0x9747b28c) as a signed 32-bit int; None when
    ``data`` is not bytes."""
    if type(data) is not bytes:
        return None
    cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(data)
    cdef Py_ssize_t length = PyBytes_GET_SIZE(data)
    cdef uint32_t m = 0x5BD1E995
    cdef uint32_t h = 0x9747B28C ^ <uint32_t>length
    cdef uint32_t k
    cdef Py_ssize_t i, n4 = length // 4
    for i in range(n4):
        k = (<uint32_t>p[4 * i]) | (<uint32_t>p[4 * i + 1] << 8) | (<uint32_t>p[4 * i + 2] << 16) \
            | (<uint32_t>p[4 * i + 3] << 24)
        k *= m
        k ^= k >> 24
        k *= m
        h *= m
        h ^= k
    cdef Py_ssize_t rest = length % 4, tail = 4 * n4
    if rest == 3:
        h ^= <uint32_t>p[tail + 2] << 16
    if rest >= 2:
        h ^= <uint32_t>p[tail + 1] << 8
    if rest >= 1:
        h ^= <uint32_t>p[tail]
        h *= m
    h ^= h >> 13
    h *= m
    h ^= h >> 15
    return <int32_t>h


# --- writing ---------------------------------------------------------------------------------------

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object text, Py_ssize_t* size) except NULL

from cpython.mem cimport PyMem_Free, PyMem_Malloc

cdef dict _OPERATION_INDEX = {op: i for i, op in enumerate(_OPERATIONS)}


cdef inline unsigned char* _put_long(unsigned char* p, int64_t n) noexcept:
    cdef uint64_t z = (<uint64_t>n << 1) ^ <uint64_t>(n >> 63)
    while z > 0x7F:
        p[0] = <unsigned char>((z & 0x7F) | 0x80)
        p += 1
        z >>= 7
    p[0] = <unsigned char>z
    return p + 1


cdef inline unsigned char* _put_span(unsigned char* p, const char* data, Py_ssize_t n) noexcept:
    p = _put_long(p, n)
    memcpy(p, data, n)
    return p + n


cdef inline bint _is_int32(int64_t n) noexcept:
    return -2147483648 <= n <= 2147483647


def entry_event_body(ev):
    """``eventwire.entry_event_body(ev)``, or None where the Python writer must run: a field of an
    unexpected type, or a number beyond its Avro type (the Python writer says which)."""
    cdef Py_ssize_t n_region, n_key, n_encoding, n_callback = 0, n_member, n_version_member, n_tx = 0
    cdef Py_ssize_t n_value = 0, n_visited, i
    cdef const char* region
    cdef const char* key
    cdef const char* encoding
    cdef const char* callback = NULL
    cdef const char* member
    cdef const char* version_member
    cdef const char* tx_id = NULL
    cdef int64_t thread, sequence, dsid, timestamp, entry_version, origin, bucket, event_time, d
    cdef int64_t op_index
    try:
        region = PyUnicode_AsUTF8AndSize(ev.region, &n_region)
        key = PyUnicode_AsUTF8AndSize(ev.key, &n_key)
        encoding = PyUnicode_AsUTF8AndSize(ev.value_encoding, &n_encoding)
        callback_argument = ev.callback_argument
        if callback_argument is not None:
            callback = PyUnicode_AsUTF8AndSize(callback_argument, &n_callback)
        event_id = ev.event_id
        member = PyUnicode_AsUTF8AndSize(event_id.member_id, &n_member)
        thread = event_id.thread_id
        sequence = event_id.sequence_id
        version = ev.version
        dsid = version.dsid
        timestamp = version.timestamp
        entry_version = version.entry_version
        version_member = PyUnicode_AsUTF8AndSize(version.member_id, &n_version_member)
        origin = ev.origin_dsid
        bucket = ev.bucket
        event_time = ev.event_time
        transaction = ev.transaction
        if transaction is not None:
            tx_id = PyUnicode_AsUTF8AndSize(transaction[0], &n_tx)
            tx_last = bool(transaction[1])
        op_index = _OPERATION_INDEX[ev.operation]
    except (TypeError, OverflowError, UnicodeEncodeError, KeyError, IndexError, AttributeError):
        return None
    value = ev.value
    if value is not None:
        if type(value) is not bytes:
            return None
        n_value = PyBytes_GET_SIZE(value)
    visited = ev.visited_dsids
    if type(visited) is not tuple:
        return None
    n_visited = len(<tuple>visited)
    if not (_is_int32(dsid) and _is_int32(origin) and _is_int32(bucket)):
        return None
    cdef Py_ssize_t bound = (n_region + n_key + n_value + n_encoding + n_callback + n_member + n_version_member
                             + n_tx + 10 * (20 + n_visited))
    cdef unsigned char* buf = <unsigned char*>PyMem_Malloc(bound)
    if buf == NULL:
        raise MemoryError()
    cdef unsigned char* p = buf
    try:
        p = _put_span(p, region, n_region)
        p = _put_span(p, key, n_key)
        p = _put_long(p, op_index)
        if value is None:
            p[0] = 0
            p += 1
        else:
            p[0] = 2
            p = _put_span(p + 1, PyBytes_AS_STRING(value), n_value)
        p = _put_span(p, encoding, n_encoding)
        if callback == NULL:
            p[0] = 0
            p += 1
        else:
            p[0] = 2
            p = _put_span(p + 1, callback, n_callback)
        p[0] = 1 if ev.possible_duplicate else 0
        p += 1
        p = _put_span(p, member, n_member)
        p = _put_long(p, thread)
        p = _put_long(p, sequence)
        p = _put_long(p, dsid)
        p = _put_long(p, timestamp)
        p = _put_long(p, entry_version)
        p = _put_span(p, version_member, n_version_member)
        p = _put_long(p, origin)
        if n_visited:
            p = _put_long(p, n_visited)
            for i in range(n_visited):
                try:
                    d = (<tuple>visited)[i]
                except (TypeError, OverflowError):
                    return None
                if not _is_int32(d):
                    return None
                p = _put_long(p, d)
        p[0] = 0
        p += 1
        p = _put_long(p, bucket)
        p = _put_long(p, event_time)
        if tx_id == NULL:
            p[0] = 0
            p += 1
        else:
            p[0] = 2
            p = _put_span(p + 1, tx_id, n_tx)
            p[0] = 1 if tx_last else 0
            p += 1
        return PyBytes_FromStringAndSize(<char*>buf, p - buf)
    finally:
        PyMem_Free(buf)


def queued_event(header, flags, queue_id, changelog_partition, changelog_offset, enqueued_at, event_body):
    """``eventwire.queued_event(...)``, or None where the Python writer must run (a number beyond its
    Avro type, a field of an unexpected type)."""
    cdef int64_t f, partition, offset, at
    cdef Py_ssize_t n_queue, n_header, n_body
    cdef const char* queue
    if type(header) is not bytes or type(event_body) is not bytes:
        return None
    try:
        f = flags
        partition = changelog_partition
        offset = changelog_offset
        at = enqueued_at
        queue = PyUnicode_AsUTF8AndSize(queue_id, &n_queue)
    except (TypeError, OverflowError, UnicodeEncodeError):
        return None
    if not (_is_int32(f) and _is_int32(partition)):
        return None
    n_header = PyBytes_GET_SIZE(header)
    n_body = PyBytes_GET_SIZE(event_body)
    cdef Py_ssize_t bound = n_header + n_queue + n_body + 50
    cdef unsigned char* buf = <unsigned char*>PyMem_Malloc(bound)
    if buf == NULL:
        raise MemoryError()
    cdef unsigned char* p = buf
    try:
        memcpy(p, PyBytes_AS_STRING(header), n_header)
        p += n_header
        p = _put_long(p, f)
        p = _put_span(p, queue, n_queue)
        p = _put_long(p, partition)
        p = _put_long(p, offset)
        p = _put_long(p, at)
        memcpy(p, PyBytes_AS_STRING(event_body), n_body)
        p += n_body
        return PyBytes_FromStringAndSize(<char*>buf, p - buf)
    finally:
        PyMem_Free(buf)


def new_entry_event(region, key, operation, value, event_id, version, int64_t origin_dsid, int64_t bucket,
                    int64_t event_time, callback_argument=None, bint possible_duplicate=False, visited_dsids=(),
                    value_encoding="json", transaction=None):
    """``EntryEvent(...)`` of these fields, positional, without its frozen ``__init__`` (``_entry_event``)."""
    return _entry_event(region, key, operation, value, event_id, version, origin_dsid, bucket, event_time,
                        callback_argument, possible_duplicate, visited_dsids, value_encoding, transaction)


def new_version_tag(int64_t dsid, int64_t timestamp, int64_t entry_version, member_id=""):
    """``VersionTag(...)`` of these fields, without its frozen ``__init__``."""
    return _version(dsid, timestamp, entry_version, member_id)


def queued_flags_body(header, data):
    """``eventwire.queued_flags_body(header, data)`` of a record that starts with ``header`` and
    reads whole, or None: a record that does not (another version, a truncated or malformed one) is
    the Python reader's to answer (None or ``MalformedRecord``)."""
    cdef Cursor c
    cdef Py_ssize_t n_header, n, i, start
    cdef int64_t flags
    if type(header) is not bytes or type(data) is not bytes:
        return None
    n_header = PyBytes_GET_SIZE(header)
    _open(&c, data)
    if c.size < n_header or memcmp(c.buf, PyBytes_AS_STRING(header), n_header) != 0:
        return None
    c.pos = n_header
    flags = _int(&c)
    n = _span(&c)  # the queue id, skipped
    if c.bad:
        return None
    c.pos += n
    for i in range(3):  # changelog_partition, changelog_offset, enqueued_at: skipped
        start = c.pos
        while c.pos < c.size and c.buf[c.pos] & 0x80:
            c.pos += 1
        c.pos += 1
        if c.pos > c.size or c.pos - start > 10:
            return None
    return (flags, PyBytes_FromStringAndSize(<const char*>c.buf + c.pos, c.size - c.pos))
