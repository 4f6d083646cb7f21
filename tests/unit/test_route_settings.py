"""Per-route settings from Envoy's gRPC metadata: read strictly, never half-ignored."""

from __future__ import annotations

import pytest

from kvgate.extproc.route_settings import (
    NO_ROUTE_SETTINGS,
    RouteSettings,
    RouteSettingsError,
    parse_route_settings,
)


def test_settings_are_read_and_other_metadata_ignored() -> None:
    settings = parse_route_settings(
        [
            ("user-agent", "grpc-c++"),
            ("x-envoy-internal", "true"),
            ("x-kvgate-route", "team-a"),
            ("X-Kvgate-Route-Models", "qwen2.5-demo, small-model"),
            ("x-kvgate-route-tenants", b"team-a"),
            ("x-kvgate-route-priority", " -5 "),
            ("x-kvgate-route-backend", "batch-pool"),
            ("x-kvgate-route-shadow", "TRUE"),
            ("x-kvgate-route-key-header", "team-key"),
        ]
    )
    assert settings == RouteSettings(
        name="team-a",
        models=frozenset({"qwen2.5-demo", "small-model"}),
        tenants=frozenset({"team-a"}),
        priority=-5,
        backend="batch-pool",
        shadow=True,
        key_header="team-key",
    )
    assert settings.allows_model("small-model") and not settings.allows_model("big-model")
    assert settings.allows_tenant("team-a") and not settings.allows_tenant("team-b")


def test_no_settings_restrict_nothing() -> None:
    settings = parse_route_settings([("content-type", "application/grpc")])
    assert settings == NO_ROUTE_SETTINGS
    assert settings.allows_model("any") and settings.allows_tenant("any")


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ([("x-kvgate-route-modles", "a")], "x-kvgate-route-modles"),  # a typo is not ignored
        ([("x-kvgate-route-models", "a"), ("x-kvgate-route-models", "b")], "x-kvgate-route-models"),
        ([("x-kvgate-route-models", "")], "x-kvgate-route-models"),
        ([("x-kvgate-route-models", "a,,b")], "x-kvgate-route-models"),
        ([("x-kvgate-route-tenants", "team a")], "x-kvgate-route-tenants"),
        ([("x-kvgate-route", "bad name!")], "x-kvgate-route"),
        ([("x-kvgate-route-priority", "high")], "x-kvgate-route-priority"),
        ([("x-kvgate-route-priority", "101")], "x-kvgate-route-priority"),
        ([("x-kvgate-route-priority", "1e3")], "x-kvgate-route-priority"),
        ([("x-kvgate-route-backend", "pool/10.0.0.1:80")], "x-kvgate-route-backend"),
        ([("x-kvgate-route-shadow", "yes")], "x-kvgate-route-shadow"),
        ([("x-kvgate-route-key-header", "Api-Key")], "x-kvgate-route-key-header"),
        ([("x-kvgate-route-key-header", "x-envoy-key")], "x-kvgate-route-key-header"),
        ([("x-kvgate-route-key-header", "host")], "x-kvgate-route-key-header"),
        ([("x-kvgate-route-key-header", ":authority")], "x-kvgate-route-key-header"),
        (
            [("x-kvgate-route-tenants", ",".join(f"t{i}" for i in range(300)))],
            "x-kvgate-route-tenants",
        ),
    ],
)
def test_unusable_settings_name_the_key(metadata: list[tuple[str, str]], key: str) -> None:
    with pytest.raises(RouteSettingsError) as caught:
        parse_route_settings(metadata)
    assert caught.value.key == key
