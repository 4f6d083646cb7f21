"""Variants of an Envoy bootstrap rendered by `testbed.harness.render_envoy_config`.

Each function edits the rendered file in place and returns its path:

- `strip_extproc`: plain Envoy, every ext_proc filter and the ext_proc cluster removed;
- `route_all_to`: the routing guard replaced by one catch-all route to a cluster (the shipped
  configs send a request upstream only on kvgate's routing header, which an Envoy without
  kvgate, or with an ext_proc server that decides nothing, never gets);
- `add_extproc_endpoints`: more endpoints in the ext_proc cluster (several ext_proc processes
  behind one Envoy);
- `round_robin_clusters`: STATIC clusters with several endpoints, ROUND_ROBIN (the way to
  serve one backend from several replicas without kvgate picking);
- `verify_jwt`: Envoy's jwt_authn filter ahead of ext_proc (a local JWKS file), its payload
  forwarded to kvgate as dynamic metadata (docs/identity.md);
- `require_client_certificates`: the LLM listener on TLS with client certificates of a CA,
  the peer's URI SANs sent to kvgate as a request attribute;
- `check_ext_authz`: Envoy's ext_authz filter (a gRPC Authorization server) ahead of
  ext_proc, the dynamic metadata of its OK answers forwarded to kvgate.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from testbed.harness import EXTPROC_CLUSTER

EXTPROC_FILTER_TYPE = "ext_proc.v3.ExternalProcessor"


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    change(config)
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def _connection_managers(config: dict[str, Any]) -> Iterable[dict[str, Any]]:
    for listener in config["static_resources"]["listeners"]:
        for chain in listener.get("filter_chains", []):
            for net_filter in chain.get("filters", []):
                yield net_filter.get("typed_config", {})


def _endpoint(port: int) -> dict[str, Any]:
    address = {"socket_address": {"address": "127.0.0.1", "port_value": port}}
    return {"endpoint": {"address": address}}


def strip_extproc(path: Path) -> Path:
    """No ext_proc: the HTTP filters of that type and the ext_proc cluster go."""

    def change(config: dict[str, Any]) -> None:
        for hcm in _connection_managers(config):
            if "http_filters" in hcm:
                hcm["http_filters"] = [
                    f
                    for f in hcm["http_filters"]
                    if EXTPROC_FILTER_TYPE not in f.get("typed_config", {}).get("@type", "")
                ]
        clusters = config["static_resources"]["clusters"]
        config["static_resources"]["clusters"] = [
            c for c in clusters if c["name"] != EXTPROC_CLUSTER
        ]

    return _edit(path, change)


def route_all_to(path: Path, cluster: str) -> Path:
    """Every virtual host: one route, any path to `cluster` (no timeout, 1 h idle)."""

    def change(config: dict[str, Any]) -> None:
        for hcm in _connection_managers(config):
            route_config = hcm.get("route_config")
            if route_config is None:
                continue
            for host in route_config["virtual_hosts"]:
                host["routes"] = [
                    {
                        "match": {"prefix": "/"},
                        "route": {"cluster": cluster, "timeout": "0s", "idle_timeout": "3600s"},
                    }
                ]

    return _edit(path, change)


def add_extproc_endpoints(path: Path, ports: Sequence[int]) -> Path:
    """The ext_proc cluster gets one more endpoint per port (a copy of its first one)."""

    def change(config: dict[str, Any]) -> None:
        for cluster in config["static_resources"]["clusters"]:
            if cluster["name"] == EXTPROC_CLUSTER:
                endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
                for port in ports:
                    endpoint = copy.deepcopy(endpoints[0])
                    endpoint["endpoint"]["address"]["socket_address"]["port_value"] = port
                    endpoints.append(endpoint)

    return _edit(path, change)


def round_robin_clusters(path: Path, clusters: Mapping[str, Sequence[int]]) -> Path:
    """Each named cluster: endpoints 127.0.0.1 at the given ports, lb_policy ROUND_ROBIN."""

    def change(config: dict[str, Any]) -> None:
        for cluster in config["static_resources"]["clusters"]:
            ports = clusters.get(cluster["name"])
            if ports is None:
                continue
            cluster["lb_policy"] = "ROUND_ROBIN"
            cluster["load_assignment"]["endpoints"] = [
                {"lb_endpoints": [_endpoint(port) for port in ports]}
            ]

    return _edit(path, change)


def _extproc_filters(config: dict[str, Any]) -> Iterable[dict[str, Any]]:
    for hcm in _connection_managers(config):
        for http_filter in hcm.get("http_filters", []):
            if EXTPROC_FILTER_TYPE in http_filter.get("typed_config", {}).get("@type", ""):
                yield http_filter["typed_config"]


JWT_AUTHN = "envoy.filters.http.jwt_authn"
_TYPE_URL = "type.googleapis.com/"


def _before_ext_proc(config: dict[str, Any], http_filter: dict[str, Any]) -> None:
    """``http_filter`` just before ext_proc in every connection manager, and its dynamic
    metadata namespace (the filter's name) forwarded to kvgate."""
    for hcm in _connection_managers(config):
        filters = hcm.get("http_filters")
        if not filters:
            continue
        at = next(
            i
            for i, f in enumerate(filters)
            if EXTPROC_FILTER_TYPE in f.get("typed_config", {}).get("@type", "")
        )
        filters.insert(at, copy.deepcopy(http_filter))
    for ext_proc in _extproc_filters(config):
        options = ext_proc.setdefault("metadata_options", {})
        options.setdefault("forwarding_namespaces", {}).setdefault("untyped", []).append(
            http_filter["name"]
        )


def verify_jwt(path: Path, *, issuer: str, jwks_file: Path, payload_key: str) -> Path:
    """jwt_authn before ext_proc on every listener: a request with a token must carry a valid
    one (Envoy answers 401 otherwise), one without passes (an API key then decides); the
    verified payload goes to kvgate in the filter's metadata."""
    jwt_filter = {
        "name": JWT_AUTHN,
        "typed_config": {
            "@type": _TYPE_URL + "envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {
                "mesh": {
                    "issuer": issuer,
                    "local_jwks": {"filename": str(jwks_file)},
                    "payload_in_metadata": payload_key,
                    # The token is not a credential the model server should see.
                    "forward": False,
                }
            },
            "rules": [
                {
                    "match": {"prefix": "/"},
                    "requires": {
                        "requires_any": {
                            "requirements": [{"provider_name": "mesh"}, {"allow_missing": {}}]
                        }
                    },
                }
            ],
        },
    }

    def change(config: dict[str, Any]) -> None:
        _before_ext_proc(config, jwt_filter)

    return _edit(path, change)


def require_client_certificates(path: Path, *, ca: Path, cert: Path, key: Path) -> Path:
    """The first listener serves TLS with `cert`/`key` and requires a client certificate of
    `ca`; ext_proc gets the peer's URI SANs (connection.uri_san_peer_certificate)."""

    def change(config: dict[str, Any]) -> None:
        listener = config["static_resources"]["listeners"][0]
        for chain in listener["filter_chains"]:
            chain["transport_socket"] = {
                "name": "envoy.transport_sockets.tls",
                "typed_config": {
                    "@type": _TYPE_URL
                    + "envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext",
                    "require_client_certificate": True,
                    "common_tls_context": {
                        "tls_certificates": [
                            {
                                "certificate_chain": {"filename": str(cert)},
                                "private_key": {"filename": str(key)},
                            }
                        ],
                        "validation_context": {"trusted_ca": {"filename": str(ca)}},
                    },
                },
            }
        for ext_proc in _extproc_filters(config):
            attributes = ext_proc.setdefault("request_attributes", [])
            attributes.append("connection.uri_san_peer_certificate")

    return _edit(path, change)


EXT_AUTHZ = "envoy.filters.http.ext_authz"
EXT_AUTHZ_CLUSTER = "ext_authz"


def check_ext_authz(path: Path, *, port: int) -> Path:
    """ext_authz before ext_proc on every listener, asking the gRPC Authorization server at
    127.0.0.1:`port` (fail closed: no answer, 403). A denied check is answered by Envoy and
    never reaches kvgate; the metadata of an OK goes to kvgate in the filter's namespace."""
    authz_filter = {
        "name": EXT_AUTHZ,
        "typed_config": {
            "@type": _TYPE_URL + "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
            "transport_api_version": "V3",
            "grpc_service": {"envoy_grpc": {"cluster_name": EXT_AUTHZ_CLUSTER}, "timeout": "2s"},
            "failure_mode_allow": False,
        },
    }
    cluster = {
        "name": EXT_AUTHZ_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": EXT_AUTHZ_CLUSTER,
            "endpoints": [{"lb_endpoints": [_endpoint(port)]}],
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _TYPE_URL + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
    }

    def change(config: dict[str, Any]) -> None:
        _before_ext_proc(config, authz_filter)
        config["static_resources"]["clusters"].append(cluster)

    return _edit(path, change)
