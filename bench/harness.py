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
3. print the table and write ``bench/results.json`` (machine, time, results);
4. stop the broker and delete the directory, also on Ctrl-C or SIGTERM.  A
   failed run keeps the directory (service logs) and says where it is.

A benchmark owns what it starts: it stops its processes in ``finally``.
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
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS_PATH = BENCH_DIR / "results.json"
PROFILES_DIR = BENCH_DIR / "profiles"
PY_SPY = Path(sys.executable).parent / "py-spy"


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
    def cpu_use(self, label: str, pids: dict[str, int | None]) -> Iterator[None]:
        """Note the CPU (in cores) each named process used during the block.

        On a 2-core machine that says at once whether a figure is bound by
        one process's CPU (a Python service at ~1 core is GIL-bound) or by
        the machine.  ``broker`` and ``bench`` (this process: the clients)
        are added when not given.
        """
        pids = {"broker": self.broker_pid, "bench": os.getpid(), **pids}
        before = {name: cpu_seconds(pid) for name, pid in pids.items() if pid is not None}
        t0 = time.monotonic()
        yield
        wall = time.monotonic() - t0
        used = []
        for name, start in before.items():
            end = cpu_seconds(pids[name])  # type: ignore[arg-type]
            if start is not None and end is not None and wall > 0:
                used.append(f"{name} {(end - start) / wall:.2f}")
        if used:
            self.note(f"{label}: CPU used, in cores of {os.cpu_count()}: {', '.join(used)}")

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


REGISTRY: dict[str, Entry] = {}


def benchmark(name: str, summary: str) -> Callable[[Benchmark], Benchmark]:
    """Register ``func`` as benchmark ``name`` (dotted, e.g. ``region.put_all.ingest``)."""

    def register(func: Benchmark) -> Benchmark:
        if name in REGISTRY:
            raise ValueError(f"benchmark {name!r} registered twice")
        REGISTRY[name] = Entry(name, func, summary)
        return func

    return register


def load_benchmarks() -> dict[str, Entry]:
    """Import every module that registers benchmarks (the import registers them)."""
    from . import region  # noqa: F401
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

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    started = time.monotonic()
    load_at_start = None
    with contextlib.suppress(OSError):
        load_at_start = [round(x, 2) for x in os.getloadavg()]
        if load_at_start[0] > 0.5:
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
        title = f"Sluice benchmarks on {broker.engine_label}" + (" (quick)" if quick else "")
        console.print(results_table(results, title))
        for n in notes:
            console.print(f"  [dim]·[/] {n}")
        for path in profiles:
            console.print(profile_table(path))
        document = {
            "machine": machine_info(broker.engine_label, load_at_start),
            "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "quick": quick,
            "durations_s": {**durations, "total": round(total_s, 1)},
            "failed": failed,
            "notes": notes,
            "profiled": bool(profiles),
            "results": [r.to_dict() for r in results],
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
