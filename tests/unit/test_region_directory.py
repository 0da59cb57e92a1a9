"""Who owns a bucket, from the claims region-service instances publish (sluice.region.directory)."""

from __future__ import annotations

from sluice.region.directory import LIVE_WITHIN_S, Instance, live_urls, owners_of


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
