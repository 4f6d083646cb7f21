"""The composition root: the only place that knows every concrete class."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2, external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvgate.config import KvgateConfig, SnapshotHolder, compile_snapshot
from kvgate.extproc import ExternalProcessor, GatewayServices
from kvgate.extproc.usage_report import tenant_usage_report
from kvgate.metrics import Metrics
from kvgate.metrics.http import create_http_app
from kvgate.policy import MonotonicClock, Reservation
from kvgate.reload import ConfigReloader
from kvgate.store import MemoryStore, StateStore
from kvgate.tokenize import PromptCounter, TokenizerService, resolve_tokenizer_dir

log = logging.getLogger("kvgate")

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def load_tokenizers(config: KvgateConfig) -> TokenizerService:
    service = TokenizerService(
        max_workers=config.server.tokenizer_threads,
        cache_size=config.server.tokenizer_cache_entries,
    )
    cache_dir = Path(config.server.tokenizer_cache_dir)
    for model in config.models:
        model_dir = resolve_tokenizer_dir(model.tokenizer, cache_dir)
        service.register(model.name, PromptCounter.from_model_dir(model_dir, name=model.name))
    return service


class KvgateServer:
    def __init__(self, config: KvgateConfig, config_path: Path | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.metrics = Metrics()
        self.clock = MonotonicClock()
        self.snapshots = SnapshotHolder(compile_snapshot(config))
        self.store: StateStore = MemoryStore(
            lease_ttl_s=config.server.lease_ttl_s,
            clock=self.clock,
            on_lease_expired=self._lease_expired,
        )
        self.tokenizers = load_tokenizers(config)
        self.services = GatewayServices(
            snapshots=self.snapshots,
            store=self.store,
            tokenizers=self.tokenizers,
            metrics=self.metrics,
            clock=self.clock,
        )
        self.health = health.aio.HealthServicer()
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self._ready = False
        self.reloader: ConfigReloader | None = None
        self.grpc_port = 0
        self.http_port = 0

    def _lease_expired(self, reservation: Reservation) -> None:
        self.metrics.expired_leases.labels(reservation.request.backend).inc()
        log.warning(
            "lease expired without settlement",
            extra={"reservation_id": reservation.reservation_id},
        )

    async def _all_tenants_usage(self) -> dict[str, Any]:
        snapshot = self.snapshots.current
        return {
            "object": "kvgate.usage.all",
            "tenants": [
                await tenant_usage_report(self.services, snapshot, name)
                for name in sorted(snapshot.tenants)
            ],
        }

    async def _set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", EXTPROC_SERVICE):
            await self.health.set(name, status)

    async def start(self) -> None:
        server_cfg = self.config.server
        for backend in self.snapshots.current.backends.values():
            self.metrics.kv_budget_tokens.labels(backend.name).set(backend.kv_budget_tokens)
            self.metrics.kv_tokens_in_flight.labels(backend.name).set(0)
        options = [
            ("grpc.max_receive_message_length", server_cfg.grpc_max_message_bytes),
            ("grpc.max_send_message_length", server_cfg.grpc_max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        self._grpc = grpc.aio.server(options=options)
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(
            ExternalProcessor(self.services), self._grpc
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (
                external_processor_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self._grpc,
        )
        await self._set_serving(False)
        self.grpc_port = self._grpc.add_insecure_port(server_cfg.grpc_listen)
        if self.grpc_port == 0:
            raise OSError(f"cannot listen on {server_cfg.grpc_listen} (gRPC)")
        await self._grpc.start()

        host, _, port = server_cfg.http_listen.rpartition(":")
        self._http = web.AppRunner(
            create_http_app(self.metrics, lambda: self._ready, self._all_tenants_usage),
            access_log=None,
        )
        await self._http.setup()
        site = web.TCPSite(self._http, host.strip("[]"), int(port))
        await site.start()
        sockets = site._server.sockets if site._server else []  # type: ignore[union-attr]
        self.http_port = sockets[0].getsockname()[1] if sockets else int(port)

        if self.config_path is not None:
            self.reloader = ConfigReloader(
                self.config_path,
                snapshots=self.snapshots,
                tokenizers=self.tokenizers,
                metrics=self.metrics,
            )
            self.reloader.start_watching()

        self._ready = True
        await self._set_serving(True)
        log.info(
            "kvgate serving",
            extra={"grpc_port": self.grpc_port, "http_port": self.http_port},
        )

    async def stop(self) -> None:
        """Stop accepting, let in-flight streams finish within the grace period, settle the rest."""
        grace = self.config.server.shutdown_grace_s
        self._ready = False
        await self._set_serving(False)
        self.services.shutting_down = True
        if self.reloader is not None:
            await self.reloader.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace)
        await self.services.drain(timeout_s=10.0)
        if self._http is not None:
            await self._http.cleanup()
        await self.store.close()
        self.tokenizers.close()
        log.info("kvgate stopped")


async def serve(config: KvgateConfig, config_path: Path | None = None) -> None:
    server = KvgateServer(config, config_path)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloader = server.reloader
    if reloader is not None:
        loop.add_signal_handler(
            signal.SIGHUP, lambda: server.services.track(_reload(reloader, "sighup"))
        )
    await stop.wait()
    log.info("shutting down")
    await server.stop()


async def _reload(reloader: ConfigReloader, trigger: str) -> None:
    await reloader.reload(trigger)


def run(config: KvgateConfig, config_path: Path | None = None) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config, config_path))
    else:
        uvloop.run(serve(config, config_path))
