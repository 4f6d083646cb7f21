"""kvgate's HTTP port: Prometheus /metrics, /healthz (alive) and /readyz (ready to admit), open
to anyone who reaches the port; and the operator's /admin/usage, behind `authorize_admin`
(kvgate.admin.auth: the operator token, or a loopback listener)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.metrics.definitions import Metrics
from kvgate.openai.errors import ApiError


def create_http_app(
    metrics: Metrics,
    is_ready: Callable[[], bool],
    usage_report: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    before_scrape: Callable[[], Awaitable[None]] | None = None,
    authorize_admin: Callable[[str | None], ApiError | None] | None = None,
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

    async def usage(request: web.Request) -> web.Response:
        if usage_report is None:
            raise web.HTTPNotFound()
        if authorize_admin is not None:
            denial = authorize_admin(request.headers.get("Authorization"))
            if denial is not None:
                return web.json_response(
                    denial.to_dict(), status=denial.status, headers=denial.headers
                )
        return web.json_response(await usage_report())

    app = web.Application()
    # The operator's view of every tenant: the operator token, or a loopback listener.
    app.router.add_get("/admin/usage", usage)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app
