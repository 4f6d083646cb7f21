"""Every Envoy bootstrap in the repo, and the harness's rendering of it, passes
`envoy --mode validate` with the real binary."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from testbed.harness import (
    ENVOY_CONFIG,
    EXTPROC_CLUSTER,
    REPO_ROOT,
    free_port,
    render_envoy_config,
    validate_envoy_config,
)
from tests.deploy.manifests import (
    check_guard_routes,
    check_local_reply_config,
    ingress_hcm,
    removed_prefixes,
)
from tests.e2e.envoy_configs import envoy_bootstraps


def _assert_valid(path: Path) -> None:
    result = validate_envoy_config(path)
    assert result.returncode == 0, (
        f"envoy --mode validate -c {path} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    )


def test_envoy_yaml_is_found() -> None:
    assert ENVOY_CONFIG in envoy_bootstraps()


@pytest.mark.parametrize("config", envoy_bootstraps(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_bootstrap_validates(config: Path) -> None:
    _assert_valid(config)


def test_rendered_config_validates(tmp_path: Path) -> None:
    ports = {"vllm-local": free_port(), "other-backend": free_port()}
    listen, admin, extproc = free_port(), free_port(), free_port()
    dst = render_envoy_config(
        ENVOY_CONFIG,
        tmp_path / "envoy.yaml",
        listen_port=listen,
        admin_port=admin,
        extproc_port=extproc,
        backends=ports,
    )
    _assert_valid(dst)

    rendered = yaml.safe_load(dst.read_text(encoding="utf-8"))
    resources = rendered["static_resources"]
    assert rendered["admin"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": admin,
    }
    assert resources["listeners"][0]["address"]["socket_address"]["port_value"] == listen
    endpoints = {
        c["name"]: c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
            "socket_address"
        ]["port_value"]
        for c in resources["clusters"]
    }
    assert endpoints == {EXTPROC_CLUSTER: extproc, **ports}


def test_rendered_config_without_the_template_backend(tmp_path: Path) -> None:
    """Backends not named vllm-local: the default route follows the first of them."""
    port = free_port()
    dst = render_envoy_config(
        ENVOY_CONFIG,
        tmp_path / "envoy.yaml",
        listen_port=free_port(),
        admin_port=free_port(),
        extproc_port=free_port(),
        backends={"gpu-a": port},
    )
    _assert_valid(dst)
    text = dst.read_text(encoding="utf-8")
    assert "vllm-local" not in text


@pytest.mark.parametrize(
    "config",
    sorted((REPO_ROOT / "envoy").glob("*.yaml")),
    ids=lambda p: str(p.relative_to(REPO_ROOT)),
)
def test_rendered_config_keeps_the_edge(config: Path, tmp_path: Path) -> None:
    """What the e2e tests run is what ships: the harness's rendering keeps the routing guard
    and the client-header settings; only the pass-through route follows the backend."""
    dst = render_envoy_config(
        config,
        tmp_path / "envoy.yaml",
        listen_port=free_port(),
        admin_port=free_port(),
        extproc_port=free_port(),
        backends={"gpu-a": free_port(), "gpu-b": free_port()},
    )
    _assert_valid(dst)
    shipped = yaml.safe_load(config.read_text(encoding="utf-8"))
    rendered = yaml.safe_load(dst.read_text(encoding="utf-8"))
    hcm, shipped_hcm = ingress_hcm(rendered), ingress_hcm(shipped)
    for key in ("use_remote_address", "xff_num_trusted_hops", "internal_address_config"):
        assert hcm[key] == shipped_hcm[key], key
    assert removed_prefixes(hcm) == removed_prefixes(shipped_hcm) >= {"x-kvgate-", "x-envoy-"}
    # Envoy's own local replies as OpenAI JSON, kvgate's replies untouched.
    assert hcm["local_reply_config"] == shipped_hcm["local_reply_config"]
    check_local_reply_config(hcm["local_reply_config"], str(config))
    (vhost,) = hcm["route_config"]["virtual_hosts"]
    check_guard_routes(vhost["routes"], str(dst))
    (shipped_vhost,) = shipped_hcm["route_config"]["virtual_hosts"]
    for route, original in zip(vhost["routes"], shipped_vhost["routes"], strict=True):
        if route.get("route", {}).get("cluster"):
            assert route["route"]["cluster"] == "gpu-a"
            route = {**route, "route": {**route["route"], "cluster": "vllm-local"}}
        assert route == original
