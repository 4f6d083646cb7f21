"""Identity sources: an ext_authz server's identity (its CheckResponse dynamic_metadata, in
the ext_authz filter's namespace), kvgate's order (token, ext_authz, API key, SPIFFE), and a
route accepting only some sources (x-kvgate-route-identity-sources)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import json_format, struct_pb2

from kvgate.config import ConfigError, parse_config
from kvgate.config.model import (
    ExtAuthzIdentityConfig,
    IdentityConfig,
    JwtIdentityConfig,
    SpiffeIdentityConfig,
)
from kvgate.extproc.identity import (
    PEER_URI_SAN_ATTRIBUTE,
    Caller,
    IdentityRefused,
    SourceNotAccepted,
    mesh_caller,
)
from kvgate.extproc.route_settings import (
    IDENTITY_SOURCES_KEY,
    RouteSettingsError,
    parse_route_settings,
)

DEMO = Path(__file__).resolve().parents[2] / "deploy/local/kvgate.yaml"
JWT_NS = "envoy.filters.http.jwt_authn"
EXT_AUTHZ_NS = "envoy.filters.http.ext_authz"
AGENT = "spiffe://cluster.local/ns/agents/sa/coder"
TENANTS = {"team-a": object(), "team-b": object(), "team-c": object()}
EVERY_SOURCE = IdentityConfig(
    jwt=JwtIdentityConfig(payload_key="payload", team_claim="team"),
    ext_authz=ExtAuthzIdentityConfig(team_key="team"),
    spiffe=SpiffeIdentityConfig(tenants={AGENT: "team-c"}),
)


def request(
    *,
    token: dict[str, Any] | None = None,
    ext_authz: dict[str, Any] | None = None,
    spiffe: str | None = None,
) -> pb.ProcessingRequest:
    """A request-headers message as Envoy sends it, with the filters' metadata forwarded."""
    message = pb.ProcessingRequest()
    if token is not None:
        payload = struct_pb2.Value()
        json_format.ParseDict(token, payload)
        message.metadata_context.filter_metadata[JWT_NS].fields["payload"].CopyFrom(payload)
    if ext_authz is not None:
        json_format.ParseDict(ext_authz, message.metadata_context.filter_metadata[EXT_AUTHZ_NS])
    if spiffe is not None:
        attributes = message.attributes["envoy.filters.http.ext_proc"]
        attributes.fields[PEER_URI_SAN_ATTRIBUTE].string_value = spiffe
    return message


def caller(
    message: pb.ProcessingRequest,
    api_key: str | None = None,
    sources: frozenset[str] | None = None,
    identity: IdentityConfig = EVERY_SOURCE,
) -> Caller | None:
    return mesh_caller(message, identity, TENANTS, api_key, sources)


# ------------------------------------------------------------------ ext_authz as a source


def test_an_ext_authz_identity_names_the_tenant_the_user_and_the_team() -> None:
    found = caller(request(ext_authz={"tenant": "team-b", "user": "bob", "team": "search"}))
    assert found == Caller(tenant="team-b", user="bob", source="ext_authz", team="search")


def test_the_ext_authz_keys_and_namespace_are_configurable() -> None:
    identity = IdentityConfig(
        ext_authz=ExtAuthzIdentityConfig(
            metadata_namespace="authz.example", tenant_key="org", user_key="email", team_key=None
        )
    )
    message = pb.ProcessingRequest()
    json_format.ParseDict(
        {"org": "team-a", "email": "a@example.com", "team": "x"},
        message.metadata_context.filter_metadata["authz.example"],
    )
    assert caller(message, identity=identity) == Caller("team-a", "a@example.com", "ext_authz")
    # The default namespace is not read when another is configured.
    assert caller(request(ext_authz={"tenant": "team-a"}), identity=identity) is None


@pytest.mark.parametrize("tenant", ["nobody", ["team-a"], 7])
def test_an_ext_authz_identity_naming_no_tenant_is_refused(tenant: Any) -> None:
    with pytest.raises(IdentityRefused) as refused:
        caller(request(ext_authz={"tenant": tenant}), api_key="sk-a-key")
    assert not isinstance(refused.value, SourceNotAccepted)


def test_ext_authz_metadata_without_the_tenant_key_is_no_identity() -> None:
    """Metadata the server writes for other filters alone: the API key decides."""
    assert caller(request(ext_authz={"user": "bob", "decision": "ok"}), api_key="sk-k") is None


def test_unconfigured_ext_authz_is_not_read() -> None:
    identity = IdentityConfig(jwt=JwtIdentityConfig(payload_key="payload"))
    assert caller(request(ext_authz={"tenant": "team-a"}), identity=identity) is None


# ------------------------------------------------------------------ the order


def test_a_verified_token_beats_the_ext_authz_identity() -> None:
    found = caller(
        request(token={"tenant": "team-a", "sub": "alice"}, ext_authz={"tenant": "team-b"})
    )
    assert found == Caller(tenant="team-a", user="alice", source="jwt")


def test_the_token_team_claim_is_read() -> None:
    found = caller(request(token={"tenant": "team-a", "team": "search"}))
    assert found is not None and found.team == "search"


@pytest.mark.parametrize(
    "claims",
    [
        {"tenant": "team-a", "sub": "u" * 257},
        {"tenant": "team-a", "team": "t" * 257},
        {"tenant": "team-a", "sub": "nul\x00in"},
    ],
)
def test_a_user_or_team_name_too_long_to_be_a_scope_is_refused(claims: dict[str, Any]) -> None:
    """Each name becomes a limit scope and a record field: bounded, or the caller is
    refused (401), never stored."""
    with pytest.raises(IdentityRefused):
        caller(request(token=claims))
    with pytest.raises(IdentityRefused):
        caller(request(ext_authz={**claims, "user": claims.get("sub", "ok")}))
    assert caller(request(token={"tenant": "team-a", "sub": "u" * 256})) is not None


def test_the_ext_authz_identity_beats_an_api_key_and_the_certificate() -> None:
    found = caller(request(ext_authz={"tenant": "team-b"}, spiffe=AGENT), api_key="sk-k")
    assert found is not None and found.source == "ext_authz"


def test_an_api_key_beats_the_certificate() -> None:
    assert caller(request(spiffe=AGENT), api_key="sk-k") is None
    assert caller(request(spiffe=AGENT)) == Caller(tenant="team-c", user=None, source="spiffe")


def test_a_tenant_only_ext_authz_names_needs_no_api_key() -> None:
    data = yaml.safe_load(DEMO.read_text())
    data["tenants"].append({"name": "mesh-only"})
    data["keys"] = {"store": "off"}
    with pytest.raises(ConfigError, match=r"identity\.ext_authz"):
        parse_config(data)
    data["identity"] = {"ext_authz": {"team_key": "team"}}
    assert parse_config(data).identity.ext_authz == ExtAuthzIdentityConfig(team_key="team")


# ------------------------------------------------------------------ per-route sources

MESH_ONLY = frozenset({"jwt", "spiffe"})
KEYS_ONLY = frozenset({"api_key"})


def test_a_mesh_only_route_refuses_an_api_key() -> None:
    with pytest.raises(SourceNotAccepted, match="API keys"):
        caller(request(), api_key="sk-k", sources=MESH_ONLY)
    # Even beside a certificate the route would accept: the key is the request's own.
    with pytest.raises(SourceNotAccepted):
        caller(request(spiffe=AGENT), api_key="sk-k", sources=MESH_ONLY)


def test_a_mesh_only_route_takes_tokens_and_certificates() -> None:
    assert caller(request(token={"tenant": "team-a"}), sources=MESH_ONLY) is not None
    found = caller(request(spiffe=AGENT), sources=MESH_ONLY)
    assert found is not None and found.source == "spiffe"


def test_a_mesh_only_route_with_no_credential_refuses() -> None:
    """Not "no API key": the route would not take one."""
    with pytest.raises(SourceNotAccepted, match="no identity"):
        caller(request(), sources=MESH_ONLY)


@pytest.mark.parametrize(
    "message",
    [
        pytest.param(request(token={"tenant": "team-a"}), id="token"),
        pytest.param(request(ext_authz={"tenant": "team-b"}), id="ext_authz"),
    ],
)
def test_a_keys_only_route_refuses_a_mesh_credential(message: pb.ProcessingRequest) -> None:
    with pytest.raises(SourceNotAccepted):
        caller(message, api_key="sk-k", sources=KEYS_ONLY)


def test_a_keys_only_route_does_not_read_the_certificate() -> None:
    """Every mTLS client has one: on a keys-only route it is not an identity, and no key
    is 'no API key' (None: the session answers missing_api_key)."""
    assert caller(request(spiffe=AGENT), sources=KEYS_ONLY) is None
    assert caller(request(spiffe=AGENT), api_key="sk-k", sources=KEYS_ONLY) is None


def test_an_ext_authz_only_route() -> None:
    only = frozenset({"ext_authz"})
    assert caller(request(ext_authz={"tenant": "team-b"}), sources=only) is not None
    with pytest.raises(SourceNotAccepted):
        caller(request(spiffe=AGENT), sources=only)


def test_a_route_naming_an_unconfigured_source_accepts_nothing_of_it() -> None:
    identity = IdentityConfig(spiffe=SpiffeIdentityConfig(tenants={AGENT: "team-c"}))
    with pytest.raises(SourceNotAccepted):
        caller(request(token={"tenant": "team-a"}), sources=frozenset({"jwt"}), identity=identity)


# ------------------------------------------------------------------ the route setting


def test_the_route_setting_parses() -> None:
    settings = parse_route_settings([(IDENTITY_SOURCES_KEY, " jwt, spiffe ")])
    assert settings.identity_sources == MESH_ONLY
    assert parse_route_settings([]).identity_sources is None


@pytest.mark.parametrize("value", ["", "jwt,", "jwt, oauth", "JWT", "api-key"])
def test_an_unknown_source_is_a_route_misconfiguration(value: str) -> None:
    with pytest.raises(RouteSettingsError) as error:
        parse_route_settings([(IDENTITY_SOURCES_KEY, value)])
    assert error.value.key == IDENTITY_SOURCES_KEY
