r"""A client's interest in a region's keys (Geode's registerInterest), and what it receives.

The client library registers interest and the subscription service matches
events against it, by these same types and rules; so they live in the core,
and the client library shows ``ALL_KEYS`` and ``ResultPolicy`` as
``sluice.client.ALL_KEYS`` and ``sluice.client.ResultPolicy``.

A registration names keys (one key, a list of keys, ``ALL_KEYS``, or a
regular expression matched against the whole key), whether it is durable,
and whether the client receives values (``receive_values=True``: the new
value of each update) or only invalidates of the entries it holds
(``False``).  A client's interest in a region is the union of its
registrations; a key may be of interest before it exists.  When a key
matches registrations of both kinds, values win.

The ``result_policy`` of a registration decides its initial load from the
region's current state: ``KEYS_VALUES`` (keys and values, the default),
``KEYS`` (keys only: invalid entries) or ``NONE``.

Interest regexes are compiled with RE2 (``google-re2``), on the client and
in the subscription service alike (``compile_regex``): matching takes time
linear in the key, whatever the pattern (issue 17: ``(a+)+`` took Python's
``re`` seconds per key and stalled every client of the service).  RE2 has
no backreferences, lookaround, atomic groups or possessive repeats; ``\d``,
``\w``, ``\s`` and ``\b`` are ASCII.  Otherwise a pattern means what it
means to Python's ``re``, matched against the whole key.  A pattern longer
than ``REGEX_CHARS_MAX`` characters, or that RE2 refuses, is an
``InvalidRequest`` naming the field ``regex``, the pattern and why.  The
patterns of one kind of registration are matched together, one pass per key
(``match_any``: an RE2 set).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import re2

from .errors import InvalidRequest

ALL_KEYS = "ALL_KEYS"
#: The longest interest regex taken, in characters: a registry record is read by every
#: subscription instance, and a pattern's compiled program grows with its length.
REGEX_CHARS_MAX = 1000
#: The memory RE2 may use for one compiled pattern (its program and its lazily built DFA); a
#: pattern that needs more is refused ("pattern too large").
REGEX_MEMORY_MAX_BYTES = 8 << 20
#: What RE2 does not have, told with every refusal.
RE2_LIMITS = "RE2 syntax: no backreferences, lookaround, atomic groups or possessive repeats"


def _re2_options(patterns: int = 1) -> Any:
    options = re2.Options()
    options.max_mem = REGEX_MEMORY_MAX_BYTES * patterns
    options.log_errors = False  # the refusal says why; nothing is written to stderr
    options.never_capture = True  # whether a key matches is all that is asked
    return options


_OPTIONS = _re2_options()


def compile_regex(pattern: object) -> Any:
    """An interest regex compiled with RE2 (matched in linear time), or ``InvalidRequest``
    naming the field ``regex``, the pattern and why it is refused."""
    if not isinstance(pattern, str):
        raise InvalidRequest("regex", pattern, "must be a string")
    if len(pattern) > REGEX_CHARS_MAX:
        raise InvalidRequest("regex", pattern, f"longer than {REGEX_CHARS_MAX} characters ({len(pattern)})")
    try:
        return re2.compile(pattern, _OPTIONS)
    except re2.error as exc:
        why = exc.args[0].decode("utf-8", "replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise InvalidRequest("regex", pattern, f"not a regular expression RE2 accepts: {why} ({RE2_LIMITS})") from None
    except ValueError as exc:  # a lone surrogate cannot be encoded as UTF-8
        raise InvalidRequest("regex", pattern, f"not valid text: {exc}") from None


class ResultPolicy(str, enum.Enum):
    KEYS_VALUES = "KEYS_VALUES"
    KEYS = "KEYS"
    NONE = "NONE"


class Delivery(str, enum.Enum):
    """What a matching update brings the client."""

    VALUES = "values"
    INVALIDATES = "invalidates"


def _one_pass(patterns: list[str]) -> Any | None:
    """``patterns`` (each taken by ``compile_regex``) as one RE2 set matching whole keys, or None when
    together they need more memory than the set may have (they are then matched one by one)."""
    one_pass = re2.Set.FullMatchSet(_re2_options(len(patterns)))
    try:
        for pattern in patterns:
            one_pass.Add(pattern)
        one_pass.Compile()
    except re2.error:
        return None
    return one_pass


def match_any(patterns: list[str]) -> Callable[[str], bool]:
    """Whether a key matches any of ``patterns`` (each taken by ``compile_regex``) as a whole: one
    RE2 set, so a key costs one pass however many patterns there are (the Python wrapper's
    per-call cost, about a microsecond, dominates a single pattern's match)."""
    one_pass = _one_pass(patterns)
    if one_pass is None:
        compiled = [compile_regex(pattern) for pattern in patterns]
        return lambda key: any(c.fullmatch(key) is not None for c in compiled)
    return lambda key: one_pass.Match(key) is not None


def match_which(patterns: list[str]) -> Callable[[str], Iterable[int]]:
    """Which of ``patterns`` (their indices, in no order) a key matches as a whole, in one pass: what
    the subscription service's interest index asks of the regexes of all its clients at once."""
    one_pass = _one_pass(patterns)
    if one_pass is None:
        compiled = [compile_regex(pattern) for pattern in patterns]
        return lambda key: [i for i, c in enumerate(compiled) if c.fullmatch(key) is not None]
    return lambda key: one_pass.Match(key) or ()


@dataclass(frozen=True, slots=True)
class Registration:
    """One registerInterest call: keys (a tuple), ALL_KEYS, or a regex."""

    keys: tuple[str, ...] = ()
    all_keys: bool = False
    regex: str | None = None
    durable: bool = False
    receive_values: bool = True
    result_policy: ResultPolicy = ResultPolicy.KEYS_VALUES

    @classmethod
    def of_keys(cls, keys: str | list[str] | tuple[str, ...], **options: object) -> Registration:
        """``register_interest(key | [keys] | ALL_KEYS, ...)``."""
        if keys == ALL_KEYS:
            return cls(all_keys=True, **options)  # type: ignore[arg-type]
        listed = (keys,) if isinstance(keys, str) else tuple(keys)
        if not listed or not all(isinstance(k, str) and k for k in listed):
            raise InvalidRequest("keys", keys, "a key, a non-empty list of non-empty keys, or ALL_KEYS")
        return cls(keys=listed, **options)  # type: ignore[arg-type]

    @classmethod
    def of_regex(cls, pattern: str, **options: object) -> Registration:
        """``register_interest_regex(pattern, ...)``: the whole key must match (``compile_regex``)."""
        compile_regex(pattern)
        return cls(regex=pattern, **options)  # type: ignore[arg-type]


@dataclass(slots=True)
class _Kind:
    """The keys, ALL_KEYS flag and regexes of registrations that share a delivery and durability."""

    keys: set[str] = field(default_factory=set)
    all_keys: bool = False
    regexes: set[str] = field(default_factory=set)
    _matches_regex: Callable[[str], bool] | None = None  # match_any(regexes), made again when they change

    def matches(self, key: str) -> bool:
        return self.all_keys or key in self.keys or (self._matches_regex is not None and self._matches_regex(key))

    def add(self, r: Registration) -> None:
        if r.regex is not None:
            compile_regex(r.regex)  # InvalidRequest before anything changes
        self.keys.update(r.keys)
        self.all_keys = self.all_keys or r.all_keys
        if r.regex is not None and r.regex not in self.regexes:
            self.regexes.add(r.regex)
            self._matches_regex = match_any(sorted(self.regexes))

    def remove(self, r: Registration) -> None:
        self.keys.difference_update(r.keys)
        if r.all_keys:
            self.all_keys = False
        if r.regex is not None and r.regex in self.regexes:
            self.regexes.discard(r.regex)
            self._matches_regex = match_any(sorted(self.regexes)) if self.regexes else None

    def empty(self) -> bool:
        return not (self.keys or self.all_keys or self.regexes)


class RegionInterest:
    """The union of one client's registrations on one region."""

    def __init__(self) -> None:
        # (receive_values, durable) -> what was registered so
        self._kinds: dict[tuple[bool, bool], _Kind] = {}

    def register(self, r: Registration) -> None:
        self._kinds.setdefault((r.receive_values, r.durable), _Kind()).add(r)

    def unregister(self, r: Registration) -> None:
        """Geode's unregisterInterest: the keys, ALL_KEYS or the regex, whatever options they came with."""
        for kind in self._kinds.values():
            kind.remove(r)
        self._kinds = {k: v for k, v in self._kinds.items() if not v.empty()}

    def drop_non_durable(self) -> None:
        """A durable client disconnected: only its durable interest is kept."""
        self._kinds = {k: v for k, v in self._kinds.items() if k[1]}

    def delivery(self, key: str) -> Delivery | None:
        """What an update of ``key`` brings this client, or None when it is of no interest."""
        invalidates = False
        for (values, _durable), kind in self._kinds.items():
            if kind.matches(key):
                if values:
                    return Delivery.VALUES
                invalidates = True
        return Delivery.INVALIDATES if invalidates else None

    def empty(self) -> bool:
        return not self._kinds

    def parts(self) -> list[tuple[bool, frozenset[str], bool, frozenset[str]]]:
        """(receive_values, keys, all_keys, regexes) of each kind of registration held: what an
        index of many clients' interest (the subscription service's) is built from."""
        return [(values, frozenset(kind.keys), kind.all_keys, frozenset(kind.regexes))
                for (values, _durable), kind in self._kinds.items()]


__all__ = ["ALL_KEYS", "REGEX_CHARS_MAX", "Delivery", "Registration", "RegionInterest", "ResultPolicy",
           "compile_regex", "match_any", "match_which"]
