"""Who is calling, from what the mesh already verified: a JWT Envoy's jwt_authn filter
checked (its payload in the filter's dynamic metadata, forwarded to kvgate by the ext_proc
filter's ``metadata_options.forwarding_namespaces``), or the mTLS peer certificate's SPIFFE
ID (Envoy's ``connection.uri_san_peer_certificate`` attribute, sent with
``request_attributes``).

Both come from Envoy, never from a request header: a client cannot forge them (a header
named like a JWT payload is only a header). The order is fixed: a verified token, then an
API key, then the connection's SPIFFE ID (a per-request credential beats the connection's
identity, and the token's own Authorization header is not read as an API key). A source
that is present but names no tenant of this config refuses the request (401) instead of
falling through to a weaker one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format, struct_pb2

from kvgate.config.model import IdentityConfig, JwtIdentityConfig, SpiffeIdentityConfig

# The attribute Envoy fills with the peer certificate's URI SANs (ext_proc request_attributes).
PEER_URI_SAN_ATTRIBUTE = "connection.uri_san_peer_certificate"


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    # The user (a token's user claim), when the source names one.
    user: str | None
    # "jwt" or "spiffe": how the caller was identified (the access log says).
    source: str


class IdentityRefused(Exception):
    """A source was present and named no tenant: why, for kvgate's log (the client's 401
    never says which tenants exist)."""


def _struct_value(value: struct_pb2.Value) -> Any:
    return json_format.MessageToDict(value)


def token_payload(message: pb.ProcessingRequest, jwt: JwtIdentityConfig) -> dict[str, Any] | None:
    """The verified token's payload, when jwt_authn put one in its metadata."""
    namespace = message.metadata_context.filter_metadata.get(jwt.metadata_namespace)
    if namespace is None or jwt.payload_key not in namespace.fields:
        return None
    payload = _struct_value(namespace.fields[jwt.payload_key])
    return payload if isinstance(payload, dict) else None


def peer_spiffe_id(message: pb.ProcessingRequest) -> str | None:
    """The mTLS peer certificate's SPIFFE ID (its first spiffe:// URI SAN), when Envoy sent
    the connection attribute."""
    for attributes in message.attributes.values():
        value = attributes.fields.get(PEER_URI_SAN_ATTRIBUTE)
        if value is None:
            continue
        sans = _struct_value(value)
        for san in sans if isinstance(sans, list) else [sans]:
            if isinstance(san, str) and san.startswith("spiffe://"):
                return san
    return None


def _claim(payload: dict[str, Any], path: str) -> Any:
    """A claim by name, or by a dotted path into nested claims (``org.team``)."""
    if path in payload:
        return payload[path]
    value: Any = payload
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def caller_from_token(
    payload: dict[str, Any], jwt: JwtIdentityConfig, tenants: Mapping[str, Any]
) -> Caller:
    """The caller a verified token names; ``IdentityRefused`` when it names none."""
    if jwt.issuers and payload.get("iss") not in jwt.issuers:
        raise IdentityRefused(f"token issuer {payload.get('iss')!r} is not accepted")
    tenant = _claim(payload, jwt.tenant_claim)
    if not isinstance(tenant, str) or tenant not in tenants:
        raise IdentityRefused(f"token claim {jwt.tenant_claim!r} names no tenant")
    user = _claim(payload, jwt.user_claim) if jwt.user_claim else None
    return Caller(tenant=tenant, user=user if isinstance(user, str) else None, source="jwt")


def caller_from_spiffe(spiffe_id: str, spiffe: SpiffeIdentityConfig) -> Caller:
    tenant = spiffe.tenants.get(spiffe_id)
    if tenant is None:
        raise IdentityRefused(f"SPIFFE ID {spiffe_id!r} names no tenant")
    return Caller(tenant=tenant, user=None, source="spiffe")


def mesh_caller(
    message: pb.ProcessingRequest,
    identity: IdentityConfig,
    tenants: Mapping[str, Any],
    api_key: str | None,
) -> Caller | None:
    """The caller the mesh identified, in kvgate's order (a verified token, then an API key,
    then the connection's SPIFFE ID); None when the API key decides (or nothing does).
    ``IdentityRefused`` when a source that decides names no tenant."""
    if identity.jwt is not None:
        payload = token_payload(message, identity.jwt)
        if payload is not None:
            return caller_from_token(payload, identity.jwt, tenants)
    if api_key is not None or identity.spiffe is None:
        return None
    spiffe_id = peer_spiffe_id(message)
    return caller_from_spiffe(spiffe_id, identity.spiffe) if spiffe_id is not None else None
