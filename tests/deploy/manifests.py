"""What the deploy/ tests share: the files under deploy/ and their loaders, the Envoy
bootstraps they ship (and envoy/envoy.yaml, the reference), kvgate's config as a pod sees it,
the Istio patches applied as istiod applies them, the edge checks, and the PromQL names
kvgate's metrics define."""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.metrics import MetricWrapperBase

from kvgate.anthropic.errors import error_type_for_status
from kvgate.anthropic.requests import COUNT_TOKENS_PATH, MESSAGES_PATH
from kvgate.config.model import ServerConfig
from kvgate.metrics import Metrics
from testbed.harness import (
    ENVOY_CONFIG,
    REPO_ROOT,
    free_port,
    validate_envoy_config,
)

DEPLOY = REPO_ROOT / "deploy"
K8S_DIRS = ("kubernetes", "istio", "envoy-gateway", "prometheus")
SIDECAR = DEPLOY / "kubernetes" / "gateway-with-sidecar.yaml"
KVGATE_DEPLOYMENT = DEPLOY / "kubernetes" / "kvgate-deployment.yaml"
# Pools: the pool-enabled kvgate configs (a ConfigMap each, joined with the tenants Secret of
# the base file) and the vLLM pods' headless Service.
SIDECAR_POOL = DEPLOY / "kubernetes" / "gateway-with-sidecar-pool.yaml"
KVGATE_DEPLOYMENT_POOL = DEPLOY / "kubernetes" / "kvgate-deployment-pool.yaml"
POOL_SERVICE = DEPLOY / "kubernetes" / "vllm-pool.yaml"
ISTIO_FILTERS = [
    DEPLOY / "istio" / "envoyfilter-gateway.yaml",
    DEPLOY / "istio" / "envoyfilter-sidecar.yaml",
]
EG_POLICY = DEPLOY / "envoy-gateway" / "extension-policy.yaml"
# The split response layout (tests/deploy/test_edge_and_layouts.py).
SIDECAR_SPLIT = DEPLOY / "kubernetes" / "gateway-with-sidecar-split.yaml"
ISTIO_SPLIT = DEPLOY / "istio" / "envoyfilter-gateway-split.yaml"
EG_SPLIT = DEPLOY / "envoy-gateway" / "extension-policy-split.yaml"
RULES = DEPLOY / "prometheus" / "rules.yaml"
SERVICE_MONITOR = DEPLOY / "prometheus" / "servicemonitor.yaml"
DASHBOARD = DEPLOY / "grafana" / "kvgate-dashboard.json"

KVGATE_IMAGE = "ghcr.io/kvgate/kvgate:0.1.0"
EXT_PROC = "envoy.filters.http.ext_proc"
ROUTER = "envoy.filters.http.router"
HCM = "envoy.filters.network.http_connection_manager"

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}


# --------------------------------------------------------------------------- loading


def yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


def k8s_files() -> list[Path]:
    # deploy/prometheus/tests/ holds promtool's rule unit tests, not Kubernetes objects.
    return [
        p
        for p in yaml_files()
        if p.relative_to(DEPLOY).parts[0] in K8S_DIRS and "tests" not in p.relative_to(DEPLOY).parts
    ]


@cache
def _docs(path: Path) -> tuple[Any, ...]:
    return tuple(d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None)


def docs(path: Path) -> list[dict[str, Any]]:
    return copy.deepcopy(list(_docs(path)))


def objects(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs(path) if kind is None or d.get("kind") == kind]


def one(path: Path, kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects(path, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"{path.name}: expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def rel(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


def ns(obj: dict[str, Any]) -> str | None:
    return obj["metadata"].get("namespace")


def pod_templates(path: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) for every workload in the file."""
    return [(w, w["spec"]["template"]) for w in docs(path) if w.get("kind") in WORKLOAD_KINDS]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels / matchExpressions, or a plain map)."""
    structured = "matchLabels" in selector or "matchExpressions" in selector
    match_labels = selector.get("matchLabels", {}) if structured else selector
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def duration_s(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(text))
    assert match, f"not a duration: {text!r}"
    value, unit = float(match[1]), match[2]
    return value * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


def deep_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Merge `patch` into `base` (maps recursively; anything else replaced)."""
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# --------------------------------------------------------------------------- Envoy helpers


def envoy_reference() -> dict[str, Any]:
    return yaml.safe_load(ENVOY_CONFIG.read_text(encoding="utf-8"))


def hcm_of(listener: dict[str, Any]) -> dict[str, Any]:
    for chain in listener["filter_chains"]:
        for net_filter in chain["filters"]:
            if net_filter["name"] == HCM:
                config: dict[str, Any] = net_filter["typed_config"]
                return config
    raise AssertionError(f"listener {listener.get('name')} has no HTTP connection manager")


def ext_proc_config(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The ext_proc typed_config of the (only) listener that has one."""
    found = []
    for listener in bootstrap["static_resources"]["listeners"]:
        filters = [f["name"] for f in hcm_of(listener).get("http_filters", [])]
        if EXT_PROC in filters:
            assert filters.index(EXT_PROC) == filters.index(ROUTER) - 1, filters
            found.append(hcm_of(listener)["http_filters"][filters.index(EXT_PROC)])
    assert len(found) == 1, "expected exactly one listener with the ext_proc filter"
    config: dict[str, Any] = found[0]["typed_config"]
    return config


def without_cluster_name(config: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(config)
    out["grpc_service"]["envoy_grpc"].pop("cluster_name")
    return out


def assert_valid_envoy(config: dict[str, Any], tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    result = validate_envoy_config(path)
    assert result.returncode == 0, (
        f"envoy --mode validate {name} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    )
    output = result.stdout + result.stderr
    assert "Deprecated field" not in output, output


def assumed_max_message_timeout_s() -> float:
    """The ext_proc filter's max_message_timeout kvgate assumes unless told otherwise
    (server.envoy_max_message_timeout_s): it refuses a pool queue whose wait bound would need
    more, so every shipped filter must allow at least this."""
    return float(ServerConfig.model_fields["envoy_max_message_timeout_s"].default)


# --------------------------------------------------------------------------- kvgate config


def kvgate_config_of(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(merged kvgate config, the workload) as the init container builds it in `path`."""
    base = one(path, "ConfigMap", "kvgate-config")["data"]["kvgate.yaml"]
    tenants = one(path, "Secret", "kvgate-tenants")["stringData"]["tenants.yaml"]
    base_doc, tenants_doc = yaml.safe_load(base), yaml.safe_load(tenants)
    assert "tenants" not in base_doc, "tenants belong in the Secret, not the ConfigMap"
    assert set(tenants_doc) == {"tenants"}, "the Secret holds only the tenants"
    merged = yaml.safe_load(base.rstrip("\n") + "\n" + tenants)  # what `cat a b` gives
    assert merged == {**base_doc, **tenants_doc}
    (workload,) = [
        w
        for w, _ in pod_templates(path)
        if any(c["image"] == KVGATE_IMAGE for c in w["spec"]["template"]["spec"]["containers"])
    ]
    return merged, workload


def kvgate_pool_config_of(pool_path: Path, base_path: Path) -> dict[str, Any]:
    """The pool-enabled kvgate config of `pool_path` (ConfigMap kvgate-config-pool) joined with
    the tenants Secret of `base_path`, as the init container joins them once the pod's
    kvgate-config-base volume names that ConfigMap."""
    base = one(pool_path, "ConfigMap", "kvgate-config-pool")["data"]["kvgate.yaml"]
    tenants = one(base_path, "Secret", "kvgate-tenants")["stringData"]["tenants.yaml"]
    assert "tenants" not in yaml.safe_load(base), "tenants belong in the Secret"
    merged: dict[str, Any] = yaml.safe_load(base.rstrip("\n") + "\n" + tenants)
    return merged


def container(template: dict[str, Any], name: str) -> dict[str, Any]:
    spec = template["spec"]
    (found,) = [
        c
        for c in spec.get("containers", []) + spec.get("initContainers", [])
        if (c["name"] == name)
    ]
    return found


def port_of(listen: str) -> int:
    return int(listen.rpartition(":")[2])


# --------------------------------------------------------------------------- workloads


def workload_files() -> list[Path]:
    return [p for p in k8s_files() if pod_templates(p)]


# --------------------------------------------------------------------------- Envoy (sidecar)


def sidecar_bootstrap() -> dict[str, Any]:
    text = one(SIDECAR, "ConfigMap", "llm-gateway-envoy")["data"]["envoy.yaml"]
    bootstrap: dict[str, Any] = yaml.safe_load(text)
    return bootstrap


def sidecar_bootstrap_on_loopback() -> tuple[dict[str, Any], int, int, int]:
    """The sidecar bootstrap moved to free loopback ports (no cluster DNS: STRICT_DNS
    endpoints become localhost): (bootstrap, admin, ingress, readiness) ports."""
    bootstrap = sidecar_bootstrap()
    admin, ingress, readiness = free_port(), free_port(), free_port()
    bootstrap["admin"]["address"]["socket_address"]["port_value"] = admin
    for listener in bootstrap["static_resources"]["listeners"]:
        socket = listener["address"]["socket_address"]
        socket["address"] = "127.0.0.1"
        socket["port_value"] = ingress if listener["name"] == "ingress" else readiness
    for cluster in bootstrap["static_resources"]["clusters"]:
        if cluster["type"] == "ORIGINAL_DST":  # a pool: hosts come from x-kvgate-destination
            continue
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        socket = endpoint["address"]["socket_address"]
        if cluster["name"] == "envoy_admin":
            socket["port_value"] = admin
        else:
            if cluster["type"] == "STRICT_DNS":
                socket["address"] = "localhost"
            socket["port_value"] = free_port()
    return bootstrap, admin, ingress, readiness


def sidecar_split_bootstrap() -> dict[str, Any]:
    text = one(SIDECAR_SPLIT, "ConfigMap", "llm-gateway-envoy-split")["data"]["envoy.yaml"]
    bootstrap: dict[str, Any] = yaml.safe_load(text)
    return bootstrap


# --------------------------------------------------------------------------- Istio


def apply_istio_patches(config: dict[str, Any], envoy_filter: dict[str, Any]) -> dict[str, Any]:
    """Apply an EnvoyFilter's patches to a one-listener Envoy bootstrap, roughly as istiod
    would (the ext_proc cluster renamed to the bootstrap's `kvgate_extproc`, Istio's inbound
    cluster `inbound|8000||` to its `vllm-local`)."""
    config = copy.deepcopy(config)
    listener = config["static_resources"]["listeners"][0]
    for patch in envoy_filter["spec"]["configPatches"]:
        apply_istio_patch(listener, patch, replace_ext_proc=True)
    return config


def apply_istio_patch(
    listener: dict[str, Any], patch: dict[str, Any], *, replace_ext_proc: bool
) -> None:
    """One EnvoyFilter patch on one listener, in place. `replace_ext_proc`: the listener
    already has envoy/envoy.yaml's ext_proc filter, which the inserted one replaces."""
    value = copy.deepcopy(patch["patch"]["value"])
    hcm = hcm_of(listener)
    if patch["applyTo"] == "HTTP_FILTER":
        assert patch["patch"]["operation"] == "INSERT_BEFORE"
        value["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = "kvgate_extproc"
        filters = hcm["http_filters"]
        if replace_ext_proc:
            filters = [f for f in filters if f["name"] != EXT_PROC]
        router = next(i for i, f in enumerate(filters) if f["name"] == ROUTER)
        hcm["http_filters"] = [*filters[:router], value, *filters[router:]]
    elif patch["applyTo"] == "NETWORK_FILTER":
        assert patch["patch"]["operation"] == "MERGE"
        merged = deep_merge(hcm, value["typed_config"])
        hcm.clear()
        hcm.update(merged)
    elif patch["applyTo"] == "LISTENER":
        assert patch["patch"]["operation"] == "MERGE"
        listener.update(deep_merge(listener, value))
    elif patch["applyTo"] == "HTTP_ROUTE":
        assert patch["patch"]["operation"] == "INSERT_FIRST"
        if value.get("route", {}).get("cluster", "").startswith("inbound|"):
            value["route"]["cluster"] = "vllm-local"
        for vhost in hcm["route_config"]["virtual_hosts"]:
            vhost["routes"] = [value, *vhost["routes"]]
    else:
        raise AssertionError(f"unexpected patch {patch['applyTo']}")


def istio_inbound_bootstrap() -> dict[str, Any]:
    """envoy/envoy.yaml turned into what an Istio sidecar's inbound listener for vLLM's
    port looks like before kvgate's EnvoyFilter: Istio's inbound defaults (no
    use_remote_address, no early header mutation; callers from the pod network and
    loopback count as internal) and its single route sending everything to the local
    vLLM; then deploy/istio/envoyfilter-sidecar.yaml applied."""
    config = envoy_reference()
    hcm = hcm_of(config["static_resources"]["listeners"][0])
    for key in ("use_remote_address", "xff_num_trusted_hops", "early_header_mutation_extensions"):
        hcm.pop(key, None)
    hcm["internal_address_config"] = {
        "cidr_ranges": [
            {"address_prefix": prefix, "prefix_len": length}
            for prefix, length in (("10.0.0.0", 8), ("172.16.0.0", 12), ("192.168.0.0", 16))
        ]
        + [{"address_prefix": "127.0.0.0", "prefix_len": 8}]
    }
    (vhost,) = hcm["route_config"]["virtual_hosts"]
    vhost["routes"] = [
        {
            "name": "default",
            "match": {"prefix": "/"},
            "route": {"cluster": "vllm-local", "timeout": "0s"},
        }
    ]
    (envoy_filter,) = objects(ISTIO_FILTERS[1], "EnvoyFilter")
    return apply_istio_patches(config, envoy_filter)


# --------------------------------------------------------------------------- the edge
# Who may reach a backend (only what kvgate admitted), and who may steer Envoy (no client).

# The local error for a request kvgate did not decide on.
NOT_ADMITTED = {
    "error": {
        "message": "The request was not admitted by kvgate, so it was not forwarded to a model "
        "server.",
        "type": "server_error",
        "param": None,
        "code": "not_admitted",
    }
}
PASSTHROUGH_PREFIX = "/v1/models"


def shipped_bootstraps() -> dict[str, dict[str, Any]]:
    """Every full Envoy bootstrap shipped (name -> config)."""
    found = {
        rel(path): yaml.safe_load(path.read_text(encoding="utf-8"))
        for path in sorted((REPO_ROOT / "envoy").glob("*.yaml"))
    }
    found[rel(SIDECAR)] = sidecar_bootstrap()
    split = DEPLOY / "kubernetes" / "gateway-with-sidecar-split.yaml"
    found[rel(split)] = yaml.safe_load(one(split, "ConfigMap")["data"]["envoy.yaml"])
    return found


def ingress_hcm(bootstrap: dict[str, Any]) -> dict[str, Any]:
    (listener,) = [
        listener
        for listener in bootstrap["static_resources"]["listeners"]
        if listener["name"] == "ingress"
    ]
    return hcm_of(listener)


def removed_prefixes(hcm: dict[str, Any]) -> set[str]:
    """The header-name prefixes the HCM's early header mutation removes."""
    prefixes = set()
    for extension in hcm.get("early_header_mutation_extensions", []):
        for mutation in extension["typed_config"]["mutations"]:
            matcher = mutation.get("remove_on_match", {}).get("key_matcher", {})
            if "prefix" in matcher:
                prefixes.add(matcher["prefix"])
    return prefixes


def header_match(route: dict[str, Any], name: str) -> dict[str, Any] | None:
    for header in route["match"].get("headers", []):
        if header["name"] == name:
            found: dict[str, Any] = header
            return found
    return None


def check_not_admitted_response(route: dict[str, Any], where: str) -> None:
    """An Envoy route that answers kvgate's not_admitted error itself."""
    response = route["direct_response"]
    assert response["status"] == 500, where
    assert json.loads(response["body"]["inline_string"]) == NOT_ADMITTED, where
    content_types = [
        h["header"]["value"]
        for h in route.get("response_headers_to_add", [])
        if h["header"]["key"].lower() == "content-type"
    ]
    assert content_types == ["application/json"], where
    assert route["response_headers_to_add"][0].get("append_action") == (
        "OVERWRITE_IF_EXISTS_OR_ADD"
    ), where


def check_guard_routes(routes: list[dict[str, Any]], where: str) -> None:
    """A backend only on kvgate's decision: admitted requests by x-kvgate-backend, the
    pass-through paths by x-kvgate-tenant, everything else a local JSON error; no retries."""
    for route in routes:
        assert "retry_policy" not in route.get("route", {}), f"{where}: {route['name']} retries"
        if "direct_response" in route:
            check_not_admitted_response(route, f"{where}: {route['name']}")
            continue
        action = route["route"]
        backend = header_match(route, "x-kvgate-backend")
        tenant = header_match(route, "x-kvgate-tenant")
        if backend is not None:
            assert backend == {"name": "x-kvgate-backend", "present_match": True}, where
            assert action == {**action, "cluster_header": "x-kvgate-backend"}, where
        else:
            assert tenant == {"name": "x-kvgate-tenant", "present_match": True}, (
                f"{where}: route {route['name']} reaches a backend without kvgate's header"
            )
            assert route["match"] == {
                "path_separated_prefix": PASSTHROUGH_PREFIX,
                "headers": [tenant],
            }, f"{where}: pass-through beyond {PASSTHROUGH_PREFIX}"
    last = routes[-1]
    assert last["match"] == {"prefix": "/"} and "direct_response" in last, (
        f"{where}: the last route must answer locally"
    )
    assert any(header_match(r, "x-kvgate-backend") for r in routes), where


# --------------------------------------------------------------------------- local replies
# Envoy's own local replies become OpenAI-shaped JSON, Anthropic-shaped on the Messages API's
# paths; kvgate's ImmediateResponses (details kvgate_*) are left alone, and so is the
# not_admitted direct response (details direct_response) except on the Messages API's paths.

KVGATE_EXCLUDED = "!response.code_details.startsWith('kvgate_')"
DIRECT_RESPONSE_EXCLUDED = "response.code_details != 'direct_response'"
# The paths kvgate answers in Anthropic's shape (kvgate.anthropic.requests), query string
# ignored (request.url_path), exactly as kvgate picks its vocabulary.
ANTHROPIC_PATHS = (MESSAGES_PATH, COUNT_TOKENS_PATH)
ANTHROPIC_PATH_MATCH = "request.url_path in [{}]".format(
    ", ".join(f"'{path}'" for path in ANTHROPIC_PATHS)
)
# The one mapper that rewrites the guard's direct response (a 500), on those paths only.
ANTHROPIC_GUARD = (
    f"{ANTHROPIC_PATH_MATCH} && response.code == 500 && response.code_details == 'direct_response'"
)
# What the Anthropic mappers add to the OpenAI ones: a type of their own for these statuses.
ANTHROPIC_ONLY_STATUSES = {401, 403, 404, 429}
RETRY_AFTER = [
    {"header": {"key": "retry-after", "value": "1"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
]


def mapper_expression(mapper: dict[str, Any]) -> str:
    extension = mapper["filter"]["extension_filter"]
    assert extension["name"] == "envoy.access_loggers.extension_filters.cel", extension
    expression: str = extension["typed_config"]["expression"]
    return expression


def status_range(expression: str) -> tuple[int, int]:
    """The statuses [low, high) a mapper's expression can match."""
    if found := re.search(r"response\.code == (\d{3})", expression):
        return int(found[1]), int(found[1]) + 1
    low = re.search(r"response\.code >= (\d{3})", expression)
    high = re.search(r"response\.code < (\d{3})", expression)
    assert low, expression
    return int(low[1]), int(high[1]) if high else 600


def _check_precedence(mappers: list[dict[str, Any]], where: str) -> None:
    """No mapper is shadowed by an earlier, wider one (the first match wins)."""
    ranges = [status_range(mapper_expression(m)) for m in mappers]
    for i, (low, high) in enumerate(ranges):
        for earlier_low, earlier_high in ranges[:i]:
            assert not (earlier_low <= low and high <= earlier_high), (
                f"{where}: {mapper_expression(mappers[i])} can never match"
            )


def check_local_reply_config(config: dict[str, Any], where: str) -> None:
    assert "body_format" not in config, f"{where}: a top-level body_format would touch every reply"
    mappers: list[dict[str, Any]] = config["mappers"]
    assert mappers, where
    for mapper in mappers:
        mapper_expression(mapper)
        assert "status_code" not in mapper and "body" not in mapper, where
        assert mapper["body_format_override"]["content_type"] == "application/json", where
    # The Anthropic mappers come first: the OpenAI ones would answer those paths otherwise.
    prefix = f"{ANTHROPIC_PATH_MATCH} && "
    anthropic = [m for m in mappers if mapper_expression(m).startswith(prefix)]
    openai = mappers[len(anthropic) :]
    assert mappers[: len(anthropic)] == anthropic, f"{where}: Anthropic mappers after OpenAI ones"
    assert anthropic, f"{where}: no mapper for the Anthropic Messages API's paths"

    for mapper in openai:
        expression = mapper_expression(mapper)
        assert "request.url_path" not in expression and "request.path" not in expression, where
        assert KVGATE_EXCLUDED in expression, f"{where}: {expression} may rewrite kvgate's replies"
        assert DIRECT_RESPONSE_EXCLUDED in expression, f"{where}: {expression}"
        first_code = status_range(expression)[0]
        error = mapper["body_format_override"]["json_format"]["error"]
        assert set(mapper["body_format_override"]["json_format"]) == {"error"}, where
        assert set(error) == {"message", "type", "param", "code"}, where
        assert error["param"] is None and error["message"] and error["code"], where
        expected_type = "invalid_request_error" if first_code < 500 else "server_error"
        assert error["type"] == expected_type, f"{where}: {expression}"
    _check_precedence(openai, where)
    # The codes that matter most each have their own mapper, in this order of precedence.
    codes = [m["body_format_override"]["json_format"]["error"]["code"] for m in openai]
    for code in ("payload_too_large", "upstream_unavailable", "gateway_timeout", "upstream_error"):
        assert code in codes, f"{where}: no mapper for {code}"
    assert codes[-1] == "gateway_error", f"{where}: the last mapper catches every other 5xx"

    # Anthropic's shape: {"type": "error", "error": {"type", "message"}}, kvgate's type for the
    # status (kvgate.anthropic.errors).
    guards = [m for m in anthropic if mapper_expression(m) == ANTHROPIC_GUARD]
    assert len(guards) == 1, f"{where}: the guard's direct response on Anthropic's paths"
    for mapper in anthropic:
        expression = mapper_expression(mapper)
        body = mapper["body_format_override"]["json_format"]
        assert set(body) == {"type", "error"} and body["type"] == "error", f"{where}: {body}"
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], where
        if mapper in guards:
            assert body["error"]["type"] == error_type_for_status(500) == "api_error", where
            continue
        assert KVGATE_EXCLUDED in expression, f"{where}: {expression} may rewrite kvgate's replies"
        assert DIRECT_RESPONSE_EXCLUDED in expression, f"{where}: {expression}"
    rest = [m for m in anthropic if m not in guards]
    covered: set[int] = set()
    for mapper in rest:
        # A range answers every status no earlier mapper took with one type: kvgate's for each.
        # (529 is Anthropic's own overload status, never Envoy's.)
        low, high = status_range(mapper_expression(mapper))
        statuses = set(range(low, high)) - covered - {529}
        covered |= statuses
        types = {error_type_for_status(status) for status in statuses}
        error_type = mapper["body_format_override"]["json_format"]["error"]["type"]
        assert types == {error_type}, f"{where}: {mapper_expression(mapper)} -> {types}"
    _check_precedence(rest, where)
    # Every OpenAI mapper has its Anthropic twin: the same condition on Anthropic's paths, the
    # same headers (retry-after), in the same order.
    twins = {mapper_expression(m).removeprefix(prefix): m for m in rest}
    order = []
    for mapper in openai:
        twin = twins.pop(mapper_expression(mapper), None)
        assert twin is not None, f"{where}: no Anthropic twin for {mapper_expression(mapper)}"
        assert twin.get("headers_to_add") == mapper.get("headers_to_add"), where
        order.append(rest.index(twin))
        if status_range(mapper_expression(mapper))[0] in (503, 504):
            assert mapper["headers_to_add"] == RETRY_AFTER, f"{where}: waiting helps, say so"
    assert order == sorted(order), f"{where}: Anthropic mappers in another order"
    assert {status_range(e)[0] for e in twins} == ANTHROPIC_ONLY_STATUSES, where
    # The guard's direct response is a 500: it must come before the catch-all 5xx.
    assert anthropic.index(guards[0]) < anthropic.index(rest[-1]), where
    assert status_range(mapper_expression(rest[-1])) == (500, 600), where


# --------------------------------------------------------------------------- PromQL names


@cache
def kvgate_metrics() -> dict[str, tuple[str, ...] | None]:
    """Every sample name kvgate exports -> its label names (None: unknown yet)."""
    names: dict[str, tuple[str, ...] | None] = {}
    for metric in vars(Metrics()).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        base, labels = metric._name, tuple(metric._labelnames)
        kind = metric._type
        if kind == "counter":
            names[f"{base}_total"] = labels
        elif kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                names[base + suffix] = (*labels, "le") if suffix == "_bucket" else labels
        else:
            names[base] = labels
    # Being added by the lead with exactly these names (the first two exist already).
    names.setdefault("kvgate_config_reloads_total", ("result",))
    names.setdefault("kvgate_tenant_rejections_total", ("tenant", "reason"))
    names.setdefault("kvgate_store_errors_total", None)  # with the Redis store
    return names


# Labels Prometheus adds from the scrape target (ServiceMonitor / pod discovery).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "endpoint", "container"}


PROMQL_FUNCTIONS = {
    "rate",
    "irate",
    "increase",
    "delta",
    "idelta",
    "deriv",
    "histogram_quantile",
    "absent",
    "absent_over_time",
    "sum_over_time",
    "avg_over_time",
    "max_over_time",
    "min_over_time",
    "clamp_min",
    "clamp_max",
    "scalar",
    "vector",
    "time",
    "abs",
    "round",
    "ceil",
    "floor",
    "label_replace",
    "label_join",
    "sort",
    "sort_desc",
    "changes",
    "resets",
    "predict_linear",
}


PROMQL_AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
}


PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
}


def _strip_grouping(expr: str) -> str:
    return re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", expr)


def promql_names(expr: str) -> tuple[set[str], list[tuple[str, set[str]]], set[str]]:
    """(series names, [(name, matcher labels)], grouping labels) of a PromQL expression."""
    selectors = [
        (m[1], set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", m[2])))
        for m in re.finditer(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", expr)
    ]
    grouping = {
        label.strip()
        for m in re.finditer(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr)
        for label in m[1].split(",")
        if label.strip()
    }
    bare = re.sub(r'"[^"]*"', "", expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    bare = _strip_grouping(bare)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)\s*(\()?", bare):
        word, call = m[1], m[2]
        if word.lower() in PROMQL_KEYWORDS:
            continue
        if call:
            assert word in PROMQL_FUNCTIONS | PROMQL_AGGREGATIONS, f"unknown function {word}"
            continue
        if word in PROMQL_AGGREGATIONS:  # `sum by (x) (...)`: the call comes after `by`
            continue
        names.add(word)
    return names, selectors, grouping


@cache
def recording_rules() -> dict[str, str]:
    rules = {}
    for group in one(RULES, "PrometheusRule")["spec"]["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                rules[rule["record"]] = rule["expr"]
    return rules


# --------------------------------------------------------------------------- Grafana


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded
