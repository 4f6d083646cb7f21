"""Every Kubernetes object under deploy/ validates against its kind's real schema, offline.

The schemas are test data (tests/deploy/schemas/, README.md there says where each comes from):
Kubernetes' own kinds from the strict JSON schemas of one Kubernetes release, and the CRDs of
Istio, Gateway API, Envoy Gateway and the Prometheus Operator as those projects ship them.

Strict, as `kubectl apply` (field validation "Strict") is: a field the schema does not know is
an error. For a CRD that is the API server's pruning rule: every object node of the (structural)
openAPIV3Schema takes only its `properties`, unless it has `additionalProperties` (a map) or
`x-kubernetes-preserve-unknown-fields: true`; an embedded resource also takes apiVersion, kind
and metadata. Not checked: CEL rules (`x-kubernetes-validations`) and `format`.

A kind with no schema here fails, naming it: a new kind needs its schema added (refresh.py).
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource

from tests.deploy.manifests import docs, k8s_files

SCHEMAS = Path(__file__).resolve().parent / "schemas"
K8S_SCHEMAS = SCHEMAS / "kubernetes" / "v1.34.0-local-strict"
DEFINITIONS_ID = "https://kubernetes.io/api/_definitions.json"
OBJECT_META = {"$ref": DEFINITIONS_ID + "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}


# --------------------------------------------------------------------------- schemas


@cache
def _registry() -> Registry:
    definitions = json.loads((K8S_SCHEMAS / "_definitions.json").read_text(encoding="utf-8"))
    return Registry().with_resource(DEFINITIONS_ID, Resource.from_contents(definitions))


@cache
def _kubernetes_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for path in sorted(K8S_SCHEMAS.glob("*.json")):
        if path.name.startswith("_"):
            continue
        schema = json.loads(path.read_text(encoding="utf-8"))
        for gvk in schema["x-kubernetes-group-version-kind"]:
            group_version = f"{gvk['group']}/{gvk['version']}" if gvk["group"] else gvk["version"]
            out[(group_version, gvk["kind"])] = schema
    return out


def _strict(node: Any, *, prune: bool, in_junctor: bool = False) -> Any:
    """A CRD's openAPIV3Schema node as JSON Schema 2020-12, unknown fields forbidden."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in ("properties", "patternProperties"):
        if key in out:
            out[key] = {k: _strict(v, prune=prune) for k, v in out[key].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = _strict(out["items"], prune=prune)
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _strict(out["additionalProperties"], prune=prune)
    for key in ("allOf", "anyOf", "oneOf"):
        if key in out:
            out[key] = [_strict(v, prune=prune, in_junctor=True) for v in out[key]]
    if "not" in out:
        out["not"] = _strict(out["not"], prune=prune, in_junctor=True)
    # OpenAPI 3.0 keywords in their JSON Schema 2020-12 spelling.
    if out.pop("nullable", False):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        # OpenAPI 3.0's boolean exclusiveMinimum/Maximum qualify minimum/maximum.
        if isinstance(out.get(exclusive), bool) and out.pop(exclusive) and bound in out:
            out[exclusive] = out.pop(bound)
    if out.get("x-kubernetes-embedded-resource"):
        out["properties"] = {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            **out.get("properties", {}),
        }
    # Pruning: junctor branches only constrain what the node around them declares.
    if (
        prune
        and not in_junctor
        and (out.get("type") == "object" or "properties" in out)
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for path in sorted((SCHEMAS / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if not crd:
                continue
            assert crd["kind"] == "CustomResourceDefinition", path
            spec = crd["spec"]
            for version in spec["versions"]:
                if not version.get("served"):
                    continue
                schema = _strict(
                    version["schema"]["openAPIV3Schema"],
                    prune=not spec.get("preserveUnknownFields", False),
                )
                # The API server takes apiVersion and kind at the root whether the CRD names them
                # or not (Istio's do not), and validates metadata as ObjectMeta whatever it says.
                schema["properties"] = {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    **schema["properties"],
                    "metadata": OBJECT_META,
                }
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                out[key] = schema
    return out


def _family(api_version: str) -> str:
    group = api_version.rpartition("/")[0]
    if group.endswith("istio.io"):
        return "istio"
    if group == "gateway.networking.k8s.io":
        return "gateway-api"
    if group == "gateway.envoyproxy.io":
        return "envoy-gateway"
    if group == "monitoring.coreos.com":
        return "prometheus-operator"
    return "kubernetes"


def schema_for(api_version: str, kind: str) -> dict[str, Any] | None:
    key = (api_version, kind)
    return _kubernetes_schemas().get(key) or _crd_schemas().get(key)


def errors(obj: dict[str, Any]) -> list[str]:
    schema = schema_for(obj.get("apiVersion", ""), obj.get("kind", ""))
    assert schema is not None, (
        f"no schema for {obj.get('apiVersion')} {obj.get('kind')} in tests/deploy/schemas/: "
        "add its Kubernetes JSON schema or CRD (tests/deploy/schemas/refresh.py)"
    )
    validator = Draft202012Validator(schema, registry=_registry())
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path)))
    ]


# --------------------------------------------------------------------------- manifests


def _objects() -> list[Any]:
    out = []
    for path in k8s_files():
        for i, obj in enumerate(docs(path)):
            name = obj.get("metadata", {}).get("name") if isinstance(obj, dict) else None
            label = f"{path.relative_to(SCHEMAS.parents[2])}#{i}:{obj.get('kind')}/{name}"
            out.append(pytest.param(obj, id=label))
    return out


def _object(kind: str, api_group: str) -> dict[str, Any]:
    for param in _objects():
        obj = param.values[0]
        if obj["kind"] == kind and obj["apiVersion"].startswith(api_group):
            return copy.deepcopy(obj)
    raise AssertionError(f"no {kind} under deploy/")


@pytest.mark.parametrize("obj", _objects())
def test_manifest_matches_its_schema(obj: Any) -> None:
    assert isinstance(obj, dict), "not a Kubernetes object"
    found = errors(obj)
    assert not found, "\n".join(found)


def test_every_family_is_covered() -> None:
    families = {_family(p.values[0]["apiVersion"]) for p in _objects()}
    expected = {"kubernetes", "istio", "gateway-api", "envoy-gateway", "prometheus-operator"}
    assert families == expected


# --------------------------------------------------------------------------- the checks bite


def _misspell(obj: dict[str, Any], path: list[str | int], typo: str) -> None:
    *parents, field = path
    node: Any = obj
    for p in parents:
        node = node[p]
    node[typo] = node.pop(field)


@pytest.mark.parametrize(
    ("kind", "group", "path", "typo"),
    [
        # Kubernetes' own, deep in a pod template.
        ("Deployment", "apps/", ["spec", "template", "spec", "containers", 0, "image"], "imgae"),
        # Istio: a DestinationRule's traffic policy.
        ("DestinationRule", "networking.istio.io/", ["spec", "trafficPolicy"], "trafficPolicey"),
        # Gateway API: an HTTPRoute's parent reference.
        ("HTTPRoute", "gateway.networking.k8s.io/", ["spec", "parentRefs"], "parentRef"),
        # Envoy Gateway: the ext_proc entry of the extension policy.
        ("EnvoyExtensionPolicy", "gateway.envoyproxy.io/", ["spec", "extProc"], "extproc"),
        # Prometheus Operator: a rule group.
        ("PrometheusRule", "monitoring.coreos.com/", ["spec", "groups", 0, "rules"], "rule"),
        ("ServiceMonitor", "monitoring.coreos.com/", ["spec", "endpoints"], "endpoint"),
    ],
)
def test_a_misspelled_field_is_caught(
    kind: str, group: str, path: list[str | int], typo: str
) -> None:
    obj = _object(kind, group)
    assert not errors(obj)
    _misspell(obj, path, typo)
    found = errors(obj)
    assert any(repr(typo) in e for e in found), found


def test_metadata_of_a_custom_resource_is_object_meta() -> None:
    obj = _object("EnvoyFilter", "networking.istio.io/")
    obj["metadata"]["labelz"] = {"a": "b"}
    assert any("'labelz'" in e for e in errors(obj))


def test_a_kind_without_schema_fails_naming_it() -> None:
    with pytest.raises(AssertionError, match=r"example\.com/v1 Widget"):
        errors({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})
