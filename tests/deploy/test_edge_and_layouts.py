"""The client-facing edge settings in every shipped Envoy config, and the split response layout in
deploy/ for each target.

Edge: the values are read from envoy/envoy.yaml (the reference) and required, unchanged, in
every shipped bootstrap and in the Istio patches: request_headers_timeout, path
normalisation, the overload manager's global connection limit (the sidecar's probe listener
opts out of it), the client address in the access log; the sidecar's Envoy runs as many
workers as its CPU limit.

Split layout: each variant (Kubernetes sidecar ConfigMap, Istio gateway EnvoyFilter, Envoy
Gateway policy) keeps the inline variant's request path unchanged except that the response
is not sent to it, and adds an observability-mode ext_proc filter equal to
envoy/envoy-observability.yaml's; the Envoy ones pass `envoy --mode validate`. The remote
variants (Istio, Envoy Gateway) need kvgate at one replica (the hand-off is in-process).
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.harness import REPO_ROOT
from tests.deploy.manifests import (
    EG_POLICY,
    EG_SPLIT,
    EXT_PROC,
    ISTIO_FILTERS,
    ISTIO_SPLIT,
    KVGATE_DEPLOYMENT,
    ROUTER,
    SIDECAR,
    SIDECAR_SPLIT,
    apply_istio_patches,
    assert_valid_envoy,
    container,
    envoy_reference,
    hcm_of,
    ingress_hcm,
    objects,
    one,
    rel,
    shipped_bootstraps,
    sidecar_bootstrap,
    sidecar_split_bootstrap,
    without_cluster_name,
)

OBSERVABILITY_CONFIG = REPO_ROOT / "envoy" / "envoy-observability.yaml"
ISTIO_GATEWAY, ISTIO_SIDECAR = ISTIO_FILTERS
OBSERVE = "kvgate.observe"
CONNECTIONS_MONITOR = "envoy.resource_monitors.global_downstream_max_connections"
EDGE_KEYS = (
    "request_headers_timeout",
    "normalize_path",
    "merge_slashes",
    "path_with_escaped_slashes_action",
)
# The response modes the inline request-path filter has and the split one does not.
INLINE_RESPONSE = {"response_header_mode": "SEND", "response_body_mode": "STREAMED"}
SPLIT_RESPONSE = {"response_header_mode": "SKIP", "response_body_mode": "NONE"}


def load(path: Path) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return config


def duration_s(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)s", text)
    assert match, text
    return float(match.group(1))


def reference_edge() -> dict[str, Any]:
    hcm = ingress_hcm(envoy_reference())
    return {key: hcm[key] for key in EDGE_KEYS}


def connection_limit(bootstrap: dict[str, Any]) -> int:
    monitors = bootstrap.get("overload_manager", {}).get("resource_monitors", [])
    (monitor,) = [m for m in monitors if m["name"] == CONNECTIONS_MONITOR]
    limit: int = monitor["typed_config"]["max_active_downstream_connections"]
    return limit


def all_bootstraps() -> dict[str, dict[str, Any]]:
    found = shipped_bootstraps()
    found.setdefault(rel(SIDECAR_SPLIT), sidecar_split_bootstrap())
    return found


def http_filter(hcm: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [f for f in hcm["http_filters"] if f["name"] == name]
    return found


def observing_filters(hcm: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in hcm["http_filters"] if f["typed_config"].get("observability_mode")]


# --------------------------------------------------------------------------- edge


def test_reference_edge_values() -> None:
    edge = reference_edge()
    # Slow loris: long enough for any real client's headers, far below a generation.
    assert 1 <= duration_s(edge["request_headers_timeout"]) <= 60
    assert edge["normalize_path"] is True
    assert edge["merge_slashes"] is True
    # Never forwarded as is: kvgate and the model server could decode %2F differently.
    assert edge["path_with_escaped_slashes_action"] in ("REJECT_REQUEST", "UNESCAPE_AND_REDIRECT")
    assert 0 < connection_limit(envoy_reference()) <= 100_000


def test_every_bootstrap_is_covered() -> None:
    names = set(all_bootstraps())
    assert {
        "envoy/envoy.yaml",
        "envoy/envoy-observability.yaml",
        rel(SIDECAR),
        rel(SIDECAR_SPLIT),
    } <= names


@pytest.mark.parametrize("name", sorted(all_bootstraps()))
def test_bootstrap_edge(name: str) -> None:
    bootstrap = all_bootstraps()[name]
    hcm = ingress_hcm(bootstrap)
    for key, value in reference_edge().items():
        assert hcm.get(key) == value, f"{name}: {key}"
    assert connection_limit(bootstrap) == connection_limit(envoy_reference()), name
    # Only the client listener counts against the limit: probes and scrapes still get in.
    for listener in bootstrap["static_resources"]["listeners"]:
        if listener["name"] != "ingress":
            assert listener.get("ignore_global_conn_limit") is True, f"{name}: {listener['name']}"
        else:
            assert not listener.get("ignore_global_conn_limit"), name


@pytest.mark.parametrize("name", sorted(all_bootstraps()))
def test_access_log_has_the_client_address(name: str) -> None:
    hcm = ingress_hcm(all_bootstraps()[name])
    assert hcm["access_log"], name
    for log in hcm["access_log"]:
        fields = log["typed_config"]["log_format"]["json_format"]
        values = set(fields.values())
        assert values & {
            "%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%",
            "%DOWNSTREAM_REMOTE_ADDRESS%",
        }, f"{name}: no client address"
        assert values & {
            "%DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT%",
            "%DOWNSTREAM_DIRECT_REMOTE_ADDRESS%",
        }, f"{name}: no TCP peer address"


def network_patches(path: Path) -> list[dict[str, Any]]:
    return [
        p["patch"]["value"]["typed_config"]
        for envoy_filter in objects(path, "EnvoyFilter")
        for p in envoy_filter["spec"]["configPatches"]
        if p["applyTo"] == "NETWORK_FILTER"
    ]


@pytest.mark.parametrize("path", [*ISTIO_FILTERS, ISTIO_SPLIT], ids=rel)
def test_istio_edge(path: Path) -> None:
    (hcm,) = network_patches(path)
    for key, value in reference_edge().items():
        assert hcm.get(key) == value, f"{rel(path)}: {key}"


def test_envoy_gateway_edge_matches_the_reference() -> None:
    """What the ClientTrafficPolicy can say, as the reference says it."""
    spec = one(EG_POLICY, "ClientTrafficPolicy")["spec"]
    actions = {"REJECT_REQUEST": "RejectRequest", "UNESCAPE_AND_REDIRECT": "UnescapeAndRedirect"}
    edge = reference_edge()
    assert spec["path"]["escapedSlashesAction"] == actions[edge["path_with_escaped_slashes_action"]]
    assert spec["path"].get("disableMergeSlashes", False) is not edge["merge_slashes"]
    assert spec["connection"]["connectionLimit"]["value"] == connection_limit(envoy_reference())


def cpu_cores(quantity: str | int) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_envoy_concurrency_is_its_cpu_limit() -> None:
    (workload,) = [
        w for w in objects(SIDECAR, "Deployment") if w["metadata"]["name"] == "llm-gateway"
    ]
    envoy = container(workload["spec"]["template"], "envoy")
    args = envoy["args"]
    assert args.count("--concurrency") == 1
    value = args[args.index("--concurrency") + 1]
    match = re.fullmatch(r"\$\((\w+)\)", value)
    assert match, f"--concurrency {value}: not taken from the container's resources"
    (env,) = [e for e in envoy.get("env", []) if e["name"] == match.group(1)]
    ref = env["valueFrom"]["resourceFieldRef"]
    assert ref["resource"] == "limits.cpu"
    assert ref.get("containerName", "envoy") == "envoy"
    # The kubelet rounds limits.cpu / divisor up to an integer.
    workers = math.ceil(cpu_cores(envoy["resources"]["limits"]["cpu"]) / cpu_cores(ref["divisor"]))
    assert cpu_cores(ref["divisor"]) == 1 and workers >= 1
    assert workers == math.ceil(cpu_cores(envoy["resources"]["limits"]["cpu"]))


# --------------------------------------------------------------------------- split layout


def reference_observe() -> dict[str, Any]:
    hcm = ingress_hcm(load(OBSERVABILITY_CONFIG))
    (observe,) = observing_filters(hcm)
    return observe


def test_reference_layouts_share_the_request_path() -> None:
    """envoy/envoy-observability.yaml's request-path filter is envoy/envoy.yaml's with the
    response taken away, and its observing filter follows it."""
    inline = ingress_hcm(envoy_reference())
    split = ingress_hcm(load(OBSERVABILITY_CONFIG))
    expected = copy.deepcopy(http_filter(inline, EXT_PROC))
    expected["typed_config"]["processing_mode"].update(SPLIT_RESPONSE)
    assert http_filter(split, EXT_PROC) == expected
    observe = reference_observe()["typed_config"]
    assert observe["failure_mode_allow"] is True
    mode = observe["processing_mode"]
    assert mode["request_header_mode"] == "SEND" and mode["request_body_mode"] == "NONE"
    assert {k: mode[k] for k in INLINE_RESPONSE} == INLINE_RESPONSE
    assert observe["metadata_options"]["forwarding_namespaces"]["untyped"] == ["kvgate"]


def check_split_chain(hcm: dict[str, Any], where: str) -> None:
    names = [f["name"] for f in hcm["http_filters"]]
    assert names.index(EXT_PROC) < names.index(OBSERVE) < names.index(ROUTER), f"{where}: {names}"
    assert names.index(ROUTER) == len(names) - 1, where
    (observe,) = observing_filters(hcm)
    assert observe["name"] == OBSERVE, where
    assert without_cluster_name(observe["typed_config"]) == without_cluster_name(
        reference_observe()["typed_config"]
    ), where
    request_path = http_filter(hcm, EXT_PROC)["typed_config"]
    assert request_path["failure_mode_allow"] is False, where
    mode = request_path["processing_mode"]
    assert {k: mode[k] for k in SPLIT_RESPONSE} == SPLIT_RESPONSE, where
    assert (
        observe["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        == request_path["grpc_service"]["envoy_grpc"]["cluster_name"]
    ), where


def test_sidecar_split_bootstrap_validates(tmp_path: Path) -> None:
    assert_valid_envoy(sidecar_split_bootstrap(), tmp_path, "sidecar-split-envoy.yaml")


def test_sidecar_split_is_the_sidecar_bootstrap_but_the_response_path() -> None:
    split = sidecar_split_bootstrap()
    check_split_chain(ingress_hcm(split), rel(SIDECAR_SPLIT))
    # Undo the split: what remains is the inline sidecar bootstrap, byte for byte.
    undone = copy.deepcopy(split)
    hcm = ingress_hcm(undone)
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != OBSERVE]
    http_filter(hcm, EXT_PROC)["typed_config"]["processing_mode"].update(INLINE_RESPONSE)
    assert undone == sidecar_bootstrap()
    # The one kvgate of the pod, on loopback: both streams of a request reach it.
    clusters = {c["name"]: c for c in split["static_resources"]["clusters"]}
    cluster = clusters[
        http_filter(ingress_hcm(split), OBSERVE)["typed_config"]["grpc_service"]["envoy_grpc"][
            "cluster_name"
        ]
    ]
    (endpoint,) = [
        e for group in cluster["load_assignment"]["endpoints"] for e in group["lb_endpoints"]
    ]
    assert endpoint["endpoint"]["address"]["socket_address"]["address"] == "127.0.0.1"
    # Same pod shape: the ConfigMap sits in the pod's namespace, under the key Envoy reads.
    (workload,) = objects(SIDECAR, "Deployment")
    configmap = one(SIDECAR_SPLIT, "ConfigMap")
    assert configmap["metadata"]["namespace"] == workload["metadata"]["namespace"]
    volumes = workload["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["name"] == "envoy-config", "the documented patch replaces volume 0"
    mount = next(
        m
        for m in container(workload["spec"]["template"], "envoy")["volumeMounts"]
        if m["name"] == "envoy-config"
    )
    assert f"{mount['mountPath']}/envoy.yaml" in container(workload["spec"]["template"], "envoy")[
        "args"
    ] and set(configmap["data"]) == {"envoy.yaml"}
    assert (
        configmap["metadata"]["name"]
        in SIDECAR_SPLIT.read_text(encoding="utf-8").split("configMap/name")[1]
    ), "the documented patch names the split ConfigMap"


def istio_split_filter() -> dict[str, Any]:
    (envoy_filter,) = objects(ISTIO_SPLIT, "EnvoyFilter")
    return envoy_filter


def test_istio_split_patches_validate(tmp_path: Path) -> None:
    """The split EnvoyFilter's patches, applied (roughly as istiod would) to envoy/envoy.yaml
    without its ext_proc filter, validate and give the split filter chain."""
    envoy_filter = copy.deepcopy(istio_split_filter())
    patches = envoy_filter["spec"]["configPatches"]
    (observe,) = [p for p in patches if p["patch"]["value"].get("name") == OBSERVE]
    assert observe["applyTo"] == "HTTP_FILTER"
    assert observe["patch"]["operation"] == "INSERT_BEFORE"
    assert observe["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == ROUTER
    patches.remove(observe)
    config = apply_istio_patches(envoy_reference(), envoy_filter)
    hcm = hcm_of(config["static_resources"]["listeners"][0])
    # The observe patch, applied after the ext_proc one: before the router.
    value = copy.deepcopy(observe["patch"]["value"])
    value["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = "kvgate_extproc"
    router = [f["name"] for f in hcm["http_filters"]].index(ROUTER)
    hcm["http_filters"].insert(router, value)
    check_split_chain(hcm, rel(ISTIO_SPLIT))
    assert_valid_envoy(config, tmp_path, "istio-split.yaml")


def test_istio_split_is_the_gateway_filter_but_the_response_path() -> None:
    split = copy.deepcopy(istio_split_filter())
    (inline,) = objects(ISTIO_GATEWAY, "EnvoyFilter")
    patches = split["spec"]["configPatches"]
    (observe,) = [p for p in patches if p["patch"]["value"].get("name") == OBSERVE]
    (request_path,) = [p for p in patches if p["patch"]["value"].get("name") == EXT_PROC]
    assert observe["match"] == request_path["match"]
    assert patches.index(request_path) < patches.index(observe), "observe after ext_proc"
    patches.remove(observe)
    request_path["patch"]["value"]["typed_config"]["processing_mode"].update(INLINE_RESPONSE)
    assert split["spec"] == inline["spec"]
    assert split["metadata"]["namespace"] == inline["metadata"]["namespace"]
    assert split["metadata"]["name"] != inline["metadata"]["name"]


def test_envoy_gateway_split_policy() -> None:
    (inline,) = one(EG_POLICY, "EnvoyExtensionPolicy")["spec"]["extProc"]
    policy = one(EG_SPLIT, "EnvoyExtensionPolicy")
    assert (
        policy["spec"]["targetRefs"] == one(EG_POLICY, "EnvoyExtensionPolicy")["spec"]["targetRefs"]
    )
    request_path, observe = policy["spec"]["extProc"]
    # The request path: the inline one without the response.
    expected = copy.deepcopy(inline)
    del expected["processingMode"]["response"]
    assert request_path == expected
    assert "shadowMode" not in request_path and request_path["failOpen"] is False
    # The observer: Envoy's observability_mode (shadowMode, Envoy Gateway v1.9.0 on), never
    # breaking a response, request headers without the body, every response chunk, and
    # the kvgate metadata (reservation id) forwarded.
    assert observe["shadowMode"] is True
    assert observe["failOpen"] is True
    assert observe["backendRefs"] == request_path["backendRefs"]
    assert observe["backendSettings"] == request_path["backendSettings"]
    assert "body" not in observe["processingMode"]["request"]
    assert observe["processingMode"]["request"]["attributes"] == ["request.id"]
    assert observe["processingMode"]["response"] == {"body": "Streamed"}
    assert observe["metadata"] == {"accessibleNamespaces": ["kvgate"]}


@pytest.mark.parametrize("path", [ISTIO_SPLIT, EG_SPLIT], ids=rel)
def test_remote_split_variants_need_one_kvgate_replica(path: Path) -> None:
    """The hand-off is in-process and Envoy cannot pin a request's two ext_proc streams to
    one replica: the remote split variants say so, and kvgate runs one replica."""
    assert "ONE kvgate REPLICA ONLY" in path.read_text(encoding="utf-8")
    (kvgate,) = objects(KVGATE_DEPLOYMENT, "Deployment")
    assert kvgate["spec"]["replicas"] == 1, (
        f"{rel(path)} meters only with one kvgate replica (src/kvgate/extproc/handoff.py)"
    )
