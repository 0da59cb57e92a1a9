"""The aims of issue 18, judged on one run's results: each figure, its value or ratio, the aim, met or not.

The harness prints this table after the figures and writes it into
results.json (``aims``).  Every aim reads results of the same run only, by
name (the names are the benchmarks'; README.md lists them), so a figure
below its aim shows as "not met" next to what was measured, and an aim
whose benchmark ran but gave no figure (it failed) as "not measured".  Aims
of benchmarks that did not run (``--only``) are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .harness import Result

#: gateway.latency's workload, as the issue states it: 5,000 events/s.
LATENCY_RATE = 5000
#: "B keeps up": the writers on A reached at least this share of LATENCY_RATE ...
KEEP_UP_WRITTEN_SHARE = 0.95
#: ... and when the writes ended, fewer events than this many seconds of input
#: were written on A and not yet applied on B.  A path slower than its input
#: builds a backlog that grows with the run (20 s): 5 % too slow already
#: leaves more than a second's worth behind.
KEEP_UP_BACKLOG_S = 1.0
#: The processes the issue sums for the gateway's CPU per event, as bench/gateway.py names them (CPU_TOTAL).
GATEWAY_CPU_TOTAL = "sender+receiver+region-b+broker-b"


@dataclass(frozen=True, slots=True)
class Verdict:
    """One row of the aims table."""

    aim: str
    measured: str
    target: str
    #: None: the benchmark ran but gave no figure for this aim.
    met: bool | None

    @property
    def verdict(self) -> str:
        return "not measured" if self.met is None else "met" if self.met else "not met"

    def to_dict(self) -> dict[str, Any]:
        return {"aim": self.aim, "measured": self.measured, "target": self.target, "met": self.met,
                "verdict": self.verdict}


class Figures:
    """One run's results, found by name (and baseline, where a figure has several)."""

    def __init__(self, results: Sequence[Result]) -> None:
        self._results = list(results)

    def get(self, name: str, baseline: str | None = None) -> Result | None:
        for r in self._results:
            if r.name == name and (baseline is None or r.baseline == baseline):
                return r
        return None


Judge = Callable[[Figures], tuple[str, bool] | None]


@dataclass(frozen=True)
class Aim:
    #: The benchmark (registry name) whose results the aim reads.
    benchmark: str
    aim: str
    target: str
    judge: Judge


def _n(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}" if value >= 10 else f"{value:.2f}"


def ratio_at_least(name: str, baseline: str, aim: float) -> Judge:
    def judge(f: Figures) -> tuple[str, bool] | None:
        r = f.get(name, baseline)
        if r is None or r.ratio is None or r.baseline_value is None:
            return None
        return f"{r.ratio:.3f}× ({_n(r.value)} vs {_n(r.baseline_value)} {r.unit})", r.ratio >= aim
    return judge


def value_at_most(name: str, aim: float) -> Judge:
    def judge(f: Figures) -> tuple[str, bool] | None:
        r = f.get(name)
        if r is None:
            return None
        return f"{_n(r.value)} {r.unit}", r.value <= aim
    return judge


def dispatcher_steady(f: Figures) -> tuple[str, bool] | None:
    """The steady-state ratio decides; the start-up is shown beside it, not judged."""
    judged = ratio_at_least("dispatcher.noop.throughput", "raw.consumer", 0.4)(f)
    if judged is None:
        return None
    text, met = judged
    startup = f.get("dispatcher.noop.startup")
    if startup is not None:
        text += f"; start-up {startup.value:.2f} s"
        if startup.baseline_value is not None:
            text += f" (a raw consumer process: {startup.baseline_value:.2f} s)"
    return text, met


def gateway_keeps_up(f: Figures) -> tuple[str, bool] | None:
    written = f.get("gateway.latency.written")
    backlog = f.get("gateway.latency.backlog_end")
    if written is None or backlog is None:
        return None
    met = written.value >= KEEP_UP_WRITTEN_SHARE * LATENCY_RATE and backlog.value <= KEEP_UP_BACKLOG_S * LATENCY_RATE
    return (f"written on A at {written.value:,.0f}/s; when the writes ended {backlog.value:,.0f} events were not "
            f"yet applied on B ({backlog.value / LATENCY_RATE:.2f} s of input)"), met


AIMS: tuple[Aim, ...] = (
    Aim("gateway.throughput", "gateway.throughput ÷ MirrorMaker 2", "≥ 0.6×",
        ratio_at_least("gateway.throughput", "mirrormaker2", 0.6)),
    Aim("gateway.latency", "gateway.latency at 5,000 events/s, bti 50 ms: B keeps up",
        f"written ≥ {KEEP_UP_WRITTEN_SHARE * LATENCY_RATE:,.0f}/s, backlog at the end "
        f"≤ {KEEP_UP_BACKLOG_S * LATENCY_RATE:,.0f} ({KEEP_UP_BACKLOG_S:g} s)",
        gateway_keeps_up),
    Aim("gateway.latency", "gateway.latency p99 at 5,000 events/s, bti 50 ms", "≤ 250 ms",
        value_at_most("gateway.latency.p99", 250)),
    Aim("gateway.throughput", "CPU per event, sender + receiver + region B + broker B (gateway.throughput)",
        "≤ 60 µs", value_at_most(f"gateway.throughput.cpu.{GATEWAY_CPU_TOTAL}", 60)),
    Aim("gateway.latency", "CPU per event, sender + receiver + region B + broker B (gateway.latency)",
        "≤ 60 µs", value_at_most(f"gateway.latency.cpu.{GATEWAY_CPU_TOTAL}", 60)),
    Aim("dispatcher.noop.throughput", "dispatcher.noop.throughput ÷ raw consumer, steady state", "≥ 0.4×",
        dispatcher_steady),
    Aim("region.put_all.ingest", "region.put_all.ingest ÷ raw producer", "≥ 0.12×",
        ratio_at_least("region.put_all.ingest", "raw.producer", 0.12)),
    Aim("subscriptions.fanout", "subscriptions.fanout.delivered ÷ raw consumer", "≥ 0.06×",
        ratio_at_least("subscriptions.fanout.delivered", "raw.consumer", 0.06)),
    Aim("region.put.latency", "region.put.latency p99", "≤ 12 ms", value_at_most("region.put.latency.p99", 12)),
)


def evaluate(results: Sequence[Result], ran: Sequence[str]) -> list[Verdict]:
    """The aims whose benchmark is among ``ran``, judged on ``results``."""
    figures = Figures(results)
    verdicts = []
    for aim in AIMS:
        if aim.benchmark not in ran:
            continue
        judged = aim.judge(figures)
        if judged is None:
            verdicts.append(Verdict(aim.aim, "no figure (the benchmark failed)", aim.target, None))
        else:
            measured, met = judged
            verdicts.append(Verdict(aim.aim, measured, aim.target, met))
    return verdicts
