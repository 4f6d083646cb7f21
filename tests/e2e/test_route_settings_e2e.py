"""Per-route settings travel from Envoy's route configuration to kvgate's decision.

envoy/envoy.yaml with two more virtual hosts whose pre-admission route carries an ext_proc
per-route override (gRPC initial metadata): `restricted.local` admits only tenant team-a and
model qwen2.5-demo; `broken.local` says something kvgate cannot read. The real Envoy binary
validates the config and sends the metadata; nothing else is stubbed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from testbed.demo_model import demo_model_dir
from testbed.harness import ENVOY_CONFIG, Stack, sim_stats, validate_envoy_config

MODEL = "qwen2.5-demo"
OTHER_MODEL = "other-demo"
TEAM_A_KEY = "sk-team-a"
TEAM_B_KEY = "sk-team-b"
# One request per minute: its second request is over RPM (enforced, or shadowed on trial).
TEAM_C_KEY = "sk-team-c"
BATCH_BACKEND = "vllm-batch"
PER_ROUTE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"


def with_route_settings(host: str, settings: dict[str, str], vhost: dict[str, Any]) -> dict:
    """A copy of the catch-all virtual host for `host` whose routes carry `settings`."""
    copied = copy.deepcopy(vhost)
    copied["name"] = host
    copied["domains"] = [host, f"{host}:*"]
    override = {
        "@type": PER_ROUTE,
        "overrides": {
            "grpc_initial_metadata": [{"key": k, "value": v} for k, v in settings.items()]
        },
    }
    for route in copied["routes"]:
        route.setdefault("typed_per_filter_config", {})["envoy.filters.http.ext_proc"] = override
    return copied


def envoy_config_with_route_settings() -> dict[str, Any]:
    config = yaml.safe_load(ENVOY_CONFIG.read_text(encoding="utf-8"))
    [listener] = config["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    vhosts = hcm["route_config"]["virtual_hosts"]
    catch_all = vhosts[-1]
    restricted = {
        "x-kvgate-route": "restricted",
        "x-kvgate-route-models": MODEL,
        "x-kvgate-route-tenants": "team-a",
    }
    vhosts.insert(0, with_route_settings("restricted.local", restricted, catch_all))
    broken = {"x-kvgate-route-model": MODEL}  # a typo of x-kvgate-route-models
    vhosts.insert(0, with_route_settings("broken.local", broken, catch_all))
    batch = {"x-kvgate-route": "batch", "x-kvgate-route-backend": BATCH_BACKEND}
    vhosts.insert(0, with_route_settings("batch.local", batch, catch_all))
    trial = {"x-kvgate-route": "trial", "x-kvgate-route-shadow": "true"}
    vhosts.insert(0, with_route_settings("trial.local", trial, catch_all))
    nowhere = {"x-kvgate-route-backend": "no-such-backend"}
    vhosts.insert(0, with_route_settings("nowhere.local", nowhere, catch_all))
    # Clients written for Azure OpenAI send the key in `api-key`: the operator names it for
    # the route and adds it to the ext_proc filter's mutation allow-list, so kvgate can
    # remove it before the request goes upstream.
    azure = {"x-kvgate-route": "azure", "x-kvgate-route-key-header": "api-key"}
    vhosts.insert(0, with_route_settings("azure.local", azure, catch_all))
    # The same with a header the allow-list does not have: kvgate cannot remove it.
    leaky = {"x-kvgate-route-key-header": "team-key"}
    vhosts.insert(0, with_route_settings("leaky.local", leaky, catch_all))
    # A route for workloads the mesh identifies: an API key is not accepted there.
    mesh_only = {"x-kvgate-route": "mesh", "x-kvgate-route-identity-sources": "jwt, spiffe"}
    vhosts.insert(0, with_route_settings("mesh.local", mesh_only, catch_all))
    for http_filter in hcm["http_filters"]:
        if http_filter["name"] == "envoy.filters.http.ext_proc":
            rules = http_filter["typed_config"]["mutation_rules"]["allow_expression"]
            rules["regex"] += "|api-key"
    return config


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    src = tmp_path_factory.mktemp("route-settings") / "envoy.yaml"
    src.write_text(yaml.safe_dump(envoy_config_with_route_settings(), sort_keys=False), "utf-8")
    model = {
        "tokenizer": str(demo_model_dir()),
        "max_context": 32768,
        "default_max_new_tokens": 64,
        "backend": "vllm-local",
    }
    with Stack(
        tenants=[
            {"name": "team-a", "api_key": TEAM_A_KEY},
            {"name": "team-b", "api_key": TEAM_B_KEY},
            {"name": "team-c", "api_key": TEAM_C_KEY, "limits": {"rpm": 1}},
        ],
        models=[{"name": MODEL, **model}, {"name": OTHER_MODEL, **model}],
        backends=[
            {"name": "vllm-local", "kv_budget_tokens": 48000},
            {"name": BATCH_BACKEND, "kv_budget_tokens": 48000},
        ],
        envoy_config=src,
    ) as running:
        yield running


def test_the_config_validates(tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(envoy_config_with_route_settings(), sort_keys=False), "utf-8")
    result = validate_envoy_config(path)
    assert result.returncode == 0, result.stderr[-2000:]


def post(stack: Stack, host: str, key: str, model: str = MODEL, **extra: str) -> httpx.Response:
    return httpx.post(
        stack.base_url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8},
        headers={"authorization": f"Bearer {key}", "host": host, **extra},
        timeout=30,
    )


def rejections(stack: Stack, reason: str) -> float:
    text = httpx.get(stack.kvgate_metrics_url, timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvgate_requests_total"
        and sample.labels == {"outcome": "rejected", "reason": reason}
    )


def served_count(stack: Stack) -> int:
    return len(sim_stats(stack)["served"])


def test_a_restricted_route_admits_its_tenant_and_model(stack: Stack) -> None:
    resp = post(stack, "restricted.local", TEAM_A_KEY)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] > 0


def test_a_restricted_route_refuses_other_tenants_and_models(stack: Stack) -> None:
    served = served_count(stack)
    other_tenant = post(stack, "restricted.local", TEAM_B_KEY)
    assert other_tenant.status_code == 403, other_tenant.text
    assert other_tenant.json()["error"]["code"] == "tenant_not_allowed_on_route"
    other_model = post(stack, "restricted.local", TEAM_A_KEY, OTHER_MODEL)
    assert other_model.status_code == 404, other_model.text
    assert other_model.json()["error"]["code"] == "model_not_found"
    assert rejections(stack, "model_not_allowed_on_route") >= 1
    assert served_count(stack) == served  # neither reached the backend


def test_the_default_route_is_not_restricted(stack: Stack) -> None:
    """The same tenant and model on the default host: the route, not kvgate's own
    configuration, made the difference above."""
    resp = post(stack, "localhost", TEAM_B_KEY)
    assert resp.status_code == 200, resp.text
    before = rejections(stack, "model_not_allowed_on_route")
    post(stack, "localhost", TEAM_A_KEY, OTHER_MODEL)  # admitted; the simulator serves one name
    assert rejections(stack, "model_not_allowed_on_route") == before


def test_unreadable_settings_fail_closed(stack: Stack) -> None:
    served = served_count(stack)
    resp = post(stack, "broken.local", TEAM_A_KEY)
    assert resp.status_code == 500, resp.text
    error = resp.json()["error"]
    assert error["code"] == "route_misconfigured"
    assert "x-kvgate-route-model" in error["message"]
    assert served_count(stack) == served


def test_a_client_cannot_say_route_settings_itself(stack: Stack) -> None:
    """Route settings come only from Envoy's route configuration (gRPC metadata): the same
    names sent as request headers are removed like every client x-kvgate-* header."""
    served = served_count(stack)
    forged = {
        "x-kvgate-route": "open",
        "x-kvgate-route-tenants": "team-b",
        "x-kvgate-route-models": OTHER_MODEL,
    }
    resp = post(stack, "restricted.local", TEAM_B_KEY, **forged)
    assert resp.status_code == 403, resp.text
    assert resp.json()["error"]["code"] == "tenant_not_allowed_on_route"
    resp = post(stack, "restricted.local", TEAM_A_KEY, OTHER_MODEL, **forged)
    assert resp.status_code == 404, resp.text
    assert served_count(stack) == served


def test_a_route_names_the_backend_that_serves_it(stack: Stack) -> None:
    """batch.local's requests go to (and reserve on) the backend its route names, not the
    model's own; a route naming a backend kvgate does not have fails closed."""
    before_batch = len(sim_stats(stack, BATCH_BACKEND)["served"])
    before_local = served_count(stack)
    resp = post(stack, "batch.local", TEAM_A_KEY)
    assert resp.status_code == 200, resp.text
    assert len(sim_stats(stack, BATCH_BACKEND)["served"]) == before_batch + 1
    assert served_count(stack) == before_local
    unknown = post(stack, "nowhere.local", TEAM_A_KEY)
    assert unknown.status_code == 500
    assert unknown.json()["error"]["code"] == "route_misconfigured"
    assert "x-kvgate-route-backend" in unknown.json()["error"]["message"]


def test_a_shadow_route_records_but_does_not_enforce_tenant_limits(stack: Stack) -> None:
    """team-c may send one request a minute: on the default route its second is a 429; on
    the shadow route it is admitted and counted as a shadow rejection."""
    first = post(stack, "localhost", TEAM_C_KEY)
    assert first.status_code == 200, first.text
    second = post(stack, "localhost", TEAM_C_KEY)
    assert second.status_code == 429 and second.json()["error"]["code"] == "rpm_exceeded"
    text = httpx.get(stack.kvgate_metrics_url, timeout=5).text
    shadowed_before = _shadow_rejections(text, "team-c")
    trial = post(stack, "trial.local", TEAM_C_KEY)
    assert trial.status_code == 200, trial.text
    text = httpx.get(stack.kvgate_metrics_url, timeout=5).text
    assert _shadow_rejections(text, "team-c") == shadowed_before + 1


def _shadow_rejections(text: str, tenant: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvgate_shadow_rejections_total" and sample.labels.get("tenant") == tenant
    )


def _sim_requests(stack: Stack) -> list[dict[str, Any]]:
    return httpx.get(f"{stack.sim_url}/sim/requests?limit=1000", timeout=5).json()["requests"]


def test_a_route_reads_the_key_from_its_own_header_and_never_forwards_it(stack: Stack) -> None:
    before = len(_sim_requests(stack))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    resp = httpx.post(
        stack.base_url + "/v1/chat/completions",
        json=body,
        headers={"api-key": TEAM_A_KEY, "host": "azure.local"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    [seen] = _sim_requests(stack)[before:]
    assert "api-key" not in {name.lower() for name in seen["headers"]}, seen["headers"]
    # On that route the usual headers are not read: the key is where the route says.
    bearer = post(stack, "azure.local", TEAM_A_KEY)
    assert bearer.status_code == 401, bearer.text
    assert "api-key header" in bearer.json()["error"]["message"]


def test_a_key_header_kvgate_may_not_remove_fails_closed(stack: Stack) -> None:
    """The route names a header that is not in the mutation allow-list: Envoy refuses
    kvgate's removal (disallow_is_error), so the request fails instead of carrying the
    tenant's key to the backend."""
    before = len(_sim_requests(stack))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    resp = httpx.post(
        stack.base_url + "/v1/chat/completions",
        json=body,
        headers={"team-key": TEAM_A_KEY, "host": "leaky.local"},
        timeout=30,
    )
    assert resp.status_code >= 500, resp.text
    assert "error" in resp.json()
    assert len(_sim_requests(stack)) == before


def test_a_mesh_only_route_refuses_an_api_key(stack: Stack) -> None:
    served = served_count(stack)
    refused = post(stack, "mesh.local", TEAM_A_KEY)
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["code"] == "unknown_identity"
    # The same key on the default route is a valid key.
    assert post(stack, "localhost", TEAM_A_KEY).status_code == 200
    assert served_count(stack) == served + 1
