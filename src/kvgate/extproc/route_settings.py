"""Per-route kvgate settings, said by Envoy's route configuration.

A route (or virtual host) configures them in its ext_proc per-route override, as gRPC
initial metadata of the stream Envoy opens to kvgate:

    typed_per_filter_config:
      envoy.filters.http.ext_proc:
        "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute
        overrides:
          grpc_initial_metadata:
            - { key: x-kvgate-route, value: team-a }
            - { key: x-kvgate-route-models, value: "qwen2.5-demo, small-model" }
            - { key: x-kvgate-route-tenants, value: team-a }
            - { key: x-kvgate-route-priority, value: "10" }  # class in a pool's queue
            - { key: x-kvgate-route-backend, value: batch-pool }  # instead of the model's
            - { key: x-kvgate-route-shadow, value: "true" }  # tenant limits not enforced
            - { key: x-kvgate-route-key-header, value: api-key }  # where the key is
            - { key: x-kvgate-route-identity-sources, value: "jwt, spiffe" }  # mesh only

Envoy merges the override of the route a request first matches (before kvgate's decision
re-routes it), so the settings belong on the routes that match requests on their way in.
Only the operator's Envoy configuration can set them: a client cannot reach the gRPC
metadata. Anything kvgate cannot read is a configuration error, answered 500
``route_misconfigured`` naming the key (fail closed), never ignored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from kvgate.extproc.identity import IDENTITY_SOURCES

PREFIX = "x-kvgate-route"
NAME_KEY = PREFIX
MODELS_KEY = f"{PREFIX}-models"
TENANTS_KEY = f"{PREFIX}-tenants"
# The priority class of the route's requests in a pool's queue (instead of the tenant's).
PRIORITY_KEY = f"{PREFIX}-priority"
# The backend (or pool) that serves the route's requests for the model they name, instead
# of the model's own (e.g. a batch route on its own pool of replicas).
BACKEND_KEY = f"{PREFIX}-backend"
# "true": the tenant's limits (RPM, TPM, concurrency, budgets) are decided and recorded on
# this route but not enforced; the KV budget always is.
SHADOW_KEY = f"{PREFIX}-shadow"
# The request header that carries the tenant's API key on this route (e.g. `api-key` for
# clients written for Azure OpenAI), instead of Authorization / x-api-key. kvgate removes
# it before the request goes upstream, so it must be in the ext_proc filter's
# mutation_rules allow-list; with disallow_is_error (the shipped configs) a header outside
# it fails the request closed instead of leaking the key.
KEY_HEADER_KEY = f"{PREFIX}-key-header"
# The identity sources the route accepts (jwt, ext_authz, api_key, spiffe; default: every
# one kvgate's config has), e.g. only the mesh's on an internal route. A credential of
# another source refuses the request (identity.mesh_caller).
IDENTITY_SOURCES_KEY = f"{PREFIX}-identity-sources"
KNOWN_KEYS = frozenset(
    {
        NAME_KEY,
        MODELS_KEY,
        TENANTS_KEY,
        PRIORITY_KEY,
        BACKEND_KEY,
        SHADOW_KEY,
        KEY_HEADER_KEY,
        IDENTITY_SOURCES_KEY,
    }
)
# A lowercase HTTP field name; not a pseudo-header, not one Envoy or kvgate owns, not one
# that routes or frames the message.
_HEADER = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
_NOT_KEY_PREFIXES = ("x-envoy-", "x-kvgate-", "content-")
_NOT_KEY_NAMES = frozenset(
    {"host", "te", "connection", "keep-alive", "transfer-encoding", "upgrade", "trailer"}
)
_PRIORITY = re.compile(r"^-?[0-9]{1,3}$")
# Backend names are Envoy cluster names (config.model.BackendConfig).
_BACKEND = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# The same shape as names in kvgate's config (models, tenants).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
_MAX_LIST = 256


class RouteSettingsError(ValueError):
    """Envoy sent route settings kvgate cannot use: a deployment error."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"route setting {key!r}: {reason}")
        self.key = key
        self.reason = reason


@dataclass(frozen=True)
class RouteSettings:
    """What a route allows; None = no restriction from the route."""

    name: str = ""
    models: frozenset[str] | None = None
    tenants: frozenset[str] | None = None
    priority: int | None = None
    backend: str | None = None
    shadow: bool = False
    key_header: str | None = None
    # None: every identity source kvgate's config has.
    identity_sources: frozenset[str] | None = None

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models

    def allows_tenant(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


NO_ROUTE_SETTINGS = RouteSettings()


def parse_route_settings(metadata: Iterable[tuple[str, str | bytes]]) -> RouteSettings:
    """The settings among a stream's gRPC metadata (other keys, e.g. gRPC's own, are not
    kvgate's business). Raises ``RouteSettingsError`` for an unknown ``x-kvgate-route-*``
    key, a repeated key, or a value that is not a name or a list of names."""
    seen: dict[str, str] = {}
    for raw_key, raw_value in metadata:
        key = raw_key.lower()
        if not key.startswith(PREFIX):
            continue
        if key not in KNOWN_KEYS:
            known = ", ".join(sorted(KNOWN_KEYS))
            raise RouteSettingsError(key, f"unknown setting (known: {known})")
        if key in seen:
            raise RouteSettingsError(key, "given more than once")
        value = raw_value.decode("utf-8", "replace") if isinstance(raw_value, bytes) else raw_value
        seen[key] = value
    name = seen.get(NAME_KEY, "").strip()
    if NAME_KEY in seen and not _NAME.match(name):
        raise RouteSettingsError(NAME_KEY, "must be a name of letters, digits and . _ : / -")
    return RouteSettings(
        name=name,
        models=_names(MODELS_KEY, seen.get(MODELS_KEY)),
        tenants=_names(TENANTS_KEY, seen.get(TENANTS_KEY)),
        priority=_priority(seen.get(PRIORITY_KEY)),
        backend=_backend(seen.get(BACKEND_KEY)),
        shadow=_flag(SHADOW_KEY, seen.get(SHADOW_KEY)),
        key_header=_key_header(seen.get(KEY_HEADER_KEY)),
        identity_sources=_identity_sources(seen.get(IDENTITY_SOURCES_KEY)),
    )


def _identity_sources(value: str | None) -> frozenset[str] | None:
    if value is None:
        return None
    names = [part.strip() for part in value.split(",")]
    if any(name not in IDENTITY_SOURCES for name in names):
        known = ", ".join(sorted(IDENTITY_SOURCES))
        raise RouteSettingsError(IDENTITY_SOURCES_KEY, f"must be a comma-separated list of {known}")
    return frozenset(names)


def _key_header(value: str | None) -> str | None:
    if value is None:
        return None
    name = value.strip()
    if not _HEADER.match(name) or name.startswith(_NOT_KEY_PREFIXES) or name in _NOT_KEY_NAMES:
        raise RouteSettingsError(
            KEY_HEADER_KEY,
            "must be a lowercase header name that is not Envoy's, kvgate's or a connection "
            "or content header",
        )
    return name


def _backend(value: str | None) -> str | None:
    if value is None:
        return None
    name = value.strip()
    if not _BACKEND.match(name):
        raise RouteSettingsError(BACKEND_KEY, "must be a backend name (letters, digits, . _ -)")
    return name


def _flag(key: str, value: str | None) -> bool:
    if value is None:
        return False
    text = value.strip().lower()
    if text not in ("true", "false"):
        raise RouteSettingsError(key, 'must be "true" or "false"')
    return text == "true"


def _priority(value: str | None) -> int | None:
    if value is None:
        return None
    text = value.strip()
    if not _PRIORITY.match(text) or not -100 <= int(text) <= 100:
        raise RouteSettingsError(PRIORITY_KEY, "must be an integer from -100 to 100")
    return int(text)


def _names(key: str, value: str | None) -> frozenset[str] | None:
    if value is None:
        return None
    names = [part.strip() for part in value.split(",")]
    if not names or any(not _NAME.match(name) for name in names):
        raise RouteSettingsError(key, "must be a comma-separated list of names")
    if len(names) > _MAX_LIST:
        raise RouteSettingsError(key, f"lists at most {_MAX_LIST} names")
    return frozenset(names)
