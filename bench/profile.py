"""Sampling profiles of kvgate under load with py-spy, and a text summary of them.

`PySpy(pid, out_stem, duration_s)` runs `py-spy record` (non-blocking sampling, every
thread, collapsed stacks) beside a load run; `summarize(out_stem.txt)` ranks functions by
the share of samples they appear in (inclusive) and are at the top of (self), per thread
kind. py-spy samples only threads that are running Python or native code, not idle ones,
so shares are of busy time.

    python -m bench.profile bench/results/profiles/kvgate-request.txt
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from testbed.harness import executable


def py_spy_binary() -> str | None:
    try:
        return executable("py-spy")
    except FileNotFoundError:
        return None


class PySpy:
    def __init__(
        self, pid: int, out_stem: Path, *, duration_s: float, rate: int = 200, native: bool = False
    ) -> None:
        self.pid = pid
        self.native = native
        self.raw = out_stem.with_suffix(".txt")
        self.svg = out_stem.with_suffix(".svg")
        self.duration_s = duration_s
        self.rate = rate
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> PySpy:
        binary = py_spy_binary()
        if binary is None:
            sys.stderr.write("py-spy not installed (pip install py-spy): no profile\n")
            return self
        common = [
            "record",
            "--pid",
            str(self.pid),
            "--rate",
            str(self.rate),
            "--duration",
            str(int(self.duration_s)),
            "--threads",
            "--full-filenames",
            # --native (C/Cython/Rust frames too) must stop the process for each sample;
            # without it py-spy reads the stacks without stopping it.
            "--native" if self.native else "--nonblocking",
        ]
        outputs = [("raw", self.raw)]
        if not self.native:  # a second blocking sampler would double the perturbation
            outputs.append(("flamegraph", self.svg))
        for fmt, path in outputs:
            self.procs.append(
                subprocess.Popen(
                    [binary, *common, "--format", fmt, "--output", str(path)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        time.sleep(0.5)  # attached before the load starts
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout=self.duration_s + 30)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait(timeout=10)


def _frame_name(frame: str) -> str:
    """'func (path/file.py:123)' -> 'func (file.py)'."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({where.rsplit('/', 2)[-1] if '/' in where else where})" if where else name


def _thread_kind(first: str) -> str:
    if "MainThread" in first:
        return "event loop (main thread)"
    if "kvgate-tokenize" in first:
        return "tokenizer threads"
    if "_poll_wrapper" in first or "grpc" in first.lower():
        return "grpc poller thread"
    return "other threads"


_NATIVE_GROUPS = (
    ("cygrpc", "grpc core (cygrpc, C/Cython)"),
    ("_message.abi3", "protobuf (upb, C)"),
    ("tokenizers", "tokenizers (Rust)"),
    ("_asynciomodule", "asyncio (C)"),
)
_UVLOOP_FILES = ("loop.c", "core.c", "linux.c", "loop-watcher.c", "stream.c", "queue.h", "poll.c")


def _category(frame: str) -> str:
    """Where a leaf frame's time goes, coarsely: a library, a syscall, or Python code."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    if name == "Runner.run":
        # Without --native, time below the loop's Python frames (uvloop, gRPC's C core and
        # Cython, protobuf, syscalls) is charged to the frame that started the loop.
        return "native: uvloop + gRPC core + protobuf + syscalls"
    for needle, label in _NATIVE_GROUPS:
        if needle in where:
            return label
    if "libc.so" in where:
        return f"libc: {name}" if not name.startswith("0x") else "libc"
    base = where.rsplit("/", 1)[-1].split(":", 1)[0]
    if base in _UVLOOP_FILES or "uvloop" in where:
        return "uvloop / libuv"
    if base.endswith((".c", ".h")) or ".so" in where:
        return "CPython interpreter / other native"
    if "/kvgate/" in where:
        return "python: kvgate"
    for pkg in ("grpc", "asyncio", "logging", "prometheus_client", "google/protobuf", "json"):
        if f"/{pkg}/" in where or f"{pkg}/" in where:
            return f"python: {pkg}"
    return "python: other"


def summarize(raw: Path, top: int = 25) -> str:
    if not raw.exists():
        return f"{raw}: no profile"
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    categories: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    main_total = 0
    total = 0
    for line in raw.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        if frames[-1].startswith(("epoll_wait", "epoll_pwait")):
            continue  # --native counts a thread blocked in epoll as running: it is idle
        kind = _thread_kind(frames[0])
        kinds[kind] += count
        total += count
        if not kind.startswith("event loop"):
            continue
        main_total += count
        seen: set[str] = set()
        for frame in frames[1:]:
            name = _frame_name(frame)
            if name not in seen:
                inclusive[name] += count
                seen.add(name)
        own[_frame_name(frames[-1])] += count
        categories[_category(frames[-1])] += count
    lines = [f"profile {raw.name}: {total} busy samples"]
    for kind, count in kinds.most_common():
        lines.append(f"  {100 * count / max(1, total):5.1f}%  {kind}")
    lines.append(f"event loop, self time by where it is spent ({main_total} busy samples):")
    for cat, count in categories.most_common(top):
        lines.append(f"  {100 * count / max(1, main_total):5.1f}%  {cat}")
    lines.append(f"event loop, inclusive (share of its {main_total} busy samples):")
    skip = ("<module>", "_run_module_as_main", "_run_code", "run (", "Runner.run", "main (")
    shown = 0
    for name, count in inclusive.most_common():
        # Python functions only: native frames (the event loop's own C, gRPC's Cython) are
        # in the table above.
        where = name.rpartition(" (")[2]
        if name.startswith(skip) or name.startswith("0x") or not where.startswith(".py", -4):
            continue
        lines.append(f"  {100 * count / max(1, main_total):5.1f}%  {name}")
        shown += 1
        if shown >= top:
            break
    lines.append("event loop, self (top of stack):")
    for name, count in own.most_common(top):
        lines.append(f"  {100 * count / max(1, main_total):5.1f}%  {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="summarize a py-spy raw (collapsed) profile")
    parser.add_argument("raw", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    print(summarize(args.raw, args.top))


if __name__ == "__main__":
    main()
