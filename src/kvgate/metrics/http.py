"""kvgate's HTTP port: Prometheus /metrics, /healthz (alive) and /readyz (ready to admit)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.metrics.definitions import Metrics


def create_http_app(
    metrics: Metrics,
    is_ready: Callable[[], bool],
    usage_report: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    before_scrape: Callable[[], Awaitable[None]] | None = None,
) -> web.Application:
    async def metrics_handler(_: web.Request) -> web.Response:
        if before_scrape is not None:
            await before_scrape()
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        ready = is_ready()
        return web.json_response(
            {"status": "ready" if ready else "not_ready"}, status=200 if ready else 503
        )

    async def usage(_: web.Request) -> web.Response:
        if usage_report is None:
            raise web.HTTPNotFound()
        return web.json_response(await usage_report())

    app = web.Application()
    # The operator's view of every tenant. Bind the HTTP port to a private address.
    app.router.add_get("/admin/usage", usage)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app
