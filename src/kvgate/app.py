"""The composition root: the only place that knows every concrete class."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2, external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvgate.admin.auth import (
    ADMIN_METHOD_PREFIX,
    HTTPS_LISTEN_FIELD,
    OperatorAuth,
    OperatorAuthInterceptor,
    load_operator_tokens,
)
from kvgate.admin.identity import (
    CertificateIdentityInterceptor,
    https_identity_middleware,
    identity_gate,
)
from kvgate.admin.service import AdminService
from kvgate.admin.tls import GrpcTls, OperatorTls
from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from kvgate.cache.answers import (
    AnswerStore,
    MemoryAnswerStore,
    RedisAnswerStore,
)
from kvgate.cache.semantic import EntryLog, MemoryEntryLog, RedisEntryLog
from kvgate.capacity.pools import PoolRegistry
from kvgate.capacity.reconcile import Reconciler
from kvgate.capacity.registry import CapacityRegistry
from kvgate.config import KvgateConfig, SnapshotHolder, compile_snapshot
from kvgate.config.secrets import redis_passwords, url_has_password
from kvgate.extproc import ExternalProcessor, GatewayServices
from kvgate.extproc.handoff import HandoffRegistry
from kvgate.keys.building import build_key_directory
from kvgate.lifecycle import BackgroundTasks, LeaseKeeper, Settler
from kvgate.lifecycle.answer_sources import AnswerSource
from kvgate.lifecycle.idempotency import IdempotencySource, TenantWaiters
from kvgate.lifecycle.leases import renew_interval_s
from kvgate.lifecycle.response_cache import ExactCacheSource
from kvgate.lifecycle.scheduler import PoolScheduler
from kvgate.lifecycle.semantic_cache import (
    SemanticCache,
    SemanticCacheSource,
    build_semantic_cache,
)
from kvgate.lifecycle.usage_report import tenant_usage_report
from kvgate.metrics import Metrics
from kvgate.metrics.definitions import (
    CountingCollector,
    SemanticCacheCollector,
    TokenFileCollector,
)
from kvgate.metrics.http import create_http_app, create_operator_app
from kvgate.policy import MonotonicClock, Reservation
from kvgate.reload import ConfigReloader
from kvgate.store import (
    FailurePolicy,
    FallbackStore,
    MemoryStore,
    RedisSettings,
    RedisStore,
    StateStore,
)
from kvgate.tokenize import TokenizerService
from kvgate.tokenize.engine_counting import EngineCounter, load_model_counter
from kvgate.tracing import build_tracing
from kvgate.usage_records.building import build_sink, build_writer
from kvgate.usage_records.metrics import UsageRecordsCollector

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from kvgate.config.model import ServerConfig

log = logging.getLogger("kvgate")

EXTPROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# grpc.health.v1 service reporting the shared store: NOT_SERVING while Redis is down. The
# server ("") stays SERVING: kvgate still answers (503 + Retry-After under fail_closed, local
# limits under fail_open), and Envoy must keep sending it traffic for that.
STORE_HEALTH_SERVICE = "kvgate.store"
# protoc's gRPC plugin annotates nothing it generates: its registration function, typed.
_add_admin_servicer = cast(
    Callable[[AdminService, grpc.aio.Server], None], admin_pb2_grpc.add_AdminServicer_to_server
)


def load_tokenizers(config: KvgateConfig) -> TokenizerService:
    service = TokenizerService(
        max_workers=config.server.tokenizer_threads,
        cache_size=config.server.tokenizer_cache_entries,
        inline_max_cost=config.server.inline_tokenize_max_chars,
    )
    cache_dir = Path(config.server.tokenizer_cache_dir)
    backends = {backend.name: backend for backend in config.backends}
    for model in config.models:
        counter = load_model_counter(model, backends[model.backend], cache_dir)
        if counter.engine not in ("compiled-bpe", EngineCounter.engine):
            log.info(
                "counting with the reference tokenizer",
                extra={"model": model.name, "reason": counter.engine_reason},
            )
        service.register(model.name, counter)
    return service


class KvgateServer:
    def __init__(
        self,
        config: KvgateConfig,
        config_path: Path | None = None,
        *,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.metrics = Metrics()
        self.clock = MonotonicClock()
        self.snapshots = SnapshotHolder(compile_snapshot(config))
        self.health = health.aio.HealthServicer()
        self._health_tasks: set[asyncio.Task[None]] = set()
        # Secrets first: a missing token or password stops the start with the field's name.
        self.operator_auth = OperatorAuth(load_operator_tokens(config.server))
        self.metrics.registry.register(TokenFileCollector(self.operator_auth))
        # None when tracing is off; enabled without the `otel` extra: ConfigError naming it.
        # span_exporter replaces the OTLP exporter (tests).
        self.tracing = build_tracing(config.tracing, exporter=span_exporter)
        self._idempotency_store: AnswerStore = MemoryAnswerStore(
            config.idempotency.memory_max_bytes
        )
        self._response_cache_store: AnswerStore = MemoryAnswerStore(
            config.response_cache.memory_max_bytes
        )
        self._semantic_entries: EntryLog = MemoryEntryLog(config.semantic_cache.memory_max_bytes)
        self._redis_store: RedisStore | None = None  # the state store's Redis, if any
        self.store: StateStore = self._build_store(config)
        # API keys as data (None: keys.store off); on the state store's Redis when it has one.
        self.keys = build_key_directory(config, redis_store=self._redis_store)
        # Built at start when on (WordLlama loads its weights here): a change needs a restart.
        self.semantic_cache: SemanticCache | None = (
            build_semantic_cache(
                config.semantic_cache, self._response_cache_store, self._semantic_entries
            )
            if config.semantic_cache.enabled
            else None
        )
        if self.semantic_cache is not None:
            self.metrics.registry.register(
                SemanticCacheCollector(self.semantic_cache.embedder, self.semantic_cache.index)
            )
        self.tokenizers = load_tokenizers(config)
        self.metrics.registry.register(CountingCollector(self.tokenizers))
        self.capacity = CapacityRegistry(metrics=self.metrics)
        self.pools = PoolRegistry(metrics=self.metrics)
        # What kvgate booked per engine against the engines' own token counters.
        self.reconciler = Reconciler((self.capacity, self.pools), self.store, self.metrics)
        self.scheduler = PoolScheduler(
            self.pools,
            self.store.backend_status,
            shared_store=config.uses_redis,
            metrics=self.metrics,
        )
        # One durable record per request, written in the background (None: off).
        self.usage_records = build_writer(config.usage_records)
        self._usage_record_reader = build_sink(config.usage_records)
        if self.usage_records is not None:
            self.metrics.registry.register(UsageRecordsCollector(self.usage_records))
        tasks = BackgroundTasks()
        leases = LeaseKeeper(
            self.store,
            self.metrics,
            lambda: renew_interval_s(self.snapshots.current.config.server.lease_ttl_s),
        )
        self.services = GatewayServices(
            snapshots=self.snapshots,
            store=self.store,
            tokenizers=self.tokenizers,
            metrics=self.metrics,
            clock=self.clock,
            capacity=self.capacity,
            handoffs=HandoffRegistry(),
            tasks=tasks,
            leases=leases,
            settler=Settler(
                store=self.store,
                snapshots=self.snapshots,
                metrics=self.metrics,
                leases=leases,
                track=tasks.track,
                tracing=self.tracing,
                # A pool's queue may admit the next request; its fair-share counter
                # learns what the tenant really got.
                on_released=self.scheduler.on_settled,
                usage_records=self.usage_records.add if self.usage_records else None,
            ),
            scheduler=self.scheduler,
            answer_sources=self._answer_sources(tasks),
            keys=self.keys,
        )
        self._grpc: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self._ready = False
        self.reloader: ConfigReloader | None = None
        self._admin: grpc.aio.Server | None = None
        self.admin_port = 0
        self.grpc_port = 0
        self.http_port = 0

    def _answer_sources(self, tasks: BackgroundTasks) -> list[AnswerSource]:
        """What may answer a request instead of a backend, in the order each is asked: a
        new cache is one AnswerSource and one line here."""
        sources: list[AnswerSource] = [
            IdempotencySource(self._idempotency_store, TenantWaiters(), self.metrics, tasks.track),
            ExactCacheSource(self._response_cache_store, self.metrics, tasks.track),
        ]
        if self.semantic_cache is not None:
            sources.append(SemanticCacheSource(self.semantic_cache, self.metrics, tasks.track))
        return sources

    def _build_store(self, config: KvgateConfig) -> StateStore:
        """The memory store, or Redis behind the failure policy (a change needs a restart)."""
        local = MemoryStore(
            lease_ttl_s=config.server.lease_ttl_s,
            clock=self.clock,
            on_lease_expired=self._lease_expired,
        )
        if not config.uses_redis:
            return local
        redis_cfg = config.redis
        sentinel = redis_cfg.sentinel
        nodes = [node.rpartition(":") for node in sentinel.nodes] if sentinel else []
        password, sentinel_password = redis_passwords(config)
        # Never the values: which field holds a secret inline, and what to use instead.
        if url_has_password(config.store):
            log.warning(
                "the store URL carries the Redis password inline; prefer redis.password_file "
                "(a Secret volume) or redis.password_env, and keep the config file secret-free"
            )
        if sentinel is not None and sentinel.password is not None:
            log.warning(
                "redis.sentinel.password is inline in the config file; prefer "
                "redis.sentinel.password_file or redis.sentinel.password_env"
            )
        settings = RedisSettings(
            url=config.store,
            key_prefix=redis_cfg.key_prefix,
            connect_timeout_s=redis_cfg.connect_timeout_s,
            timeout_s=redis_cfg.timeout_s,
            cluster=redis_cfg.cluster,
            sentinel_master=sentinel.master if sentinel else None,
            sentinel_nodes=tuple((host, int(port)) for host, _, port in nodes),
            sentinel_password=(sentinel_password or sentinel.password) if sentinel else None,
            password=password,
            max_connections=redis_cfg.max_connections,
            settled_id_retention_s=redis_cfg.settled_id_retention_s,
        )
        shared = RedisStore.from_settings(
            settings, lease_ttl_s=config.server.lease_ttl_s, on_lease_expired=self._lease_expired
        )
        self._redis_store = shared
        # Idempotency keys live beside the ledgers, under the same hash tag.
        self._idempotency_store = RedisAnswerStore(
            shared.client,
            shared.key_tag,
            timeout_s=redis_cfg.timeout_s,
            max_memory_fraction=redis_cfg.answer_store_max_memory_fraction,
        )
        # Cache entries too (keys "cache|...", with their TTL): shared by every replica.
        self._response_cache_store = self._idempotency_store
        # Semantic-cache entries: one stream per context, mirrored by each replica.
        self._semantic_entries = RedisEntryLog(
            shared.client, shared.key_tag, timeout_s=redis_cfg.timeout_s
        )
        return FallbackStore(
            shared,
            local,
            policy=FailurePolicy(redis_cfg.failure_policy),
            retry_after_s=redis_cfg.unavailable_retry_after_s,
            probe_interval_s=redis_cfg.probe_interval_s,
            max_pending=redis_cfg.max_pending_settlements,
            events=_StoreEvents(self),
        )

    async def _set_store_health(self, up: bool) -> None:
        self.metrics.store_up.set(1 if up else 0)
        await self.health.set(
            STORE_HEALTH_SERVICE,
            health_pb2.HealthCheckResponse.SERVING
            if up
            else health_pb2.HealthCheckResponse.NOT_SERVING,
        )

    def store_availability_changed(self, up: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._set_store_health(up))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

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
                await tenant_usage_report(self.services.store, self.services.clock, snapshot, name)
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

    async def _sync_capacity(self, config: KvgateConfig) -> None:
        """Discovery monitors, pools and queues follow the (re)loaded configuration."""
        await self.capacity.sync(config)
        await self.pools.sync(config)
        self.scheduler.sync(config)

    async def start(self) -> None:
        server_cfg = self.config.server
        # Operator TLS: its files are read before anything listens (unusable ones stop the
        # start, naming the field); the operator endpoints then answer on TLS listeners only.
        self.operator_tls = (
            OperatorTls(server_cfg.operator_tls) if server_cfg.operator_tls else None
        )
        # ext_proc mutual TLS: Envoy's certificate (and identity) before any stream opens.
        grpc_tls = GrpcTls(server_cfg.grpc_tls) if server_cfg.grpc_tls else None
        self.operator_https_port = 0
        if self.operator_tls is not None:
            https = [HTTPS_LISTEN_FIELD] if server_cfg.operator_https_listen else []
            self.operator_auth.use_tls(
                ["server.admin_listen", *https],
                client_certs=self.operator_tls.client_certs_required,
            )
        await self._sync_capacity(self.config)
        if self.usage_records is not None:
            self.usage_records.start()
        await self.reconciler.start()
        if self.keys is not None:
            await self.keys.start()  # loads nothing: lookups fill its cache
        for backend in self.snapshots.current.backends.values():
            self.metrics.kv_budget_tokens.labels(backend.name).set(backend.kv_budget_tokens)
            self.metrics.kv_tokens_in_flight.labels(backend.name).set(0)
        options = [
            ("grpc.max_receive_message_length", server_cfg.grpc_max_message_bytes),
            ("grpc.max_send_message_length", server_cfg.grpc_max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]

        def current_server() -> ServerConfig:  # the allow-lists follow reloads
            return self.snapshots.current.config.server

        self._grpc = grpc.aio.server(
            options=options,
            interceptors=[
                CertificateIdentityInterceptor(
                    identity_gate("grpc", "grpc_tls", current_server, self.metrics),
                    [f"/{EXTPROC_SERVICE}/"],
                )
            ]
            if grpc_tls is not None
            else None,
        )
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
        if isinstance(self.store, FallbackStore):
            # Redis down at start-up is not fatal: the failure policy applies until it answers.
            await self._set_store_health(await self.store.check())
        else:
            self.metrics.store_up.set(1)  # the memory store is always there
        self.grpc_port = (
            self._grpc.add_secure_port(server_cfg.grpc_listen, grpc_tls.grpc_credentials())
            if grpc_tls is not None
            else self._grpc.add_insecure_port(server_cfg.grpc_listen)
        )
        if self.grpc_port == 0:
            raise OSError(f"cannot listen on {server_cfg.grpc_listen} (gRPC)")
        await self._grpc.start()

        http_listeners = {"server.http_listen": server_cfg.http_listen}
        if server_cfg.operator_https_listen is not None:
            http_listeners[HTTPS_LISTEN_FIELD] = server_cfg.operator_https_listen
        for warning in self.operator_auth.exposure_warnings(http_listeners):
            log.warning(warning)
        host, _, port = server_cfg.http_listen.rpartition(":")
        http_app = create_http_app(
            self.metrics,
            lambda: self._ready,
            self._all_tenants_usage,
            before_scrape=self.services.refresh_backend_gauges,
            authorize_admin=self.operator_auth.for_listener(
                server_cfg.http_listen, "server.http_listen"
            ),
        )
        operator_https = None
        if self.operator_tls is not None and server_cfg.operator_https_listen is not None:
            # /admin/usage over HTTPS on its own port; the probes and Prometheus keep plain
            # HTTP on http_listen. Cleaning up the HTTP runner (stop()) stops it too.
            operator_app = create_operator_app(
                self._all_tenants_usage,
                self.operator_auth.for_listener(
                    server_cfg.operator_https_listen, HTTPS_LISTEN_FIELD
                ),
                require_client_cert=self.operator_tls.client_certs_required,
            )
            operator_app.middlewares.append(
                https_identity_middleware(
                    identity_gate("operator_https", "operator_tls", current_server, self.metrics)
                )
            )
            operator_https = web.AppRunner(operator_app, access_log=None)

            async def stop_operator_https(_: web.Application) -> None:
                await operator_https.cleanup()

            http_app.on_cleanup.append(stop_operator_https)
        self._http = web.AppRunner(http_app, access_log=None)
        await self._http.setup()
        site = web.TCPSite(self._http, host.strip("[]"), int(port))
        await site.start()
        addresses = self._http.addresses  # its one site's bound sockets
        self.http_port = addresses[0][1] if addresses else int(port)
        if operator_https is not None and self.operator_tls is not None:
            listen = server_cfg.operator_https_listen or ""
            host, _, port = listen.rpartition(":")
            await operator_https.setup()
            secure = web.TCPSite(
                operator_https,
                host.strip("[]"),
                int(port),
                ssl_context=self.operator_tls.ssl_context(),
            )
            await secure.start()
            addresses = operator_https.addresses  # its one site's bound sockets
            self.operator_https_port = addresses[0][1] if addresses else int(port)

        if self.config_path is not None:
            self.reloader = ConfigReloader(
                self.config_path,
                snapshots=self.snapshots,
                tokenizers=self.tokenizers,
                metrics=self.metrics,
                on_applied=self._sync_capacity,
                prepare=self._prepare_reload,
            )
            self.reloader.start_watching()
        await self._start_admin(options)

        self._ready = True
        await self._set_serving(True)
        log.info(
            "kvgate serving",
            extra={"grpc_port": self.grpc_port, "http_port": self.http_port},
        )

    def _prepare_reload(self, config: KvgateConfig) -> Callable[[], None]:
        """Re-read the operator token(s) of the new config (a failure rejects the reload)."""
        tokens = load_operator_tokens(config.server)

        def apply() -> None:
            had_token = self.operator_auth.configured
            self.operator_auth.replace(tokens)
            server_cfg = config.server
            if not had_token:
                return  # the start-up warnings (if any) still hold
            for warning in self.operator_auth.exposure_warnings(
                {
                    "server.http_listen": server_cfg.http_listen,
                    "server.admin_listen": server_cfg.admin_listen,
                }
            ):
                log.warning(warning)

        return apply

    async def _start_admin(self, options: list[tuple[str, int]]) -> None:
        # Not-loopback without a token: the server still starts and refuses every call with
        # PERMISSION_DENIED naming the setting (and a warning now), so the data plane never
        # depends on the operator surface and the operator who tries learns why.
        admin_listen = self.config.server.admin_listen
        for warning in self.operator_auth.exposure_warnings({"server.admin_listen": admin_listen}):
            log.warning(warning)
        self._admin = grpc.aio.server(
            options=options,
            interceptors=[
                OperatorAuthInterceptor(
                    self.operator_auth.for_listener(admin_listen, "server.admin_listen")
                ),
                # After the token check: the certificate must also be on the allow-list.
                CertificateIdentityInterceptor(
                    identity_gate(
                        "admin",
                        "operator_tls",
                        lambda: self.snapshots.current.config.server,  # follows reloads
                        self.metrics,
                    ),
                    [ADMIN_METHOD_PREFIX],
                ),
            ],
        )
        admin = AdminService(
            self.services,
            self.snapshots,
            self.reloader,
            self.pools,
            self.reconciler,
            usage_records=self._usage_record_reader,
        )
        _add_admin_servicer(admin, self._admin)
        reflection.enable_server_reflection(
            (admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name, reflection.SERVICE_NAME),
            self._admin,
        )
        if self.operator_tls is not None:
            # Mutual TLS when a client CA is configured: the handshake refuses a client without
            # a certificate that CA signed, before any call is read.
            self.admin_port = self._admin.add_secure_port(
                admin_listen, self.operator_tls.grpc_credentials()
            )
            log.info(
                "operator listeners use " + self.operator_tls.mode,
                extra={
                    "admin_listen": admin_listen,
                    "operator_https_listen": self.config.server.operator_https_listen,
                },
            )
        else:
            self.admin_port = self._admin.add_insecure_port(admin_listen)
        if self.admin_port == 0:
            raise OSError(f"cannot listen on {self.config.server.admin_listen} (admin gRPC)")
        await self._admin.start()

    async def stop(self) -> None:
        """Stop accepting, let in-flight streams finish within the grace period, settle the rest."""
        grace = self.snapshots.current.config.server.shutdown_grace_s  # a reload may change it
        self._ready = False
        await self._set_serving(False)
        self.services.shutting_down = True
        if self.reloader is not None:
            await self.reloader.stop()
        if self._admin is not None:
            await self._admin.stop(0)
        if self._grpc is not None:
            await self._grpc.stop(grace)
        await self.services.drain(timeout_s=10.0)
        if self.keys is not None:
            await self.keys.close()  # before the store: it may share its Redis client
        if self.usage_records is not None:
            # The drained settlements' records: to the spool, and to the sink if it answers.
            await self.usage_records.close()
        if self._usage_record_reader is not None:
            await self._usage_record_reader.close()
        if self._http is not None:
            await self._http.cleanup()
        await self.reconciler.stop()
        await self.capacity.close()
        await self.pools.close()
        await self.store.close()
        if self.semantic_cache is not None:
            await self.semantic_cache.close()
        self.tokenizers.close()
        await self.tokenizers.close_engines()
        if self.tracing is not None:
            # The settlements' spans are recorded by now (drained above): export them.
            await asyncio.to_thread(self.tracing.shutdown)
        log.info("kvgate stopped")


class _StoreEvents:
    """The failure handling's reports, as metrics and health."""

    def __init__(self, server: KvgateServer) -> None:
        self._server = server
        self._metrics = server.metrics

    def availability(self, up: bool) -> None:
        self._server.store_availability_changed(up)

    def fallback_decision(self, admitted: bool) -> None:
        outcome = "admitted" if admitted else "rejected"
        self._metrics.store_fallback_decisions.labels(outcome).inc()

    def error(self, op: str) -> None:
        self._metrics.store_errors.labels(op).inc()

    def pending(self, count: int) -> None:
        self._metrics.store_pending_settlements.set(count)

    def dropped(self) -> None:
        self._metrics.store_dropped_settlements.inc()

    def reconciled(self, kind: str) -> None:
        self._metrics.store_reconciled_settlements.labels(kind).inc()


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
