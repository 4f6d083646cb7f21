"""The ext_proc port as a security boundary in deploy/: the NetworkPolicy admits only the gateway
pods to kvgate's ext_proc port and only Prometheus to its metrics port; the mutual TLS variant
(deploy/kubernetes/kvgate-extproc-mtls.yaml and deploy/envoy/kvgate-extproc-mtls-cluster.yaml)
is kvgate's shipped config plus server.grpc_tls, its documented patch mounts the certificates
and moves the probes off the gRPC port, and Envoy's side validates with the real Envoy."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.admin.auth import is_loopback_listen
from kvgate.config import parse_config
from tests.admin.pki import Pki, needs_openssl
from tests.deploy.manifests import (
    DEPLOY,
    EG_POLICY,
    KVGATE_DEPLOYMENT,
    SIDECAR,
    assert_valid_envoy,
    container,
    envoy_reference,
    kvgate_config_of,
    ns,
    one,
    port_of,
    selects,
)

MTLS = DEPLOY / "kubernetes" / "kvgate-extproc-mtls.yaml"
MTLS_CLUSTER = DEPLOY / "envoy" / "kvgate-extproc-mtls-cluster.yaml"
ISTIO_GATEWAY_FILTER = DEPLOY / "istio" / "envoyfilter-gateway.yaml"
ISTIO_SIDECAR_FILTER = DEPLOY / "istio" / "envoyfilter-sidecar.yaml"
EXTPROC_PORT = 50051
METRICS_PORT = 9464
ADMIN_PORT = 50052
KVGATE_NS = "kvgate-system"
GATEWAY_ID = "spiffe://cluster.local/ns/llm-gateway/sa/llm-gateway"
KVGATE_TLS_NAME = "kvgate-headless.kvgate-system.svc.cluster.local"

Pod = tuple[str, dict[str, str]]  # (namespace, labels)


# --------------------------------------------------------------------------- NetworkPolicy


def admits(policy: dict[str, Any], pod: Pod, port: int) -> bool:
    """Whether an ingress NetworkPolicy lets `pod` (in another namespace, no ipBlock) reach
    `port` on the pods it selects: any rule whose ports include the port (none: all ports)
    and one of whose peers matches (no `from`: every source); a peer with both selectors
    needs both."""
    namespace, labels = pod
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports")
        if ports is not None and not any(p.get("port") in (None, port) for p in ports):
            continue
        peers = rule.get("from")
        if peers is None:
            return True
        for peer in peers:
            if "ipBlock" in peer:
                continue
            ns_selector = peer.get("namespaceSelector")
            pod_selector = peer.get("podSelector")
            ns_labels = {"kubernetes.io/metadata.name": namespace}
            if ns_selector is None and namespace != ns(policy):
                continue  # a podSelector alone means the policy's own namespace
            if ns_selector is not None and not selects(ns_selector, ns_labels):
                continue
            if pod_selector is not None and not selects(pod_selector, labels):
                continue
            return True
    return False


def istio_workload_labels(path: Path) -> dict[str, str]:
    (envoy_filter,) = [
        d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "EnvoyFilter"
    ]
    return envoy_filter["spec"]["workloadSelector"]["labels"]


def envoy_gateway_proxy() -> Pod:
    """Envoy Gateway labels its proxy pods with the Gateway they serve."""
    gateway = one(EG_POLICY, "Gateway")
    return (
        "envoy-gateway-system",
        {
            "gateway.envoyproxy.io/owning-gateway-name": gateway["metadata"]["name"],
            "gateway.envoyproxy.io/owning-gateway-namespace": ns(gateway),
            "app.kubernetes.io/component": "proxy",
        },
    )


def gateway_pods() -> dict[str, Pod]:
    """Every Envoy that calls the standalone kvgate's ext_proc, with its pods' labels as the
    files that deploy it say."""
    (_, sidecar_template), *_ = [
        (w, w["spec"]["template"])
        for w in yaml.safe_load_all(SIDECAR.read_text())
        if w.get("kind") == "Deployment"
    ]
    sidecar_labels = dict(sidecar_template["metadata"]["labels"])
    return {
        "istio ingress gateway": (
            "istio-system",
            {**istio_workload_labels(ISTIO_GATEWAY_FILTER), "app": "istio-ingressgateway"},
        ),
        "istio sidecar of the vLLM pods": ("llm", istio_workload_labels(ISTIO_SIDECAR_FILTER)),
        "envoy gateway proxy": envoy_gateway_proxy(),
        # A hand-written fleet, labelled like the gateway pods of gateway-with-sidecar.yaml.
        "envoy fleet": ("llm-gateway", sidecar_labels),
    }


PROMETHEUS: Pod = (
    "monitoring",
    {"app.kubernetes.io/name": "prometheus", "prometheus": "k8s"},
)
# Pods that share a namespace with an admitted one, or kvgate's own: none may open streams.
NEIGHBOURS: dict[str, Pod] = {
    "another pod of the gateways' namespace": ("llm", {"app": "chat-frontend"}),
    "a pod of the Istio namespace": ("istio-system", {"app": "istiod"}),
    "a pod of Envoy Gateway's namespace": (
        "envoy-gateway-system",
        {"app.kubernetes.io/name": "envoy-gateway"},
    ),
    "a pod of kvgate's namespace": (KVGATE_NS, {"app.kubernetes.io/name": "debug"}),
    "grafana": ("monitoring", {"app.kubernetes.io/name": "grafana"}),
}


def kvgate_policy() -> dict[str, Any]:
    return one(KVGATE_DEPLOYMENT, "NetworkPolicy", "kvgate")


def test_network_policy_rules_are_narrow() -> None:
    """Every rule names its ports and its sources, each source by namespace AND pod labels."""
    policy = kvgate_policy()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for rule in policy["spec"]["ingress"]:
        assert rule.get("ports"), f"a rule without ports opens every port: {rule}"
        assert rule.get("from"), f"a rule without sources admits everyone: {rule}"
        for peer in rule["from"]:
            assert set(peer) == {"namespaceSelector", "podSelector"}, peer
            assert peer["podSelector"].get("matchLabels"), peer
        assert {p["port"] for p in rule["ports"]} <= {EXTPROC_PORT, METRICS_PORT}


@pytest.mark.parametrize("gateway", sorted(gateway_pods()))
def test_gateways_reach_ext_proc_and_nothing_else(gateway: str) -> None:
    pod = gateway_pods()[gateway]
    policy = kvgate_policy()
    assert admits(policy, pod, EXTPROC_PORT), gateway
    assert not admits(policy, pod, METRICS_PORT), gateway
    assert not admits(policy, pod, ADMIN_PORT), gateway


def test_only_prometheus_reaches_metrics() -> None:
    policy = kvgate_policy()
    assert admits(policy, PROMETHEUS, METRICS_PORT)
    assert not admits(policy, PROMETHEUS, EXTPROC_PORT)
    assert not admits(policy, PROMETHEUS, ADMIN_PORT)


@pytest.mark.parametrize("neighbour", sorted(NEIGHBOURS))
def test_neighbours_of_admitted_pods_are_refused(neighbour: str) -> None:
    pod = NEIGHBOURS[neighbour]
    policy = kvgate_policy()
    for port in (EXTPROC_PORT, METRICS_PORT, ADMIN_PORT):
        assert not admits(policy, pod, port), (neighbour, port)


def test_the_policy_evaluator_bites() -> None:
    """A namespace-wide rule (what the policy used to say) admits the neighbours."""
    wide = copy.deepcopy(kvgate_policy())
    for rule in wide["spec"]["ingress"]:
        for peer in rule["from"]:
            peer.pop("podSelector")
    assert admits(wide, NEIGHBOURS["another pod of the gateways' namespace"], EXTPROC_PORT)
    assert admits(wide, NEIGHBOURS["grafana"], METRICS_PORT)
    open_rule = {"spec": {"ingress": [{"ports": [{"port": EXTPROC_PORT}]}]}, "metadata": {}}
    assert admits(open_rule, ("anywhere", {}), EXTPROC_PORT)
    assert not admits(open_rule, ("anywhere", {}), METRICS_PORT)


def test_admin_port_is_loopback_in_every_standalone_config() -> None:
    """The policy admits nobody to the operator API because no shipped config exposes it."""
    for path, name in ((KVGATE_DEPLOYMENT, "kvgate-config"), (MTLS, "kvgate-config-mtls")):
        config = yaml.safe_load(one(path, "ConfigMap", name)["data"]["kvgate.yaml"])
        assert is_loopback_listen(config["server"]["admin_listen"]), path
        assert port_of(config["server"]["admin_listen"]) == ADMIN_PORT


# --------------------------------------------------------------------------- the mTLS variant


def mtls_config() -> dict[str, Any]:
    return yaml.safe_load(one(MTLS, "ConfigMap", "kvgate-config-mtls")["data"]["kvgate.yaml"])


def test_mtls_config_is_the_shipped_config_plus_grpc_tls() -> None:
    base, _ = kvgate_config_of(KVGATE_DEPLOYMENT)
    tenants = yaml.safe_load(
        one(KVGATE_DEPLOYMENT, "Secret", "kvgate-tenants")["stringData"]["tenants.yaml"]
    )
    mtls = mtls_config()
    grpc_tls = mtls["server"].pop("grpc_tls")
    assert {**mtls, **tenants} == base, "only server.grpc_tls may differ from kvgate-config"
    config = parse_config({**mtls_config(), **tenants}, "kvgate-config-mtls + kvgate-tenants")
    assert config.server.grpc_tls is not None
    assert config.server.grpc_tls.allowed_clients is not None
    assert config.server.grpc_tls.allowed_clients.uri_sans == [GATEWAY_ID]
    assert set(grpc_tls) == {"cert_file", "key_file", "client_ca_file", "allowed_clients"}


def documented_patch() -> list[dict[str, Any]]:
    text = MTLS.read_text(encoding="utf-8")
    match = re.search(r"patch deployment kvgate --type json -p '(\[.*?\])'", text, re.S)
    assert match, "the kubectl patch command is documented"
    body = "\n".join(line.lstrip("#").strip() for line in match[1].splitlines())
    assert f"-n {KVGATE_NS} patch deployment kvgate" in text
    return json.loads(body)


def apply_json_patch(document: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 add / replace, as kubectl applies them."""
    out = copy.deepcopy(document)
    for op in patch:
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")
        ]
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "add" and isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), op["value"])
        elif op["op"] in ("add", "replace"):
            if op["op"] == "replace":
                assert (int(last) < len(node)) if isinstance(node, list) else last in node, op
            node[int(last) if isinstance(node, list) else last] = op["value"]
        else:
            raise AssertionError(f"unexpected op {op['op']}")
    return out


def test_documented_patch_mounts_the_certificates_and_moves_the_probes() -> None:
    deployment = one(KVGATE_DEPLOYMENT, "Deployment", "kvgate")
    template = deployment["spec"]["template"]
    assert template["spec"]["volumes"][0]["name"] == "kvgate-config-base"
    assert template["spec"]["containers"][0]["name"] == "kvgate"
    patched = apply_json_patch(deployment, documented_patch())["spec"]["template"]
    volumes = {v["name"]: v for v in patched["spec"]["volumes"]}
    assert volumes["kvgate-config-base"]["configMap"]["name"] == "kvgate-config-mtls"
    kvgate = container(patched, "kvgate")
    grpc_tls = mtls_config()["server"]["grpc_tls"]
    for field in ("cert_file", "key_file", "client_ca_file"):
        path = grpc_tls[field]
        (mount,) = [
            m for m in kvgate["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")
        ]
        assert mount.get("readOnly") is True, field
        assert "secret" in volumes[mount["name"]], f"{field}: the key belongs in a Secret"
    ports = {p["containerPort"] for p in kvgate["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" not in kvgate[probe], f"{probe}: the kubelet has no client certificate"
        assert kvgate[probe]["httpGet"]["port"] in ports and kvgate[probe]["httpGet"]["port"] == (
            METRICS_PORT
        )
    assert kvgate["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The init container and config-sync read the swapped ConfigMap from the same volume.
    for name in ("kvgate-config", "config-sync"):
        mounts = {m["name"] for m in container(patched, name)["volumeMounts"]}
        assert "kvgate-config-base" in mounts


def mtls_cluster() -> dict[str, Any]:
    cluster = yaml.safe_load(MTLS_CLUSTER.read_text(encoding="utf-8"))
    assert isinstance(cluster, dict) and cluster["name"] == "kvgate_extproc"
    return cluster


def test_envoy_side_names_kvgate_and_presents_the_allowed_identity() -> None:
    cluster = mtls_cluster()
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    headless = one(KVGATE_DEPLOYMENT, "Service", "kvgate-headless")
    service_name = f"{headless['metadata']['name']}.{ns(headless)}.svc.cluster.local"
    assert address["socket_address"] == {"address": service_name, "port_value": EXTPROC_PORT}
    tls = cluster["transport_socket"]["typed_config"]
    assert tls["@type"].endswith("UpstreamTlsContext")
    assert tls["sni"] == service_name == KVGATE_TLS_NAME
    common = tls["common_tls_context"]
    assert common["alpn_protocols"] == ["h2"]
    (san,) = common["validation_context"]["match_typed_subject_alt_names"]
    assert san == {"san_type": "DNS", "matcher": {"exact": service_name}}
    (certificate,) = common["tls_certificates"]
    assert certificate["certificate_chain"]["filename"].startswith("/etc/envoy/")
    # The identity Envoy's certificate must carry is the one kvgate's config admits.
    assert GATEWAY_ID in MTLS_CLUSTER.read_text(encoding="utf-8")
    assert GATEWAY_ID in MTLS.read_text(encoding="utf-8")


def with_test_files(cluster: dict[str, Any], pki: Pki, client: str, ca: str) -> dict[str, Any]:
    """The cluster with its certificate files replaced by the test PKI's."""
    out = copy.deepcopy(cluster)
    common = out["transport_socket"]["typed_config"]["common_tls_context"]
    (certificate,) = common["tls_certificates"]
    certificate["certificate_chain"] = {"filename": str(pki.crt(client))}
    certificate["private_key"] = {"filename": str(pki.key(client))}
    common["validation_context"]["trusted_ca"] = {"filename": str(pki.crt(ca))}
    return out


def merged_bootstrap(cluster: dict[str, Any]) -> dict[str, Any]:
    reference = envoy_reference()
    clusters = reference["static_resources"]["clusters"]
    index = next(i for i, c in enumerate(clusters) if c["name"] == cluster["name"])
    clusters[index] = {**clusters[index], **cluster}
    return reference


@needs_openssl
def test_mtls_cluster_validates_in_envoy_yaml(tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki")
    pki.ca("ca")
    pki.leaf("envoy", "ca", server=False, sans=f"URI:{GATEWAY_ID}")
    cluster = with_test_files(mtls_cluster(), pki, "envoy", "ca")
    bootstrap = merged_bootstrap(cluster)
    assert_valid_envoy(bootstrap, tmp_path, "envoy-extproc-mtls.yaml")
    # The rest of the reference cluster is kept: health checks and outlier detection.
    (merged,) = [
        c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "kvgate_extproc"
    ]
    assert "health_checks" in merged and "outlier_detection" in merged
