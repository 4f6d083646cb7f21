"""CapacityMonitor against the vLLM simulator, and against backends that fail."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvgate.capacity.backpressure import REASON_KV_CACHE_FULL, BackpressurePolicy
from kvgate.capacity.discovery import CapacityMonitor
from kvgate.policy.clock import ManualClock
from testbed.demo_model import DEMO_MODEL_NAME, demo_model_dir
from vllm_sim import SimConfig, create_app
from vllm_sim.tokenization import SimTokenizer


@pytest.fixture(scope="module")
def sim_tokenizer() -> SimTokenizer:
    return SimTokenizer(demo_model_dir())


@pytest.fixture
async def sim(sim_tokenizer: SimTokenizer) -> AsyncIterator[TestServer]:
    config = SimConfig(
        model_dir=Path(demo_model_dir()),
        served_model_name=DEMO_MODEL_NAME,
        num_gpu_blocks=3000,
        block_size=16,
    )
    server = TestServer(create_app(config, tokenizer=sim_tokenizer))
    await server.start_server()
    yield server
    await server.close()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose socket completes the TCP handshake (the kernel's backlog accepts)
    but never reads or answers: a wedged server."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def metrics_url(server: TestServer) -> str:
    return str(server.make_url("/metrics"))


async def test_monitor_reads_sim_capacity(sim: TestServer) -> None:
    clock = ManualClock()
    monitor = CapacityMonitor(metrics_url(sim), model_name=DEMO_MODEL_NAME, clock=clock.now)
    try:
        assert monitor.latest() is None  # never scraped
        assert await monitor.poll_once()
        cap = monitor.latest()
        assert cap is not None
        # 3,000 blocks x 16 tokens.
        assert cap.kv_capacity_tokens == 48000
        assert cap.num_gpu_blocks == 3000
        assert cap.block_size == 16
        assert cap.kv_cache_usage == 0.0
        assert cap.num_requests_running == 0
        assert cap.num_requests_waiting == 0
        assert cap.num_preemptions_total == 0
        assert cap.model_name == DEMO_MODEL_NAME
        assert monitor.scrape_successes == 1
        assert monitor.scrape_failures == 0
    finally:
        await monitor.stop()


async def test_wrong_model_name_counts_as_failure(sim: TestServer) -> None:
    monitor = CapacityMonitor(metrics_url(sim), model_name="not-served")
    try:
        assert not await monitor.poll_once()
        assert monitor.latest() is None
        assert monitor.scrape_failures == 1
        assert monitor.last_error is not None and "not-served" in monitor.last_error
    finally:
        await monitor.stop()


async def test_http_error_counts_as_failure(sim: TestServer) -> None:
    monitor = CapacityMonitor(str(sim.make_url("/no-such-path")))
    try:
        assert not await monitor.poll_once()
        assert monitor.last_error is not None and "HTTP 404" in monitor.last_error
    finally:
        await monitor.stop()


async def test_stopped_sim_goes_stale(sim_tokenizer: SimTokenizer) -> None:
    config = SimConfig(
        model_dir=Path(demo_model_dir()),
        served_model_name=DEMO_MODEL_NAME,
        num_gpu_blocks=3000,
        block_size=16,
    )
    server = TestServer(create_app(config, tokenizer=sim_tokenizer))
    await server.start_server()
    clock = ManualClock()
    monitor = CapacityMonitor(
        metrics_url(server), model_name=DEMO_MODEL_NAME, max_staleness_s=5.0, clock=clock.now
    )
    try:
        assert await monitor.poll_once()
        scraped_at = clock.now()
        await server.close()  # the backend goes away

        clock.advance(3.0)
        assert not await monitor.poll_once()
        assert monitor.scrape_failures == 1
        assert monitor.consecutive_failures == 1
        # A blip shorter than max_staleness keeps the last good reading ...
        fresh = monitor.latest()
        assert fresh is not None and fresh.kv_capacity_tokens == 48000
        # ... an outage longer than it does not.
        clock.advance(2.5)
        assert not await monitor.poll_once()
        assert monitor.scrape_failures == 2
        assert monitor.latest() is None
        assert monitor.latest(now=scraped_at + 5.0) is not None  # the boundary is inclusive
        assert monitor.latest(now=scraped_at + 5.01) is None
    finally:
        await monitor.stop()
        await server.close()


async def test_silent_backend_poll_returns_within_timeout(silent_port: int) -> None:
    clock = ManualClock()
    monitor = CapacityMonitor(
        f"http://127.0.0.1:{silent_port}/metrics", timeout_s=0.3, clock=clock.now
    )
    try:
        started = time.monotonic()
        assert not await monitor.poll_once()
        elapsed = time.monotonic() - started
        assert 0.25 <= elapsed < 1.5, elapsed
        assert monitor.scrape_failures == 1
        assert monitor.last_error == "timed out after 0.3s"
        assert monitor.latest() is None
    finally:
        await monitor.stop()


async def test_background_loop_survives_failures(silent_port: int) -> None:
    # A wedged backend: the loop keeps going, counting one timeout per round.
    monitor = CapacityMonitor(
        f"http://127.0.0.1:{silent_port}/metrics", interval_s=0.05, timeout_s=0.1
    )
    await monitor.start()
    try:
        await _until(lambda: monitor.scrape_failures >= 3, within_s=3.0)
        assert monitor.running
        assert monitor.scrape_successes == 0
        assert monitor.latest() is None
    finally:
        await monitor.stop()
    assert not monitor.running
    failures = monitor.scrape_failures
    await asyncio.sleep(0.2)
    assert monitor.scrape_failures == failures  # really stopped


async def test_background_loop_polls_sim(sim: TestServer) -> None:
    monitor = CapacityMonitor(metrics_url(sim), model_name=DEMO_MODEL_NAME, interval_s=0.05)
    await monitor.start()
    await monitor.start()  # idempotent
    try:
        await _until(lambda: monitor.scrape_successes >= 3, within_s=3.0)
        cap = monitor.latest()
        assert cap is not None and cap.kv_capacity_tokens == 48000
    finally:
        await monitor.stop()
    await monitor.stop()  # idempotent


async def test_load_shows_up_and_drives_backpressure(sim: TestServer) -> None:
    """A request holding KV on the sim shows in the monitor's reading and the policy."""
    monitor = CapacityMonitor(metrics_url(sim), model_name=DEMO_MODEL_NAME)
    # Stall after one token: the request stays running and keeps its blocks.
    body = {
        "model": DEMO_MODEL_NAME,
        "messages": [{"role": "user", "content": "Hello there, how are you?"}],
        "max_tokens": 4000,
        "stream": True,
    }
    headers = {"x-sim-output-tokens": "4000", "x-sim-stall-after": "1"}

    async with aiohttp.ClientSession() as client:
        resp = await client.post(sim.make_url("/v1/chat/completions"), json=body, headers=headers)
        try:
            await resp.content.readline()  # the first event is out: the request runs

            async def running() -> bool:
                await monitor.poll_once()
                cap = monitor.latest()
                return cap is not None and cap.num_requests_running == 1

            await _until_async(running, within_s=5.0)
            cap = monitor.latest()
            assert cap is not None
            assert cap.kv_cache_usage is not None and 0 < cap.kv_cache_usage < 0.01
            assert cap.kv_used_tokens is not None and 0 < cap.kv_used_tokens <= 48000
            # A tiny threshold turns that small usage into a shed verdict.
            verdict = BackpressurePolicy(max_kv_cache_usage=1e-6).evaluate(cap)
            assert verdict.shed and verdict.reason == REASON_KV_CACHE_FULL
            assert not BackpressurePolicy().evaluate(cap).shed
        finally:
            resp.close()
            await monitor.stop()


async def test_injected_session_is_not_closed(sim: TestServer) -> None:
    async with aiohttp.ClientSession() as session:
        monitor = CapacityMonitor(metrics_url(sim), session=session)
        assert await monitor.poll_once()
        await monitor.stop()
        assert not session.closed


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        CapacityMonitor("http://x/metrics", timeout_s=0)


async def test_parsing_error_is_a_failure_not_an_exception() -> None:
    async def handler(_request: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_running{engine="0" 3\n')

    app = web.Application()
    app.router.add_get("/metrics", handler)
    server = TestServer(app)
    await server.start_server()
    monitor = CapacityMonitor(metrics_url(server))
    try:
        assert not await monitor.poll_once()
        assert monitor.last_error is not None and "malformed" in monitor.last_error
    finally:
        await monitor.stop()
        await server.close()


async def _until(predicate: Callable[[], bool], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def _until_async(predicate: Callable[[], Awaitable[bool]], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


# --- a hostile endpoint ---------------------------------------------------------------------

_GOOD_METRICS = (
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n'
)
MIB = 1024 * 1024


async def _serve(
    routes: dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]],
) -> TestServer:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    server = TestServer(app)
    await server.start_server()
    return server


async def test_a_redirect_is_a_failed_scrape_and_is_not_followed() -> None:
    """A pod answering /metrics with a redirect (to the metadata service, another pod, a
    page that reports a huge cache) gets no reading; the target is never asked."""
    followed: list[str] = []

    async def redirect(_request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/elsewhere")

    async def elsewhere(request: web.Request) -> web.StreamResponse:
        followed.append(request.path)
        return web.Response(text=_GOOD_METRICS)

    server = await _serve({"/metrics": redirect, "/elsewhere": elsewhere})
    monitor = CapacityMonitor(metrics_url(server))
    try:
        assert not await monitor.poll_once()
        assert monitor.last_error is not None and "HTTP 302" in monitor.last_error
        assert "redirects are not followed" in monitor.last_error
        assert followed == [] and monitor.latest() is None
    finally:
        await monitor.stop()
        await server.close()


async def test_a_50_mib_body_fails_the_scrape_without_being_read() -> None:
    """Valid metrics followed by 50 MiB of comment lines, streamed without a length: the
    scrape stops reading past max_body_bytes instead of buffering it all."""
    sent = 0
    line = b"# " + b"x" * 1021 + b"\n"

    async def huge(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        await resp.write(_GOOD_METRICS.encode())
        chunk = line * 64  # 64 KiB
        try:
            while sent < 50 * MIB:
                await resp.write(chunk)
                sent += len(chunk)
        except (ConnectionResetError, ConnectionError):
            return resp  # the client hung up: what was sent so far is the measure
        await resp.write_eof()
        return resp

    server = await _serve({"/metrics": huge})
    monitor = CapacityMonitor(metrics_url(server), max_body_bytes=4 * MIB, timeout_s=10)
    try:
        assert not await monitor.poll_once()
        assert monitor.last_error is not None and "max_body_bytes" in monitor.last_error
        await asyncio.sleep(0.2)  # let the server notice the closed connection
        assert sent < 20 * MIB, sent  # 4 MiB read, the rest at most socket buffers
    finally:
        await monitor.stop()
        await server.close()


async def test_a_declared_body_over_the_bound_fails_before_it_is_read() -> None:
    async def declared(_request: web.Request) -> web.StreamResponse:
        return web.Response(body=_GOOD_METRICS.encode() + b"#" * (50 * MIB))

    server = await _serve({"/metrics": declared})
    monitor = CapacityMonitor(metrics_url(server), max_body_bytes=4 * MIB, timeout_s=10)
    try:
        assert not await monitor.poll_once()
        assert monitor.last_error is not None
        assert f"body of {len(_GOOD_METRICS) + 50 * MIB} bytes" in monitor.last_error
    finally:
        await monitor.stop()
        await server.close()


async def test_a_body_within_the_bound_is_read() -> None:
    async def padded(_request: web.Request) -> web.StreamResponse:
        return web.Response(text=_GOOD_METRICS + "# padding\n" * 6000)  # about 60 KiB

    server = await _serve({"/metrics": padded})
    monitor = CapacityMonitor(metrics_url(server), max_body_bytes=64 * 1024)
    try:
        assert await monitor.poll_once()
        reading = monitor.latest()
        assert reading is not None and reading.kv_capacity_tokens == 1600
    finally:
        await monitor.stop()
        await server.close()


async def test_a_body_that_never_finishes_is_cut_at_the_timeout() -> None:
    """Headers and a trickle of valid lines, then nothing, forever: the scrape as a whole is
    bounded by timeout_s, not each read."""

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        await resp.write(_GOOD_METRICS.encode())
        while True:  # a byte every 50 ms keeps any per-read timeout from firing
            await resp.write(b"#\n")
            await asyncio.sleep(0.05)

    server = await _serve({"/metrics": endless})
    monitor = CapacityMonitor(metrics_url(server), timeout_s=0.5)
    try:
        started = time.monotonic()
        assert not await monitor.poll_once()
        assert time.monotonic() - started < 1.5
        assert monitor.last_error == "timed out after 0.5s"
    finally:
        await monitor.stop()
        await server.close()


async def test_the_scrape_asks_for_an_uncompressed_body_and_refuses_a_compressed_one() -> None:
    """A gzip body's size says nothing about what it inflates to (a few KiB can be GiBs)."""
    asked: list[str] = []

    async def gzipped(request: web.Request) -> web.StreamResponse:
        asked.append(request.headers.get("Accept-Encoding", ""))
        resp = web.Response(text=_GOOD_METRICS)
        resp.enable_compression(web.ContentCoding.gzip)
        return resp

    server = await _serve({"/metrics": gzipped})
    monitor = CapacityMonitor(metrics_url(server))
    try:
        assert not await monitor.poll_once()
        assert asked == ["identity"]
        assert monitor.last_error is not None and "'gzip'-encoded body" in monitor.last_error
    finally:
        await monitor.stop()
        await server.close()


async def test_every_good_reading_reaches_the_observer_once() -> None:
    async def good(_request: web.Request) -> web.StreamResponse:
        return web.Response(text=_GOOD_METRICS)

    seen: list[int | None] = []
    server = await _serve({"/metrics": good})
    monitor = CapacityMonitor(
        metrics_url(server), on_reading=lambda reading: seen.append(reading.kv_capacity_tokens)
    )
    try:
        assert await monitor.poll_once() and await monitor.poll_once()
        assert seen == [1600, 1600]
    finally:
        await monitor.stop()
        await server.close()
