"""CPU accounting of the benchmarks: per process (and its threads or descendants), the whole
machine, what other users of a shared machine took during a run, and waiting for it to be
quiet before one.
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces.
    return raw[raw.rindex(")") + 2 :].split()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), in seconds; 0 if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # After the name: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def threads_cpu_seconds(pid: int) -> float:
    """Run time of all live threads of `pid` from schedstat (ns), in seconds; 0 if gone.

    /proc/<pid>/stat counts whole clock ticks (10 ms), coarser than one request's work."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as fh:
                total += int(fh.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended between listdir and open
    return total / 1e9


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and its live descendants (LiteLLM's workers, a shell's child)."""
    return sum(process_cpu_seconds(p) for p in [pid, *descendants(pid)])


def machine_busy_seconds() -> float:
    """Busy CPU time of the whole machine (all cores) from /proc/stat, in seconds."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    return (sum(values) - idle) / _CLK_TCK


def wait_machine_quiet(
    timeout: float, max_cores: float, window_s: float = 1.0
) -> tuple[float, float]:
    """Wait (one window at least, `timeout` s at most) until the machine's busy CPU over one
    window is at most `max_cores`. Returns (seconds waited, busy cores of the last window)."""
    start = time.monotonic()
    busy = machine_busy_seconds()
    cores = math.nan
    while True:
        time.sleep(window_s)
        now = machine_busy_seconds()
        cores = (now - busy) / window_s
        busy = now
        if cores <= max_cores or time.monotonic() - start >= timeout:
            return time.monotonic() - start, cores


class CpuWindow:
    """The machine's busy CPU and ours (the given processes + this one) over a window: what
    other users of this shared machine took meanwhile (foreign cores)."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self._pids = pids
        self._start = self._snap()

    def _snap(self) -> tuple[float, float, float]:
        own = resource.getrusage(resource.RUSAGE_SELF)
        ours = sum(process_cpu_seconds(p) for p in self._pids()) + own.ru_utime + own.ru_stime
        return time.monotonic(), machine_busy_seconds(), ours

    def close(self) -> dict[str, float]:
        t1, busy1, ours1 = self._snap()
        t0, busy0, ours0 = self._start
        wall = max(t1 - t0, 1e-9)
        return {
            "wall_s": round(wall, 2),
            "machine_busy_cores": round((busy1 - busy0) / wall, 2),
            "benchmark_cores": round((ours1 - ours0) / wall, 2),
            "foreign_cores": round(max(0.0, (busy1 - busy0) - (ours1 - ours0)) / wall, 2),
        }
