"""deploy/ for pools: several vLLM replicas of one model behind one kvgate backend.

- The headless Service: no cluster IP, not-ready pods left out of DNS, the port and DNS name
  every pool config resolves.
- The pool-enabled kvgate configs (sidecar and standalone), joined with their file's tenants
  Secret, pass kvgate's validation, differ from the single-backend configs only in the pool,
  and differ from each other only in the listen addresses; the documented `kubectl patch`
  replaces the volume the init container and config-sync read.
- Every ext_proc filter that can carry a pool request lets kvgate extend its deadline as long
  as the pool's queue may ask (max_message_timeout).
- Kubernetes sidecar: both bootstraps have envoy/envoy.yaml's ORIGINAL_DST cluster under the
  pool's name; a real Envoy on that cluster connects to the address in x-kvgate-destination
  and to nothing without it.
- Istio: the CLUSTER ADD patch is that cluster and validates in a bootstrap, the commented
  mTLS transport socket too; the HTTP_ROUTE patch names the VirtualService's pool route, and
  applied as istiod would, the route reaches the cluster (`envoy --mode validate`).
- Envoy Gateway: the EnvoyPatchPolicy targets the Gateway; its patches, applied to a stand-in
  of Envoy Gateway's xDS by a JSONPath/JSON Patch emulation of the subset they use, add the
  cluster, point only the pool rule's route at it and give only kvgate's request-path filter
  max_message_timeout; the result validates. The ClientTrafficPolicy strips the header.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.config import parse_config
from testbed.harness import ManagedProcess, _bin, free_port
from tests.deploy.manifests import (
    DEPLOY,
    EG_POLICY,
    EG_SPLIT,
    EXT_PROC,
    ISTIO_FILTERS,
    ISTIO_SPLIT,
    KVGATE_DEPLOYMENT,
    KVGATE_DEPLOYMENT_POOL,
    POOL_SERVICE,
    SIDECAR,
    SIDECAR_POOL,
    apply_istio_patches,
    assert_valid_envoy,
    assumed_max_message_timeout_s,
    container,
    deep_merge,
    duration_s,
    envoy_reference,
    hcm_of,
    ingress_hcm,
    kvgate_config_of,
    kvgate_pool_config_of,
    ns,
    objects,
    one,
    rel,
    sidecar_bootstrap,
    sidecar_split_bootstrap,
)

ISTIO_GATEWAY = ISTIO_FILTERS[0]
ISTIO_POOL = DEPLOY / "istio" / "envoyfilter-gateway-pool.yaml"
EG_POOL = DEPLOY / "envoy-gateway" / "pool-patch-policy.yaml"
DESTINATION_HEADER = "x-kvgate-destination"
CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
# (pool config file, the file whose Deployment and tenants Secret it goes with, the index of
# the pod volume `kvgate-config-base` the documented patch replaces)
POOL_CONFIGS = [(SIDECAR_POOL, SIDECAR, 1), (KVGATE_DEPLOYMENT_POOL, KVGATE_DEPLOYMENT, 0)]


def pool_backends(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [b for b in config["backends"] if "endpoints" in b or "endpoint_discovery" in b]


def reference_pool_cluster() -> dict[str, Any]:
    (cluster,) = [
        c for c in envoy_reference()["static_resources"]["clusters"] if c["type"] == "ORIGINAL_DST"
    ]
    return cluster


def clusters_of(bootstrap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}


def request_path_filters(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        f["typed_config"] for f in ingress_hcm(bootstrap)["http_filters"] if f["name"] == EXT_PROC
    ]


# --------------------------------------------------------------------------- the Service


def test_pool_service_is_headless_and_ready_pods_only() -> None:
    service = one(POOL_SERVICE, "Service", "vllm-pool")
    spec = service["spec"]
    assert spec["clusterIP"] == "None", "headless: one DNS record per pod, no virtual IP"
    assert spec["publishNotReadyAddresses"] is False, "a loading vLLM pod must not be picked"
    assert spec.get("type", "ClusterIP") == "ClusterIP"
    assert spec["selector"], "selects the vLLM pods"
    fqdn = f"{service['metadata']['name']}.{ns(service)}.svc.cluster.local"
    ports = {p["port"] for p in spec["ports"]}
    for pool_path, base_path, _ in POOL_CONFIGS:
        for backend in pool_backends(kvgate_pool_config_of(pool_path, base_path)):
            discovery = backend["endpoint_discovery"]
            assert discovery["dns_name"] == fqdn, rel(pool_path)
            assert discovery["port"] in ports, rel(pool_path)


# --------------------------------------------------------------------------- kvgate's config


@pytest.mark.parametrize("pool_path, base_path, volume", POOL_CONFIGS, ids=lambda v: str(v))
def test_pool_config_is_the_base_config_with_a_pool(
    pool_path: Path, base_path: Path, volume: int
) -> None:
    pool = kvgate_pool_config_of(pool_path, base_path)
    config = parse_config(pool, f"{rel(pool_path)} (ConfigMap + Secret)")
    (backend,) = [b for b in config.backends if b.is_pool]
    assert backend.endpoint_discovery is not None and backend.discovery is not None
    assert "{endpoint}" in backend.discovery.metrics_url, "each pod scraped on its own"
    assert backend.kv_budget_tokens == "auto", "each pod's budget from its own /metrics"
    assert backend.queue is not None
    # kvgate accepted the queue's wait bound against envoy_max_message_timeout_s (parse_config
    # refuses more); the Envoy filters this config's requests pass must allow that much.
    allowed = [
        duration_s(f["max_message_timeout"]) for f in gateway_filters_for(pool_path).values()
    ]
    assert allowed and config.server.envoy_max_message_timeout_s <= min(allowed)
    assert all(m.backend == backend.name for m in config.models)
    # Everything else is the single-backend config of the same pod: same server (so the
    # probes and ports checked by test_manifests still hold), store, tenants, models.
    base, workload = kvgate_config_of(base_path)
    assert pool["server"] == base["server"] and pool["store"] == base["store"]
    assert pool["tenants"] == base["tenants"]
    assert [{**m, "backend": None} for m in pool["models"]] == [
        {**m, "backend": None} for m in base["models"]
    ]
    # The documented patch replaces the ConfigMap of the volume the init container and
    # config-sync read kvgate.yaml from.
    template = workload["spec"]["template"]
    vol = template["spec"]["volumes"][volume]
    assert vol["name"] == "kvgate-config-base" and vol["configMap"]["name"] == "kvgate-config"
    for name in ("kvgate-config", "config-sync"):
        mounts = {m["name"]: m["mountPath"] for m in container(template, name)["volumeMounts"]}
        assert mounts["kvgate-config-base"] == "/config/base"
    configmap = one(pool_path, "ConfigMap", "kvgate-config-pool")
    assert ns(configmap) == ns(workload)
    text = pool_path.read_text(encoding="utf-8")
    assert (
        f'"path":"/spec/template/spec/volumes/{volume}/configMap/name",'
        f'"value":"kvgate-config-pool"' in text
    )
    assert f"-n {ns(workload)} patch deployment {workload['metadata']['name']}" in text


def test_sidecar_and_standalone_pool_configs_agree() -> None:
    sidecar = kvgate_pool_config_of(SIDECAR_POOL, SIDECAR)
    standalone = kvgate_pool_config_of(KVGATE_DEPLOYMENT_POOL, KVGATE_DEPLOYMENT)
    assert {k: v for k, v in sidecar.items() if k != "server"} == {
        k: v for k, v in standalone.items() if k != "server"
    }


# --------------------------------------------------------------------------- Envoy deadlines


def deadline_filters() -> dict[str, dict[str, Any]]:
    """Every request-path ext_proc filter a pool request can pass."""
    found = {}
    for name, bootstrap in (
        ("envoy/envoy.yaml", envoy_reference()),
        (rel(SIDECAR), sidecar_bootstrap()),
        ("gateway-with-sidecar-split.yaml", sidecar_split_bootstrap()),
    ):
        (found[name],) = request_path_filters(bootstrap)
    for path in (ISTIO_GATEWAY, ISTIO_SPLIT):
        (envoy_filter,) = objects(path, "EnvoyFilter")
        for patch in envoy_filter["spec"]["configPatches"]:
            value = patch["patch"]["value"]
            if value.get("name") == EXT_PROC:
                found[rel(path)] = value["typed_config"]
    return found


def gateway_filters_for(pool_path: Path) -> dict[str, dict[str, Any]]:
    """The request-path filters a pool config's requests pass: the sidecar bootstraps for the
    sidecar config; the Istio gateway filters and the Envoy Gateway patch for the standalone one."""
    found = deadline_filters()
    if pool_path == SIDECAR_POOL:
        return {k: v for k, v in found.items() if "sidecar" in k}
    (patch,) = [p for p in eg_patches() if p["type"] == LISTENER_TYPE]
    istio = {k: v for k, v in found.items() if k.startswith("deploy/istio/")}
    return {**istio, rel(EG_POOL): {"max_message_timeout": patch["operation"]["value"]}}


@pytest.mark.parametrize("name", sorted(deadline_filters()))
def test_queue_deadline_fits_max_message_timeout(name: str) -> None:
    config = deadline_filters()[name]
    assert duration_s(config["message_timeout"]) == 2.0, name
    assert duration_s(config["max_message_timeout"]) >= assumed_max_message_timeout_s(), name


def test_envoy_gateway_has_no_max_message_timeout_field_but_the_patch_sets_it() -> None:
    """Envoy Gateway's ExtProc API lacks the field (checked against its CRD, v1.9.0); the pool
    patch policy adds it, and both policy files say so."""
    crd = yaml.safe_load(
        (
            Path(__file__).parent
            / "schemas"
            / "crds"
            / "gateway.envoyproxy.io_envoyextensionpolicies.yaml"
        ).read_text(encoding="utf-8")
    )
    (version,) = crd["spec"]["versions"]
    ext_proc = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["extProc"]
    fields = set(ext_proc["items"]["properties"])
    assert "messageTimeout" in fields
    assert not {f for f in fields if "max" in f.lower() and "timeout" in f.lower()}
    for path in (EG_POLICY, EG_SPLIT):
        assert "pool-patch-policy.yaml" in path.read_text(encoding="utf-8"), rel(path)
    (patch,) = [p for p in eg_patches() if p["type"] == LISTENER_TYPE]
    assert patch["operation"]["path"] == "max_message_timeout"
    assert duration_s(patch["operation"]["value"]) >= assumed_max_message_timeout_s()


# --------------------------------------------------------------------------- sidecar


def test_sidecar_bootstraps_route_the_pool_to_an_original_dst_cluster() -> None:
    pool = kvgate_pool_config_of(SIDECAR_POOL, SIDECAR)
    for bootstrap in (sidecar_bootstrap(), sidecar_split_bootstrap()):
        clusters = clusters_of(bootstrap)
        for backend in pool_backends(pool):
            cluster = clusters[backend["name"]]
            assert cluster == {**reference_pool_cluster(), "name": backend["name"]}
            assert cluster["type"] == "ORIGINAL_DST"
            assert cluster["lb_policy"] == "CLUSTER_PROVIDED"
            assert "load_assignment" not in cluster
            assert cluster["original_dst_lb_config"] == {
                "use_http_header": True,
                "http_header_name": DESTINATION_HEADER,
            }
        # The models' pass-through (/v1/models) cluster still exists.
        passthrough = [
            r
            for r in ingress_hcm(bootstrap)["route_config"]["virtual_hosts"][0]["routes"]
            if r["name"] == "kvgate_passthrough"
        ]
        assert passthrough[0]["route"]["cluster"] in clusters


# Everything to one cluster: the sidecar's pool cluster, nothing else.
ORIGINAL_DST_BOOTSTRAP = """
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}
static_resources:
  listeners:
    - name: ingress
      address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listen} }} }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.\
http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ingress
                route_config:
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      routes:
                        - match: {{ prefix: / }}
                          route: {{ cluster: {cluster} }}
                http_filters:
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"""


class _Named(BaseHTTPRequestHandler):
    """A backend that answers with its own name."""

    def do_GET(self) -> None:
        body = self.server.name.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _get(url: str, headers: dict[str, str]) -> tuple[int, str]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as err:
        return int(err.code), ""


def test_original_dst_cluster_connects_where_the_header_says_and_nowhere_else(
    tmp_path: Path,
) -> None:
    """A real Envoy, routing everything to the sidecar's pool cluster: each request reaches
    the backend x-kvgate-destination names; without the header, or with a host name instead
    of IP:PORT, Envoy has no host (503) and counts the invalid value."""
    backends = []
    for name in ("pod-a", "pod-b"):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Named)
        server.name = name  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        backends.append(server)
    try:
        cluster = clusters_of(sidecar_bootstrap())["vllm-pool"]
        admin, listen = free_port(), free_port()
        bootstrap = yaml.safe_load(
            ORIGINAL_DST_BOOTSTRAP.format(admin=admin, listen=listen, cluster=cluster["name"])
        )
        bootstrap["static_resources"]["clusters"] = [cluster]
        path = tmp_path / "envoy.yaml"
        path.write_text(yaml.safe_dump(bootstrap, sort_keys=False), encoding="utf-8")
        argv = [_bin("envoy"), "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
        with ManagedProcess("envoy-original-dst", argv, log_dir=tmp_path) as envoy:
            envoy.wait_http(f"http://127.0.0.1:{admin}/ready", timeout=30)
            base = f"http://127.0.0.1:{listen}/v1/models"
            for _ in range(3):
                for server in backends:
                    port = server.server_address[1]
                    status, body = _get(base, {DESTINATION_HEADER: f"127.0.0.1:{port}"})
                    assert (status, body) == (200, server.name)  # type: ignore[attr-defined]
            assert _get(base, {})[0] == 503, "no header: no default host"
            assert _get(base, {DESTINATION_HEADER: "vllm.llm.svc.cluster.local:8000"})[0] == 503
            with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats", timeout=5) as resp:
                stats = resp.read().decode()
            invalid = re.search(
                r"^cluster\.vllm-pool\.original_dst_host_invalid: (\d+)$", stats, re.M
            )
            assert invalid and int(invalid[1]) == 1, "the host name was refused as invalid"
            assert envoy.running
    finally:
        for server in backends:
            server.shutdown()
            server.server_close()


# --------------------------------------------------------------------------- Istio


def istio_pool_filter() -> dict[str, Any]:
    (envoy_filter,) = objects(ISTIO_POOL, "EnvoyFilter")
    return envoy_filter


def istio_pool_patch(apply_to: str) -> dict[str, Any]:
    (patch,) = [p for p in istio_pool_filter()["spec"]["configPatches"] if p["applyTo"] == apply_to]
    return patch


def commented_transport_socket() -> dict[str, Any]:
    """The mTLS transport socket commented below the cluster in the Istio pool patch."""
    lines = ISTIO_POOL.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "#   transport_socket:")
    indent = lines[start].index("#")
    block = []
    for line in lines[start:]:
        if not line.startswith(" " * indent + "#   "):
            break
        block.append(line[indent + 4 :])
    loaded: dict[str, Any] = yaml.safe_load("\n".join(block))
    return loaded


def test_istio_pool_filter_targets_the_llm_gateway() -> None:
    pool = istio_pool_filter()
    (gateway_filter,) = objects(ISTIO_GATEWAY, "EnvoyFilter")
    assert pool["spec"]["workloadSelector"] == gateway_filter["spec"]["workloadSelector"]
    assert ns(pool) == ns(gateway_filter)
    assert pool["metadata"]["name"] not in {gateway_filter["metadata"]["name"]}
    for patch in pool["spec"]["configPatches"]:
        assert patch["match"]["context"] == "GATEWAY"
    cluster = istio_pool_patch("CLUSTER")
    assert cluster["patch"]["operation"] == "ADD"
    pool_names = {
        b["name"]
        for b in pool_backends(kvgate_pool_config_of(KVGATE_DEPLOYMENT_POOL, KVGATE_DEPLOYMENT))
    }
    assert cluster["patch"]["value"] == {
        **reference_pool_cluster(),
        "name": cluster["patch"]["value"]["name"],
    }
    assert cluster["patch"]["value"]["name"] in pool_names


def test_istio_pool_route_is_the_virtual_service_route_of_the_pool() -> None:
    """Istio names an Envoy route after the VirtualService http route's `name` (plus "." and
    the match's name when it has one): the HTTP_ROUTE patch must name exactly that, on the
    LLM listener's port, and send it to the added cluster."""
    service = one(ISTIO_GATEWAY, "VirtualService", "llm")
    route_patch = istio_pool_patch("HTTP_ROUTE")
    match = route_patch["match"]["routeConfiguration"]
    (http_route,) = [
        r for r in service["spec"]["http"] if r.get("name") == match["vhost"]["route"]["name"]
    ]
    (vs_match,) = http_route["match"]
    assert "name" not in vs_match, "a named match would rename the Envoy route"
    pool_name = istio_pool_patch("CLUSTER")["patch"]["value"]["name"]
    assert vs_match["headers"] == {"x-kvgate-backend": {"exact": pool_name}}
    assert http_route["retries"] == {"attempts": 0} and http_route["timeout"] == "0s"
    gateway = one(ISTIO_GATEWAY, "Gateway", "llm-gateway")
    (server,) = gateway["spec"]["servers"]
    assert match["portNumber"] == server["port"]["number"]
    assert route_patch["patch"]["operation"] == "MERGE"
    assert route_patch["patch"]["value"] == {"route": {"cluster": pool_name}}
    # Without the patch the route goes to the pool's Service (Istio balances itself).
    (destination,) = http_route["route"]
    service_obj = one(POOL_SERVICE, "Service", "vllm-pool")
    assert destination["destination"]["host"] == (
        f"{service_obj['metadata']['name']}.{ns(service_obj)}.svc.cluster.local"
    )


def test_istio_pool_patches_validate(tmp_path: Path) -> None:
    """envoy/envoy.yaml without its own pool cluster, the gateway EnvoyFilter applied (as
    test_manifests does), then the pool patches as istiod applies them: the cluster added,
    the VirtualService's route (as Istio renders it) merged. Envoy checks every route's
    cluster exists."""
    config = envoy_reference()
    config["static_resources"]["clusters"] = [
        c for c in config["static_resources"]["clusters"] if c["type"] != "ORIGINAL_DST"
    ]
    (gateway_filter,) = objects(ISTIO_GATEWAY, "EnvoyFilter")
    config = apply_istio_patches(config, gateway_filter)
    config["static_resources"]["clusters"].append(istio_pool_patch("CLUSTER")["patch"]["value"])
    route_patch = istio_pool_patch("HTTP_ROUTE")
    name = route_patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
    rendered = {
        "name": name,
        "match": {
            "prefix": "/",
            "headers": [{"name": "x-kvgate-backend", "string_match": {"exact": "vllm-pool"}}],
        },
        "route": {
            "cluster": "outbound|8000||vllm-pool.llm.svc.cluster.local",
            "timeout": "0s",
        },
    }
    merged = deep_merge(rendered, route_patch["patch"]["value"])
    assert merged["route"] == {"cluster": "vllm-pool", "timeout": "0s"}
    hcm = hcm_of(config["static_resources"]["listeners"][0])
    (vhost,) = hcm["route_config"]["virtual_hosts"]
    vhost["routes"] = [merged, *vhost["routes"]]
    assert_valid_envoy(config, tmp_path, "istio-pool.yaml")


def test_istio_pool_mtls_transport_socket_validates(tmp_path: Path) -> None:
    """The commented ISTIO_MUTUAL client context, on the cluster, with a stand-in for the
    `sds-grpc` cluster istio-agent's bootstrap provides."""
    socket = commented_transport_socket()["transport_socket"]
    tls = socket["typed_config"]
    assert tls["common_tls_context"]["alpn_protocols"] == ["istio-peer-exchange", "istio"]
    sds = tls["common_tls_context"]["tls_certificate_sds_secret_configs"][0]
    assert sds["name"] == "default"
    assert (
        tls["common_tls_context"]["combined_validation_context"][
            "validation_context_sds_secret_config"
        ]["name"]
        == "ROOTCA"
    )
    config = envoy_reference()
    config["node"] = {"id": "istio-ingressgateway", "cluster": "istio-ingressgateway"}  # SDS
    clusters = config["static_resources"]["clusters"]
    index = next(i for i, c in enumerate(clusters) if c["type"] == "ORIGINAL_DST")
    clusters[index] = {**istio_pool_patch("CLUSTER")["patch"]["value"], "transport_socket": socket}
    clusters.append(
        {
            "name": "sds-grpc",
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3"
                    ".HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
            "load_assignment": {
                "cluster_name": "sds-grpc",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {"pipe": {"path": str(tmp_path / "sds.sock")}}
                                }
                            }
                        ]
                    }
                ],
            },
        }
    )
    assert_valid_envoy(config, tmp_path, "istio-pool-mtls.yaml")


# --------------------------------------------------------------------------- Envoy Gateway


def eg_policy() -> dict[str, Any]:
    return one(EG_POOL, "EnvoyPatchPolicy", "kvgate-pool")


def eg_patches() -> list[dict[str, Any]]:
    patches: list[dict[str, Any]] = eg_policy()["spec"]["jsonPatches"]
    return patches


_JSONPATH = re.compile(r"\.\.(\w+)\[\?match\(@\.name, '([^']*)'\)\]((?:\.\w+)*)")


def locate(document: Any, expression: str) -> list[list[str | int]]:
    """The JSONPath subset the policy uses, as JSON Pointer token lists: a descendant
    segment `..key`, a filter `[?match(@.name, 'regex')]` (RFC 9535: the whole name matches)
    on that key's list, then member names."""
    m = _JSONPATH.fullmatch(expression)
    assert m, f"outside the emulated JSONPath subset: {expression}"
    key, regex, rest = m[1], m[2], [p for p in m[3].split(".") if p]
    found: list[list[str | int]] = []

    def walk(node: Any, at: list[str | int]) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == key and isinstance(v, list):
                    for i, item in enumerate(v):
                        if isinstance(item, dict) and re.fullmatch(regex, str(item.get("name"))):
                            found.append([*at, k, i, *rest])
                walk(v, [*at, k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, [*at, i])

    walk(document, [])
    return found


def apply_json_patch(document: Any, operation: dict[str, Any]) -> int:
    """One EnvoyPatchPolicy operation (`add` creates missing parents, as Envoy Gateway's
    EnsurePathExistsOnAdd); returns how many locations it changed."""
    pointers = locate(document, operation["jsonPath"])
    extra = [p for p in operation.get("path", "").split("/") if p]
    for pointer in pointers:
        *parents, last = [*pointer, *extra]
        node = document
        for part in parents:
            node = (
                node.setdefault(part, {})
                if operation["op"] == "add" and isinstance(part, str)
                else node[part]
            )
        if operation["op"] == "replace":
            assert last in node, f"replace of a missing {last}"
        else:
            assert operation["op"] == "add", operation
        node[last] = copy.deepcopy(operation["value"])
    return len(pointers)


def eg_route_rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = one(EG_POLICY, "HTTPRoute", "llm")["spec"]["rules"]
    return rules


def eg_route_name(rule: int, match: int = 0, host: str = "*") -> str:
    """Envoy Gateway's xDS route name for an HTTPRoute rule's match (internal/gatewayapi:
    irRouteName, then the listener hostname with dots as underscores)."""
    route = one(EG_POLICY, "HTTPRoute", "llm")
    return f"httproute/{ns(route)}/{route['metadata']['name']}/rule/{rule}/match/{match}/{host}"


def eg_filter_name(path: Path, index: int) -> str:
    """Envoy Gateway's HCM filter name for extProc[index] of the EnvoyExtensionPolicy."""
    policy = one(path, "EnvoyExtensionPolicy")
    return (
        f"{EXT_PROC}/envoyextensionpolicy/{ns(policy)}/{policy['metadata']['name']}/extproc/{index}"
    )


def eg_stand_in() -> tuple[dict[str, Any], dict[str, Any]]:
    """(bootstrap, route configuration) shaped like Envoy Gateway's output for the Gateway and
    HTTPRoute of extension-policy.yaml, in proto field names (Envoy Gateway marshals xDS with
    UseProtoNames before patching): envoy/envoy.yaml's listener with the ext_proc filter named
    as Envoy Gateway names it (without max_message_timeout, which Envoy Gateway cannot set),
    and one route per HTTPRoute rule with a cluster per rule."""
    config = envoy_reference()
    config["static_resources"]["clusters"] = [
        c for c in config["static_resources"]["clusters"] if c["type"] != "ORIGINAL_DST"
    ]
    hcm = ingress_hcm(config)
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == EXT_PROC]
    ext_proc["name"] = eg_filter_name(EG_POLICY, 0)
    ext_proc["typed_config"].pop("max_message_timeout")
    template = clusters_of(config)["vllm-local"]
    routes = []
    for i, rule in enumerate(eg_route_rules()):
        (match,) = rule["matches"]
        envoy_match: dict[str, Any] = {"prefix": match["path"]["value"]}
        if match.get("headers"):
            envoy_match["headers"] = [
                {"name": h["name"], "string_match": {"exact": h["value"]}} for h in match["headers"]
            ]
        route: dict[str, Any] = {"name": eg_route_name(i), "match": envoy_match}
        if "backendRefs" in rule:
            cluster = f"httproute/llm/llm/rule/{i}"
            config["static_resources"]["clusters"].append(
                {
                    **copy.deepcopy(template),
                    "name": cluster,
                    "load_assignment": {**template["load_assignment"], "cluster_name": cluster},
                }
            )
            route["route"] = {"cluster": cluster, "timeout": "0s"}
        else:
            route["direct_response"] = {"status": 500}
        routes.append(route)
    route_config = {
        "name": "llm/llm-gateway/http",
        "virtual_hosts": [{"name": "llm/llm-gateway/http/*", "domains": ["*"], "routes": routes}],
    }
    hcm["route_config"] = route_config
    return config, route_config


def test_eg_pool_rule_is_the_one_the_patch_names() -> None:
    """The route patch selects the rule by Envoy Gateway's position-based route name: that
    position must hold the pool rule, and no other rule's name may match."""
    pool_names = {
        b["name"]
        for b in pool_backends(kvgate_pool_config_of(KVGATE_DEPLOYMENT_POOL, KVGATE_DEPLOYMENT))
    }
    (route_patch,) = [p for p in eg_patches() if p["type"] == ROUTE_TYPE]
    regex = _JSONPATH.fullmatch(route_patch["operation"]["jsonPath"])[2]  # type: ignore[index]
    matching = [i for i in range(len(eg_route_rules())) if re.fullmatch(regex, eg_route_name(i))]
    assert len(matching) == 1
    (rule,) = [eg_route_rules()[i] for i in matching]
    (match,) = rule["matches"]
    assert match["headers"] == [
        {"type": "Exact", "name": "x-kvgate-backend", "value": route_patch["operation"]["value"]}
    ]
    assert route_patch["operation"]["value"] in pool_names
    assert re.fullmatch(regex, eg_route_name(matching[0], host="llm_example_com"))
    # Its backend is the pool's Service (what Envoy Gateway balances over when unpatched).
    service = one(POOL_SERVICE, "Service", "vllm-pool")
    assert rule["backendRefs"] == [
        {"name": "vllm-pool", "port": service["spec"]["ports"][0]["port"]}
    ]
    assert ns(service) == ns(one(EG_POLICY, "HTTPRoute", "llm"))


def test_eg_patch_names_the_gateway_resources() -> None:
    policy = eg_policy()
    target = policy["spec"]["targetRef"]
    gateway = one(EG_POLICY, "Gateway", target["name"])
    assert target["kind"] == "Gateway" and ns(policy) == ns(gateway), "same namespace as target"
    assert policy["spec"]["type"] == "JSONPatch"
    (listener,) = gateway["spec"]["listeners"]
    name = f"{ns(gateway)}/{gateway['metadata']['name']}/{listener['name']}"
    by_type = {p["type"]: p for p in eg_patches()}
    assert set(by_type) == {CLUSTER_TYPE, ROUTE_TYPE, LISTENER_TYPE}
    assert by_type[ROUTE_TYPE]["name"] == name and by_type[LISTENER_TYPE]["name"] == name
    cluster = by_type[CLUSTER_TYPE]
    assert cluster["operation"]["op"] == "add" and "path" not in cluster["operation"]
    assert cluster["operation"]["value"] == {**reference_pool_cluster(), "name": cluster["name"]}
    # The filter pattern takes the request-path filter of both layouts, never the observer.
    regex = _JSONPATH.fullmatch(by_type[LISTENER_TYPE]["operation"]["jsonPath"])[2]  # type: ignore[index]
    assert re.fullmatch(regex, eg_filter_name(EG_POLICY, 0))
    assert re.fullmatch(regex, eg_filter_name(EG_SPLIT, 0))
    assert not re.fullmatch(regex, eg_filter_name(EG_SPLIT, 1))
    observe = one(EG_SPLIT, "EnvoyExtensionPolicy")["spec"]["extProc"][1]
    assert observe.get("shadowMode") is True


def test_eg_patches_applied_to_a_stand_in_validate(tmp_path: Path) -> None:
    config, route_config = eg_stand_in()
    before = copy.deepcopy(route_config)
    by_type = {p["type"]: p for p in eg_patches()}
    listener = config["static_resources"]["listeners"][0]
    assert apply_json_patch(listener, by_type[LISTENER_TYPE]["operation"]) == 1
    assert apply_json_patch(route_config, by_type[ROUTE_TYPE]["operation"]) == 1
    config["static_resources"]["clusters"].append(by_type[CLUSTER_TYPE]["operation"]["value"])
    # Only the pool rule's cluster changed; only kvgate's filter got the deadline.
    changed = [
        (a["name"], a["route"]["cluster"], b["route"]["cluster"])
        for a, b in zip(
            before["virtual_hosts"][0]["routes"],
            route_config["virtual_hosts"][0]["routes"],
            strict=True,
        )
        if a != b
    ]
    assert changed == [(eg_route_name(1), "httproute/llm/llm/rule/1", "vllm-pool")]
    (ext_proc,) = [f for f in hcm_of(listener)["http_filters"] if f["name"].startswith(EXT_PROC)]
    assert ext_proc["typed_config"]["max_message_timeout"] == "35s"
    assert json.dumps(listener).count("max_message_timeout") == 1
    assert_valid_envoy(config, tmp_path, "envoy-gateway-pool.yaml")


def test_eg_clients_cannot_name_a_destination() -> None:
    removed = one(EG_POLICY, "ClientTrafficPolicy")["spec"]["headers"]["earlyRequestHeaders"][
        "remove"
    ]
    assert DESTINATION_HEADER in removed


def test_every_pool_file_is_documented_in_operations() -> None:
    text = (DEPLOY.parent / "docs" / "operations.md").read_text(encoding="utf-8")
    assert "## Pools: several vLLM replicas per model" in text
    for path in (POOL_SERVICE, SIDECAR_POOL, KVGATE_DEPLOYMENT_POOL, ISTIO_POOL, EG_POOL):
        assert path.name in text, f"docs/operations.md does not mention {rel(path)}"
