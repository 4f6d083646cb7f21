"""kvgate's HTTP port: Prometheus /metrics, /healthz (alive) and /readyz (ready to admit), open
to anyone who reaches the port; and the operator's /admin/usage, behind `authorize_admin`
(kvgate.admin.auth: the operator token, or a loopback listener). With operator TLS, /admin/usage
is served by its own HTTPS listener (`create_operator_app`) and refused on this port."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.metrics.definitions import Metrics
from kvgate.openai.errors import INVALID_REQUEST_ERROR, ApiError

AdminAuthorizer = Callable[[str | None], ApiError | None]
UsageReport = Callable[[], Awaitable[dict[str, Any]]]


def _usage_handler(
    usage_report: UsageReport | None,
    authorize_admin: AdminAuthorizer | None,
    require_client_cert: bool = False,
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def usage(request: web.Request) -> web.Response:
        if usage_report is None:
            raise web.HTTPNotFound()
        if require_client_cert and not _peer_certificate(request):
            # The handshake already demands one (mutual TLS); this only guards against a
            # listener set up without it.
            refusal = ApiError(
                403,
                "This operator endpoint needs a client certificate (mutual TLS).",
                INVALID_REQUEST_ERROR,
                "client_certificate_required",
            )
            return web.json_response(refusal.to_dict(), status=refusal.status)
        if authorize_admin is not None:
            denial = authorize_admin(request.headers.get("Authorization"))
            if denial is not None:
                return web.json_response(
                    denial.to_dict(), status=denial.status, headers=denial.headers
                )
        return web.json_response(await usage_report())

    return usage


def _peer_certificate(request: web.Request) -> bool:
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    return bool(ssl_object is not None and ssl_object.getpeercert())


def create_http_app(
    metrics: Metrics,
    is_ready: Callable[[], bool],
    usage_report: UsageReport | None = None,
    before_scrape: Callable[[], Awaitable[None]] | None = None,
    authorize_admin: AdminAuthorizer | None = None,
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

    app = web.Application()
    # The operator's view of every tenant: the operator token, or a loopback listener.
    app.router.add_get("/admin/usage", _usage_handler(usage_report, authorize_admin))
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def create_operator_app(
    usage_report: UsageReport,
    authorize_admin: AdminAuthorizer,
    *,
    require_client_cert: bool,
) -> web.Application:
    """The operator HTTPS listener (`server.operator_https_listen`): /admin/usage only; the
    probes and Prometheus stay on the plain port."""
    app = web.Application()
    app.router.add_get(
        "/admin/usage", _usage_handler(usage_report, authorize_admin, require_client_cert)
    )
    return app
