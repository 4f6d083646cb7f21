"""Discovering a running vLLM server's KV capacity and load by polling ``/metrics``.

:class:`CapacityMonitor` scrapes one backend on an interval and keeps the last good
reading. :meth:`CapacityMonitor.latest` returns it only while it is fresh, so callers
(the backpressure policy) never act on old numbers. The parsing itself lives in the
pure :mod:`kvgate.capacity.vllm_metrics`, re-exported here for convenience.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp

from kvgate.capacity.vllm_metrics import VllmCapacity, VllmMetricsError, parse_vllm_metrics

__all__ = ["CapacityMonitor", "VllmCapacity", "VllmMetricsError", "parse_vllm_metrics"]

log = logging.getLogger("kvgate.capacity")

# Ask for the classic text format: it is what prometheus_client's parser reads, and
# what vLLM serves unless a client asks for OpenMetrics. Uncompressed: a gzip body's size
# says nothing about what it inflates to.
_HEADERS = {"Accept": "text/plain; version=0.0.4", "Accept-Encoding": "identity"}
# vLLM's /metrics is about 100 KiB; a larger body is not a vLLM scrape.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_CHUNK_BYTES = 64 * 1024


class CapacityMonitor:
    """Polls one vLLM backend's metrics URL; never raises out of its loop.

    ``clock`` returns monotonic seconds and only times freshness (when a scrape
    succeeded, how old it is), so tests can age a reading without sleeping. Pacing and
    the per-request timeout use the event loop's own time.

    The endpoint is not trusted: a redirect, a body over ``max_body_bytes``, a compressed
    body or a scrape longer than ``timeout_s`` (connect to last byte) is a failed scrape.
    ``on_reading`` sees every good reading once, when it arrives.
    """

    def __init__(
        self,
        metrics_url: str,
        *,
        model_name: str | None = None,
        interval_s: float = 1.0,
        timeout_s: float = 2.0,
        max_staleness_s: float = 5.0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        on_reading: Callable[[VllmCapacity], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0 or max_staleness_s <= 0 or max_body_bytes <= 0:
            raise ValueError(
                "interval_s, timeout_s, max_staleness_s and max_body_bytes must be > 0"
            )
        self.metrics_url = metrics_url
        self.model_name = model_name
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_staleness_s = max_staleness_s
        self.max_body_bytes = max_body_bytes
        self._on_reading = on_reading
        self._clock = clock
        self._session = session
        self._owns_session = session is None
        self._task: asyncio.Task[None] | None = None
        self._latest: VllmCapacity | None = None
        self.last_success_at: float | None = None
        self.last_error: str | None = None
        self.scrape_successes = 0
        self.scrape_failures = 0
        self.consecutive_failures = 0

    # --- lifecycle -------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Start polling in the background (the first scrape happens at once)."""
        if self.running:
            return
        self._task = asyncio.create_task(self._run(), name=f"capacity-monitor {self.metrics_url}")

    async def stop(self) -> None:
        """Stop polling and close the HTTP session if the monitor created it."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    # --- reading ---------------------------------------------------------------------

    def latest(self, now: float | None = None) -> VllmCapacity | None:
        """The last good reading, or None if there is none younger than max_staleness_s."""
        if self._latest is None or self.last_success_at is None:
            return None
        age = (self._clock() if now is None else now) - self.last_success_at
        return self._latest if age <= self.max_staleness_s else None

    async def poll_once(self) -> bool:
        """Scrape once; True on success. Failures are counted and logged, not raised."""
        try:
            text = await self._fetch()
            capacity = parse_vllm_metrics(text, self.model_name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure is "no fresh data", never a crash
            self._record_failure(exc)
            return False
        self._latest = capacity
        self.last_success_at = self._clock()
        self.scrape_successes += 1
        if self._on_reading is not None:
            try:
                self._on_reading(capacity)
            except Exception:  # an observer's bug must not turn a good scrape into a failure
                log.exception("capacity monitor for %s: reading observer failed", self.metrics_url)
        if self.consecutive_failures:
            log.info(
                "metrics scrape of %s recovered after %d failures",
                self.metrics_url,
                self.consecutive_failures,
            )
        self.consecutive_failures = 0
        self.last_error = None
        return True

    # --- internals -------------------------------------------------------------------

    async def _fetch(self) -> str:
        session = self._ensure_session()
        # Why both: aiohttp's total timeout covers connect and read, asyncio.timeout
        # also bounds anything else (DNS, a slow body decode) so a poll never hangs.
        async with asyncio.timeout(self.timeout_s):
            async with session.get(
                self.metrics_url,
                headers=_HEADERS,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                # A redirect could point the scrape anywhere (the metadata service, another
                # pod): the endpoint itself answers, or the scrape fails.
                allow_redirects=False,
            ) as resp:
                if 300 <= resp.status < 400:
                    raise VllmMetricsError(
                        f"HTTP {resp.status} from {self.metrics_url}: redirects are not followed"
                    )
                if resp.status != 200:
                    raise VllmMetricsError(f"HTTP {resp.status} from {self.metrics_url}")
                encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    raise VllmMetricsError(f"a {encoding!r}-encoded body is refused")
                return (await self._read_bounded(resp)).decode("utf-8", errors="replace")

    async def _read_bounded(self, resp: aiohttp.ClientResponse) -> bytes:
        """The body, or VllmMetricsError once it passes max_body_bytes (never buffered
        beyond that: a declared length over it fails before a byte is read)."""
        declared = resp.content_length
        if declared is not None and declared > self.max_body_bytes:
            raise VllmMetricsError(
                f"body of {declared} bytes is over max_body_bytes ({self.max_body_bytes})"
            )
        body = bytearray()
        async for chunk in resp.content.iter_chunked(_CHUNK_BYTES):
            body += chunk
            if len(body) > self.max_body_bytes:
                raise VllmMetricsError(
                    f"body is over max_body_bytes ({self.max_body_bytes}); not read further"
                )
        return bytes(body)

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
            self._owns_session = True
        return self._session

    def _record_failure(self, exc: BaseException) -> None:
        self.scrape_failures += 1
        self.consecutive_failures += 1
        if isinstance(exc, TimeoutError):
            self.last_error = f"timed out after {self.timeout_s:g}s"
        else:
            self.last_error = f"{type(exc).__name__}: {exc}"
        # Log the first failure of a run loudly, the rest quietly: a dead backend
        # polled every second must not flood the log.
        level = logging.WARNING if self.consecutive_failures == 1 else logging.DEBUG
        log.log(level, "metrics scrape of %s failed: %s", self.metrics_url, self.last_error)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # poll_once already catches; this is the last line
                log.exception("capacity monitor for %s: unexpected error", self.metrics_url)
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))
