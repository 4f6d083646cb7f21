"""The load generator: open-loop Poisson arrivals and closed-loop workers, over aiohttp.

Open loop: arrival times are drawn up front (exponential gaps, seeded), and every request's
latency is measured from its INTENDED send time, so time a request spends waiting behind a
slow system (or a late generator) is counted, not hidden (no coordinated omission). The
dispatcher also records its own lag (actual send - intended send): when that grows, the
generator, not the system under test, is the bottleneck, and the run says so.

Closed loop: `concurrency` workers, each sending its next request when the previous one
ends; used for the unloaded baseline (one worker) and to check the generator's own ceiling.

For streamed responses every SSE event is classified cheaply (byte tests, no JSON): token
events (a choices delta with content), the role event, the usage event and [DONE]. The
generator records the time to the first token event and the gap before every later token
event (tokens that arrive in one TCP read share its timestamp, as a client would see them).

It runs in its own process (`python -m bench.loadgen --serve`), reading one JSON job per
stdin line and answering with one JSON line per job, so its CPU is separate from the
orchestrator's and can be measured (bench/cpu.py reads /proc for it).

Every run is bounded: `duration_s` of arrivals, at most `max_requests`, and `timeout_s` per
request; requests still running `drain_s` after the last arrival are cancelled and counted
as errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

# A fixed-width marker in a body template, replaced per request by a unique id of the same
# width: every prompt is distinct (no cache hit anywhere) and Content-Length never changes.
MARKER = b"@@REQ-ID-0000@@"


def request_id_bytes(n: int, prefix: str = "") -> bytes:
    text = f"{prefix}{n:x}"
    if len(text) > len(MARKER):
        raise ValueError(f"request id {text!r} longer than the marker")
    return text.rjust(len(MARKER), "0").encode("ascii")


@dataclass
class Job:
    """One run. Bodies come from `body_path` (a template holding MARKER once)."""

    url: str
    body_path: str
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    mode: str = "open"  # "open" | "closed"
    rate: float = 10.0  # open loop: mean arrivals per second
    concurrency: int = 1  # closed loop: workers
    duration_s: float = 10.0
    warmup_s: float = 1.0  # requests intended before this are sent but not reported
    max_requests: int = 100_000
    timeout_s: float = 30.0
    drain_s: float = 30.0
    seed: int = 1
    id_prefix: str = ""
    out_path: str = ""  # where the per-request results go (JSON)


@dataclass
class Result:
    """Per-request columns (requests intended after warm-up), plus run totals."""

    intended: list[float] = field(default_factory=list)  # s since run start
    lag: list[float] = field(default_factory=list)  # actual send - intended, s
    latency: list[float] = field(default_factory=list)  # end - intended, s
    service: list[float] = field(default_factory=list)  # end - actual send, s
    ttft: list[float] = field(default_factory=list)  # first token - intended, s (streams)
    status: list[int] = field(default_factory=list)  # HTTP status, 0 = transport error
    tokens: list[int] = field(default_factory=list)  # token events seen (streams)
    gaps: list[float] = field(default_factory=list)  # every inter-token gap, s (streams)
    errors: dict[str, int] = field(default_factory=dict)
    sent: int = 0
    measured_s: float = 0.0  # the reported window (intended times), s
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this generator's own CPU during the run
    cancelled: int = 0

    def add_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class _StreamClock:
    """Token-event timestamps from raw SSE bytes (events may span reads)."""

    __slots__ = ("first", "gaps", "last", "n", "tail")

    def __init__(self) -> None:
        self.tail = b""
        self.first: float | None = None
        self.last = 0.0
        self.n = 0
        self.gaps: list[float] = []

    def feed(self, chunk: bytes, now: float) -> None:
        data = self.tail + chunk if self.tail else chunk
        start = 0
        while True:
            end = data.find(b"\n\n", start)
            if end < 0:
                break
            event = data[start:end]
            start = end + 2
            # A token event: a choices delta with content text (not the role event, not the
            # usage event with "choices":[], not [DONE]). Completions carry "text".
            if (b'"content":"' in event or b'"text":"' in event) and b'"role"' not in event:
                if self.first is None:
                    self.first = now
                else:
                    self.gaps.append(now - self.last)
                self.last = now
                self.n += 1
        self.tail = data[start:]


async def _one(
    session: aiohttp.ClientSession,
    job: Job,
    body: bytes,
    intended: float,
    t0: float,
    res: Result,
    record: bool,
) -> None:
    loop_time = time.perf_counter
    sent_at = loop_time()
    status = 0
    clock = _StreamClock() if job.stream else None
    try:
        async with session.post(job.url, data=body, headers=job.headers) as resp:
            status = resp.status
            if clock is not None and status == 200:
                async for chunk in resp.content.iter_any():
                    clock.feed(chunk, loop_time())
            else:
                await resp.read()
    except TimeoutError:
        if record:
            res.add_error("timeout")
    except (aiohttp.ClientError, OSError) as exc:
        if record:
            res.add_error(type(exc).__name__)
    end = loop_time()
    if not record:
        return
    if status and not 200 <= status < 300:
        res.add_error(f"http_{status}")
    res.intended.append(intended - t0)
    res.lag.append(sent_at - intended)
    res.latency.append(end - intended)
    res.service.append(end - sent_at)
    res.status.append(status)
    if clock is not None:
        res.ttft.append((clock.first - intended) if clock.first is not None else float("nan"))
        res.tokens.append(clock.n)
        res.gaps.extend(clock.gaps)


def _cpu_now() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _read_template(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _write_result(path: str, res: Result) -> None:
    # Outside the timed window: after the last request has ended.
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(asdict(res), fh)


async def run_job(job: Job, session: aiohttp.ClientSession) -> Result:
    template = _read_template(job.body_path)
    if template.count(MARKER) != 1:
        raise ValueError(f"{job.body_path}: the body template must hold {MARKER!r} exactly once")
    head, _, tail = template.partition(MARKER)
    res = Result()
    tasks: set[asyncio.Task[None]] = set()
    cpu0 = _cpu_now()
    wall0 = time.perf_counter()
    # Open loop: the schedule starts a moment from now; closed loop: at once.
    t0 = wall0 + 0.05 if job.mode == "open" else wall0
    counter = 0

    def body_for(n: int) -> bytes:
        return head + request_id_bytes(n, job.id_prefix) + tail

    if job.mode == "open":
        rng = random.Random(job.seed)
        intended = t0
        end_at = t0 + job.duration_s
        while counter < job.max_requests:
            intended += rng.expovariate(job.rate)
            if intended >= end_at:
                break
            delay = intended - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            counter += 1
            record = intended - t0 >= job.warmup_s
            task = asyncio.create_task(
                _one(session, job, body_for(counter), intended, t0, res, record)
            )
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        res.measured_s = max(0.0, job.duration_s - job.warmup_s)
    elif job.mode == "closed":
        end_at = t0 + job.duration_s
        lock = asyncio.Lock()
        next_id = 0

        async def worker() -> None:
            nonlocal next_id
            while True:
                now = time.perf_counter()
                if now >= end_at:
                    return
                async with lock:
                    if next_id >= job.max_requests:
                        return
                    next_id += 1
                    n = next_id
                # In a closed loop the intended time is the send time.
                await _one(session, job, body_for(n), now, t0, res, now - t0 >= job.warmup_s)

        workers = [asyncio.create_task(worker()) for _ in range(job.concurrency)]
        tasks.update(workers)
        await asyncio.wait(workers, timeout=job.duration_s + job.drain_s + 1)
        counter = next_id
        res.measured_s = max(0.0, job.duration_s - job.warmup_s)
    else:
        raise ValueError(f"unknown mode {job.mode!r}")

    pending = {t for t in tasks if not t.done()}
    if pending:
        _done, still = await asyncio.wait(pending, timeout=job.drain_s)
        for task in still:
            task.cancel()
        if still:
            await asyncio.gather(*still, return_exceptions=True)
            res.cancelled = len(still)
            res.errors["cancelled_after_drain"] = len(still)
    res.sent = counter
    res.wall_s = time.perf_counter() - wall0
    res.cpu_s = _cpu_now() - cpu0
    return res


def _session(timeout_s: float) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, use_dns_cache=False)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


async def _serve() -> None:
    """Read jobs (JSON lines) on stdin, answer one JSON line each on stdout."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    sessions: dict[float, aiohttp.ClientSession] = {}
    try:
        while True:
            line = await reader.readline()
            if not line:
                return
            try:
                job = Job(**json.loads(line))
                session = sessions.get(job.timeout_s)
                if session is None:
                    session = sessions[job.timeout_s] = _session(job.timeout_s)
                res = await run_job(job, session)
                if job.out_path:
                    _write_result(job.out_path, res)
                summary = {
                    "ok": True,
                    "sent": res.sent,
                    "reported": len(res.latency),
                    "errors": res.errors,
                    "cpu_s": res.cpu_s,
                    "wall_s": res.wall_s,
                }
            except Exception as exc:  # report, keep serving
                summary = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(summary) + "\n")
            sys.stdout.flush()
    finally:
        for session in sessions.values():
            await session.close()


async def _once(job: Job) -> None:
    async with _session(job.timeout_s) as session:
        res = await run_job(job, session)
    if job.out_path:
        _write_result(job.out_path, res)
    lat = sorted(res.latency)
    p = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3) if lat else (lambda q: 0.0)
    print(
        f"sent {res.sent} reported {len(lat)} errors {res.errors} "
        f"p50 {p(0.5):.2f} ms p99 {p(0.99):.2f} ms cpu {res.cpu_s:.2f}s wall {res.wall_s:.1f}s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="kvgate bench load generator")
    parser.add_argument("--serve", action="store_true", help="read JSON jobs on stdin")
    parser.add_argument("--job", help="run one job given as JSON, print a summary")
    args = parser.parse_args(argv)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    if args.serve:
        runner(_serve())
    elif args.job:
        runner(_once(Job(**json.loads(args.job))))
    else:
        parser.error("give --serve or --job")


if __name__ == "__main__":
    main()
