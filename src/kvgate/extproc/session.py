"""One ext_proc stream = one HTTP request: Envoy's messages in, replies out.

The request headers authenticate the tenant and choose the stream's role
(``kvgate.extproc.handlers``): a metered API's request, a pass-through, the usage report,
a refusal, or, on the split layout's observing stream, the answer of a request admitted
elsewhere. Settlement happens exactly once, whichever way the stream ends: the response's
end_of_stream, a client disconnect, an upstream reset, an Envoy timeout, or shutdown. The
request's decision, metering and settlement are its ``Exchange``
(`kvgate.lifecycle.exchange`), its API's grammar and error shape a protocol
(`kvgate.protocols`); this module only translates Envoy's messages, headers and layouts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvgate.config import hash_api_key
from kvgate.config.snapshot import compile_level
from kvgate.extproc import messages
from kvgate.extproc.handlers import (
    CountingHandler,
    Handler,
    MeteredHandler,
    ObservingHandler,
    Phase,
    StreamFacts,
    UnmeteredHandler,
)
from kvgate.extproc.handoff import METADATA_KEY
from kvgate.extproc.identity import IdentityRefused, mesh_caller
from kvgate.extproc.priority_header import parse_priority_class
from kvgate.extproc.route_settings import (
    BACKEND_KEY,
    NO_ROUTE_SETTINGS,
    RouteSettings,
    RouteSettingsError,
)
from kvgate.extproc.services import GatewayServices
from kvgate.keys import KeyRefusal
from kvgate.lifecycle import Ticket
from kvgate.lifecycle.exchange import Exchange, PromptCount, RouteScope, UnmeteredForward
from kvgate.lifecycle.protocol import ErrorAnswer, ErrorVocabulary, Outcome
from kvgate.lifecycle.usage_report import tenant_usage_report
from kvgate.policy import Level, LevelKind, Reason, shadowed
from kvgate.protocols import DEFAULT_ERRORS, METERED_APIS, PROMPT_COUNT_APIS, UNMETERED_APIS
from kvgate.store import StoreUnavailable
from kvgate.usage_records.facts import Principal

if TYPE_CHECKING:
    pass

log = logging.getLogger("kvgate.session")


@dataclass(frozen=True, slots=True)
class _IssuedKey:
    """A valid key from the key directory: whose it is and its own limits."""

    tenant: str
    principal: Principal
    levels: tuple[Level, ...]


_Mode = processing_mode_pb2.ProcessingMode

# Requests that only need a valid key: they cost the GPU nothing.
PASSTHROUGH_PATHS = frozenset({"/v1/models"})
USAGE_PATH = "/v1/kvgate/usage"
HEADER_PREFIX = "x-kvgate-"
# The priority class a request asks for in a pool's queue (allowed per tenant).
PRIORITY_HEADER = "kvgate-priority"
IDEMPOTENCY_HEADER = "idempotency-key"
# How a refusal names that header: its usual spelling.
IDEMPOTENCY_HEADER_NAME = "Idempotency-Key"
# HTTP's optional whitespace (RFC 9110 5.6.3): the only padding trimmed from a credential.
# str.strip() would also drop U+00A0, U+3000, U+2028, U+0085 ..., so "key\u3000" would
# authenticate as "key".
_OWS = " \t"
# Tenant credentials: removed before a request goes upstream; a backend that needs a key
# gets its own from kvgate's config.
CREDENTIAL_HEADERS = ("authorization", "x-api-key")


def _path_only(path: str) -> str:
    return path.split("?", 1)[0]


def _api_key(headers: dict[str, str], key_header: str | None = None) -> str | None:
    if key_header is not None:
        # The route names the one header its clients put the key in (raw, or "Bearer KEY").
        value = headers.get(key_header, "").strip(_OWS)
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer":
            value = token.strip(_OWS)
        return value or None
    auth = headers.get("authorization", "")
    scheme, _, token = auth.strip(_OWS).partition(" ")
    token = token.strip(_OWS)
    if scheme.lower() == "bearer" and token:
        return token
    key = headers.get("x-api-key", "").strip(_OWS)
    return key or None


def _json_content_type(value: str | None) -> bool:
    """A request content type the engine accepts: application/json (parameters such as
    charset aside). vLLM refuses every other one with a 400; one that is absent passes here
    (many clients omit it for JSON) and meets the engine's own 400, which is charged nothing."""
    if value is None or not value.strip(_OWS):
        return True
    return value.split(";", 1)[0].strip(_OWS).lower() == "application/json"


def _admission_id(request_id: str) -> str:
    """The store's key for this admission: unique per stream. x-request-id alone is not:
    a client may send its own (Envoy keeps it), and reservations, billing records and
    abandon tombstones must never be shared between two requests."""
    return f"{request_id}/{secrets.token_hex(8)}"


class StreamSession:
    def __init__(
        self,
        services: GatewayServices,
        *,
        route: RouteSettings | RouteSettingsError = NO_ROUTE_SETTINGS,
    ) -> None:
        self._svc = services
        self._facts = StreamFacts(services, route, services.snapshots.current)
        self._path = ""
        # The refusals' shape: the path's API's, OpenAI's until the path is known.
        self._errors: ErrorVocabulary = DEFAULT_ERRORS
        # The stream's role, chosen by its request headers (handlers.py).
        self._handler = Handler(Phase.REQUEST_HEADERS)
        # What Envoy says of its configuration on a stream's first message: in the split
        # layout (envoy-observability.yaml) this request-path stream never sees the answer;
        # admission needs the whole body in one message (BUFFERED).
        self._answer_seen_elsewhere = False
        self._request_body_mode: int = _Mode.BUFFERED

    @property
    def phase(self) -> Phase:
        return self._handler.phase

    @property
    def ticket(self) -> Ticket | None:
        """What admission decided, once the request is admitted."""
        return self._handler.ticket

    @property
    def request_id(self) -> str:
        return self._facts.request_id

    # ------------------------------------------------------------------ dispatch

    async def handle(self, message: pb.ProcessingRequest) -> pb.ProcessingResponse | None:
        kind = message.WhichOneof("request")
        if message.observability_mode:
            await self._observe(message, kind)
            return None
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self._answer_seen_elsewhere = config.response_body_mode == _Mode.NONE
            self._request_body_mode = config.request_body_mode
        handler = self._handler
        try:
            if kind == "request_headers":
                if self.phase is not Phase.REQUEST_HEADERS:
                    # A second head for one request: nothing it says is taken.
                    return pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                return await self._on_request_headers(message.request_headers, message)
            if kind == "request_body":
                return await handler.on_request_body(message.request_body)
            if kind == "response_headers":
                return await handler.on_response_headers(message.response_headers)
            if kind == "response_body":
                return await handler.on_response_body(message.response_body)
            if kind == "request_trailers":
                return pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
            if kind == "response_trailers":
                return pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
        except Exception:
            self._svc.metrics.internal_errors.labels(self.phase.value).inc()
            log.exception(
                "internal error", extra={"request_id": self.request_id, "phase": self.phase.value}
            )
            return self._internal_error_reply(kind)
        return None

    async def _observe(self, message: pb.ProcessingRequest, kind: str | None) -> None:
        """The observing stream of the split layout: Envoy ignores its replies. Its first
        message claims the ticket the request-path stream handed off."""
        if self.phase is Phase.REQUEST_HEADERS:
            fields = message.metadata_context.filter_metadata.get(messages.METADATA_NAMESPACE)
            key = fields.fields.get(METADATA_KEY) if fields is not None else None
            ticket = self._svc.handoffs.claim(key.string_value) if key is not None else None
            if ticket is None:
                # Rejected or passed through: nothing to meter.
                self._handler = Handler(Phase.PASSTHROUGH)
                return
            api = METERED_APIS[ticket.request.path]
            exchange = Exchange.observing(self._svc, self._facts.snapshot, api, ticket)
            self._facts.request_id = ticket.request_id
            self._handler = ObservingHandler(self._facts, exchange, Phase.FORWARDED)
        try:
            if kind == "response_headers":
                await self._handler.on_response_headers(message.response_headers)
            elif kind == "response_body":
                await self._handler.on_response_body(message.response_body)
        except Exception:
            self._svc.metrics.internal_errors.labels("observe").inc()
            log.exception("internal error", extra={"request_id": self.request_id})

    def _internal_error_reply(self, kind: str | None) -> pb.ProcessingResponse:
        if kind in ("request_headers", "request_body") and self.ticket is None:
            return self._reject(self._errors.internal_error(), Outcome.INTERNAL_ERROR)
        # Once forwarded, never break the client's stream: pass the chunk through unchanged.
        if kind == "response_headers":
            return messages.continue_response_headers()
        if kind == "response_body":
            return messages.continue_response_body()
        if kind == "request_body":
            return pb.ProcessingResponse(request_body=pb.BodyResponse())
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse())

    async def _issued_key(
        self, key_hash: str, errors: ErrorVocabulary
    ) -> _IssuedKey | pb.ProcessingResponse | None:
        """The tenant, principal and key level of a key from the key directory; a refusal
        when it was revoked or has expired, or the directory cannot answer (never let
        through); None when the directory does not hold it."""
        keys = self._svc.keys
        assert keys is not None
        try:
            async with asyncio.timeout(self._facts.snapshot.config.server.decision_timeout_s):
                record = await keys.lookup(key_hash)
        except Exception:  # any store failure: refuse, never admit an unchecked key
            log.exception("the key directory could not be asked")
            return self._reject(
                errors.service_unavailable(retry_after_s=1), Outcome.KEY_DIRECTORY_UNAVAILABLE
            )
        if record is None:
            return None
        refusal = record.refusal(time.time())
        if refusal is KeyRefusal.REVOKED:
            return self._reject(errors.refused_api_key("revoked"), Outcome.REVOKED_API_KEY)
        if refusal is KeyRefusal.EXPIRED:
            return self._reject(errors.refused_api_key("expired"), Outcome.EXPIRED_API_KEY)
        own = (
            (compile_level(LevelKind.KEY, record.key_id, record.limits),)
            if record.limits is not None
            else ()
        )
        return _IssuedKey(record.tenant, Principal(record.team, record.user, record.key_id), own)

    def _reject(self, answer: ErrorAnswer, label: Reason | Outcome) -> pb.ProcessingResponse:
        self._handler.phase = Phase.REJECTED
        return self._facts.refusal(answer, label)

    def wants_interim(self, message: pb.ProcessingRequest) -> bool:
        """Whether this message's decision may wait in a pool's queue, so that the servicer
        must be able to send Envoy a message-timeout extension before the reply."""
        return self._handler.may_wait() and message.WhichOneof("request") == "request_body"

    async def handle_with_interim(
        self, message: pb.ProcessingRequest
    ) -> AsyncIterator[pb.ProcessingResponse]:
        """handle(), but yield the message-timeout extension first if the request queues."""
        handler = self._handler
        assert isinstance(handler, MeteredHandler)
        decide = asyncio.ensure_future(self.handle(message))
        async for reply in handler.decide_with_interim(decide):
            yield reply

    def close(self, *, shutting_down: bool) -> None:
        """The gRPC stream ended: whatever the request still holds is settled."""
        self._handler.close(shutting_down=shutting_down)

    # ------------------------------------------------------------------ request headers

    async def _on_request_headers(
        self, http: pb.HttpHeaders, message: pb.ProcessingRequest
    ) -> pb.ProcessingResponse:
        facts = self._facts
        headers = messages.header_map_to_dict(http.headers)
        facts.request_id = headers.get("x-request-id", "")
        tracing = self._svc.settler.tracing
        trace_parent = tracing.extract(headers) if tracing is not None else None
        self._path = _path_only(headers.get(":path", ""))
        api = METERED_APIS.get(self._path)
        counting = PROMPT_COUNT_APIS.get(self._path)
        unmetered = UNMETERED_APIS.get(self._path)
        known = api or counting or unmetered
        errors = self._errors = known.errors if known is not None else DEFAULT_ERRORS
        # Methods are case-sensitive (RFC 9110 9.1): "post" is not POST, and vLLM says 405.
        method = headers.get(":method", "")
        # Clients must not be able to forge the headers Envoy routes and logs on.
        forged = [name for name in headers if name.startswith(HEADER_PREFIX)]
        route = facts.route
        snapshot = facts.snapshot
        if isinstance(route, RouteSettingsError):
            # Fail closed: settings kvgate cannot read must not be silently ignored.
            log.error("unusable per-route settings from Envoy: %s", route)
            return self._reject(errors.route_misconfigured(route.key), Outcome.ROUTE_MISCONFIGURED)

        key = _api_key(headers, route.key_header)
        # The tenant's credentials never go upstream, wherever the route says they are.
        credentials = (
            (*CREDENTIAL_HEADERS, route.key_header) if route.key_header else CREDENTIAL_HEADERS
        )
        try:
            caller = mesh_caller(
                message, snapshot.config.identity, snapshot.tenants, key, route.identity_sources
            )
        except IdentityRefused as refused:
            log.info("identity refused: %s", refused, extra={"request_id": facts.request_id})
            return self._reject(errors.unknown_identity(), Outcome.UNKNOWN_IDENTITY)
        levels: tuple[Level, ...] = ()
        if caller is not None:
            tenant: str | None = caller.tenant
            facts.identity_source = caller.source
            facts.principal = Principal(team=caller.team, user=caller.user)
        elif key is None:
            return self._reject(errors.missing_api_key(route.key_header), Outcome.MISSING_API_KEY)
        else:
            key_hash = hash_api_key(key)
            tenant = snapshot.tenants_by_key_hash.get(key_hash)
            if tenant is None and self._svc.keys is not None:
                found = await self._issued_key(key_hash, errors)
                if isinstance(found, pb.ProcessingResponse):
                    return found
                if found is not None:
                    tenant, facts.principal = found.tenant, found.principal
                    levels = found.levels
        if tenant is None or tenant not in snapshot.tenants:
            return self._reject(errors.invalid_api_key(), Outcome.INVALID_API_KEY)
        facts.tenant = tenant
        principal = facts.principal
        levels = (*snapshot.levels(tenant, principal.team, principal.user), *levels)
        policy = snapshot.tenants[tenant].with_levels(levels)
        if route.shadow:
            # The operator's route trials the tenant's limits: decided and counted in
            # kvgate_shadow_rejections_total, never enforced (the KV budget still is).
            policy = shadowed(policy)
        if route.backend is not None and route.backend not in snapshot.backends:
            log.error("route names backend %r, which kvgate's config does not have", route.backend)
            return self._reject(
                errors.route_misconfigured(BACKEND_KEY), Outcome.ROUTE_MISCONFIGURED
            )
        if not route.allows_tenant(tenant):
            return self._reject(
                errors.tenant_not_allowed_on_route(), Outcome.TENANT_NOT_ALLOWED_ON_ROUTE
            )

        if self._path == USAGE_PATH:
            return await self._usage_report(method, tenant, policy.levels)
        if self._path in PASSTHROUGH_PATHS or self._path.startswith("/v1/models/"):
            if method not in ("GET", "HEAD"):
                return self._reject(
                    errors.method_not_allowed(method, self._path), Outcome.INVALID_REQUEST
                )
            self._handler = Handler(Phase.PASSTHROUGH)
            self._svc.metrics.requests.labels("passthrough", Outcome.PASSTHROUGH.value).inc()
            reply = messages.continue_request_headers(
                {"x-kvgate-tenant": tenant}, [*forged, *credentials], skip_rest=True
            )
            reply.dynamic_metadata.CopyFrom(messages.metadata(facts.metadata("passthrough")))
            return reply
        if known is None:
            return self._reject(errors.unsupported_path(self._path), Outcome.UNSUPPORTED_PATH)
        if method != "POST":
            return self._reject(
                errors.method_not_allowed(method, self._path), Outcome.INVALID_REQUEST
            )
        if http.end_of_stream:
            return self._reject(
                errors.invalid_request("The request body is empty; expected JSON."),
                Outcome.INVALID_REQUEST,
            )
        if not _json_content_type(headers.get("content-type")):
            # The engine reads only JSON bodies (none given: JSON too); anything else it
            # refuses after kvgate would have reserved for it.
            return self._reject(
                errors.invalid_request(
                    "The request body must be JSON: send content-type: application/json.",
                    "content-type",
                ),
                Outcome.INVALID_REQUEST,
            )
        if self._request_body_mode != _Mode.BUFFERED:
            # With STREAMED or partial bodies the first body message is not the whole body:
            # admitting on it would let the rest through unmetered. A deployment error.
            log.error("ext_proc request_body_mode must be BUFFERED for metered paths")
            return self._reject(
                errors.internal_error("kvgate is misconfigured: it cannot meter this request."),
                Outcome.INTERNAL_ERROR,
            )
        settings = route if isinstance(route, RouteSettings) else NO_ROUTE_SETTINGS
        scope = RouteScope(backend=settings.backend, models=settings.models)
        if unmetered is not None:
            forward = UnmeteredForward(
                self._svc,
                snapshot,
                unmetered,
                policy,
                admission_id=_admission_id(facts.request_id),
                route=scope,
            )
            self._handler = UnmeteredHandler(facts, forward)
            return messages.continue_request_headers(
                {"x-kvgate-tenant": tenant}, [*forged, *credentials]
            )
        if counting is not None:
            count = PromptCount(
                self._svc,
                snapshot,
                counting,
                policy,
                admission_id=_admission_id(facts.request_id),
                route=scope,
            )
            self._handler = CountingHandler(facts, count)
            return messages.continue_request_headers(
                {"x-kvgate-tenant": tenant}, [*forged, *credentials]
            )
        assert api is not None
        priority = self._requested_priority(headers, tenant)
        if not isinstance(priority, int):
            return self._reject(priority, Outcome.INVALID_REQUEST)
        idempotency_key = headers.get(IDEMPOTENCY_HEADER)
        if idempotency_key is not None and snapshot.config.idempotency.enabled:
            idempotency_key = idempotency_key.strip(_OWS)
            if not (
                1 <= len(idempotency_key) <= 255
                and idempotency_key.isascii()
                and idempotency_key.isprintable()
            ):
                return self._reject(
                    errors.invalid_request(
                        "The Idempotency-Key header must be 1 to 255 printable ASCII characters.",
                        IDEMPOTENCY_HEADER_NAME,
                        "invalid_value",
                    ),
                    Outcome.INVALID_REQUEST,
                )
        else:
            idempotency_key = None
        exchange = Exchange(
            self._svc,
            snapshot,
            api,
            policy,
            request_id=facts.request_id,
            admission_id=_admission_id(facts.request_id),
            priority=priority,
            idempotency_key=idempotency_key,
            route=scope,
            sees_answer=not self._answer_seen_elsewhere,
            on_wait=lambda wait_s: handler.extend_message_timeout(wait_s),
            principal=facts.principal,
        )
        handler = MeteredHandler(
            facts,
            exchange,
            may_wait=bool(snapshot.queued_pools) or idempotency_key is not None,
            answer_seen_elsewhere=self._answer_seen_elsewhere,
            trace_parent=trace_parent,
        )
        self._handler = handler
        return messages.continue_request_headers(
            {"x-kvgate-tenant": tenant}, [*forged, *credentials]
        )

    def _requested_priority(self, headers: dict[str, str], tenant: str) -> int | ErrorAnswer:
        """The request's class in a pool's queue: the tenant's own, or one of the classes
        the operator allows it to ask for with the kvgate-priority header."""
        own, allowed = self._facts.snapshot.priorities.get(tenant, (0, frozenset()))
        route = self._facts.route
        if isinstance(route, RouteSettings) and route.priority is not None:
            # The operator's route says which class its requests are: the route's class
            # replaces the tenant's own (the header may still ask for an allowed one).
            own = route.priority
        asked = headers.get(PRIORITY_HEADER)
        if asked is None:
            return own
        choices = ", ".join(str(p) for p in sorted({own, *allowed}))
        asked_class = parse_priority_class(asked.strip(_OWS))
        if asked_class is None:
            return self._errors.invalid_request(
                f"The {PRIORITY_HEADER} header must be a whole number written with the "
                f"digits 0-9 and an optional leading '-' (allowed for this key: {choices}).",
                PRIORITY_HEADER,
                "invalid_value",
            )
        if asked_class in allowed or asked_class == own:
            return asked_class
        return self._errors.invalid_request(
            f"The {PRIORITY_HEADER} header asks for a priority class this key may not use "
            f"(allowed: {choices}).",
            PRIORITY_HEADER,
            "invalid_value",
        )

    async def _usage_report(
        self, method: str, tenant: str, levels: tuple[Level, ...]
    ) -> pb.ProcessingResponse:
        if method not in ("GET", "HEAD"):
            return self._reject(
                self._errors.method_not_allowed(method, self._path, ("GET", "HEAD")),
                Outcome.INVALID_REQUEST,
            )
        self._handler = Handler(Phase.PASSTHROUGH)
        self._svc.metrics.requests.labels("answered", Outcome.USAGE_REPORT.value).inc()
        try:
            report = await tenant_usage_report(
                self._svc.store, self._svc.clock, self._facts.snapshot, tenant, levels
            )
        except StoreUnavailable as exc:
            return self._reject(
                self._errors.service_unavailable(
                    "Usage is unavailable while kvgate cannot reach its state store.",
                    retry_after_s=exc.retry_after_s,
                ),
                Reason.STORE_UNAVAILABLE,
            )
        return messages.immediate_response(
            200, json.dumps(report, separators=(",", ":")).encode(), details="kvgate_usage"
        )
