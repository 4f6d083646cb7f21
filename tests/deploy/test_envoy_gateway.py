"""deploy/envoy-gateway/: the listener and cluster settings Envoy Gateway does not get right by
default for kvgate, checked against envoy/envoy.yaml (the reference) rather than against
numbers repeated here.

- The ClientTrafficPolicy of the Gateway: HTTP/2 stream window and buffer limit that take the
  reference's 8 MiB bodies (Envoy Gateway's 64 KiB default window gave HTTP/2 clients 413 on
  prompts over 64 KiB), the client address from the TCP peer, path normalisation, a
  connection limit the circuit breakers do not undercut, no whole-request timeout.
- The kvgate ext_proc cluster (EnvoyExtensionPolicy backendSettings): circuit breakers raised
  from Envoy Gateway's 1,024 to the reference's, an active grpc.health.v1 check as the
  reference's kvgate_extproc cluster has it, the same HTTP/2 and TCP settings.
- The model-server clusters (BackendTrafficPolicy of the HTTPRoute): the reference's circuit
  breakers, no retries anywhere.

Field names and the Envoy Gateway versions that have them: docs/operations.md, "Envoy Gateway".
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.deploy.manifests import (
    EG_POLICY,
    duration_s,
    envoy_reference,
    ingress_hcm,
    ns,
    objects,
    one,
)

# Envoy Gateway's circuit breaker thresholds when none are set (its CRDs' default).
EG_DEFAULT_CIRCUIT_BREAKER = 1024
# Envoy's bounds for HTTP/2 flow-control windows.
H2_MAX_WINDOW = 2**31 - 1
# Envoy Gateway circuitBreaker field -> Envoy cluster threshold.
CIRCUIT_BREAKER_FIELDS = {
    "maxConnections": "max_connections",
    "maxPendingRequests": "max_pending_requests",
    "maxParallelRequests": "max_requests",
}
_QUANTITY_UNITS = {
    "": 1,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
}


def quantity(value: int | str) -> int:
    """A Kubernetes quantity (int-or-string, e.g. 8Mi) in bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|k|M|G)?", value)
    assert match, f"not a quantity: {value!r}"
    return int(match[1]) * _QUANTITY_UNITS[match[2] or ""]


# --------------------------------------------------------------------------- loading


def client_policy() -> dict[str, Any]:
    return one(EG_POLICY, "ClientTrafficPolicy")


def ext_proc() -> dict[str, Any]:
    (config,) = one(EG_POLICY, "EnvoyExtensionPolicy")["spec"]["extProc"]
    found: dict[str, Any] = config
    return found


def backend_settings() -> dict[str, Any]:
    settings: dict[str, Any] = ext_proc()["backendSettings"]
    return settings


def reference_listener() -> dict[str, Any]:
    (listener,) = [
        listener
        for listener in envoy_reference()["static_resources"]["listeners"]
        if listener["name"] == "ingress"
    ]
    found: dict[str, Any] = listener
    return found


def reference_cluster(name: str) -> dict[str, Any]:
    (cluster,) = [c for c in envoy_reference()["static_resources"]["clusters"] if c["name"] == name]
    found: dict[str, Any] = cluster
    return found


def reference_thresholds(name: str) -> dict[str, Any]:
    (default,) = [
        t
        for t in reference_cluster(name)["circuit_breakers"]["thresholds"]
        if t.get("priority", "DEFAULT") == "DEFAULT"
    ]
    found: dict[str, Any] = default
    return found


def body_limit() -> int:
    """The request body limit of the reference: its listener's buffer limit."""
    limit: int = reference_listener()["per_connection_buffer_limit_bytes"]
    return limit


def llm_route() -> dict[str, Any]:
    return one(EG_POLICY, "HTTPRoute", "llm")


def route_backend_policy() -> dict[str, Any]:
    """The BackendTrafficPolicy of the LLM HTTPRoute (Envoy Gateway honours one per target)."""
    route = llm_route()
    (policy,) = [
        p
        for p in objects(EG_POLICY, "BackendTrafficPolicy")
        if any(
            t["kind"] == "HTTPRoute" and t["name"] == route["metadata"]["name"]
            for t in p["spec"]["targetRefs"]
        )
    ]
    return policy


# --------------------------------------------------------------------------- the listener


def test_client_traffic_policy_targets_the_gateway_of_the_api() -> None:
    policy = client_policy()
    assert policy["apiVersion"] == "gateway.envoyproxy.io/v1alpha1"
    (target,) = policy["spec"]["targetRefs"]
    assert target["group"] == "gateway.networking.k8s.io" and target["kind"] == "Gateway"
    assert "sectionName" not in target, "every listener of the Gateway"
    gateway = one(EG_POLICY, "Gateway", target["name"])
    assert ns(gateway) == ns(policy), "a policy attaches only within its namespace"
    # The Gateway is the one serving the OpenAI API.
    parents = llm_route()["spec"]["parentRefs"]
    assert any(
        p["name"] == gateway["metadata"]["name"] and p.get("namespace", ns(gateway)) == ns(gateway)
        for p in parents
    )


def test_buffer_limit_is_the_reference_body_limit() -> None:
    connection = client_policy()["spec"]["connection"]
    assert quantity(connection["bufferLimit"]) == body_limit()


def test_http2_windows_take_a_whole_body() -> None:
    """Over HTTP/2 the per-stream buffer is the stream window: below the body limit, a
    Buffered prompt over the window gets 413 (Envoy Gateway's default window: 64 KiB)."""
    http2 = client_policy()["spec"]["http2"]
    stream = quantity(http2["initialStreamWindowSize"])
    connection = quantity(http2["initialConnectionWindowSize"])
    assert stream >= body_limit(), f"HTTP/2 bodies over {stream} bytes would get 413"
    # Not more than the reference accepts over HTTP/2 either (one 413 threshold).
    reference = ingress_hcm(envoy_reference())["http2_protocol_options"]
    assert stream <= reference["initial_stream_window_size"]
    assert stream <= connection <= H2_MAX_WINDOW


def test_client_address_is_the_tcp_peer() -> None:
    """As the reference (use_remote_address, no trusted hop). Any clientIPDetection makes
    Envoy Gateway drop use_remote_address for the XFF extension; with numTrustedHops 0 or 1
    the client address is then the rightmost x-forwarded-for entry, written by the client."""
    hcm = ingress_hcm(envoy_reference())
    assert hcm["use_remote_address"] is True and hcm["xff_num_trusted_hops"] == 0
    spec = client_policy()["spec"]
    assert "clientIPDetection" not in spec, "a client could choose its own address"
    assert not spec.get("enableProxyProtocol"), "no PROXY protocol sender is assumed"


def test_paths_are_normalised_and_escaped_slashes_rejected() -> None:
    path = client_policy()["spec"]["path"]
    # %2F / %5C: kvgate would decide on one path and the model server decode another.
    assert path["escapedSlashesAction"] == "RejectRequest"
    assert path.get("disableMergeSlashes", False) is False


def test_connection_limit_is_below_the_circuit_breakers() -> None:
    """Every client connection the listener admits can carry a generation without a circuit
    breaker (kvgate's or the model server's) refusing it."""
    limit = client_policy()["spec"]["connection"]["connectionLimit"]["value"]
    assert limit > 0
    assert backend_settings()["circuitBreaker"]["maxParallelRequests"] >= limit
    backends = route_backend_policy()["spec"]["circuitBreaker"]
    assert backends["maxParallelRequests"] >= limit
    assert backends["maxConnections"] >= limit, "one HTTP/1.1 connection per generation"


def test_no_whole_request_timeout() -> None:
    """requestReceivedTimeout is the HCM request_timeout (the reference keeps it at 0s): it
    would cover the upload and kvgate's admission, not only the headers."""
    assert duration_s(ingress_hcm(envoy_reference())["request_timeout"]) == 0
    timeout = client_policy()["spec"].get("timeout", {}).get("http", {})
    assert "requestReceivedTimeout" not in timeout


def test_generation_routes_have_no_deadline() -> None:
    for rule in llm_route()["spec"]["rules"]:
        if "backendRefs" in rule:
            assert duration_s(rule["timeouts"]["request"]) == 0, rule["matches"]


# --------------------------------------------------------------------------- kvgate's cluster


@pytest.mark.parametrize("field", sorted(CIRCUIT_BREAKER_FIELDS))
def test_ext_proc_circuit_breaker_is_the_references(field: str) -> None:
    """One ext_proc stream per request in flight: Envoy Gateway's 1,024 would fail requests
    closed past ~1k concurrent generations."""
    value = backend_settings()["circuitBreaker"][field]
    reference = reference_thresholds("kvgate_extproc")[CIRCUIT_BREAKER_FIELDS[field]]
    assert value > EG_DEFAULT_CIRCUIT_BREAKER
    assert value >= reference, f"{field} {value} < envoy/envoy.yaml's {reference}"


def test_ext_proc_active_grpc_health_check_is_the_references() -> None:
    health = backend_settings()["healthCheck"]
    active = health["active"]
    (reference,) = reference_cluster("kvgate_extproc")["health_checks"]
    assert active["type"] == "GRPC"
    assert "grpc_health_check" in reference
    # The same grpc.health.v1 service name as Envoy's own check ("" = the whole server).
    service = active.get("grpc", {}).get("service", "")
    assert service == reference["grpc_health_check"].get("service_name", "")
    assert duration_s(active["interval"]) == duration_s(reference["interval"])
    assert duration_s(active["timeout"]) == duration_s(reference["timeout"])
    assert duration_s(active["timeout"]) <= duration_s(ext_proc()["messageTimeout"])
    assert active["unhealthyThreshold"] == reference["unhealthy_threshold"]
    assert active["healthyThreshold"] == reference["healthy_threshold"]
    # NOT_SERVING means no new streams even when no kvgate is healthy (no panic routing).
    panic = reference_cluster("kvgate_extproc")["common_lb_config"]["healthy_panic_threshold"]
    assert health["panicThreshold"] == panic["value"]


def test_ext_proc_connection_settings_are_the_references() -> None:
    settings = backend_settings()
    cluster = reference_cluster("kvgate_extproc")
    options = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]["explicit_http_config"]["http2_protocol_options"]
    assert settings["http2"]["maxConcurrentStreams"] == options["max_concurrent_streams"]
    keepalive = cluster["upstream_connection_options"]["tcp_keepalive"]
    assert duration_s(settings["tcpKeepalive"]["idleTime"]) == keepalive["keepalive_time"]
    assert duration_s(settings["tcpKeepalive"]["interval"]) == keepalive["keepalive_interval"]
    assert settings["tcpKeepalive"]["probes"] == keepalive["keepalive_probes"]
    connect = duration_s(settings["timeout"]["tcp"]["connectTimeout"])
    assert connect == duration_s(cluster["connect_timeout"])


# --------------------------------------------------------------------------- model servers


@pytest.mark.parametrize("field", sorted(CIRCUIT_BREAKER_FIELDS))
def test_backend_circuit_breaker_is_the_references(field: str) -> None:
    value = route_backend_policy()["spec"]["circuitBreaker"][field]
    reference = reference_thresholds("vllm-local")[CIRCUIT_BREAKER_FIELDS[field]]
    assert value > EG_DEFAULT_CIRCUIT_BREAKER
    assert value >= reference, f"{field} {value} < envoy/envoy.yaml's {reference}"


def test_no_retries_on_the_llm_routes() -> None:
    """A retry is a second generation under one admission (and one bill)."""
    for policy in objects(EG_POLICY, "BackendTrafficPolicy"):
        assert "retry" not in policy["spec"], policy["metadata"]["name"]
    for rule in llm_route()["spec"]["rules"]:
        assert "retry" not in rule, rule["matches"]
    assert "retry" not in backend_settings()
    # And the clusters refuse them outright, as the reference's backend clusters do.
    assert reference_thresholds("vllm-local")["max_retries"] == 0
    assert route_backend_policy()["spec"]["circuitBreaker"]["maxParallelRetries"] == 0
