"""The shipped configs keep the operator surfaces private: the admin gRPC API on loopback or
behind a token from a mounted Secret, and kvgate's own verdict on every operator listener."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvgate.admin.auth import OperatorAuth, OperatorTokens, is_loopback_listen
from kvgate.config import parse_config
from tests.deploy.manifests import container, kvgate_config_of, rel, workload_files

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", workload_files(), ids=rel)
def test_manifest_admin_api_is_loopback_or_token_from_a_secret(path: Path) -> None:
    merged, workload = kvgate_config_of(path)
    server = parse_config(merged).server
    tokens = server.admin_token_file or server.admin_token_env
    assert is_loopback_listen(server.admin_listen) or tokens, (
        f"{rel(path)}: admin_listen {server.admin_listen} needs an operator token"
    )
    if server.admin_token_file:  # the file must come from a Secret volume of the pod
        template = workload["spec"]["template"]
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        mounts = [
            m
            for m in container(template, "kvgate")["volumeMounts"]
            if server.admin_token_file.startswith(m["mountPath"].rstrip("/") + "/")
        ]
        assert mounts, f"{rel(path)}: {server.admin_token_file} is not mounted"
        assert "secret" in volumes[mounts[0]["name"]], "the token belongs in a Secret"
    # What kvgate itself will say about each operator listener of this config.
    auth = OperatorAuth(OperatorTokens(env_token="x" * 32) if tokens else OperatorTokens())
    warned = auth.exposure_warnings({"server.admin_listen": server.admin_listen})
    assert warned == [], warned


def test_local_config_keeps_every_operator_listener_on_loopback() -> None:
    config = yaml.safe_load((ROOT / "deploy/local/kvgate.yaml").read_text(encoding="utf-8"))
    server = parse_config(config).server
    assert is_loopback_listen(server.http_listen) and is_loopback_listen(server.admin_listen)
