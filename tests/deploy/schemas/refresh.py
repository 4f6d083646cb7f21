"""Rebuilds the schemas in this folder from upstream release artefacts (README.md says which).

    python tests/deploy/schemas/refresh.py --kubernetes-validate WHEEL_OR_DIR \\
        --envoy-gateway GIT_DIR --istio GIT_DIR --prometheus-operator GIT_DIR

Each GIT_DIR is a clone (bare is fine) holding the tag pinned below; the Kubernetes schemas
come from the kubernetes-validate wheel (`pip download --no-deps kubernetes-validate==X`).
Only the kinds deploy/ uses are kept: add a kind to KINDS / *_CRDS and run this again.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

K8S_VERSION = "v1.34.0"
K8S_FLAVOUR = f"{K8S_VERSION}-local-strict"
KINDS = (
    "configmap-v1",
    "deployment-apps-v1",
    "namespace-v1",
    "networkpolicy-networking-v1",
    "poddisruptionbudget-policy-v1",
    "secret-v1",
    "service-v1",
    "serviceaccount-v1",
)

ENVOY_GATEWAY_TAG = "v1.9.0"
ENVOY_GATEWAY_CRDS = (
    "backendtrafficpolicies",
    "clienttrafficpolicies",
    "envoyextensionpolicies",
    "envoypatchpolicies",
    "httproutefilters",
    "securitypolicies",
)
# Gateway API, standard channel, as Envoy Gateway's CRD chart ships it.
GATEWAY_API_FILE = "charts/gateway-crds-helm/templates/standard-gatewayapi-crds.yaml"
GATEWAY_API_CRDS = ("gateways", "httproutes", "referencegrants")

ISTIO_TAG = "1.30.3"
ISTIO_FILE = "manifests/charts/base/files/crd-all.gen.yaml"
ISTIO_CRDS = (
    "destinationrules.networking.istio.io",
    "envoyfilters.networking.istio.io",
    "gateways.networking.istio.io",
    "virtualservices.networking.istio.io",
    "authorizationpolicies.security.istio.io",
    "peerauthentications.security.istio.io",
    "requestauthentications.security.istio.io",
)

PROMETHEUS_OPERATOR_TAG = "v0.93.0"
PROMETHEUS_OPERATOR_CRDS = ("prometheusrules", "servicemonitors")


def git_show(repo: Path, tag: str, path: str) -> str:
    return subprocess.run(
        ["git", "--git-dir", str(repo), "show", f"{tag}:{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def crd_documents(text: str) -> dict[str, str]:
    """CRD name -> that document's text, verbatim, from a multi-document YAML file."""
    out = {}
    for doc in re.split(r"^---\s*$", text, flags=re.M):
        m = re.search(r"^kind: CustomResourceDefinition$", doc, flags=re.M)
        name = re.search(r"^  name: (\S+)$", doc, flags=re.M)
        if m and name:
            body = "\n".join(
                line for line in doc.strip("\n").splitlines() if not line.startswith("{{")
            )
            out[name.group(1)] = "---\n" + body + "\n"
    return out


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def kubernetes(source: Path) -> None:
    prefix = f"kubernetes_validate/kubernetes-json-schema/{K8S_FLAVOUR}/"

    def read(name: str) -> str:
        if source.is_dir():
            return (source / prefix / name).read_text(encoding="utf-8")
        with zipfile.ZipFile(source) as z:
            return z.read(prefix + name).decode("utf-8")

    out = HERE / "kubernetes" / K8S_FLAVOUR
    definitions = json.loads(read("_definitions.json"))
    wanted: set[str] = set()
    pending = []
    for kind in KINDS:
        text = read(f"{kind}.json")
        write(out / f"{kind}.json", text)
        pending += re.findall(r'"\$ref": "[^"#]*#/\$defs/([^"]+)"', text)
    while pending:  # the definitions these kinds reach, each kept whole
        name = pending.pop()
        if name not in wanted:
            wanted.add(name)
            pending += re.findall(
                r'"\$ref": "[^"#]*#/\$defs/([^"]+)"', json.dumps(definitions["$defs"][name])
            )
    definitions["$defs"] = {k: v for k, v in definitions["$defs"].items() if k in wanted}
    write(out / "_definitions.json", json.dumps(definitions, indent=2, sort_keys=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubernetes-validate", type=Path, required=True)
    ap.add_argument("--envoy-gateway", type=Path, required=True)
    ap.add_argument("--istio", type=Path, required=True)
    ap.add_argument("--prometheus-operator", type=Path, required=True)
    a = ap.parse_args()

    kubernetes(a.kubernetes_validate)
    crds = HERE / "crds"
    for plural in ENVOY_GATEWAY_CRDS:
        name = f"gateway.envoyproxy.io_{plural}.yaml"
        path = f"charts/gateway-helm/charts/crds/crds/generated/{name}"
        write(crds / name, git_show(a.envoy_gateway, ENVOY_GATEWAY_TAG, path))
    docs = crd_documents(git_show(a.envoy_gateway, ENVOY_GATEWAY_TAG, GATEWAY_API_FILE))
    for plural in GATEWAY_API_CRDS:
        name = f"{plural}.gateway.networking.k8s.io"
        write(crds / f"gateway.networking.k8s.io_{plural}.yaml", docs[name])
    docs = crd_documents(git_show(a.istio, ISTIO_TAG, ISTIO_FILE))
    for name in ISTIO_CRDS:
        plural, group = name.split(".", 1)
        write(crds / f"{group}_{plural}.yaml", docs[name])
    for plural in PROMETHEUS_OPERATOR_CRDS:
        name = f"monitoring.coreos.com_{plural}.yaml"
        path = f"example/prometheus-operator-crd/{name}"
        write(crds / name, git_show(a.prometheus_operator, PROMETHEUS_OPERATOR_TAG, path))


if __name__ == "__main__":
    main()
