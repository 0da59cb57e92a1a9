"""Who owns a bucket, from the claims region-service instances publish (sluice.core.directory)."""

from __future__ import annotations

from sluice.core.directory import LIVE_WITHIN_S, Instance, live_urls, owners_of


def _inst(name: str, url: str, claims: list[tuple[str, int, int]], state: str = "running",
          updated_at: int = 1_000_000) -> Instance:
    return Instance(name, url, state, tuple(claims), updated_at)


def test_the_latest_claim_of_a_bucket_wins_so_a_dead_owner_is_superseded_by_its_successor() -> None:
    dead = _inst("a", "http://a", [("orders", 0, 100), ("orders", 1, 100)])
    successor = _inst("b", "http://b", [("orders", 0, 200), ("orders", 2, 50)])
    owners = owners_of({"a": dead, "b": successor})
    assert owners == {("orders", 0): "http://b", ("orders", 1): "http://a", ("orders", 2): "http://b"}


def test_a_stopped_instance_owns_nothing_and_is_not_offered() -> None:
    gone = _inst("a", "http://a", [("orders", 0, 300)], state="stopped")
    live = _inst("b", "http://b", [("orders", 0, 100)])
    assert owners_of({"a": gone, "b": live}) == {("orders", 0): "http://b"}
    assert live_urls({"a": gone, "b": live}, now_ms=1_000_000) == ["http://b"]


def test_instances_not_heard_from_lately_are_left_out_unless_none_is_fresh() -> None:
    now = 10_000_000
    fresh = _inst("a", "http://a", [], updated_at=now - 1_000)
    silent = _inst("b", "http://b", [], updated_at=now - int(LIVE_WITHIN_S * 1000) - 1)
    assert live_urls({"a": fresh, "b": silent}, now_ms=now) == ["http://a"]
    assert live_urls({"b": silent}, now_ms=now) == ["http://b"]


# --- which records and URLs a reader believes (MemberTrust) ---------------------------------


def _record(name: str, url: str) -> bytes:
    from sluice.core.codec import get_codec

    return get_codec().encode("RegionInstance", {"instance": name, "url": url, "state": "running",
                                                 "buckets": [{"region": "orders", "bucket": 0, "since": 5}],
                                                 "updated_at": 5})


def test_with_a_member_token_only_records_signed_with_it_are_believed() -> None:
    """Unsigned, tampered, wrongly keyed and other-key-signed records (tombstones included) are ignored;
    the signature covers the key, so a signed record replayed under another instance's key is too."""
    from sluice.core.codec import get_codec
    from sluice.core.directory import SIGNATURE_HEADER, MemberTrust, _decode

    codec = get_codec()
    trust = MemberTrust("m" * 32)
    key, value = b"region/a", _record("a", "http://127.0.0.1:7071")
    signed = trust.headers(key, value)
    assert _decode(codec, key, value, signed, trust) is not None
    assert _decode(codec, key, value, None, trust) is None
    assert _decode(codec, key, value[:-1] + b"\x02", signed, trust) is None
    assert _decode(codec, b"region/b", value, trust.headers(b"region/b", value), trust) is None  # names "a"
    assert _decode(codec, b"region/b", value, signed, trust) is None
    assert _decode(codec, key, value, MemberTrust("x" * 32).headers(key, value), trust) is None
    assert _decode(codec, key, None, None, trust) is None
    assert _decode(codec, key, None, trust.headers(key, None), trust) == ("a", None)
    assert _decode(codec, key, value, [(SIGNATURE_HEADER, b"")], trust) is None
    # Without a member token (a loopback-only site) records are taken as they are.
    assert _decode(codec, key, value, None, MemberTrust(None)) is not None


def test_member_urls_must_name_an_allowed_host_signed_or_not() -> None:
    """Empty member_hosts: loopback and this process's own host; else IP networks and host-name globs.
    URLs with a user, a query or another scheme are never member URLs."""
    from sluice.core.directory import MemberTrust

    default = MemberTrust(None, (), ("10.1.2.3", "orders-0.example"))
    for url in ("http://127.0.0.1:7071", "http://localhost:7071", "http://[::1]:7071", "http://127.0.0.2:1",
                "http://10.1.2.3:7071", "https://orders-0.example"):
        assert default.allows(url), url
    for url in ("http://10.1.2.4:7071", "http://evil.example:7071", "ftp://127.0.0.1", "http://u:p@127.0.0.1:1",
                "http://127.0.0.1:1/?x=", "http://127.0.0.1:99999", "not a url", "http://:80"):
        assert not default.allows(url), url
    listed = MemberTrust(None, ("10.0.0.0/8", "*.orders.svc.cluster.local", "fd00::/8"))
    for url in ("http://10.9.8.7:7071", "http://orders-1.orders.svc.cluster.local:7071", "http://[fd00::5]:1"):
        assert listed.allows(url), url
    for url in ("http://127.0.0.1:7071", "http://11.0.0.1:1", "http://orders.svc.cluster.local.evil:1"):
        assert not listed.allows(url), url


def test_live_urls_leave_out_urls_the_reader_does_not_believe() -> None:
    """A running, fresh instance whose URL names a host outside member_hosts is not offered."""
    from sluice.core.directory import MemberTrust

    now = 10_000_000
    good = _inst("a", "http://127.0.0.1:1", [], updated_at=now)
    bad = _inst("b", "http://10.0.0.1:1", [], updated_at=now)
    assert live_urls({"a": good, "b": bad}, now_ms=now, trust=MemberTrust(None)) == ["http://127.0.0.1:1"]


def test_a_bucket_is_unowned_since_it_was_first_seen_so_until_someone_owns_it() -> None:
    """readiness(): the time each bucket owned by no instance was first seen so, forgotten once owned."""
    from sluice.region.service import unowned_since

    regions = {("orders", 3)}
    first = unowned_since({}, 100.0, regions, mine={("orders", 0)}, claimed={("orders", 1): "http://b"})
    assert first == {("orders", 2): 100.0}
    later = unowned_since(first, 130.0, regions, mine=set(), claimed={("orders", 0): "http://b"})
    assert later == {("orders", 1): 130.0, ("orders", 2): 100.0}
    assert unowned_since(later, 140.0, regions, mine={("orders", 1), ("orders", 2)}, claimed={("orders", 0): "x"}) == {}
