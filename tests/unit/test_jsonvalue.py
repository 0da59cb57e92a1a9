"""Stored JSON values (core/jsonvalue.py): the fast checks give the verdicts of the exact reader."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.core import jsonvalue

#: Texts near JSON: numbers of every length (long integers, exponents beyond a double), NaN and
#: Infinity, brackets and quotes, so that valid and invalid texts are both common.
PIECES = st.sampled_from(["[", "]", "{", "}", ",", ":", '"a"', "1", "-", "e999", "1e308", ".5", "NaN",
                          "Infinity", "true", "null", " ", "0" * 19, "9" * 30, "1" + "0" * 400, "x"])
TEXTS = st.lists(PIECES, max_size=12).map("".join).map(str.encode) | st.binary(max_size=30)


def _loads_verdict(data: bytes) -> bool:
    try:
        jsonvalue.loads(data)
    except ValueError:
        return False
    return True


@settings(max_examples=1500, deadline=None, database=None)
@given(TEXTS)
def test_check_refuses_exactly_what_loads_refuses(data: bytes) -> None:
    try:
        jsonvalue.check(data)
        verdict = True
    except ValueError:
        verdict = False
    assert verdict == _loads_verdict(data)


@settings(max_examples=1000, deadline=None, database=None)
@given(st.text(alphabet="0123456789 ,.-ax\u0663", max_size=60).map(str.encode))
def test_a_long_digit_run_is_found_as_a_regular_expression_finds_it(data: bytes) -> None:
    assert jsonvalue.has_long_digits(data) == bool(re.search(rb"[0-9]{19,}", data))


def test_long_integers_stay_exact_and_non_finite_numbers_are_refused() -> None:
    assert jsonvalue.loads(b"[12345678901234567890123]") == [12345678901234567890123]
    for text in (b"NaN", b"[1e999]", b"-Infinity"):
        assert not _loads_verdict(text)
    jsonvalue.check(b"1" + b"0" * 400)  # exact: a Python int, though orjson cannot hold it
