"""What kvgate's runtime distribution (the wheel, hence the image) carries: kvgate only;
what may import what outside it (tests/, testbed/, bench/).

The vLLM simulator is a test double with its own distribution (`sim/`, `vllm-sim`), installed
next to kvgate for development by the Makefile; it must not come back into the runtime wheel.

And what the distribution and the image are built from: dependency floors that the
committed generated code needs, the image's constraints file (every runtime dependency pinned
exactly, each pin within pyproject's range), the Apache-2.0 LICENSE, and the Dockerfile's base
image argument, OCI labels, baked tokenizers and non-root user.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
import shlex
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[2]


def _toml(path: Path) -> dict[str, Any]:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def test_runtime_wheel_holds_kvgate_only() -> None:
    project = _toml(REPO_ROOT / "pyproject.toml")
    find = project["tool"]["setuptools"]["packages"]["find"]
    assert find["where"] == ["src"]
    assert find["include"] == ["kvgate", "kvgate.*"]
    # Nothing else sits in src/ either (the Dockerfile copies src/ whole; kvgate itself is a
    # namespace package, without __init__.py, so look at directories).
    top_level = {
        p.name
        for p in (REPO_ROOT / "src").iterdir()
        if p.is_dir() and not p.name.endswith(".egg-info") and p.name != "__pycache__"
    }
    assert top_level == {"kvgate"}
    assert set(project["project"]["scripts"]) == {"kvgate"}
    extras = project["project"]["optional-dependencies"]
    assert "sim" not in extras
    assert not any("vllm" in req for reqs in extras.values() for req in reqs)


def test_simulator_is_its_own_distribution() -> None:
    sim = _toml(REPO_ROOT / "sim" / "pyproject.toml")["project"]
    assert sim["name"] == "vllm-sim"
    assert sim["scripts"] == {"vllm-sim": "vllm_sim.cli:main"}
    assert (REPO_ROOT / "sim" / "src" / "vllm_sim" / "__init__.py").is_file()
    # The development install brings it (the e2e harness and `make up` run `vllm-sim`).
    assert "-e ./sim" in (REPO_ROOT / "Makefile").read_text(encoding="utf-8")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_testbed_and_bench_do_not_import_tests() -> None:
    """The process test bed (testbed/) is shared by tests/ and bench/; neither it nor the
    benchmarks reach into tests/, and the store tests do not borrow the e2e harness."""
    offenders = [
        f"{path.relative_to(REPO_ROOT)}: {name}"
        for folder in ("testbed", "bench", "deploy", "tools")
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
        for name in _imports(path)
        if name == "tests" or name.startswith("tests.")
    ]
    offenders += [
        f"{path.relative_to(REPO_ROOT)}: {name}"
        for path in sorted((REPO_ROOT / "tests" / "store").rglob("*.py"))
        for name in _imports(path)
        if name.startswith("tests.e2e")
    ]
    assert offenders == []


def test_package_data_globs_match_files() -> None:
    """Every package-data pattern ships something (a pattern matching nothing is a stale
    claim about what the wheel holds)."""
    project = _toml(REPO_ROOT / "pyproject.toml")
    for package, patterns in project["tool"]["setuptools"]["package-data"].items():
        root = REPO_ROOT / "src" / package.replace(".", "/")
        for pattern in patterns:
            assert list(root.glob(pattern)), f"{package}: {pattern} matches nothing"


# --------------------------------------------------------------------------- packaging
# Floors, the image's constraints file, the LICENSE, and what the Dockerfile promises (base image
# as a build argument, OCI labels, baked tokenizers, non-root user).

PYPROJECT = REPO_ROOT / "pyproject.toml"
LICENSE = REPO_ROOT / "LICENSE"
CONSTRAINTS = REPO_ROOT / "deploy" / "docker" / "constraints.txt"
DOCKERFILE = REPO_ROOT / "deploy" / "docker" / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / "deploy" / "docker" / "Dockerfile.dockerignore"
ADMIN_STUBS = REPO_ROOT / "src" / "kvgate" / "admin" / "v1"
# sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt, byte for byte.
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
# The image's interpreter (python:3.11-slim on Linux): markers are evaluated for it, with the
# full version the constraints file was resolved for (its header names it).
IMAGE_PYTHON = re.search(
    r"Resolved for CPython (3\.11\.\d+) on Linux", CONSTRAINTS.read_text(encoding="utf-8")
)
IMAGE_MARKERS = {
    "python_version": "3.11",
    "python_full_version": IMAGE_PYTHON.group(1) if IMAGE_PYTHON else "3.11.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def _runtime_requirements() -> list[Requirement]:
    deps = _toml(PYPROJECT)["project"]["dependencies"]
    reqs = [Requirement(dep) for dep in deps]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(IMAGE_MARKERS)]


def _requirement(name: str) -> Requirement:
    (req,) = [r for r in _runtime_requirements() if canonicalize_name(r.name) == name]
    return req


def _floor(req: Requirement) -> Version:
    floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert floors, f"{req} has no floor"
    return max(floors)


def _constraint_pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for number, raw in enumerate(CONSTRAINTS.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==" and "*" not in spec.version, f"line {number}: {line}"
        assert not req.extras and req.marker is None and req.url is None, f"line {number}"
        name = canonicalize_name(req.name)
        assert name not in pins, f"line {number}: {name} pinned twice"
        pins[name] = Version(spec.version)
    return pins


def test_license_is_the_apache_2_text_and_declared() -> None:
    data = LICENSE.read_bytes()
    text = data.decode("utf-8")
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
    assert hashlib.sha256(data).hexdigest() == APACHE_2_SHA256, "not the unmodified text"
    project = _toml(PYPROJECT)["project"]
    assert project["license"] == "Apache-2.0"
    # In the wheel's .dist-info/licenses/ (PEP 639) and, through the ignore file, in the
    # image's build context (the build needs it: license-files must match something).
    assert "LICENSE" in project["license-files"]
    assert "!LICENSE" in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()


def _stub_grpc_version() -> Version:
    (stub,) = ADMIN_STUBS.glob("*_pb2_grpc.py")
    found = re.findall(
        r"^GRPC_GENERATED_VERSION = '([^']+)'$", stub.read_text(encoding="utf-8"), re.M
    )
    assert len(found) == 1, stub
    return Version(found[0])


def _stub_protobuf_versions() -> list[Version]:
    versions = []
    for stub in sorted(ADMIN_STUBS.glob("*_pb2.py")):
        found = re.findall(
            r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
            r"\s*(\d+),\s*(\d+),\s*(\d+),",
            stub.read_text(encoding="utf-8"),
        )
        assert len(found) == 1, stub
        versions.append(Version(".".join(found[0])))
    assert versions
    return versions


def test_grpc_floors_cover_the_committed_stubs() -> None:
    """The admin stubs raise at import on a grpc older than the grpcio-tools that generated
    them; a floor below that version lets pip install a kvgate that cannot start."""
    generated = _stub_grpc_version()
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        req = _requirement(name)
        assert _floor(req) >= generated, f"{req}: the stubs need grpcio>={generated}"
        assert req.specifier.contains(generated), req


def test_protobuf_floor_covers_the_generated_code() -> None:
    req = _requirement("protobuf")
    for generated in _stub_protobuf_versions():
        assert _floor(req) >= generated, f"{req}: the admin API's gencode is {generated}"
        assert req.specifier.contains(generated), req
        # The runtime must stay in the gencode's major (or the next): no unbounded protobuf.
        assert not req.specifier.contains(Version(f"{generated.major + 2}.0.0")), req


def test_constraints_pin_every_runtime_dependency() -> None:
    pins = _constraint_pins()
    assert "kvgate" not in pins
    for req in _runtime_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not pinned in {CONSTRAINTS.name}"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} does not satisfy pyproject's {req}"
        )
        for extra in req.extras:  # redis[hiredis]: the extra's packages are pinned too
            dist_reqs = _installed_requires(name, pins[name])
            if dist_reqs is None:
                continue
            for sub in dist_reqs:
                if (
                    sub.marker is not None
                    and sub.marker.evaluate({**IMAGE_MARKERS, "extra": extra})
                    and not sub.marker.evaluate({**IMAGE_MARKERS, "extra": ""})
                ):
                    assert canonicalize_name(sub.name) in pins, f"{req}: {sub.name} not pinned"
    # The stubs' grpc check holds for the pinned grpcio as well.
    assert pins["grpcio"] >= _stub_grpc_version()


def _installed_requires(name: str, version: Version) -> list[Requirement] | None:
    """The requirements of the installed distribution `name`, when it is the pinned version
    (otherwise its requirements may differ from the pinned one's: None)."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    if Version(dist.version) != version:
        return None
    return [Requirement(r) for r in dist.requires or []]


def test_constraints_are_closed_under_dependencies() -> None:
    """Every package a pinned package needs on the image's interpreter is pinned too (checked
    through the installed metadata of each package installed at its pinned version)."""
    pins = _constraint_pins()
    checked = 0
    for name, version in pins.items():
        requires = _installed_requires(name, version)
        if requires is None:
            continue
        checked += 1
        for sub in requires:
            if sub.marker is not None and not sub.marker.evaluate({**IMAGE_MARKERS, "extra": ""}):
                continue
            sub_name = canonicalize_name(sub.name)
            assert sub_name in pins, f"{name}=={version} needs {sub}, not pinned"
            assert sub.specifier.contains(pins[sub_name], prereleases=True), (
                f"{name}=={version} needs {sub}; pinned {pins[sub_name]}"
            )
    assert checked, "no pinned package is installed at its pinned version: nothing was checked"


def test_constraints_file_is_the_lock_tool_output() -> None:
    """The committed file carries the header tools/lock_image_deps.py writes (it is generated,
    and says how to regenerate it)."""
    spec = importlib.util.spec_from_file_location(
        "lock_image_deps", REPO_ROOT / "tools" / "lock_image_deps.py"
    )
    assert spec and spec.loader
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.OUTPUT == CONSTRAINTS
    text = CONSTRAINTS.read_text(encoding="utf-8")
    assert IMAGE_PYTHON, "the header names the Python it was resolved for"
    assert text.startswith(tool.HEADER.format(python=IMAGE_PYTHON.group(1)))
    pins = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert pins == sorted(pins, key=lambda line: line.partition("==")[0].lower())


# --------------------------------------------------------------------------- the Dockerfile


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        pending = ""
        instructions.append((keyword.upper(), args.strip()))
    assert not pending
    return instructions


def _args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    """ARG defaults (no default: "")."""
    out: dict[str, str] = {}
    for keyword, args in instructions:
        if keyword == "ARG":
            name, _, default = args.partition("=")
            out[name] = default.strip('"')
    return out


def _expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], value)


def test_dockerfile_base_image_is_a_build_argument() -> None:
    instructions = _dockerfile()
    first_from = next(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    before = _args(instructions[:first_from])
    assert before.get("PYTHON_IMAGE") == "python:3.11-slim"
    froms = [a for k, a in instructions if k == "FROM"]
    assert froms[-1].split()[0] == "${PYTHON_IMAGE}"
    # Operators are told how to pin it by digest (no digest is invented here).
    assert "python:3.11-slim@sha256:<digest>" in DOCKERFILE.read_text(encoding="utf-8")


def test_dockerfile_installs_with_the_constraints_file() -> None:
    instructions = _dockerfile()
    copies = [a.split() for k, a in instructions if k == "COPY"]
    (dest,) = [c[-1] for c in copies if "deploy/docker/constraints.txt" in c[:-1]]
    installs = [a for k, a in instructions if k == "RUN" and "pip install" in a]
    assert installs, "no pip install"
    for run in installs:
        assert re.search(rf"(-c|--constraint)[ =]{re.escape(dest)}(\s|$)", run), run
    ignore = DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
    assert "!deploy/docker/constraints.txt" in ignore


def test_dockerfile_has_the_oci_labels() -> None:
    instructions = _dockerfile()
    args = _args(instructions)
    labels: dict[str, str] = {}
    for keyword, value in instructions:
        if keyword == "LABEL":
            for pair in shlex.split(value):
                key, _, val = pair.partition("=")
                labels[key] = _expand(val, args)
    project = _toml(PYPROJECT)["project"]
    prefix = "org.opencontainers.image."
    assert labels[prefix + "title"] == project["name"]
    assert labels[prefix + "description"] == project["description"]
    assert labels[prefix + "licenses"] == project["license"]
    assert labels[prefix + "version"] == project["version"]
    assert prefix + "source" in labels
    # version and source come from build arguments.
    raw = " ".join(v for k, v in instructions if k == "LABEL")
    assert f'{prefix}version="${{VERSION}}"' in raw
    assert f'{prefix}source="${{SOURCE}}"' in raw


def test_dockerfile_can_bake_tokenizers() -> None:
    instructions = _dockerfile()
    assert ("ARG", "TOKENIZERS=") in instructions  # a build argument, empty by default
    arg_at = instructions.index(("ARG", "TOKENIZERS="))
    runs = [a for k, a in instructions[arg_at:] if k == "RUN" and "${TOKENIZERS}" in a]
    assert len(runs) == 1
    (run,) = runs
    # From the build context into /opt/kvgate/models, only when the argument is set.
    assert "--mount=type=bind" in run
    assert '[ -n "${TOKENIZERS}" ]' in run
    assert "/opt/kvgate/models" in run
    env = " ".join(a for k, a in instructions if k == "ENV")
    assert "HF_HUB_OFFLINE=${TOKENIZERS:+1}" in env
    assert "!tokenizers/" in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()


def test_dockerfile_runs_as_non_root() -> None:
    instructions = _dockerfile()
    keywords = [k for k, _ in instructions]
    last_user = max(i for i, k in enumerate(keywords) if k == "USER")
    user = instructions[last_user][1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), user
    # Nothing runs (or is installed) after the switch, and the entrypoint runs as that user.
    assert "RUN" not in keywords[last_user:]
    assert keywords.index("ENTRYPOINT") > last_user
