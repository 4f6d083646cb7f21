"""deploy/: every manifest parses and has what it needs to work.

- Kubernetes objects: identity, workloads (selectors, images, ports, probes, resources,
  non-root read-only containers), Services / PDBs / NetworkPolicies that select pods of the
  same file, volumes that name objects of the same file.
- The Envoy bootstrap inside the sidecar ConfigMap passes `envoy --mode validate`, carries
  envoy/envoy.yaml's ext_proc filter unchanged, has a cluster per kvgate backend, and its
  readiness listener exposes only /ready and /stats/prometheus (a real Envoy is started).
- kvgate's config (ConfigMap + tenants Secret, joined as the init container joins them)
  passes kvgate's own validation and listens where the pod spec probes.
- Istio EnvoyFilters and the Envoy Gateway policy: ext_proc before the router, fail closed,
  message timeout >= 1 s, request body BUFFERED, response body STREAMED, the same options as
  envoy/envoy.yaml; the Istio patches validate when applied to envoy/envoy.yaml.
- PrometheusRule and Grafana expressions use only metrics (and labels) kvgate defines, besides
  Prometheus' `up` and Envoy's `envoy_*` (those are checked against a running Envoy in
  tests/deploy/test_alerts.py).
- The Dockerfile, linted structurally (no docker engine here).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from kvgate.config import parse_config
from testbed.harness import (
    REPO_ROOT,
    ManagedProcess,
    _bin,
)
from tests.deploy.manifests import (
    DASHBOARD,
    DEPLOY,
    EG_POLICY,
    EXT_PROC,
    HCM,
    ISTIO_FILTERS,
    KVGATE_DEPLOYMENT,
    KVGATE_DEPLOYMENT_POOL,
    KVGATE_IMAGE,
    NOT_ADMITTED,
    PASSTHROUGH_PREFIX,
    ROUTER,
    RULES,
    SERVICE_MONITOR,
    SIDECAR,
    TARGET_LABELS,
    apply_istio_patches,
    assert_valid_envoy,
    assumed_max_message_timeout_s,
    check_guard_routes,
    check_local_reply_config,
    check_not_admitted_response,
    container,
    dashboard,
    docs,
    duration_s,
    envoy_reference,
    ext_proc_config,
    header_match,
    ingress_hcm,
    istio_inbound_bootstrap,
    k8s_files,
    kvgate_config_of,
    kvgate_metrics,
    kvgate_pool_config_of,
    ns,
    objects,
    one,
    pod_templates,
    port_of,
    promql_names,
    recording_rules,
    rel,
    removed_prefixes,
    selects,
    shipped_bootstraps,
    sidecar_bootstrap,
    sidecar_bootstrap_on_loopback,
    without_cluster_name,
    workload_files,
    yaml_files,
)
from tests.e2e.envoy_configs import envoy_bootstraps

PREVIEW = DEPLOY / "grafana" / "render_preview.py"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
DOCKERIGNORE = DEPLOY / "docker" / "Dockerfile.dockerignore"

ENVOY_IMAGE = "envoyproxy/envoy:v1.40-latest"
KVGATE_UID = 10001
ISTIO_KVGATE_CLUSTER = "outbound|50051||kvgate.kvgate-system.svc.cluster.local"

# Containers that serve nothing (no ports, no probes): the config file follower.
HELPER_CONTAINERS = {"config-sync"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "GatewayClass"}


# --------------------------------------------------------------------------- Envoy helpers


def check_ext_proc(config: dict[str, Any], where: str) -> None:
    """The admission-critical settings, whatever else differs."""
    assert config["failure_mode_allow"] is False, f"{where}: must fail closed"
    assert duration_s(config["message_timeout"]) >= 1.0, f"{where}: message_timeout < 1 s"
    # A pool's queue extends the deadline with override_message_timeout; Envoy ignores it
    # beyond max_message_timeout (0, the default: always).
    assert duration_s(config.get("max_message_timeout", "0s")) >= assumed_max_message_timeout_s(), (
        f"{where}: max_message_timeout below what kvgate assumes (envoy_max_message_timeout_s)"
    )
    mode = config["processing_mode"]
    assert mode["request_header_mode"] == "SEND", where
    assert mode["request_body_mode"] == "BUFFERED", where
    assert mode["response_header_mode"] == "SEND", where
    assert mode["response_body_mode"] == "STREAMED", where
    assert config["metadata_options"]["receiving_namespaces"]["untyped"] == ["kvgate"], where
    assert config.get("send_body_without_waiting_for_header_response", False) is False, where


# --------------------------------------------------------------------------- every YAML


@pytest.mark.parametrize("path", yaml_files(), ids=rel)
def test_yaml_parses(path: Path) -> None:
    loaded = docs(path)
    assert loaded, f"{rel(path)}: no documents"
    assert all(isinstance(d, dict) for d in loaded), f"{rel(path)}: a document is not a map"


def test_deploy_has_the_expected_files() -> None:
    for path in [SIDECAR, KVGATE_DEPLOYMENT, *ISTIO_FILTERS, EG_POLICY, RULES, DASHBOARD]:
        assert path.is_file(), rel(path)
    assert {rel(p) for p in k8s_files()} >= {rel(SIDECAR), rel(KVGATE_DEPLOYMENT), rel(RULES)}


@pytest.mark.parametrize("path", k8s_files(), ids=rel)
def test_k8s_objects_have_identity(path: Path) -> None:
    seen: set[tuple[str, str | None, str]] = set()
    for obj in docs(path):
        assert obj.get("apiVersion"), f"{rel(path)}: object without apiVersion: {obj}"
        assert obj.get("kind"), f"{rel(path)}: object without kind"
        name = obj.get("metadata", {}).get("name")
        assert name, f"{rel(path)}: {obj['kind']} without metadata.name"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name), f"bad name {name!r}"
        if obj["kind"] not in CLUSTER_SCOPED:
            assert ns(obj), f"{rel(path)}: {obj['kind']}/{name} has no namespace"
        key = (obj["kind"], ns(obj), name)
        assert key not in seen, f"{rel(path)}: {key} twice"
        seen.add(key)
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/part-of") == "kvgate", f"{key}: part-of label"


def test_objects_in_several_files_are_identical() -> None:
    by_key: dict[tuple[str, str | None, str], tuple[Path, dict[str, Any]]] = {}
    for path in k8s_files():
        for obj in docs(path):
            key = (obj["kind"], ns(obj), obj["metadata"]["name"])
            if key in by_key:
                other_path, other = by_key[key]
                assert obj == other, f"{key} differs between {rel(other_path)} and {rel(path)}"
            by_key[key] = (path, obj)


# --------------------------------------------------------------------------- workloads


def test_workload_files() -> None:
    assert set(workload_files()) == {SIDECAR, KVGATE_DEPLOYMENT}


@pytest.mark.parametrize("path", workload_files(), ids=rel)
def test_workloads_are_complete(path: Path) -> None:
    configmaps = {o["metadata"]["name"] for o in objects(path, "ConfigMap")}
    secrets = {o["metadata"]["name"] for o in objects(path, "Secret")}
    accounts = {o["metadata"]["name"] for o in objects(path, "ServiceAccount")}
    for workload, template in pod_templates(path):
        name = workload["metadata"]["name"]
        match = workload["spec"]["selector"]["matchLabels"]
        labels = template["metadata"]["labels"]
        assert match and all(labels.get(k) == v for k, v in match.items()), (
            f"{name}: selector {match} does not match the template labels {labels}"
        )
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec.get("serviceAccountName") in accounts, f"{name}: service account"
        assert spec.get("automountServiceAccountToken") is False, name
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps, volume
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets, volume

        for c in spec.get("initContainers", []) + spec["containers"]:
            where = f"{name}/{c['name']}"
            assert c.get("image") in (KVGATE_IMAGE, ENVOY_IMAGE), f"{where}: image {c.get('image')}"
            resources = c.get("resources", {})
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources.get(part, {})), f"{where}: {part}"
            security = c.get("securityContext", {})
            assert security.get("runAsNonRoot") is True, where
            assert security.get("runAsUser", 0) != 0, where
            assert security.get("readOnlyRootFilesystem") is True, where
            assert security.get("allowPrivilegeEscalation") is False, where
            assert security.get("capabilities", {}).get("drop") == ["ALL"], where
            if c["image"] == KVGATE_IMAGE:
                assert security["runAsUser"] == KVGATE_UID, f"{where}: the image's user"
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{where}: volume {mount['name']}"

        for c in spec["containers"]:
            where = f"{name}/{c['name']}"
            if c["name"] in HELPER_CONTAINERS:
                assert "ports" not in c, f"{where}: a helper serves nothing"
                continue
            ports = c.get("ports", [])
            assert ports, f"{where}: no ports"
            names = {p["name"] for p in ports}
            numbers = {p["containerPort"] for p in ports}
            assert c.get("readinessProbe") and c.get("livenessProbe"), f"{where}: probes"
            for probe_kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(probe_kind)
                if probe is None:
                    continue
                (handler,) = [k for k in ("httpGet", "tcpSocket", "grpc", "exec") if k in probe]
                if handler != "exec":
                    port = probe[handler]["port"]
                    assert port in numbers or port in names, f"{where}: {probe_kind} port {port}"


@pytest.mark.parametrize("path", workload_files(), ids=rel)
def test_selectors_select_pods_of_the_same_file(path: Path) -> None:
    pods = [(ns(w), t["metadata"]["labels"], t["spec"]) for w, t in pod_templates(path)]

    def selected(obj: dict[str, Any], selector: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            spec for pod_ns, labels, spec in pods if pod_ns == ns(obj) and selects(selector, labels)
        ]

    for service in objects(path, "Service"):
        specs = selected(service, service["spec"]["selector"])
        assert specs, f"Service {service['metadata']['name']} selects no pod in {rel(path)}"
        port_names = {p["name"] for s in specs for c in s["containers"] for p in c.get("ports", [])}
        port_numbers = {
            p["containerPort"] for s in specs for c in s["containers"] for p in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in port_names or target in port_numbers, (
                f"Service {service['metadata']['name']}: targetPort {target}"
            )
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        for obj in objects(path, kind):
            key = "selector" if kind == "PodDisruptionBudget" else "podSelector"
            assert selected(obj, obj["spec"][key]), f"{kind} {obj['metadata']['name']}"


def test_kvgate_deployment_service_speaks_grpc() -> None:
    service = one(KVGATE_DEPLOYMENT, "Service", "kvgate")
    grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["port"] == 50051 and grpc_port["appProtocol"] == "grpc"
    assert any(p["name"] == "metrics" and p["port"] == 9464 for p in service["spec"]["ports"])
    headless = one(KVGATE_DEPLOYMENT, "Service", "kvgate-headless")
    assert headless["spec"]["clusterIP"] == "None"
    one(KVGATE_DEPLOYMENT, "PodDisruptionBudget", "kvgate")
    # All probes of the standalone kvgate use grpc.health.v1 on the ext_proc port.
    _, template = pod_templates(KVGATE_DEPLOYMENT)[0]
    kvgate = container(template, "kvgate")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert kvgate[probe]["grpc"] == {"port": 50051}, probe
    text = KVGATE_DEPLOYMENT.read_text(encoding="utf-8")
    assert "HTTP/2" in text and "http2_protocol_options" in text


# --------------------------------------------------------------------------- kvgate config


@pytest.mark.parametrize("path", workload_files(), ids=rel)
def test_kvgate_config_is_valid_and_matches_the_pod(path: Path) -> None:
    merged, workload = kvgate_config_of(path)
    config = parse_config(merged, f"{rel(path)} (ConfigMap + Secret)")
    assert config.store == "memory"
    template = workload["spec"]["template"]
    kvgate = container(template, "kvgate")
    ports = {p["name"]: p["containerPort"] for p in kvgate["ports"]}
    http_host, _, _ = config.server.http_listen.rpartition(":")
    assert http_host == "0.0.0.0", "the kubelet and Prometheus reach kvgate on the pod IP"
    assert port_of(config.server.http_listen) == ports["metrics"] == 9464
    assert port_of(config.server.grpc_listen) == 50051
    if "grpc" in ports:  # standalone: Envoy and the kubelet reach the gRPC port
        assert config.server.grpc_listen.startswith("0.0.0.0:") and ports["grpc"] == 50051
    else:  # sidecar: only the Envoy of the same pod
        assert config.server.grpc_listen.startswith("127.0.0.1:")
    # Writable places under a read-only root filesystem.
    mounts = {m["mountPath"] for m in kvgate["volumeMounts"]}
    assert any(config.server.tokenizer_cache_dir.startswith(m + "/") for m in mounts)
    assert "/etc/kvgate" in mounts  # the image's entrypoint reads /etc/kvgate/kvgate.yaml
    # The init container joins exactly the mounted files and checks the result.
    init = container(template, "kvgate-config")
    script = " ".join(init["args"])
    init_mounts = {m["mountPath"] for m in init["volumeMounts"]}
    for file in re.findall(r"(/[\w/.-]+\.yaml)", script):
        assert str(Path(file).parent) in init_mounts, f"init container reads {file}"
    assert "kvgate check-config /etc/kvgate/kvgate.yaml" in script


@pytest.mark.parametrize("path", workload_files(), ids=rel)
def test_config_sync_follows_changes(path: Path, tmp_path: Path) -> None:
    """Run the config-sync script (paths moved to tmp_path, 0.1 s period) with /bin/sh."""
    _, workload = kvgate_config_of(path)
    template = workload["spec"]["template"]
    init, sync = container(template, "kvgate-config"), container(template, "config-sync")
    assert sync["command"] == ["/bin/sh", "-c"]
    assert {m["mountPath"] for m in sync["volumeMounts"]} == {
        m["mountPath"] for m in init["volumeMounts"]
    }, "the init container and config-sync must join the same files"
    base_dir, tenants_dir, out_dir = (tmp_path / d for d in ("base", "tenants", "etc"))
    for d in (base_dir, tenants_dir, out_dir):
        d.mkdir()
    (base_dir / "kvgate.yaml").write_text(
        one(path, "ConfigMap", "kvgate-config")["data"]["kvgate.yaml"], encoding="utf-8"
    )
    tenants_file = tenants_dir / "tenants.yaml"
    tenants_file.write_text(
        one(path, "Secret", "kvgate-tenants")["stringData"]["tenants.yaml"], encoding="utf-8"
    )
    script = sync["args"][0]
    assert "sleep 10" in script
    script = (
        script.replace("/config/base", str(base_dir))
        .replace("/config/tenants", str(tenants_dir))
        .replace("/etc/kvgate", str(out_dir))
        .replace("sleep 10", "sleep 0.1")
    )
    target = out_dir / "kvgate.yaml"

    def wait_for(predicate: Any, what: str) -> None:
        deadline = time.monotonic() + 10
        while not predicate():
            assert time.monotonic() < deadline, f"config-sync: {what}"
            time.sleep(0.05)

    proc = subprocess.Popen(["/bin/sh", "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        wait_for(target.exists, "no config written")
        merged, _ = kvgate_config_of(path)
        assert yaml.safe_load(target.read_text(encoding="utf-8")) == merged
        inode = target.stat().st_ino
        time.sleep(0.5)  # several periods without a change: the file is left alone
        assert target.stat().st_ino == inode
        tenants_file.write_text(
            tenants_file.read_text(encoding="utf-8").replace("team-a", "team-c"),
            encoding="utf-8",
        )
        wait_for(lambda: "team-c" in target.read_text(encoding="utf-8"), "no update")
        parse_config(yaml.safe_load(target.read_text(encoding="utf-8")))
        assert target.stat().st_ino != inode, "replaced by a rename, not rewritten in place"
        assert not list(out_dir.glob(".*.new")), "no temporary file left behind"
    finally:
        proc.terminate()
        assert proc.wait(timeout=5) == 0, "config-sync exits cleanly on SIGTERM"
    assert "updated" in (proc.stdout.read() if proc.stdout else "")


# --------------------------------------------------------------------------- Envoy (sidecar)


def test_sidecar_bootstrap_validates(tmp_path: Path) -> None:
    assert_valid_envoy(sidecar_bootstrap(), tmp_path, "sidecar-envoy.yaml")


def test_sidecar_bootstrap_keeps_the_reference_ext_proc_filter() -> None:
    config = ext_proc_config(sidecar_bootstrap())
    assert config == ext_proc_config(envoy_reference())
    check_ext_proc(config, "sidecar bootstrap")


def test_sidecar_bootstrap_matches_the_pod_and_kvgate() -> None:
    bootstrap = sidecar_bootstrap()
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}
    merged, workload = kvgate_config_of(SIDECAR)
    config = parse_config(merged)
    # kvgate routes by naming a backend; Envoy needs a cluster of that name for each.
    for backend in config.backends:
        assert backend.name in clusters, f"no Envoy cluster for kvgate backend {backend.name}"
        assert clusters[backend.name]["type"] in ("STRICT_DNS", "LOGICAL_DNS", "STATIC")
    extproc = clusters[ext_proc_config(bootstrap)["grpc_service"]["envoy_grpc"]["cluster_name"]]
    address = extproc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"
    ]
    assert f"{address['address']}:{address['port_value']}" == config.server.grpc_listen
    assert "http2_protocol_options" in json.dumps(extproc)
    assert extproc["health_checks"][0]["grpc_health_check"] == {}
    vllm = clusters["vllm"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert vllm["address"]["socket_address"]["address"].endswith(".svc.cluster.local")
    # The admin interface stays on loopback; probes use the readiness listener.
    assert bootstrap["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    template = workload["spec"]["template"]
    envoy = container(template, "envoy")
    listeners = {
        listener["name"]: listener["address"]["socket_address"]["port_value"]
        for listener in bootstrap["static_resources"]["listeners"]
    }
    ports = {p["name"]: p["containerPort"] for p in envoy["ports"]}
    assert ports["http"] == listeners["ingress"]
    assert envoy["readinessProbe"]["httpGet"] == {"path": "/ready", "port": listeners["readiness"]}
    assert "/etc/envoy/envoy.yaml" in envoy["args"]


def test_sidecar_readiness_listener_exposes_only_ready_and_stats(tmp_path: Path) -> None:
    """Run the real Envoy on the bootstrap (moved to free loopback ports)."""
    bootstrap, _admin, _ingress, readiness = sidecar_bootstrap_on_loopback()
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False), encoding="utf-8")
    argv = [_bin("envoy"), "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
    with ManagedProcess("envoy-sidecar", argv, log_dir=tmp_path) as envoy:
        envoy.wait_http(f"http://127.0.0.1:{readiness}/ready", timeout=30)
        with urllib.request.urlopen(
            f"http://127.0.0.1:{readiness}/stats/prometheus", timeout=5
        ) as resp:
            assert resp.status == 200
            assert "envoy_cluster_" in resp.read().decode()
        for method, page in (
            ("GET", "/clusters"),
            ("GET", "/config_dump"),
            ("POST", "/quitquitquit"),
        ):
            request = urllib.request.Request(
                f"http://127.0.0.1:{readiness}{page}",
                data=b"" if method == "POST" else None,
                method=method,
            )
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(request, timeout=5)
            assert err.value.code == 404, page
        assert envoy.running


def _commented_cluster(text: str) -> dict[str, Any]:
    """The kvgate_extproc cluster snippet in the header comment of kvgate-deployment.yaml."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("#   - name: kvgate_extproc"))
    block = []
    for line in lines[start:]:
        if not line.startswith("#   "):
            break
        block.append(line[4:])
    (cluster,) = yaml.safe_load("\n".join(block))
    assert isinstance(cluster, dict)
    return cluster


def test_documented_http2_cluster_validates(tmp_path: Path) -> None:
    snippet = _commented_cluster(KVGATE_DEPLOYMENT.read_text(encoding="utf-8"))
    reference = envoy_reference()
    clusters = reference["static_resources"]["clusters"]
    index = next(i for i, c in enumerate(clusters) if c["name"] == snippet["name"])
    clusters[index] = {**clusters[index], **snippet}
    assert_valid_envoy(reference, tmp_path, "deployment-cluster.yaml")
    address = snippet["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"
    ]
    headless = one(KVGATE_DEPLOYMENT, "Service", "kvgate-headless")
    assert address["address"] == (
        f"{headless['metadata']['name']}.{ns(headless)}.svc.cluster.local"
    )
    assert address["port_value"] == 50051


# --------------------------------------------------------------------------- Istio


def istio_filters() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, f) for p in ISTIO_FILTERS for f in objects(p, "EnvoyFilter")]


def ext_proc_patch(envoy_filter: dict[str, Any]) -> dict[str, Any]:
    patches = [
        p
        for p in envoy_filter["spec"]["configPatches"]
        if p["applyTo"] == "HTTP_FILTER" and p["patch"]["value"]["name"] == EXT_PROC
    ]
    assert len(patches) == 1
    return patches[0]


JWT_AUTHN_NAMESPACE = "envoy.filters.http.jwt_authn"
EXT_AUTHZ_NAMESPACE = "envoy.filters.http.ext_authz"


@pytest.mark.parametrize("path", ISTIO_FILTERS, ids=rel)
def test_istio_envoyfilter_inserts_ext_proc_before_the_router(path: Path) -> None:
    (envoy_filter,) = objects(path, "EnvoyFilter")
    assert envoy_filter["apiVersion"] == "networking.istio.io/v1alpha3"
    assert envoy_filter["spec"]["workloadSelector"]["labels"]
    patch = ext_proc_patch(envoy_filter)
    match = patch["match"]
    assert match["context"] in ("GATEWAY", "SIDECAR_INBOUND")
    chain_filter = match["listener"]["filterChain"]["filter"]
    assert chain_filter["name"] == HCM
    assert chain_filter["subFilter"]["name"] == ROUTER
    assert patch["patch"]["operation"] == "INSERT_BEFORE"
    config = patch["patch"]["value"]["typed_config"]
    check_ext_proc(config, rel(path))
    # Everything but the cluster is envoy/envoy.yaml's filter; the allow-list regex is the
    # same allow-list in fewer RE2 instructions (equivalence: tests/deploy/test_istio.py).
    reference = ext_proc_config(envoy_reference())
    for each in (config, reference):
        each["mutation_rules"]["allow_expression"].pop("regex")
    # Beyond envoy/envoy.yaml: the identity the mesh verified goes to kvgate (jwt_authn's
    # payload from a RequestAuthentication, an ext_authz server's answer; deploy/istio/
    # identity.yaml), and nothing else.
    forwarded = config["metadata_options"].pop("forwarding_namespaces")
    assert forwarded == {"untyped": [JWT_AUTHN_NAMESPACE, EXT_AUTHZ_NAMESPACE]}
    assert without_cluster_name(config) == without_cluster_name(reference)
    assert config["grpc_service"]["envoy_grpc"]["cluster_name"] == ISTIO_KVGATE_CLUSTER
    # Every patch targets the same proxies (context) as the filter.
    for other in envoy_filter["spec"]["configPatches"]:
        assert other["match"]["context"] == match["context"]


def test_istio_cluster_is_the_kvgate_service() -> None:
    _, _, _, host = ISTIO_KVGATE_CLUSTER.split("|")
    name, namespace = host.split(".")[:2]
    service = one(KVGATE_DEPLOYMENT, "Service", name)
    assert ns(service) == namespace
    port = int(ISTIO_KVGATE_CLUSTER.split("|")[1])
    assert any(
        p["port"] == port and p.get("appProtocol") == "grpc" for p in service["spec"]["ports"]
    ), "Istio uses HTTP/2 for the port only when it is declared gRPC"
    rule = one(DEPLOY / "istio" / "kvgate-destinationrule.yaml", "DestinationRule", "kvgate")
    assert rule["spec"]["host"] == host
    assert rule["spec"]["trafficPolicy"]["connectionPool"]["http"]["http2MaxRequests"] >= 10000


@pytest.mark.parametrize("path", ISTIO_FILTERS, ids=rel)
def test_istio_patches_validate_on_envoy_yaml(path: Path, tmp_path: Path) -> None:
    """Apply the patches (roughly as istiod would) to envoy/envoy.yaml and validate."""
    (envoy_filter,) = objects(path, "EnvoyFilter")
    config = apply_istio_patches(envoy_reference(), envoy_filter)
    assert_valid_envoy(config, tmp_path, f"istio-{path.stem}.yaml")


def test_istio_inbound_bootstrap_validates(tmp_path: Path) -> None:
    assert_valid_envoy(istio_inbound_bootstrap(), tmp_path, "istio-inbound.yaml")


def test_istio_gateway_routes_every_kvgate_backend() -> None:
    merged, _ = kvgate_config_of(KVGATE_DEPLOYMENT)
    pool = kvgate_pool_config_of(KVGATE_DEPLOYMENT_POOL, KVGATE_DEPLOYMENT)
    backends = {b["name"] for b in merged["backends"] + pool["backends"]}
    service = one(ISTIO_FILTERS[0], "VirtualService", "llm")
    routed = {
        m["headers"]["x-kvgate-backend"]["exact"]
        for route in service["spec"]["http"]
        for m in route.get("match", [])
        if "x-kvgate-backend" in m.get("headers", {})
    }
    assert routed == backends
    last = service["spec"]["http"][-1]
    assert "match" not in last and "route" not in last, "the last route answers locally"
    assert last["directResponse"]["status"] == 500
    gateway = one(ISTIO_FILTERS[0], "Gateway", "llm-gateway")
    assert f"{ns(gateway)}/{gateway['metadata']['name']}" in service["spec"]["gateways"]


# --------------------------------------------------------------------------- Envoy Gateway


def test_envoy_gateway_policy() -> None:
    policy = one(EG_POLICY, "EnvoyExtensionPolicy")
    assert policy["apiVersion"] == "gateway.envoyproxy.io/v1alpha1"
    (ext_proc,) = policy["spec"]["extProc"]
    assert ext_proc["failOpen"] is False
    assert duration_s(ext_proc["messageTimeout"]) >= 1.0
    assert ext_proc["processingMode"]["request"]["body"] == "Buffered"
    assert ext_proc["processingMode"]["response"]["body"] == "Streamed"
    assert ext_proc["metadata"]["writableNamespaces"] == ["kvgate"]
    # The backend is the kvgate Service of kvgate-deployment.yaml, allowed by a ReferenceGrant.
    (backend,) = ext_proc["backendRefs"]
    service = one(KVGATE_DEPLOYMENT, "Service", backend["name"])
    assert backend.get("namespace", ns(policy)) == ns(service)
    assert backend["port"] in {p["port"] for p in service["spec"]["ports"]}
    grant = one(EG_POLICY, "ReferenceGrant")
    assert ns(grant) == ns(service)
    assert {
        "group": "gateway.envoyproxy.io",
        "kind": "EnvoyExtensionPolicy",
        "namespace": ns(policy),
    } in grant["spec"]["from"]
    assert {"group": "", "kind": "Service", "name": service["metadata"]["name"]} in grant["spec"][
        "to"
    ]
    # Targets exist in the same file.
    for target in policy["spec"]["targetRefs"]:
        one(EG_POLICY, target["kind"], target["name"])


def test_envoy_gateway_routes_every_kvgate_backend() -> None:
    merged, _ = kvgate_config_of(KVGATE_DEPLOYMENT)
    pool = kvgate_pool_config_of(KVGATE_DEPLOYMENT_POOL, KVGATE_DEPLOYMENT)
    backends = {b["name"] for b in merged["backends"] + pool["backends"]}
    route = one(EG_POLICY, "HTTPRoute", "llm")
    routed = {
        h["value"]
        for rule in route["spec"]["rules"]
        for m in rule.get("matches", [])
        for h in m.get("headers", [])
        if h["name"] == "x-kvgate-backend"
    }
    assert routed == backends
    traffic = one(EG_POLICY, "ClientTrafficPolicy")
    removed = set(traffic["spec"]["headers"]["earlyRequestHeaders"]["remove"])
    assert {"x-kvgate-backend", "x-kvgate-tenant", "x-kvgate-model"} <= removed


# --------------------------------------------------------------------------- the edge
# Who may reach a backend (only what kvgate admitted), and who may steer Envoy (no client),
# asserted for every shipped config. tests/e2e/test_edge_holes.py runs the real Envoy on them.

# x-envoy-* request headers a client could use to make Envoy retry, time out, hedge or
# mislabel a request; every config removes at least these.
ENVOY_CONTROL_HEADERS = (
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-max-retries",
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-hedge-on-per-try-timeout",
    "x-envoy-original-path",
    "x-envoy-internal",
)


def removed_by_regex(hcm: dict[str, Any]) -> list[str]:
    regexes = []
    for extension in hcm.get("early_header_mutation_extensions", []):
        for mutation in extension["typed_config"]["mutations"]:
            matcher = mutation.get("remove_on_match", {}).get("key_matcher", {})
            if "safe_regex" in matcher:
                regexes.append(matcher["safe_regex"]["regex"])
    return regexes


@pytest.mark.parametrize("name", sorted(shipped_bootstraps()))
def test_bootstrap_edge_settings(name: str) -> None:
    bootstrap = shipped_bootstraps()[name]
    hcm = ingress_hcm(bootstrap)
    # Clients are external: Envoy honours no x-envoy-* header of theirs.
    assert hcm["use_remote_address"] is True, name
    assert hcm["xff_num_trusted_hops"] == 0, name
    assert hcm["internal_address_config"] == {}, f"{name}: no address may count as internal"
    assert {"x-kvgate-", "x-envoy-"} <= removed_prefixes(hcm), name
    (vhost,) = hcm["route_config"]["virtual_hosts"]
    assert "retry_policy" not in vhost, name
    check_guard_routes(vhost["routes"], name)
    # The pass-through route is chosen on a header kvgate sets without asking for a re-match.
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == EXT_PROC]
    assert ext_proc["typed_config"]["route_cache_action"] == "CLEAR", name
    # Backend clusters refuse retries outright.
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["name"] in ("kvgate_extproc", "envoy_admin"):
            continue
        thresholds = cluster["circuit_breakers"]["thresholds"]
        assert {t["priority"] for t in thresholds} == {"DEFAULT", "HIGH"}, name
        assert all(t["max_retries"] == 0 for t in thresholds), f"{name}: {cluster['name']}"


def test_every_envoy_bootstrap_is_checked() -> None:
    assert {rel(p) for p in envoy_bootstraps()} <= set(shipped_bootstraps())


def _network_patch(path: Path) -> dict[str, Any]:
    (envoy_filter,) = objects(path, "EnvoyFilter")
    (patch,) = [
        p for p in envoy_filter["spec"]["configPatches"] if p["applyTo"] == "NETWORK_FILTER"
    ]
    value: dict[str, Any] = patch["patch"]["value"]["typed_config"]
    return value


def test_istio_gateway_edge() -> None:
    hcm = _network_patch(ISTIO_FILTERS[0])
    assert hcm["use_remote_address"] is True
    assert {"x-kvgate-", "x-envoy-"} <= removed_prefixes(hcm)
    (envoy_filter,) = objects(ISTIO_FILTERS[0], "EnvoyFilter")
    assert (
        ext_proc_patch(envoy_filter)["patch"]["value"]["typed_config"]["route_cache_action"]
        == "CLEAR"
    )
    service = one(ISTIO_FILTERS[0], "VirtualService", "llm")
    routes = service["spec"]["http"]
    for route in routes:
        if "directResponse" in route:
            continue
        # Istio retries by default (2 attempts): a retry is a second generation.
        assert route["retries"] == {"attempts": 0}, route["name"]
        for match in route["match"]:
            headers = match.get("headers", {})
            if "x-kvgate-backend" in headers:
                assert set(match) == {"headers"}
                assert set(headers["x-kvgate-backend"]) == {"exact"}
            else:
                assert headers == {"x-kvgate-tenant": {"regex": ".+"}}, route["name"]
                assert match["uri"] in ({"exact": "/v1/models"}, {"prefix": "/v1/models/"})
    last = routes[-1]
    assert set(last) == {"name", "directResponse", "headers"}
    assert last["directResponse"]["status"] == 500
    assert json.loads(last["directResponse"]["body"]["string"]) == NOT_ADMITTED
    assert last["headers"] == {"response": {"set": {"content-type": "application/json"}}}


def test_istio_sidecar_edge() -> None:
    hcm = _network_patch(ISTIO_FILTERS[1])
    assert "x-kvgate-" in removed_prefixes(hcm)
    # The control headers go; Istio's own metadata exchange between sidecars stays.
    # By exact name: one regex for them all is over RE2's default program size.
    assert not removed_by_regex(hcm)
    removed = {
        m["remove_on_match"]["key_matcher"].get("exact")
        for e in hcm["early_header_mutation_extensions"]
        for m in e["typed_config"]["mutations"]
    }
    assert set(ENVOY_CONTROL_HEADERS) <= removed
    for name in ("x-envoy-peer-metadata", "x-envoy-peer-metadata-id", "x-envoy-attempt-count"):
        assert name not in removed, name
    # On Istio's inbound route table, the guard routes come first (after the unmetered GETs
    # of tests/deploy/test_istio.py), then Istio's own route.
    inbound = istio_inbound_bootstrap()
    (vhost,) = ingress_hcm(inbound)["route_config"]["virtual_hosts"]
    guards = [r for r in vhost["routes"][:-1] if "direct_response" in r]
    istio_default = vhost["routes"][-1]
    assert istio_default["name"] == "default"
    assert len(guards) == 2
    for route in guards:
        check_not_admitted_response(route, route["name"])
        assert header_match(route, "x-kvgate-backend") == {
            "name": "x-kvgate-backend",
            "present_match": False,
        }
    (other_paths,) = [r for r in guards if r["match"].get("prefix") == "/"]
    (path_header,) = [h for h in other_paths["match"]["headers"] if h["name"] == ":path"]
    assert path_header["invert_match"] is True
    models = path_header["string_match"]["safe_regex"]["regex"]
    for path in ("/v1/models", "/v1/models/m", "/v1/models?x=1", "/v1/models/m?x=/y"):
        assert re.fullmatch(models, path), path
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/modelsx", "/v1/models2/x"):
        assert not re.fullmatch(models, path), path


def test_envoy_gateway_edge() -> None:
    traffic = one(EG_POLICY, "ClientTrafficPolicy")
    # The TCP peer, as use_remote_address (tests/deploy/test_envoy_gateway.py says why).
    assert "clientIPDetection" not in traffic["spec"]
    removed = set(traffic["spec"]["headers"]["earlyRequestHeaders"]["remove"])
    assert set(ENVOY_CONTROL_HEADERS) <= removed
    for policy in objects(EG_POLICY, "BackendTrafficPolicy"):
        assert "retry" not in policy["spec"], "no retry policy for generations"
    route = one(EG_POLICY, "HTTPRoute", "llm")
    guard = None
    for rule in route["spec"]["rules"]:
        assert "retry" not in rule
        (match,) = rule["matches"]
        if "backendRefs" not in rule:
            assert match == {"path": {"type": "PathPrefix", "value": "/"}}
            (filter_,) = rule["filters"]
            guard = filter_["extensionRef"]
            continue
        headers = match.get("headers", [])
        if headers:
            assert [h["name"] for h in headers] == ["x-kvgate-backend"]
        else:
            # The documented deviation: the pass-through path alone.
            assert match == {"path": {"type": "PathPrefix", "value": PASSTHROUGH_PREFIX}}
    assert guard is not None and guard["kind"] == "HTTPRouteFilter"
    response = one(EG_POLICY, "HTTPRouteFilter", guard["name"])["spec"]["directResponse"]
    assert response["statusCode"] == 500
    assert response["contentType"] == "application/json"
    assert response["body"]["type"] == "Inline"
    assert json.loads(response["body"]["inline"]) == NOT_ADMITTED


# --------------------------------------------------------------------------- local replies
# Envoy's own local replies become OpenAI-shaped JSON, Anthropic-shaped on the Messages API's
# paths; kvgate's ImmediateResponses (details kvgate_*) and the not_admitted direct response
# (details direct_response; but on the Messages API's paths) are left alone.
# tests/e2e/test_local_replies.py and test_local_replies_anthropic.py run the real Envoy on
# envoy/envoy.yaml's mappers.


def test_reference_local_reply_config() -> None:
    check_local_reply_config(ingress_hcm(envoy_reference())["local_reply_config"], "envoy.yaml")


@pytest.mark.parametrize("name", sorted(shipped_bootstraps()))
def test_bootstrap_local_replies(name: str) -> None:
    """Every shipped bootstrap has envoy/envoy.yaml's mappers on its ingress HCM."""
    hcm = ingress_hcm(shipped_bootstraps()[name])
    reference = ingress_hcm(envoy_reference())["local_reply_config"]
    assert hcm["local_reply_config"] == reference, name


@pytest.mark.parametrize("path", ISTIO_FILTERS, ids=rel)
def test_istio_merges_the_local_replies(path: Path) -> None:
    merged = _network_patch(path)["local_reply_config"]
    assert merged == ingress_hcm(envoy_reference())["local_reply_config"], rel(path)


def test_envoy_gateway_local_replies() -> None:
    """responseOverride matches on status alone: only codes kvgate never answers itself
    (its 503 / 500 / 4xx bodies must pass unchanged)."""
    (policy,) = [
        p for p in objects(EG_POLICY, "BackendTrafficPolicy") if "responseOverride" in p["spec"]
    ]
    for target in policy["spec"]["targetRefs"]:
        one(EG_POLICY, target["kind"], target["name"])
    seen = set()
    for rule in policy["spec"]["responseOverride"]:
        statuses = {c["value"] for c in rule["match"]["statusCodes"] if c["type"] == "Value"}
        assert all(c["type"] == "Value" for c in rule["match"]["statusCodes"])
        assert statuses <= {413, 502, 504}, statuses
        seen |= statuses
        response = rule["response"]
        assert response["contentType"] == "application/json"
        error = json.loads(response["body"]["inline"])["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
        assert error["type"] == ("invalid_request_error" if min(statuses) < 500 else "server_error")
    assert seen == {413, 502, 504}


# --------------------------------------------------------------------------- PromQL names


def external_series(name: str) -> bool:
    """Prometheus' own `up`, or Envoy's stats: tests/deploy/test_alerts.py checks those."""
    return name == "up" or name.startswith("envoy_")


def labels_of(name: str) -> set[str] | None:
    """Label names a series can carry (None: unknown, don't check)."""
    known = kvgate_metrics()
    if name == "up":
        return set(TARGET_LABELS)
    if external_series(name):
        return None
    if name in known:
        labels = known[name]
        return None if labels is None else set(labels) | TARGET_LABELS
    if name in recording_rules():
        found: set[str] = set(TARGET_LABELS)
        for inner in promql_names(recording_rules()[name])[0]:
            inner_labels = labels_of(inner)
            if inner_labels is None:
                return None
            found |= inner_labels
        return found
    raise AssertionError(f"{name} is neither a kvgate metric nor a recording rule")


def check_expr(expr: str, where: str) -> set[str]:
    names, selectors, grouping = promql_names(expr)
    assert names, f"{where}: no series in {expr!r}"
    for name in names:
        assert name in kvgate_metrics() or name in recording_rules() or external_series(name), (
            f"{where}: {name} is not a metric kvgate defines ({expr!r})"
        )
    available: set[str] = set()
    unknown = False
    for name in names:
        labels = labels_of(name)
        if labels is None:
            unknown = True
        else:
            available |= labels
    for name, matcher_labels in selectors:
        labels = labels_of(name)
        if labels is not None:
            assert matcher_labels <= labels, (
                f"{where}: {name} has no label(s) {matcher_labels - labels}"
            )
    if not unknown:
        assert grouping <= available, (
            f"{where}: grouping by unknown label(s) {grouping - available}"
        )
    return names


def test_promql_name_extraction() -> None:
    names, selectors, grouping = promql_names(
        'sum by (tenant) (rate(kvgate_prompt_tokens_total{tenant=~"$tenant"}[$__rate_interval]))'
        " / ignoring (reason) group_left sum(kvgate:requests:rate5m) > 0.9"
    )
    assert names == {"kvgate_prompt_tokens_total", "kvgate:requests:rate5m"}
    assert selectors == [("kvgate_prompt_tokens_total", {"tenant"})]
    assert grouping == {"tenant", "reason"}
    with pytest.raises(AssertionError):
        check_expr("rate(kvgate_no_such_metric_total[5m])", "test")
    with pytest.raises(AssertionError):
        check_expr('kvgate_requests_total{tenant="a"}', "test")  # no tenant label there
    with pytest.raises(AssertionError):
        check_expr("sum by (model) (kvgate_kv_budget_tokens)", "test")


def test_known_metric_names() -> None:
    names = kvgate_metrics()
    assert names["kvgate_requests_total"] == ("outcome", "reason")
    assert "kvgate_decision_seconds_bucket" in names and "kvgate_kv_budget_tokens" in names
    for added in (
        "kvgate_config_reloads_total",
        "kvgate_tenant_rejections_total",
        "kvgate_store_errors_total",
    ):
        assert added in names


# --------------------------------------------------------------------------- Prometheus


def test_prometheus_rules() -> None:
    rule_object = one(RULES, "PrometheusRule")
    assert rule_object["apiVersion"] == "monitoring.coreos.com/v1"
    alerts: dict[str, dict[str, Any]] = {}
    for group in rule_object["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert ("alert" in rule) != ("record" in rule), rule
            name = rule.get("alert") or rule["record"]
            check_expr(rule["expr"], name)
            if "record" in rule:
                assert re.fullmatch(r"kvgate:[a-z0-9_]+:[a-z0-9_]+", name), name
            else:
                alerts[name] = rule
                assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
                assert rule["annotations"]["summary"] and rule["annotations"]["description"]
                duration_s(rule.get("for", "0s"))

    def alert_using(metric: str) -> dict[str, Any]:
        found = [
            a
            for a in alerts.values()
            if metric in promql_names(a["expr"])[0]
            or any(
                metric in promql_names(recording_rules()[r])[0]
                for r in promql_names(a["expr"])[0]
                if r in recording_rules()
            )
        ]
        assert found, f"no alert uses {metric}"
        return found[0]

    saturation = alert_using("kvgate_kv_tokens_in_flight")
    assert "0.9" in saturation["expr"] and duration_s(saturation["for"]) == 300
    assert "kvgate_kv_budget_tokens" in recording_rules()["kvgate:kv_utilization:ratio"]
    assert "increase(" in alert_using("kvgate_prompt_count_mismatches_total")["expr"]
    alert_using("kvgate_internal_errors_total")
    alert_using("kvgate_store_errors_total")
    assert 'result="failure"' in alert_using("kvgate_config_reloads_total")["expr"]
    assert "tenant" in alert_using("kvgate_tenant_rejections_total")["expr"]
    assert 'outcome="rejected"' in alert_using("kvgate_requests_total")["expr"]
    alert_using("kvgate_expired_leases_total")


def test_service_monitor_selects_the_metrics_services() -> None:
    monitor = one(SERVICE_MONITOR, "ServiceMonitor")
    spec = monitor["spec"]
    services = [
        s
        for path in workload_files()
        for s in objects(path, "Service")
        if ns(s) in spec["namespaceSelector"]["matchNames"]
        and selects(spec["selector"], s["metadata"].get("labels", {}))
    ]
    assert {ns(s) for s in services} == set(spec["namespaceSelector"]["matchNames"])
    port_names = {p["name"] for s in services for p in s["spec"]["ports"]}
    for endpoint in spec["endpoints"]:
        assert endpoint["port"] in port_names
    for service in services:  # kvgate's metrics on every selected Service, none twice
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    assert "kvgate-headless" not in {s["metadata"]["name"] for s in services}


# --------------------------------------------------------------------------- Grafana


def test_dashboard_structure() -> None:
    board = dashboard()
    assert board["schemaVersion"] >= 38
    assert board["title"] and board["uid"]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name, metric in (
        ("tenant", "kvgate_prompt_tokens_total"),
        ("backend", "kvgate_kv_budget_tokens"),
    ):
        query = variables[name]["query"]
        query = query["query"] if isinstance(query, dict) else query
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
        assert match and match[1] == metric and match[2] == name, query
        assert name in (kvgate_metrics()[metric] or ()), f"{metric} has no label {name}"

    panels = board["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], int] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) and pos[k] >= 0 for k in ("x", "y", "w", "h")), pos
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"panels {cells.get((x, y))} and {panel['id']} overlap"
                cells[(x, y)] = panel["id"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"


def test_dashboard_expressions_use_kvgate_metrics() -> None:
    used: set[str] = set()
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            used |= check_expr(target["expr"], f"panel {panel['title']!r}")
    required = {
        "kvgate_requests_total",  # admitted vs rejected by reason
        "kvgate_kv_tokens_in_flight",  # KV in flight vs budget
        "kvgate_kv_budget_tokens",
        "kvgate_prompt_tokens_total",  # tokens/s by tenant
        "kvgate_output_tokens_total",
        "kvgate_cost_usd_total",  # cost/h by tenant
        "kvgate_reserved_unused_tokens_total",  # reservation unused ratio
        "kvgate_prompt_count_error_tokens_bucket",
        "kvgate_decision_seconds_bucket",  # decision latency
        "kvgate_stream_disconnects_total",  # disconnects
        "kvgate_tenant_remaining_tokens",  # remaining TPM
    }
    assert required <= used, f"missing panels for {required - used}"


# --------------------------------------------------------------------------- preview script


@cache
def preview_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvgate_render_preview", PREVIEW)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_preview_draws_every_dashboard_panel() -> None:
    titles = {p["title"] for p in dashboard()["panels"]}
    assert set(preview_module().PANELS) == titles


def test_preview_histogram_quantile_matches_prometheus() -> None:
    quantile = preview_module().histogram_quantile
    buckets = {0.001: 0.0, 0.002: 50.0, 0.005: 90.0, 0.01: 100.0, math.inf: 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.002)
    assert quantile(0.7, buckets) == pytest.approx(0.002 + 0.003 * 20 / 40)
    assert quantile(0.25, buckets) == pytest.approx(0.001 + 0.001 * 25 / 50)
    assert quantile(0.99, {1.0: 0.0, math.inf: 10.0}) == 1.0  # in +Inf: the last bound
    assert math.isnan(quantile(0.5, {1.0: 0.0, math.inf: 0.0}))


def test_preview_image_is_committed() -> None:
    image = REPO_ROOT / "docs" / "img" / "dashboard-preview.png"
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "dangling line continuation"
    return instructions


def test_dockerfile_structure() -> None:
    instructions = dockerfile_instructions()
    keywords = [k for k, _ in instructions]
    known = {
        "FROM",
        "RUN",
        "CMD",
        "LABEL",
        "EXPOSE",
        "ENV",
        "ADD",
        "COPY",
        "ENTRYPOINT",
        "VOLUME",
        "USER",
        "WORKDIR",
        "ARG",
        "ONBUILD",
        "STOPSIGNAL",
        "HEALTHCHECK",
        "SHELL",
    }
    assert set(keywords) <= known, set(keywords) - known
    # Only build arguments (the base image's) may come before the first FROM.
    first_from = keywords.index("FROM")
    assert set(keywords[:first_from]) <= {"ARG"}
    base_args = dict(a.partition("=")[::2] for _, a in instructions[:first_from])
    froms = [a for k, a in instructions if k == "FROM"]
    base = re.sub(r"\$\{(\w+)\}", lambda m: base_args[m.group(1)], froms[-1].split()[0])
    assert base.split("@")[0] == "python:3.11-slim"
    last_from = max(i for i, k in enumerate(keywords) if k == "FROM")
    users = [a for k, a in instructions[last_from:] if k == "USER"]
    assert users, "the final stage must switch to a non-root user"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and int(user) == KVGATE_UID, user
    (entrypoint,) = [a for k, a in instructions if k == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["kvgate", "serve", "--config", "/etc/kvgate/kvgate.yaml"]
    exposed = {p for k, a in instructions if k == "EXPOSE" for p in a.split()}
    assert {"50051", "9464"} <= exposed
    (healthcheck,) = [a for k, a in instructions if k == "HEALTHCHECK"]
    assert "/readyz" in healthcheck and "9464" in healthcheck
    runs = " ".join(a for k, a in instructions if k == "RUN")
    assert "pip install" in runs
    # What COPY takes from the build context exists, and the ignore file lets it through.
    ignore = DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
    for args in (a for k, a in instructions if k == "COPY" and "--from" not in a):
        for source in args.split()[:-1]:
            assert (REPO_ROOT / source).exists(), source
            assert f"!{source.rstrip('/')}" in {line.rstrip("/") for line in ignore}, source


def _iter_env_values() -> Iterator[str]:
    for path in workload_files():
        for _, template in pod_templates(path):
            for c in template["spec"]["containers"]:
                for env in c.get("env", []):
                    if "valueFrom" not in env:  # e.g. Envoy's CPU limit (resourceFieldRef)
                        yield f"{env['name']}={env.get('value')}"


def test_image_and_manifests_agree_on_paths() -> None:
    instructions = dockerfile_instructions()
    env = " ".join(a for k, a in instructions if k == "ENV")
    assert "HF_HOME=/var/cache/kvgate/hf" in env
    assert set(_iter_env_values()) == {"HF_HOME=/var/cache/kvgate/hf"}
