"""deploy/istio/: the EnvoyFilters on a shared ingress gateway and on vLLM's sidecar.

- Gateway: every patch matches only the LLM API's listener (the Gateway server's port, the
  HTTP connection manager of its filter chain) on the gateway pods the Gateway selects;
  applied as istiod matches patches to a gateway that also serves another application, the
  other application's listener is left exactly as it was, and the result passes
  `envoy --mode validate`.
- RE2 program size: the factored mutation allow-list accepts exactly the header names
  envoy/envoy.yaml's accepts and compiles within the limit Istio's bootstrap sets
  (re2.max_program_size.error_level = 32768) and within the 200 the manifests name as the
  floor for a mesh that lowers it; every other regex the patches add fits Envoy's own
  default of 100 (measured with the real Envoy), which refuses the allow-list.
- Sidecar: vLLM's GET /metrics, /health, /ping and /version bypass kvgate (ext_proc
  disabled on their route, ahead of the guard routes), every other route keeps ext_proc;
  a real Envoy with kvgate unreachable serves those four and fails closed on the rest.
"""

from __future__ import annotations

import copy
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.harness import ManagedProcess, _bin, free_port, validate_envoy_config
from tests.deploy.manifests import (
    EXT_PROC,
    HCM,
    ISTIO_FILTERS,
    ROUTER,
    apply_istio_patch,
    envoy_reference,
    ext_proc_config,
    hcm_of,
    ingress_hcm,
    istio_inbound_bootstrap,
    objects,
    one,
)

GATEWAY_FILE, SIDECAR_FILE = ISTIO_FILTERS
ENVOY_DEFAULT_RE2_LIMIT = 100  # re2.max_program_size.error_level when nothing sets it
# What Istio's bootstrap sets it to (its "global config" runtime layer).
ISTIO_BOOTSTRAP_RE2_LIMIT = 32768
# The floor the manifests ask of a mesh whose ProxyConfig.runtimeValues lowers it.
DOCUMENTED_RE2_FLOOR = 200
EXT_PROC_PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
UNMETERED_PATHS = ("/metrics", "/health", "/ping", "/version")


def gateway_filter() -> dict[str, Any]:
    (envoy_filter,) = objects(GATEWAY_FILE, "EnvoyFilter")
    return envoy_filter


def sidecar_filter() -> dict[str, Any]:
    (envoy_filter,) = objects(SIDECAR_FILE, "EnvoyFilter")
    return envoy_filter


def llm_port() -> int:
    (server,) = one(GATEWAY_FILE, "Gateway", "llm-gateway")["spec"]["servers"]
    port: int = server["port"]["number"]
    return port


def allow_list(envoy_filter: dict[str, Any]) -> str:
    (patch,) = [p for p in envoy_filter["spec"]["configPatches"] if p["applyTo"] == "HTTP_FILTER"]
    regex: str = patch["patch"]["value"]["typed_config"]["mutation_rules"]["allow_expression"][
        "regex"
    ]
    return regex


def without_re2_overrides(config: dict[str, Any], **keys: int) -> dict[str, Any]:
    """The bootstrap with Envoy's own RE2 limits (plus `keys`, dots as double underscores)."""
    config = copy.deepcopy(config)
    static = {k.replace("__", "."): v for k, v in keys.items()}
    config["layered_runtime"] = {"layers": [{"name": "static", "static_layer": static}]}
    return config


def as_istio_runs_it(config: dict[str, Any]) -> dict[str, Any]:
    """The bootstrap with the RE2 limit Istio's own bootstrap sets."""
    return without_re2_overrides(
        config, re2__max_program_size__error_level=ISTIO_BOOTSTRAP_RE2_LIMIT
    )


def re2_program_sizes(config: dict[str, Any], tmp_path: Path, name: str) -> dict[str, int]:
    """Validate `config` with Istio's bootstrap error level and a warn level of 1, so Envoy
    logs the RE2 program size of every regex it compiles. {regex: size}."""
    measured = without_re2_overrides(
        config,
        re2__max_program_size__error_level=ISTIO_BOOTSTRAP_RE2_LIMIT,
        re2__max_program_size__warn_level=1,
    )
    path = tmp_path / name
    path.write_text(yaml.safe_dump(measured, sort_keys=False), encoding="utf-8")
    result = validate_envoy_config(path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{name} does not fit Istio's RE2 limit:\n{output}"
    sizes = {
        m[1]: int(m[2]) for m in re.finditer(r"regex '(.*?)' RE2 program size of (\d+)", output)
    }
    assert sizes, f"Envoy reported no program size (warn level ignored?):\n{output}"
    return sizes


def assert_validates(config: dict[str, Any], tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    result = validate_envoy_config(path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"envoy --mode validate {name}:\n{output}"
    assert "Deprecated field" not in output, output


# --------------------------------------------------------------------------- gateway


def listener_port(listener: dict[str, Any]) -> int:
    port: int = listener["address"]["socket_address"]["port_value"]
    return port


def listener_matches(listener: dict[str, Any], match: dict[str, Any] | None) -> bool:
    """istiod's listener match (name, portNumber, filterChain.filter[.subFilter])."""
    if match is None:
        return True
    if "name" in match and match["name"] != listener["name"]:
        return False
    if "portNumber" in match and match["portNumber"] != listener_port(listener):
        return False
    chain_filter = match.get("filterChain", {}).get("filter")
    if chain_filter:
        if chain_filter["name"] != HCM:
            return False
        sub = chain_filter.get("subFilter", {}).get("name")
        if sub and sub not in [f["name"] for f in hcm_of(listener).get("http_filters", [])]:
            return False
    return True


def apply_to_matching_listeners(
    config: dict[str, Any], envoy_filter: dict[str, Any]
) -> dict[str, Any]:
    """Apply the gateway EnvoyFilter's patches only where their listener match says, as
    istiod does; every patch must land on exactly one listener."""
    config = copy.deepcopy(config)
    for patch in envoy_filter["spec"]["configPatches"]:
        targets = [
            listener
            for listener in config["static_resources"]["listeners"]
            if listener_matches(listener, patch["match"].get("listener"))
        ]
        assert len(targets) == 1, f"{patch['applyTo']} patch lands on {len(targets)} listeners"
        (listener,) = targets
        # The gateway patches add no routes: an HTTP_ROUTE patch here would fail the helper.
        assert patch["applyTo"] != "HTTP_ROUTE"
        apply_istio_patch(listener, patch, replace_ext_proc=False)
    return config


def shared_gateway() -> dict[str, Any]:
    """What istiod gives a shared ingress gateway before kvgate's EnvoyFilter: the LLM API's
    listener on the Gateway's port (envoy/envoy.yaml's listener without what the EnvoyFilter
    adds) and another application's plain-HTTP listener on 8080 (Istio's port 80)."""
    config = envoy_reference()
    (llm,) = config["static_resources"]["listeners"]
    llm.pop("per_connection_buffer_limit_bytes", None)
    hcm = hcm_of(llm)
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != EXT_PROC]
    for key in ("early_header_mutation_extensions", "local_reply_config"):
        hcm.pop(key)
    llm["name"] = f"0.0.0.0_{llm_port()}"
    llm["address"]["socket_address"] = {"address": "0.0.0.0", "port_value": llm_port()}
    other = {
        "name": "0.0.0.0_8080",
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": 8080}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": HCM,
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network"
                            ".http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "outbound_0.0.0.0_8080",
                            "route_config": {
                                "name": "http.8080",
                                "virtual_hosts": [
                                    {
                                        "name": "shop.example.com:80",
                                        "domains": ["shop.example.com"],
                                        "routes": [
                                            {
                                                "match": {"prefix": "/"},
                                                "route": {"cluster": "vllm-local"},
                                            }
                                        ],
                                    }
                                ],
                            },
                            "http_filters": [
                                {
                                    "name": ROUTER,
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters"
                                        ".http.router.v3.Router"
                                    },
                                }
                            ],
                        },
                    }
                ]
            }
        ],
    }
    config["static_resources"]["listeners"].append(other)
    return config


def test_gateway_envoyfilter_matches_only_the_llm_listener() -> None:
    envoy_filter = gateway_filter()
    gateway = one(GATEWAY_FILE, "Gateway", "llm-gateway")
    # The gateway pods the Gateway runs on, and no others.
    assert envoy_filter["spec"]["workloadSelector"]["labels"] == gateway["spec"]["selector"]
    assert envoy_filter["metadata"]["namespace"] == gateway["metadata"]["namespace"]
    (server,) = gateway["spec"]["servers"]
    # A port of its own: Istio merges every plain-HTTP server on a port into one listener,
    # so a shared port (80) would share the connection manager with other applications.
    assert server["port"]["number"] not in (80, 443, 8080, 8443, 15021, 15090)
    for patch in envoy_filter["spec"]["configPatches"]:
        match = patch["match"]
        assert match["context"] == "GATEWAY"
        assert match["listener"]["portNumber"] == server["port"]["number"], patch["applyTo"]
        if patch["applyTo"] in ("HTTP_FILTER", "NETWORK_FILTER"):
            assert match["listener"]["filterChain"]["filter"]["name"] == HCM, patch["applyTo"]


def test_shared_gateway_other_application_gets_nothing(tmp_path: Path) -> None:
    before = shared_gateway()
    after = apply_to_matching_listeners(before, gateway_filter())
    old = {listener["name"]: listener for listener in before["static_resources"]["listeners"]}
    new = {listener["name"]: listener for listener in after["static_resources"]["listeners"]}
    assert new["0.0.0.0_8080"] == old["0.0.0.0_8080"], "another application's listener changed"
    llm = new[f"0.0.0.0_{llm_port()}"]
    filters = [f["name"] for f in hcm_of(llm)["http_filters"]]
    assert filters.index(EXT_PROC) == filters.index(ROUTER) - 1
    assert hcm_of(llm)["local_reply_config"]["mappers"]
    assert hcm_of(llm)["early_header_mutation_extensions"]
    assert llm["per_connection_buffer_limit_bytes"] == 8 * 1024 * 1024
    # With the RE2 limit Istio's bootstrap sets: no runtime annotation on the gateway pods.
    assert_validates(as_istio_runs_it(after), tmp_path, "istio-shared-gateway.yaml")


# --------------------------------------------------------------------------- RE2


def _corpus() -> Iterator[str]:
    """Header names around the allow-list: its names and prefixes, each cut, extended and
    edited one character at a time, and a few joined."""
    names = [
        "retry-after",
        "retry-after-ms",
        "content-length",
        "content-type",
        "www-authenticate",
        "allow",
        "authorization",
        "x-api-key",
        "x-kvgate-",
        "x-ratelimit-",
        "x-kvgate-backend",
        "x-ratelimit-remaining-tokens",
        "anthropic-ratelimit-",
        "anthropic-ratelimit-requests-reset",
        "idempotent-replayed",
    ]
    alphabet = sorted(set("".join(names)) | set("xz.-_\n\u00e9"))
    yield ""
    for name in names:
        yield name
        for i in range(len(name) + 1):
            yield name[:i]
            yield name[i:]
            for ch in alphabet:
                yield name[:i] + ch + name[i:]
                if i < len(name):
                    yield name[:i] + ch + name[i + 1 :]
            if i < len(name):
                yield name[:i] + name[i + 1 :]
        for other in names:
            yield name + other
            yield name + "|" + other


def test_factored_allow_list_is_envoy_yaml_allow_list() -> None:
    reference = ext_proc_config(envoy_reference())["mutation_rules"]["allow_expression"]["regex"]
    for envoy_filter in (gateway_filter(), sidecar_filter()):
        factored = allow_list(envoy_filter)
        checked = 0
        for name in _corpus():
            expected = re.fullmatch(reference, name) is not None
            assert (re.fullmatch(factored, name) is not None) == expected, repr(name)
            checked += 1
        assert checked > 10000


def test_the_allow_list_needs_istios_limit_and_fits_the_documented_floor(tmp_path: Path) -> None:
    """The limit is real: Envoy left at its own default (100) refuses the gateway's factored
    allow-list; at the floor the manifests name (200) it accepts it."""
    config = apply_to_matching_listeners(shared_gateway(), gateway_filter())
    path = tmp_path / "default-limit.yaml"
    path.write_text(yaml.safe_dump(without_re2_overrides(config)), encoding="utf-8")
    result = validate_envoy_config(path)
    assert result.returncode != 0
    assert "max program size of 100" in result.stdout + result.stderr
    floor = without_re2_overrides(config, re2__max_program_size__error_level=DOCUMENTED_RE2_FLOOR)
    assert_validates(floor, tmp_path, "floor.yaml")


@pytest.mark.parametrize("variant", ["gateway", "sidecar"])
def test_every_istio_regex_fits_its_program_size(variant: str, tmp_path: Path) -> None:
    """The allow-list fits the documented floor (so Istio's 32768 with room to spare); every
    other regex the patches add fits Envoy's own default."""
    if variant == "gateway":
        config = apply_to_matching_listeners(shared_gateway(), gateway_filter())
        envoy_filter = gateway_filter()
    else:
        config, envoy_filter = istio_inbound_bootstrap(), sidecar_filter()
    sizes = re2_program_sizes(config, tmp_path, f"re2-{variant}.yaml")
    allowed = allow_list(envoy_filter)
    assert allowed in sizes, sizes
    assert ENVOY_DEFAULT_RE2_LIMIT < sizes[allowed] <= DOCUMENTED_RE2_FLOOR, sizes
    others = {regex: size for regex, size in sizes.items() if regex != allowed}
    assert max(others.values(), default=0) <= ENVOY_DEFAULT_RE2_LIMIT, others


def test_no_runtime_annotation_is_left_behind() -> None:
    """The manifests no longer ask for the annotation they no longer need."""
    for path in ISTIO_FILTERS:
        text = path.read_text(encoding="utf-8")
        assert '"500"' not in text, f"{path.name} still asks for re2 runtime values"


# --------------------------------------------------------------------------- sidecar


def unmetered_patch() -> dict[str, Any]:
    patches = sidecar_filter()["spec"]["configPatches"]
    found = [
        (i, p)
        for i, p in enumerate(patches)
        if p["applyTo"] == "HTTP_ROUTE" and "route" in p["patch"]["value"]
    ]
    assert len(found) == 1, "one route for vLLM's unmetered GETs"
    index, patch = found[0]
    # INSERT_FIRST patches apply in order: the last one ends up first, before the guards.
    later = [p for p in patches[index + 1 :] if p["applyTo"] == "HTTP_ROUTE"]
    assert not later, "the unmetered route must be the last INSERT_FIRST patch"
    return patch


def test_sidecar_unmetered_route_targets_istios_inbound_cluster() -> None:
    patch = unmetered_patch()
    assert patch["match"]["context"] == "SIDECAR_INBOUND"
    assert patch["match"]["routeConfiguration"]["portNumber"] == 8000
    assert patch["patch"]["operation"] == "INSERT_FIRST"
    route = patch["patch"]["value"]
    assert route["route"]["cluster"] == "inbound|8000||"
    assert "retry_policy" not in route["route"]


def test_sidecar_vllm_gets_bypass_kvgate_and_nothing_else(tmp_path: Path) -> None:
    inbound = istio_inbound_bootstrap()
    (vhost,) = ingress_hcm(inbound)["route_config"]["virtual_hosts"]
    first, rest = vhost["routes"][0], vhost["routes"][1:]
    per_filter = first["typed_per_filter_config"][EXT_PROC]
    assert per_filter == {"@type": EXT_PROC_PER_ROUTE, "disabled": True}
    regex = first["match"]["safe_regex"]["regex"]
    assert set(first["match"]) == {"safe_regex", "headers"}
    assert first["match"]["headers"] == [{"name": ":method", "string_match": {"exact": "GET"}}]
    for path in UNMETERED_PATHS:
        assert re.fullmatch(regex, path), path
    for path in (
        "/",
        "/metrics/",
        "/metricsx",
        "/healthz",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/metrics/../v1/completions",
        "/x/metrics",
    ):
        assert not re.fullmatch(regex, path), path
    # Every other route keeps ext_proc: the guards, Istio's own route.
    for route in rest:
        assert EXT_PROC not in route.get("typed_per_filter_config", {}), route["name"]
    assert rest[-1]["name"] == "default"
    assert first["route"]["cluster"] == rest[-1]["route"]["cluster"]
    # With the RE2 limit Istio's bootstrap sets: no runtime annotation on the vLLM pods.
    assert_validates(as_istio_runs_it(inbound), tmp_path, "istio-inbound.yaml")


class _Backend(BaseHTTPRequestHandler):
    seen: list[tuple[str, str]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        type(self).seen.append((self.command, self.path))
        body = b"vllm"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _status(url: str, method: str) -> int:
    request = urllib.request.Request(url, data=b"{}" if method == "POST" else None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def test_sidecar_with_kvgate_down_serves_only_the_unmetered_gets(tmp_path: Path) -> None:
    """A real Envoy on the emulated inbound listener, kvgate unreachable (fail closed): the
    four GETs reach vLLM, every other request is refused and never reaches it."""
    _Backend.seen = []
    backend = ThreadingHTTPServer(("127.0.0.1", 0), _Backend)
    thread = threading.Thread(target=backend.serve_forever, daemon=True)
    thread.start()
    try:
        config = istio_inbound_bootstrap()
        admin, listen = free_port(), free_port()
        config["admin"]["address"]["socket_address"].update(address="127.0.0.1", port_value=admin)
        (listener,) = config["static_resources"]["listeners"]
        listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen}
        for cluster in config["static_resources"]["clusters"]:
            if cluster["type"] == "ORIGINAL_DST":  # envoy/envoy.yaml's pool: no endpoints
                continue
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            port = backend.server_address[1] if cluster["name"] == "vllm-local" else free_port()
            endpoint["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": port}
        path = tmp_path / "envoy.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        argv = [_bin("envoy"), "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
        with ManagedProcess("envoy-istio-inbound", argv, log_dir=tmp_path) as envoy:
            envoy.wait_http(f"http://127.0.0.1:{admin}/ready", timeout=30)
            base = f"http://127.0.0.1:{listen}"
            for target in (*UNMETERED_PATHS, "/metrics?name[]=vllm:num_requests_running"):
                assert _status(base + target, "GET") == 200, target
            unmetered_seen = len(_Backend.seen)
            for method, target in (
                ("POST", "/metrics"),
                ("POST", "/ping"),
                ("GET", "/v1/models"),
                ("POST", "/v1/chat/completions"),
                ("GET", "/metricsx"),
                ("GET", "/metrics/"),
            ):
                assert _status(base + target, method) >= 500, (method, target)
            assert len(_Backend.seen) == unmetered_seen, _Backend.seen
            assert envoy.running
    finally:
        backend.shutdown()
        backend.server_close()
