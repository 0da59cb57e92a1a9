"""The benchmark registry and runner.

A benchmark is a function registered with ``@benchmark("area.what")``.  It
takes a :class:`Context` (the broker every benchmark of the run shares, a
work directory of its own, the ``quick`` flag, a console for progress) and
returns a list of :class:`Result`: a figure, its unit, and the baseline it is
measured against with the baseline's value, measured by the same function in
the same run on the same broker.  The harness computes every ratio
(``value / baseline_value``), so no benchmark reports a ratio it did not
measure both sides of.

One run, step by step:

1. start one embedded broker (``sluice.broker.start_broker``) in a fresh
   temporary directory;
2. call each selected benchmark in registration order; one that raises is
   reported as failed and the others still run;
3. print the figures, the CPU each measured process used per event (a
   table of its own) and the issue's aims with "met" or "not met"
   (``bench/aims.py``), and write ``bench/results.json`` (machine, time,
   results, aims);
4. stop the broker and delete the directory, also on Ctrl-C or SIGTERM.  A
   failed run keeps the directory (service logs) and says where it is.

A benchmark owns what it starts: it stops its processes in ``finally``.

CPU per event: ``Context.cpu_use`` reads the CPU seconds (user + system,
every thread, from ``/proc/PID/stat``) of each named process every
``CPU_SAMPLE_S`` while a block runs; ``Context.cpu_per_event`` divides
what each used over the part that handled the events by the events, in
microseconds, and returns them as results of unit ``µs/event``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from sluice.core.processes import die_with_parent

if TYPE_CHECKING:
    from .aims import Verdict

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_PATH = BENCH_DIR / "results.json"
PROFILES_DIR = BENCH_DIR / "profiles"
PY_SPY = Path(sys.executable).parent / "py-spy"
#: A 1-minute load average above this at the start makes the run warn that the machine is busy.
BUSY_LOAD = 0.5
#: The unit of the CPU-per-event results (printed in a table of their own).
CPU_UNIT = "µs/event"
#: Seconds between two readings of the measured processes' CPU (``Context.cpu_use``).
CPU_SAMPLE_S = 0.05


# --- what a benchmark returns ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Result:
    """One figure and the baseline it is compared with (both from this run).

    ``baseline`` names what was measured as the reference (e.g.
    ``raw.producer``); ``None`` when the figure stands alone.
    """

    name: str
    value: float
    unit: str
    baseline: str | None = None
    baseline_value: float | None = None

    @property
    def ratio(self) -> float | None:
        """``value / baseline_value``, or None without a (non-zero) baseline."""
        if self.baseline_value is None or self.baseline_value == 0:
            return None
        return self.value / self.baseline_value

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "baseline": self.baseline,
            "baseline_value": self.baseline_value,
            "ratio": self.ratio,
        }


# --- what a benchmark gets ------------------------------------------------------


@dataclass
class Context:
    """What the harness hands every benchmark.

    ``workdir`` is the benchmark's own directory (site files, service logs).
    ``engine`` is "kafka" or "tansu"; ``engine_label`` its name and version.
    """

    bootstrap: str
    workdir: Path
    quick: bool
    engine: str
    engine_label: str
    console: Console
    progress: Progress
    name: str = ""
    broker_pid: int | None = None
    notes: list[str] = field(default_factory=list)
    #: Where ``--profile`` puts py-spy profiles; None: not profiling.
    profile_dir: Path | None = None
    profiles: list[Path] = field(default_factory=list)

    def sized(self, full: int, quick: int) -> int:
        """The size of a workload: ``quick`` under ``--quick``, else ``full``."""
        return quick if self.quick else full

    def topic_prefix(self) -> str:
        """A fresh topic prefix, so benchmarks sharing the broker never share topics."""
        return f"bench{uuid.uuid4().hex[:8]}."

    def step(self, text: str) -> None:
        """One progress line (also readable in a CI log, where bars do not redraw)."""
        self.console.log(f"[dim]{self.name}[/] {text}")

    def note(self, text: str) -> None:
        """A remark worth keeping with the results (printed under the table)."""
        self.notes.append(f"{self.name}: {text}")
        self.step(text)

    @contextlib.contextmanager
    def counting(self, description: str, total: int) -> Iterator[Callable[[int], None]]:
        """A progress bar; yields ``advance(n)``, safe to call from any thread."""
        task: TaskID = self.progress.add_task(description, total=total)
        try:
            yield lambda n: self.progress.advance(task, n)
        finally:
            self.progress.remove_task(task)

    @contextlib.contextmanager
    def cpu_use(self, label: str, processes: Mapping[str, "CpuSource"], *,
                broker: str | None = "broker") -> Iterator["CpuUse"]:
        """Measure the CPU each named process uses during the block; yields the :class:`CpuUse`.

        ``processes`` maps a name to a pid, a list of pids (a group, summed)
        or a function returning CPU seconds (a process tree).  The run's
        broker (named ``broker``, or as given; None leaves it out) and
        ``bench`` (this process: the clients, the runner) are added.  The
        block's use, in cores, is noted when it ends: on a 2-core machine
        that says at once whether a figure is bound by one process's CPU (a
        Python service at ~1 core is GIL-bound) or by the machine.  Once the
        block has ended, ``seconds`` and ``between`` give CPU seconds for
        :meth:`cpu_per_event`.
        """
        sources: dict[str, CpuSource] = {}
        if broker is not None:
            sources[broker] = self.broker_pid
        sources["bench"] = os.getpid()
        sources.update(processes)
        use = CpuUse(label, sources)
        use.start()
        try:
            yield use
        finally:
            use.stop()
        cores = use.cores()
        if cores:
            self.note(f"{label}: CPU used, in cores of {os.cpu_count()}: "
                      + ", ".join(f"{name} {c:.2f}" for name, c in cores.items()))

    def cpu_per_event(self, figure: str, cpu_s: Mapping[str, float], events: int, *,
                      processes: Sequence[str], total: Sequence[str] = (),
                      baselines: Mapping[str, tuple[str, float | None]] | None = None,
                      what: str = "") -> list[Result]:
        """µs of CPU per event of each of ``processes``, and of their ``total``, as results.

        ``cpu_s`` holds the CPU seconds each process used over the part of
        the run that handled ``events`` events (``CpuUse.seconds`` or a
        window of it, ``CpuUse.between``).  Each result is named
        ``<figure>.cpu.<process>``; the total ``<figure>.cpu.<a>+<b>+…``.
        ``baselines`` maps a process (or the total, ``a+b+…``) to the name and
        µs per event of what it is compared with (the raw mirror's CPU per
        record); the others have none.  A process whose CPU was not read is
        left out, and so is a total missing one of its processes; the note
        says so.  ``what`` names the event in the note ("per delivery").
        """
        baselines = baselines or {}
        if events <= 0:
            raise ValueError(f"{figure}: CPU per event of {events} events")
        per_event = {name: cpu_s[name] * 1e6 / events for name in processes if name in cpu_s}
        results = []
        for name, us in per_event.items():
            base_name, base_us = baselines.get(name, (None, None))
            results.append(Result(f"{figure}.cpu.{name}", us, CPU_UNIT, base_name, base_us))
        parts = [f"{name} {us:,.1f}" for name, us in per_event.items()]
        unread = [name for name in processes if name not in cpu_s]
        if total:
            key = "+".join(total)
            if all(name in cpu_s for name in total):
                us = sum(cpu_s[name] for name in total) * 1e6 / events
                base_name, base_us = baselines.get(key, (None, None))
                results.append(Result(f"{figure}.cpu.{key}", us, CPU_UNIT, base_name, base_us))
                parts.append(f"{' + '.join(total)} {us:,.1f}"
                             + (f" ({base_name} {base_us:,.1f})" if base_name and base_us is not None else ""))
            else:
                unread += [f"the total {' + '.join(total)}"]
        self.note(f"CPU per event{' (' + what + ')' if what else ''}, µs, {events:,} events: {', '.join(parts)}"
                  + (f"; not read: {', '.join(unread)}" if unread else ""))
        return results

    @contextlib.contextmanager
    def profiling(self, pid: int, label: str) -> Iterator[None]:
        """Under ``--profile``, sample process ``pid`` with py-spy for the duration of the block.

        The raw (collapsed-stack) profile goes to ``profile_dir/<benchmark>.<label>.txt``
        and its top self-time functions are printed at the end of the run.  Only
        samples of the thread holding the GIL are kept (``--gil``): a Python
        service is bound by that one lock, and py-spy cannot tell a thread
        blocked in a C call (``producer.poll``) from a busy one.  py-spy pauses
        the process for each sample, so the figures of a profiled run are a
        little lower: profile to find where time goes, not to report figures.
        """
        if self.profile_dir is None:
            yield
            return
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        out = self.profile_dir / f"{self.name}.{label}.txt"
        spy = subprocess.Popen(
            [str(PY_SPY), "record", "-p", str(pid), "-f", "raw", "--nolineno", "--gil", "-o", str(out)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True, preexec_fn=die_with_parent,  # noqa: PLW1509 - only calls prctl
        )
        try:
            yield
        finally:
            # py-spy writes its output when interrupted.
            spy.send_signal(signal.SIGINT)
            try:
                _, err = spy.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                spy.kill()
                _, err = spy.communicate()
            if out.is_file():
                self.profiles.append(out)
                self.step(f"profile of pid {pid} written to {out}")
            else:
                self.note(f"py-spy wrote no profile: {err.decode(errors='replace').strip()[-300:]}")


Benchmark = Callable[[Context], list[Result]]


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads) from /proc; None if unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # Fields 14 and 15 of stat(5) (utime, stime), counted after the ")" of the command name.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: What ``Context.cpu_use`` reads: a pid, a group of pids (summed), or a function returning CPU seconds.
CpuSource = int | Sequence[int] | Callable[[], float | None] | None


def read_cpu(source: CpuSource) -> float | None:
    """The CPU seconds of a :data:`CpuSource` now; None if it cannot be read (gone, or no pid)."""
    if source is None:
        return None
    if isinstance(source, int):
        return cpu_seconds(source)
    if callable(source):
        return source()
    seconds = [cpu_seconds(pid) for pid in source]
    if not seconds or any(s is None for s in seconds):
        return None
    return sum(s for s in seconds if s is not None)


class CpuUse:
    """The CPU seconds named processes used during a block, read every ``CPU_SAMPLE_S`` by a thread.

    ``seconds()`` covers the whole block; ``between(t0, t1)`` a window of it
    (``time.monotonic()`` times), interpolated between the readings either
    side, so that a benchmark can leave a process's start-up out.  The
    kernel counts CPU time in clock ticks (10 ms), so a window should last
    a second or more.  A process whose CPU could not be read at both ends
    of the window (it exited) is left out.
    """

    def __init__(self, label: str, sources: Mapping[str, CpuSource]) -> None:
        self.label = label
        self._sources = dict(sources)
        #: (monotonic time, {name: CPU seconds}) in time order; the first at the start, the last at the end.
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"cpu-{label}", daemon=True)

    def _read(self) -> tuple[float, dict[str, float]]:
        now = time.monotonic()
        values = {}
        for name, source in self._sources.items():
            value = read_cpu(source)
            if value is not None:
                values[name] = value
        return now, values

    def start(self) -> None:
        self.samples.append(self._read())
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(CPU_SAMPLE_S):
            self.samples.append(self._read())

    def stop(self) -> None:
        """Take the last reading.  Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._thread.join(5)
        self.samples.append(self._read())

    @property
    def started(self) -> float:
        return self.samples[0][0]

    @property
    def ended(self) -> float:
        return self.samples[-1][0]

    def _at(self, name: str, t: float) -> float | None:
        """Process ``name``'s CPU seconds at time ``t`` (clamped to the block), interpolated."""
        points = [(ts, v[name]) for ts, v in self.samples if name in v]
        if not points:
            return None
        times = [ts for ts, _ in points]
        t = min(max(t, self.started), self.ended)
        if t < times[0] - CPU_SAMPLE_S or t > times[-1] + CPU_SAMPLE_S:
            return None  # not read around t: not running yet, or gone
        if t <= times[0]:
            return points[0][1]
        if t >= times[-1]:
            return points[-1][1]
        i = bisect_left(times, t)
        (t0, v0), (t1, v1) = points[i - 1], points[i]
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each process used from ``t0`` to ``t1`` (monotonic, within the block)."""
        out = {}
        for name in self._sources:
            start, end = self._at(name, t0), self._at(name, t1)
            if start is not None and end is not None:
                out[name] = max(0.0, end - start)
        return out

    def seconds(self) -> dict[str, float]:
        """CPU seconds each process used during the whole block."""
        return self.between(self.started, self.ended)

    def cores(self) -> dict[str, float]:
        """The block's use of each process, in cores (CPU seconds per second of the block)."""
        wall = self.ended - self.started
        return {name: used / wall for name, used in self.seconds().items()} if wall > 0 else {}


def profile_summary(path: Path, top: int = 15) -> tuple[int, list[tuple[str, int]], list[tuple[str, int]]]:
    """(samples, top functions by self samples, top functions by total samples) of a raw py-spy profile.

    A raw profile has one line per distinct stack: ``frame;frame;…;leaf COUNT``,
    outermost first, each frame ``function (file)``.
    """
    self_samples: dict[str, int] = {}
    total_samples: dict[str, int] = {}
    samples = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        samples += count
        frames = stack.split(";")
        self_samples[frames[-1]] = self_samples.get(frames[-1], 0) + count
        for frame in set(frames):
            total_samples[frame] = total_samples.get(frame, 0) + count
    by_self = sorted(self_samples.items(), key=lambda kv: -kv[1])[:top]
    by_total = sorted(total_samples.items(), key=lambda kv: -kv[1])[:top]
    return samples, by_self, by_total


def profile_table(path: Path, top: int = 15) -> Table:
    samples, by_self, by_total = profile_summary(path, top)
    table = Table(title=f"{path.name}: {samples} samples (top {top})")
    table.add_column("self %", justify="right")
    table.add_column("function (self time)", no_wrap=True, overflow="ellipsis", max_width=70)
    table.add_column("total %", justify="right")
    table.add_column("function (total time)", no_wrap=True, overflow="ellipsis", max_width=70)
    for i in range(max(len(by_self), len(by_total))):
        s_name, s_n = by_self[i] if i < len(by_self) else ("", 0)
        t_name, t_n = by_total[i] if i < len(by_total) else ("", 0)
        table.add_row(f"{100 * s_n / max(samples, 1):.1f}" if s_name else "", s_name,
                      f"{100 * t_n / max(samples, 1):.1f}" if t_name else "", t_name)
    return table


@dataclass(frozen=True)
class Entry:
    name: str
    func: Benchmark
    summary: str
    #: Whether ``--quick`` runs it (a benchmark whose sizes are what it measures has no quick form).
    quick: bool = True


REGISTRY: dict[str, Entry] = {}


def benchmark(name: str, summary: str, quick: bool = True) -> Callable[[Benchmark], Benchmark]:
    """Register ``func`` as benchmark ``name`` (dotted, e.g. ``region.put_all.ingest``); ``quick=False``
    leaves it out of ``--quick`` runs."""

    def register(func: Benchmark) -> Benchmark:
        if name in REGISTRY:
            raise ValueError(f"benchmark {name!r} registered twice")
        REGISTRY[name] = Entry(name, func, summary, quick)
        return func

    return register


def load_benchmarks() -> dict[str, Entry]:
    """Import every module that registers benchmarks (the import registers them)."""
    from . import region  # noqa: F401
    from . import region_failover  # noqa: F401
    from . import dispatcher  # noqa: F401
    from . import gateway  # noqa: F401
    from . import subscriptions  # noqa: F401
    from . import lake  # noqa: F401

    return REGISTRY


def select(only: str | None) -> list[Entry]:
    """Every benchmark, or those named ``only`` or under it (``region`` selects ``region.*``)."""
    entries = list(load_benchmarks().values())
    if only is None:
        return entries
    chosen = [e for e in entries if e.name == only or e.name.startswith(only + ".")]
    if not chosen:
        names = ", ".join(REGISTRY)
        raise SystemExit(f"bench: no benchmark named {only!r}; there are: {names}")
    return chosen


# --- child processes ------------------------------------------------------------


# die_with_parent: sluice.core.processes (imported above), shared with the services' own runners.


# --- the machine ----------------------------------------------------------------


def machine_info(engine_label: str, load_at_start: list[float] | None = None) -> dict[str, Any]:
    """What the figures depend on: CPU, memory, runtimes, broker."""
    cpu = platform.processor() or platform.machine()
    memory_bytes = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_bytes = int(line.split()[1]) * 1024
                break
    java = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=20, check=False)
        lines = (out.stderr or out.stdout).strip().splitlines()
        java = lines[0] if lines else None
    try:
        import confluent_kafka

        kafka_client = f"confluent-kafka {confluent_kafka.__version__}, librdkafka {confluent_kafka.libversion()[0]}"
    except ImportError:  # pragma: no cover - a dependency of sluice
        kafka_client = None
    return {
        "hostname": socket.gethostname(),
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory_bytes,
        "os": platform.platform(),
        "python": platform.python_version(),
        "java": java,
        "broker": engine_label,
        "kafka_client": kafka_client,
        # Other work on the machine skews every figure (ratios less so):
        # the 1/5/15-minute load averages before the run started.
        "load_average_at_start": load_at_start,
    }


# --- running ------------------------------------------------------------------


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def results_table(results: list[Result], title: str) -> Table:
    """The figures, or the CPU per event: one row per result, in the order the benchmarks gave them."""
    table = Table(title=title)
    table.add_column("figure", no_wrap=True)
    table.add_column("value", justify="right")
    table.add_column("unit")
    table.add_column("baseline", no_wrap=True)
    table.add_column("baseline value", justify="right")
    table.add_column("ratio", justify="right")
    for r in results:
        ratio = r.ratio
        table.add_row(r.name, _fmt(r.value), r.unit, r.baseline or "–", _fmt(r.baseline_value),
                      "–" if ratio is None else f"{ratio:.3f}×")
    return table


def aims_table(verdicts: Sequence["Verdict"], title: str) -> Table:
    """The issue's aims (``bench/aims.py``): each figure as measured in this run, its aim, met or not."""
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("this run")
    table.add_column("aim", no_wrap=True)
    table.add_column("", no_wrap=True)
    for v in verdicts:
        style = "green" if v.met else "red" if v.met is False else "yellow"
        table.add_row(v.aim, v.measured, v.target, f"[{style}]{v.verdict}[/]")
    return table


def run(
    entries: list[Entry],
    *,
    engine: str = "auto",
    quick: bool = False,
    output: Path = RESULTS_PATH,
    profile_dir: Path | None = None,
    console: Console | None = None,
) -> int:
    """Run ``entries`` on one fresh broker; 0 when every benchmark completed."""
    from sluice.broker import start_broker

    if console is None:
        console = Console(log_path=False)
        if not console.is_terminal:
            # A CI log is not a terminal: rich would assume 80 columns and cut the table.
            console = Console(log_path=False, width=150)
    workdir = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    broker = None
    failed: list[str] = []
    results: list[Result] = []
    durations: dict[str, float] = {}
    notes: list[str] = []
    profiles: list[Path] = []
    keep_workdir = False

    def on_sigterm(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    if quick:
        for entry in [e for e in entries if not e.quick]:
            console.log(f"{entry.name}: left out of a --quick run (its sizes are what it measures)")
        entries = [e for e in entries if e.quick]
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    started = time.monotonic()
    load_at_start = None
    with contextlib.suppress(OSError):
        load_at_start = [round(x, 2) for x in os.getloadavg()]
        if load_at_start[0] > BUSY_LOAD:
            console.log(f"[yellow]the machine is busy (load average {load_at_start[0]:.1f} on {os.cpu_count()} "
                        "cores): figures will be low and noisy[/]")
    try:
        with console.status(f"starting an embedded broker ({engine})…"):
            broker = start_broker("bench", 0, engine, data_dir=workdir / "broker")
        console.log(f"broker: {broker.engine_label} on {broker.bootstrap} "
                    f"(started in {broker.last_start_s or 0:.1f}s); work directory {workdir}")
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            overall = progress.add_task("benchmarks", total=len(entries))
            for i, entry in enumerate(entries, 1):
                progress.update(overall, description=f"benchmark {i}/{len(entries)}: {entry.name}")
                bench_dir = workdir / entry.name
                bench_dir.mkdir()
                ctx = Context(broker.bootstrap, bench_dir, quick, broker.engine, broker.engine_label,
                              console, progress, name=entry.name, broker_pid=broker.pid,
                              profile_dir=profile_dir)
                t0 = time.monotonic()
                try:
                    got = entry.func(ctx)
                except KeyboardInterrupt:
                    raise
                except Exception:  # noqa: BLE001 - one failed benchmark must not hide the others
                    failed.append(entry.name)
                    keep_workdir = True
                    console.print(f"[red]{entry.name} failed[/]")
                    console.print(traceback.format_exc(), markup=False, highlight=False)
                    got = []
                durations[entry.name] = round(time.monotonic() - t0, 1)
                results.extend(got)
                notes.extend(ctx.notes)
                profiles.extend(ctx.profiles)
                console.log(f"{entry.name}: {durations[entry.name]:.1f}s")
                progress.advance(overall)
        total_s = time.monotonic() - started
        from .aims import evaluate  # here: aims imports this module

        verdicts = evaluate(results, [e.name for e in entries])
        title = f"Sluice benchmarks on {broker.engine_label}" + (" (quick)" if quick else "")
        for n in notes:
            console.print(f"  [dim]·[/] {n}")
        for path in profiles:
            console.print(profile_table(path))
        figures = [r for r in results if r.unit != CPU_UNIT]
        cpu = [r for r in results if r.unit == CPU_UNIT]
        console.print(results_table(figures, title))
        if cpu:
            console.print(results_table(cpu, "CPU per event: µs of CPU time of each process per event"))
        if verdicts:
            caveats = (["a quick run, small and noisy, does not decide them"] if quick else []) + (
                [f"the machine was busy (load average {load_at_start[0]:.1f} at the start): figures low and noisy"]
                if load_at_start and load_at_start[0] > BUSY_LOAD else [])
            console.print(aims_table(verdicts, "Aims (issue 18), judged on this run"
                                     + (f" ({'; '.join(caveats)})" if caveats else "")))
        document = {
            "machine": machine_info(broker.engine_label, load_at_start),
            "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "quick": quick,
            "durations_s": {**durations, "total": round(total_s, 1)},
            "failed": failed,
            "notes": notes,
            "profiled": bool(profiles),
            "results": [r.to_dict() for r in results],
            "aims": [v.to_dict() for v in verdicts],
        }
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(document, indent=2) + "\n")
        console.print(f"wrote {output} ({total_s:.0f}s in all)")
        if failed:
            console.print(f"[red]failed: {', '.join(failed)}[/]; logs kept in {workdir}")
        return 1 if failed else 0
    except KeyboardInterrupt:
        keep_workdir = True
        console.print(f"[yellow]interrupted[/]; stopping everything (logs kept in {workdir})")
        return 130
    finally:
        # Benchmarks stop their own processes in their own `finally`; the
        # broker goes last because they may still be flushing into it.
        if broker is not None:
            broker.stop()
        signal.signal(signal.SIGTERM, previous)
        if not keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
