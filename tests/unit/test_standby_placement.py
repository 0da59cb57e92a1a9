"""Where standby copies go (standby.standby_buckets): never on the owner, k per bucket, the same everywhere."""

import itertools

from sluice.region.standby import standby_buckets

REGION = "orders"
BUCKETS = {REGION: 8}


def placement(members, owners, copies):
    """Every member's standby buckets, as each computes them alone."""
    return {m: standby_buckets(m, members, owners, BUCKETS, {REGION: copies}) for m in members}


def range_owners(members):
    """Kafka's range assignment of 8 buckets over ``members`` (in name order)."""
    ring = sorted(members)
    per, extra = divmod(8, len(ring))
    owners, b = {}, 0
    for i, m in enumerate(ring):
        for _ in range(per + (1 if i < extra else 0)):
            owners[(REGION, b)] = m
            b += 1
    return owners


def test_no_copies_no_standbys():
    members = ["a", "b"]
    assert placement(members, range_owners(members), 0) == {"a": set(), "b": set()}


def test_two_instances_one_copy_each_keeps_what_the_other_owns():
    members = ["a", "b"]
    owners = range_owners(members)
    found = placement(members, owners, 1)
    assert found["a"] == {rb for rb, m in owners.items() if m == "b"}
    assert found["b"] == {rb for rb, m in owners.items() if m == "a"}


def test_every_bucket_has_k_copies_none_on_its_owner():
    for n, k in itertools.product(range(2, 6), range(1, 4)):
        members = [f"m{i}" for i in range(n)]
        owners = range_owners(members)
        found = placement(members, owners, k)
        for b in range(8):
            holders = [m for m in members if (REGION, b) in found[m]]
            assert owners[(REGION, b)] not in holders
            assert len(holders) == min(k, n - 1), (n, k, b, holders)


def test_two_instances_every_failover_promotes_a_copy():
    members = ["a", "b"]
    found = placement(members, range_owners(members), 1)
    for failed in members:
        survivor = next(m for m in members if m != failed)
        moved = {rb for rb, m in range_owners(members).items() if m == failed}
        assert moved <= found[survivor]


def test_with_range_assignment_most_of_a_failed_owners_buckets_find_their_copy():
    # The group's assignor decides; with range assignment the ring successor takes most of them.
    members = ["a", "b", "c"]
    found = placement(members, range_owners(members), 1)
    after = range_owners(["a", "c"])  # b failed
    moved = [rb for rb, m in range_owners(members).items() if m == "b"]
    promoted = [rb for rb in moved if rb in found[after[rb]]]
    assert len(promoted) * 2 > len(moved)


def test_unknown_owners_still_get_distinct_copies():
    members = ["a", "b", "c"]
    found = placement(members, {}, 1)
    for b in range(8):
        assert sum((REGION, b) in found[m] for m in members) == 1


def test_alone_there_is_nothing_to_keep():
    assert standby_buckets("a", [], {}, BUCKETS, {REGION: 1}) == set()
    assert standby_buckets("a", ["a"], {}, BUCKETS, {REGION: 2}) == set()


def test_an_instance_missing_from_the_directory_counts_itself():
    # Its own record not read back yet: it still takes its place on the ring.
    found = standby_buckets("b", ["a"], {(REGION, b): "a" for b in range(8)}, BUCKETS, {REGION: 1})
    assert found == {(REGION, b) for b in range(8)}
