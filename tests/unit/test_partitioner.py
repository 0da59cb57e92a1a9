"""Keys land on the partition Kafka's Java default partitioner would choose (DESIGN §1).

``murmur2`` must equal ``org.apache.kafka.common.utils.Utils.murmur2`` bit for bit,
and ``partition_for_key`` must be ``toPositive(murmur2(key)) % partitions``, so any
Kafka producer keyed the same way writes to the same bucket as Sluice.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core.kafka import murmur2, partition_for_key

# Kafka's UtilsTest.testMurmur2 vectors (clients/src/test/java/.../utils/UtilsTest.java).
KAFKA_VECTORS = [
    ("21", -973932308),
    ("foobar", -790332482),
    ("a-little-bit-long-string", -985981536),
    ("a-little-bit-longer-string", -1486304829),
    ("lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    ("abc", 479470107),
]


def _int32(x: int) -> int:
    """Java int overflow: keep 32 bits, read them as two's complement."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x & 0x80000000 else x


def _ushr(x: int, n: int) -> int:
    """Java's unsigned shift ``x >>> n`` on an int."""
    return _int32((x & 0xFFFFFFFF) >> n)


def java_murmur2(data: bytes) -> int:
    """A line-by-line transliteration of Utils.murmur2, in Java int arithmetic."""
    length = len(data)
    seed = _int32(0x9747B28C)
    m = 0x5BD1E995
    r = 24
    h = _int32(seed ^ length)
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = _int32(data[i4] + (data[i4 + 1] << 8) + (data[i4 + 2] << 16) + (data[i4 + 3] << 24))
        k = _int32(k * m)
        k ^= _ushr(k, r)
        k = _int32(k * m)
        h = _int32(h * m)
        h = _int32(h ^ k)
    rest = length % 4
    tail = length & ~3
    # Java's switch falls through from case 3 to case 1.
    if rest == 3:
        h = _int32(h ^ (data[tail + 2] << 16))
    if rest >= 2:
        h = _int32(h ^ (data[tail + 1] << 8))
    if rest >= 1:
        h = _int32(h ^ data[tail])
        h = _int32(h * m)
    h = _int32(h ^ _ushr(h, 13))
    h = _int32(h * m)
    h = _int32(h ^ _ushr(h, 15))
    return h


@pytest.mark.parametrize(("text", "expected"), KAFKA_VECTORS, ids=[t[:12] for t, _ in KAFKA_VECTORS])
def test_murmur2_matches_kafka_utils_test_vectors(text: str, expected: int) -> None:
    """murmur2 of each string in Kafka's own test gives the signed 32-bit value Java gives."""
    assert murmur2(text.encode()) == expected


@pytest.mark.parametrize(("text", "expected"), KAFKA_VECTORS, ids=[t[:12] for t, _ in KAFKA_VECTORS])
def test_reference_transliteration_matches_kafka_utils_test_vectors(text: str, expected: int) -> None:
    """The Java transliteration used as the oracle below agrees with Kafka's vectors too."""
    assert java_murmur2(text.encode()) == expected


@settings(max_examples=300, deadline=None, database=None)
@given(data=st.binary(max_size=64))
def test_murmur2_equals_java_for_any_bytes(data: bytes) -> None:
    """For any bytes (every tail length 0-3, bytes >= 0x80), murmur2 equals Java's int arithmetic."""
    assert murmur2(data) == java_murmur2(data)
    assert -(2**31) <= murmur2(data) < 2**31


@pytest.mark.parametrize("data", [b"", b"\x80", b"\xff\xff", b"\xff\xff\xff", b"\xff\xff\xff\xff\xff"])
def test_murmur2_of_edge_inputs_equals_java(data: bytes) -> None:
    """Empty input and high-bit bytes in every tail position hash as Java hashes them."""
    assert murmur2(data) == java_murmur2(data)


@pytest.mark.parametrize(("text", "hashed"), KAFKA_VECTORS, ids=[t[:12] for t, _ in KAFKA_VECTORS])
@pytest.mark.parametrize("partitions", [1, 2, 3, 7, 8, 16, 113, 1000])
def test_partition_for_key_is_to_positive_murmur2_mod_partitions(text: str, hashed: int, partitions: int) -> None:
    """partition_for_key clears the sign bit of murmur2 (toPositive) and takes it mod the partition count."""
    assert partition_for_key(text.encode(), partitions) == (hashed & 0x7FFFFFFF) % partitions


def test_partition_for_key_uses_to_positive_not_abs() -> None:
    """A negative hash is masked with 0x7fffffff, as Kafka does, which differs from abs()."""
    key = b"foobar"  # murmur2 = -790332482
    assert murmur2(key) < 0
    assert partition_for_key(key, 1000) == (-790332482 & 0x7FFFFFFF) % 1000 == 166
    assert partition_for_key(key, 1000) != abs(-790332482) % 1000


@settings(max_examples=300, deadline=None, database=None)
@given(key=st.binary(max_size=48), partitions=st.integers(1, 10_000))
def test_partition_for_key_is_in_range_and_stable(key: bytes, partitions: int) -> None:
    """Every key maps to one partition in [0, partitions), the same each time, as Java computes it."""
    partition = partition_for_key(key, partitions)
    assert 0 <= partition < partitions
    assert partition == partition_for_key(key, partitions)
    assert partition == (java_murmur2(key) & 0x7FFFFFFF) % partitions
