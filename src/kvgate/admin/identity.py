"""Which verified client certificates a mutual TLS listener accepts (`allowed_clients`).

The handshake proves a client holds a certificate the client CA signed; with an allow-list,
the certificate must also name one of the listed identities: a URI SAN (a SPIFFE ID), a DNS SAN
or the subject's common name. One match suffices. A CA that signs certificates for many
workloads (a cluster or mesh CA) then still lets in only the operators, or only Envoy.

The decision is made per call (admin gRPC), per request (/admin/usage over HTTPS) or per
stream (ext_proc), from the peer certificate the TLS layer verified, and the list is read from
the current configuration each time: a reload revokes an identity without a restart. A refusal
is PERMISSION_DENIED / 403 naming what the certificate presented, logged and counted in
kvgate_client_certificates_refused_total{listener}.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import grpc
from aiohttp import web

from kvgate.config.model import ClientIdentitiesConfig, ServerConfig
from kvgate.metrics import Metrics
from kvgate.openai.errors import INVALID_REQUEST_ERROR, ApiError

log = logging.getLogger("kvgate.admin.identity")

REFUSED_CODE = "client_certificate_not_allowed"
AllowList = Callable[[], ClientIdentitiesConfig | None]


@dataclass(frozen=True)
class PeerIdentity:
    """What a verified client certificate says about its holder."""

    uri_sans: tuple[str, ...] = ()
    dns_sans: tuple[str, ...] = ()
    common_name: str | None = None

    def describe(self) -> str:
        parts = [f"URI:{u}" for u in self.uri_sans] + [f"DNS:{d}" for d in self.dns_sans]
        if self.common_name is not None:
            parts.append(f"CN={self.common_name}")
        return ", ".join(parts) or "no SAN and no common name"


def identity_from_auth_context(auth_context: Mapping[str, Iterable[bytes]]) -> PeerIdentity | None:
    """The identity in a gRPC call's auth context; None without a client certificate."""
    if not auth_context.get("x509_pem_cert"):
        return None

    def values(key: str) -> tuple[str, ...]:
        return tuple(v.decode("utf-8", "replace") for v in auth_context.get(key, ()))

    names = values("x509_common_name")
    return PeerIdentity(values("peer_uri"), values("peer_dns"), names[0] if names else None)


def identity_from_peercert(peercert: Mapping[str, Any] | None) -> PeerIdentity | None:
    """The identity in `SSLObject.getpeercert()`; None without a client certificate."""
    if not peercert:
        return None
    sans = peercert.get("subjectAltName", ())
    common_name = next(
        (value for rdn in peercert.get("subject", ()) for key, value in rdn if key == "commonName"),
        None,
    )
    return PeerIdentity(
        tuple(value for kind, value in sans if kind == "URI"),
        tuple(value for kind, value in sans if kind == "DNS"),
        common_name,
    )


def is_allowed(allowed: ClientIdentitiesConfig | None, identity: PeerIdentity) -> bool:
    if allowed is None:
        return True  # any certificate the client CA signed
    return (
        any(uri in allowed.uri_sans for uri in identity.uri_sans)
        or any(dns.lower() in allowed.dns_sans for dns in identity.dns_sans)
        or (identity.common_name is not None and identity.common_name in allowed.common_names)
    )


class ClientIdentityGate:
    """One listener's allow-list check: `refusal()` is None when the certificate may pass."""

    def __init__(
        self, listener: str, field: str, allowed: AllowList, on_refused: Callable[[], None]
    ) -> None:
        self.listener = listener  # the metric label: admin, operator_https, grpc
        self.field = field  # e.g. server.operator_tls.allowed_clients
        self._allowed = allowed
        self._on_refused = on_refused

    def enforcing(self) -> bool:
        """Whether an allow-list is configured now (else the handshake alone decides)."""
        return self._allowed() is not None

    def refusal(self, identity: PeerIdentity | None) -> str | None:
        allowed = self._allowed()
        if allowed is None:
            return None
        if identity is not None and is_allowed(allowed, identity):
            return None
        presented = identity.describe() if identity is not None else "no client certificate"
        self._on_refused()
        log.warning(
            "client certificate refused: not in the allow-list",
            extra={"listener": self.listener, "presented": presented, "setting": self.field},
        )
        return (
            f"The client certificate ({presented}) is signed by the trusted CA but is not one "
            f"of the identities in {self.field}."
        )


def identity_gate(
    listener: str,
    section: Literal["operator_tls", "grpc_tls"],
    server: Callable[[], ServerConfig],
    metrics: Metrics,
) -> ClientIdentityGate:
    """The gate of a listener whose allow-list is `server.<section>.allowed_clients` in the
    configuration `server()` returns now (the current snapshot's: follows reloads)."""

    def allowed() -> ClientIdentitiesConfig | None:
        tls = getattr(server(), section)
        return tls.allowed_clients if tls is not None else None

    return ClientIdentityGate(
        listener,
        f"server.{section}.allowed_clients",
        allowed,
        metrics.client_certificates_refused.labels(listener).inc,
    )


class CertificateIdentityInterceptor(grpc.aio.ServerInterceptor):
    """Checks the caller's certificate against the allow-list on every call of the methods
    under `method_prefixes`; other services on the port (health, reflection) need only the
    handshake. The check runs when the call starts, before its handler reads anything."""

    def __init__(self, gate: ClientIdentityGate, method_prefixes: Sequence[str]) -> None:
        self._gate = gate
        self._prefixes = tuple(method_prefixes)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefixes):
            return handler
        return _checked_handler(handler, self._gate)


# typeshed types a method handler's behaviours as the sync server's; under grpc.aio they are
# coroutine functions (one response) or async generator functions (streamed responses), called
# with the aio context.
_AioUnary = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Any]]
_AioStreaming = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]


def _checked_handler(
    handler: grpc.RpcMethodHandler[Any, Any], gate: ClientIdentityGate
) -> grpc.RpcMethodHandler[Any, Any]:
    async def admit(context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if not gate.enforcing():
            return  # no list: skip reading the peer's certificate on every stream
        refusal = gate.refusal(identity_from_auth_context(context.auth_context()))
        if refusal is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)

    deserializer, serializer = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        inner_uu = cast(_AioUnary, handler.unary_unary)

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await admit(context)
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserializer, serializer)
    if handler.unary_stream:
        inner_us = cast(_AioStreaming, handler.unary_stream)

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await admit(context)
            async for response in inner_us(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserializer, serializer)
    if handler.stream_unary:
        inner_su = cast(_AioUnary, handler.stream_unary)

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await admit(context)
            return await inner_su(requests, context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, deserializer, serializer)
    inner_ss = cast(_AioStreaming, handler.stream_stream)  # the only kind left

    async def stream_stream(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await admit(context)
        async for response in inner_ss(requests, context):
            yield response

    return grpc.stream_stream_rpc_method_handler(stream_stream, deserializer, serializer)


def https_identity_middleware(gate: ClientIdentityGate) -> Any:
    """For the operator HTTPS app: 403 (OpenAI error shape) for a certificate off the list,
    before any handler runs."""

    @web.middleware
    async def check_identity(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        transport = request.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        peercert = ssl_object.getpeercert() if ssl_object is not None else None
        refusal = gate.refusal(identity_from_peercert(peercert))
        if refusal is not None:
            denial = ApiError(403, refusal, INVALID_REQUEST_ERROR, REFUSED_CODE)
            return web.json_response(denial.to_dict(), status=denial.status)
        return await handler(request)

    return check_identity
