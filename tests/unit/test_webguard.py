"""The forgery and token rules both HTTP faces share (core/webguard.py), without a server."""

from __future__ import annotations

from sluice.core.webguard import bearer_matches, digest, forgery_problem, is_loopback, same_origin


def headers(**given: str) -> dict[str, str]:
    return {name.replace("_", "-"): value for name, value in given.items()}


def test_a_state_changing_request_from_another_site_is_refused_and_a_program_passes() -> None:
    """Another site's page is told by Sec-Fetch-Site, Origin or Referer, or by a body that is not JSON;
    a program sending JSON with no browser headers passes, and safe methods always do."""
    own = {"host": "127.0.0.1:7070", "content-type": "application/json"}
    assert forgery_problem({**own}.get, "POST", True) is None
    assert forgery_problem({**own, "origin": "http://127.0.0.1:7070"}.get, "POST", True) is None
    assert forgery_problem(headers(host="127.0.0.1:7070").get, "DELETE", False) is None
    assert forgery_problem(headers(host="x", origin="http://evil.example").get, "GET", False) is None
    refused = {
        "sec-fetch-site": {**own, "sec-fetch-site": "cross-site"},
        "origin": {**own, "origin": "http://evil.example"},
        "referer": {**own, "referer": "http://evil.example/page"},
        "content-type": {"host": "127.0.0.1:7070", "content-type": "text/plain"},
    }
    for field, given in refused.items():
        problem = forgery_problem(given.get, "POST", True)
        assert problem is not None and problem[0] == field, (field, problem)
    assert forgery_problem({**own, "sec-fetch-site": "same-site"}.get, "POST", True) is not None
    assert forgery_problem(headers(host="h").get, "POST", False)[0] == "content-type"  # type: ignore[index]


def test_origins_compare_host_and_effective_port() -> None:
    """A Host without a port stands for the scheme's default port; brackets and case do not matter."""
    assert same_origin("http://LocalHost:80", "localhost")
    assert same_origin("https://example.com", "example.com")
    assert not same_origin("http://example.com:8080", "example.com")
    assert same_origin("http://[::1]:7070", "[::1]:7070")
    assert not same_origin("ftp://example.com", "example.com")
    assert not same_origin("http://example.com:99999", "example.com")


def test_bearer_tokens_match_in_constant_time_and_nothing_else_matches() -> None:
    """Only `Bearer <the token>` matches; a missing, empty or other-scheme header is no match, not an error."""
    expected = digest("s3cret-token")
    assert bearer_matches("Bearer s3cret-token", expected)
    assert bearer_matches(b"bearer  s3cret-token ", expected)
    for given in (None, "", "Bearer", "Bearer other", "Basic s3cret-token", "s3cret-token", b"\xff\xfe"):
        assert not bearer_matches(given, expected), given


def test_loopback_names_and_addresses() -> None:
    """localhost, 127.0.0.0/8 and ::1 are loopback; anything else, names included, is not."""
    assert all(is_loopback(h) for h in ("localhost", "127.0.0.1", "127.9.9.9", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "example.com", "::", ""))
