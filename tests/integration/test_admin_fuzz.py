"""The status page's API fuzzed with schemathesis from its own OpenAPI document (issue 17).

The app runs in process (schemathesis' ASGI transport) with the bearer token
on, against a real site on a real broker: the sampler reads Kafka and every
accepted action really writes the control topic.  Every control-topic write
goes through ``set_state``, which the test wraps to see which request made
it.  Examples are bounded (``EXAMPLES`` per operation and generation mode)
and derandomized, so a run is repeatable and takes seconds.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from sluice.admin import serve
from sluice.core.config import SiteConfig

from regionkit import control_records, write_site
from waiting import wait_for

pytestmark = pytest.mark.timeout(120)

TOKEN = "fuzz-" + "x" * 20
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = 25


def test_fuzzing_the_pages_api_with_the_token_on_finds_no_server_error_and_no_forged_write(
        site_a: Any, unique_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Positive and negative cases for every operation of /api/openapi.json, with the token: no answer is a 5xx
    and every schemathesis check passes (documented codes and content types, bodies and auth refused when
    invalid); a request that is not answered 200 writes no control record, and neither does the same action sent
    again from another origin; the control topic holds exactly one record per accepted action."""
    cfg = write_site(tmp_path / "site.yaml", site="a", bootstrap=site_a.bootstrap,
                     prefix=site_a.topic_prefix(unique_prefix), buckets=2)
    sampler = serve.StatusSampler(cfg, interval_s=1, history_s=10, token_required=True)
    writes: list[tuple[str, str]] = []
    real_set_state = serve.set_state

    def recording_set_state(cfg: SiteConfig, queue_id: str, state: str, **kwargs: Any) -> None:
        writes.append((queue_id, state))
        real_set_state(cfg, queue_id, state, **kwargs)

    monkeypatch.setattr(serve, "set_state", recording_set_state)
    sampler.start()
    try:
        wait_for(lambda: sampler.ready, timeout_s=30, what="the sampler's first sample")
        app = serve.create_app(sampler, TOKEN)
        schema = schemathesis.openapi.from_asgi("/api/openapi.json", app, headers=AUTH)
        answers: collections.Counter[tuple[str, str, int]] = collections.Counter()
        accepted = 0
        unbreakable: list[str] = []

        for result in schema.get_all_operations():
            operation = result.ok()
            posts = operation.method.upper() == "POST"
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
                def fuzz(case: Any) -> None:
                    nonlocal accepted
                    before = len(writes)
                    response = case.call(headers=AUTH)
                    case.validate_response(response)  # every default check, not_a_server_error among them
                    answers[(operation.label, mode.value, response.status_code)] += 1
                    wrote = len(writes) - before
                    if posts and response.status_code == 200:
                        assert wrote == 1
                        accepted += 1
                    else:
                        assert wrote == 0, f"{operation.label} answered {response.status_code} and wrote {wrote}"
                    if posts:
                        forged = case.call(headers={**AUTH, "Origin": "http://evil.example"})
                        assert forged.status_code in (401, 403), forged.text
                        assert len(writes) - before == wrote, "a request from another origin wrote a record"

                try:
                    fuzz()
                except Unsatisfiable:
                    # Nothing of the operation can be made invalid (/healthz, /readyz: no parameter, no body,
                    # no token).
                    assert mode is GenerationMode.NEGATIVE, operation.label
                    unbreakable.append(operation.label)

        assert sorted(unbreakable) == ["GET /healthz", "GET /readyz"], unbreakable
        assert not [key for key in answers if key[2] >= 500], answers
        assert accepted > 0 and any(status in (400, 404) for _, _, status in answers), answers
        assert len(control_records(cfg)) == len(writes) == accepted
        print(f"\nschemathesis: {sum(answers.values())} requests, {accepted} actions accepted; "
              + ", ".join(f"{label} {mode} {status}: {n}" for (label, mode, status), n in sorted(answers.items())))
    finally:
        sampler.stop()
