"""Who is calling, from what the mesh already verified: a JWT Envoy's jwt_authn filter
checked (its payload in the filter's dynamic metadata, forwarded to kvgate by the ext_proc
filter's ``metadata_options.forwarding_namespaces``), the identity an ext_authz server
returned with its OK (the ``dynamic_metadata`` of its CheckResponse, in the ext_authz
filter's namespace, forwarded the same way), or the mTLS peer certificate's SPIFFE ID
(Envoy's ``connection.uri_san_peer_certificate`` attribute, sent with
``request_attributes``).

All come from Envoy, never from a request header: a client cannot forge them (a header
named like a JWT payload is only a header). The order is fixed: a verified token, then the
ext_authz server's identity, then an API key, then the connection's SPIFFE ID (a
per-request credential beats the connection's identity, and the token's own Authorization
header is not read as an API key). A source that is present but names no tenant of this
config refuses the request (401) instead of falling through to a weaker one.

A route may accept only some sources (``x-kvgate-route-identity-sources``): a per-request
credential it does not accept (a token, an ext_authz identity, an API key) refuses the
request rather than being ignored, so a caller is never charged as someone else; the
connection's SPIFFE ID, which every mTLS client has, is then only not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format, struct_pb2

from kvgate.config.model import (
    ExtAuthzIdentityConfig,
    IdentityConfig,
    JwtIdentityConfig,
    SpiffeIdentityConfig,
)

# The attribute Envoy fills with the peer certificate's URI SANs (ext_proc request_attributes).
PEER_URI_SAN_ATTRIBUTE = "connection.uri_san_peer_certificate"

# The identity sources, as a route names them (route_settings.IDENTITY_SOURCES_KEY).
JWT = "jwt"
EXT_AUTHZ = "ext_authz"
API_KEY = "api_key"
SPIFFE = "spiffe"
IDENTITY_SOURCES = frozenset({JWT, EXT_AUTHZ, API_KEY, SPIFFE})


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    # The user (a token's user claim), when the source names one.
    user: str | None
    # "jwt", "ext_authz" or "spiffe": how the caller was identified (the access log says).
    source: str
    # The team under the tenant (tenants[].teams), when the source names one.
    team: str | None = None


class IdentityRefused(Exception):
    """A source was present and named no tenant, or the route does not accept the caller's
    credential: why, for kvgate's log (the client's 401 never says which tenants exist)."""


class SourceNotAccepted(IdentityRefused):
    """The request carries a credential (a token, an ext_authz identity, an API key) of a
    source its route does not accept, or no credential the route accepts."""


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


# A user's or team's name becomes a limit scope (its own buckets, its own ledger) and a
# field of every record: a claim longer than this, or holding a NUL, names nobody.
MAX_NAME_CHARS = 256


def _level_name(value: Any, what: str) -> str | None:
    """A user or team name from a claim: None when absent or not a string; refused when it
    is too long or holds a NUL (``IdentityRefused``)."""
    if not isinstance(value, str):
        return None
    if len(value) > MAX_NAME_CHARS or "\x00" in value:
        raise IdentityRefused(f"the {what} is longer than {MAX_NAME_CHARS} characters or has a NUL")
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
    team = _claim(payload, jwt.team_claim) if jwt.team_claim else None
    return Caller(
        tenant=tenant,
        user=_level_name(user, "user claim"),
        source=JWT,
        team=_level_name(team, "team claim"),
    )


def ext_authz_identity(
    message: pb.ProcessingRequest, ext_authz: ExtAuthzIdentityConfig
) -> dict[str, Any] | None:
    """What the ext_authz server said about the caller, when it named a tenant at all (its
    metadata may carry other keys for other filters: those alone are no identity)."""
    namespace = message.metadata_context.filter_metadata.get(ext_authz.metadata_namespace)
    if namespace is None or ext_authz.tenant_key not in namespace.fields:
        return None
    return {name: _struct_value(value) for name, value in namespace.fields.items()}


def caller_from_ext_authz(
    metadata: dict[str, Any], ext_authz: ExtAuthzIdentityConfig, tenants: Mapping[str, Any]
) -> Caller:
    """The caller an ext_authz server named; ``IdentityRefused`` when it names no tenant."""
    tenant = metadata.get(ext_authz.tenant_key)
    if not isinstance(tenant, str) or tenant not in tenants:
        raise IdentityRefused(f"ext_authz metadata {ext_authz.tenant_key!r} names no tenant")
    user = metadata.get(ext_authz.user_key) if ext_authz.user_key else None
    team = metadata.get(ext_authz.team_key) if ext_authz.team_key else None
    return Caller(
        tenant=tenant,
        user=_level_name(user, "ext_authz user"),
        source=EXT_AUTHZ,
        team=_level_name(team, "ext_authz team"),
    )


def caller_from_spiffe(spiffe_id: str, spiffe: SpiffeIdentityConfig) -> Caller:
    tenant = spiffe.tenants.get(spiffe_id)
    if tenant is None:
        raise IdentityRefused(f"SPIFFE ID {spiffe_id!r} names no tenant")
    return Caller(tenant=tenant, user=None, source=SPIFFE)


def mesh_caller(
    message: pb.ProcessingRequest,
    identity: IdentityConfig,
    tenants: Mapping[str, Any],
    api_key: str | None,
    sources: frozenset[str] | None = None,
) -> Caller | None:
    """The caller the mesh identified, in kvgate's order (a verified token, then an
    ext_authz server's identity, then an API key, then the connection's SPIFFE ID); None
    when the API key decides (or nothing does, and the route accepts API keys).

    ``sources``: the route's accepted sources (None: every configured one). Raises
    ``IdentityRefused`` when a source that decides names no tenant, and its subclass
    ``SourceNotAccepted`` when the request carries a credential the route does not accept
    or nothing the route accepts; both are 401 ``unknown_identity``."""

    def accepts(source: str) -> bool:
        return sources is None or source in sources

    if identity.jwt is not None:
        payload = token_payload(message, identity.jwt)
        if payload is not None:
            if not accepts(JWT):
                raise SourceNotAccepted("the route does not accept verified tokens")
            return caller_from_token(payload, identity.jwt, tenants)
    if identity.ext_authz is not None:
        metadata = ext_authz_identity(message, identity.ext_authz)
        if metadata is not None:
            if not accepts(EXT_AUTHZ):
                raise SourceNotAccepted("the route does not accept ext_authz identities")
            return caller_from_ext_authz(metadata, identity.ext_authz, tenants)
    if api_key is not None:
        if not accepts(API_KEY):
            raise SourceNotAccepted("the route does not accept API keys")
        return None
    if identity.spiffe is not None and accepts(SPIFFE):
        spiffe_id = peer_spiffe_id(message)
        if spiffe_id is not None:
            return caller_from_spiffe(spiffe_id, identity.spiffe)
    if not accepts(API_KEY):
        # Nothing this route accepts: not "no API key", which the route would not take.
        raise SourceNotAccepted("no identity the route accepts")
    return None
