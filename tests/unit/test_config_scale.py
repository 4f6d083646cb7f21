"""Configs of many tenants: the fast YAML reader reads as PyYAML does, equal sections are
shared, and a reload compiles only the tenants that changed (the same result as compiling
everything)."""

from __future__ import annotations

import gc
import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from bench.config_scale import generate_config
from kvgate.config import (
    ConfigError,
    KvgateConfig,
    compile_snapshot,
    load_config,
    model,
    parse_config,
)
from kvgate.config.model import gc_paused, read_yaml
from kvgate.config.snapshot import RuntimeSnapshot

REPO = Path(__file__).resolve().parents[2]


def pyyaml(text: str) -> Any:
    return yaml.load(text, Loader=yaml.CSafeLoader)


def typed(value: Any) -> Any:
    """`value` with each scalar's type beside it (1 == 1.0 == True in Python)."""
    if isinstance(value, dict):
        return {typed(k): typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    if isinstance(value, float) and value != value:
        return (float, "nan")
    return (type(value), value)


def test_a_generated_fleet_reads_as_pyyaml_reads_it() -> None:
    text = generate_config(400, seed=3)
    assert typed(read_yaml(text)) == typed(pyyaml(text))


def test_the_shipped_configs_read_as_pyyaml_reads_them() -> None:
    configs = [REPO / "deploy/local/kvgate.yaml", *sorted((REPO / "examples").glob("*.yaml"))]
    read = 0
    for path in configs:
        if path.exists():
            text = path.read_text(encoding="utf-8")
            assert typed(read_yaml(text)) == typed(pyyaml(text)), path
            read += 1
    assert read >= 1


# Scalars YAML 1.1 (PyYAML) and YAML 1.2 read differently, and what only PyYAML resolves.
TRICKY = [
    "k: yes\n",
    "k: Off\n",
    "on: 1\n",
    "k: [a, no]\n",
    "k: 017\n",
    "k: 09\n",
    "k: 0o17\n",
    "k: 0X1f\n",
    "k: 1:30\n",
    "k: 1e3\n",
    "k: 1.0e3\n",
    "k: 0E_0\n",
    "k: [1_e3, .5e3]\n",
    "k: -.5\n",
    "k: +.5  # a comment\n",
    "k: 2024-01-15\n",
    "k: 2024-01-15T12:00:00Z\n",
    "k: !!str 1\n",
    "base: &b {a: 1}\nk:\n  <<: *b\n  c: 2\n",
    "k: 1\nk: 2\n",
    "k: 1\n---\nk: 2\n",
    "k: [1\n",
    "",
]


@pytest.mark.parametrize("text", TRICKY)
def test_what_yaml_1_1_reads_otherwise_is_read_by_pyyaml(text: str) -> None:
    try:
        expected = typed(pyyaml(text))
    except yaml.YAMLError as exc:
        with pytest.raises(yaml.YAMLError) as raised:
            read_yaml(text)
        assert str(raised.value) == str(exc)
        return
    assert typed(read_yaml(text)) == expected


PLAIN_SCALAR = st.text(alphabet="0123456789.:-+_eEoxXbBnNyYsOfta ", min_size=1, max_size=8)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scalars=st.lists(PLAIN_SCALAR, min_size=1, max_size=4))
def test_any_plain_scalar_reads_as_pyyaml_reads_it(scalars: list[str]) -> None:
    text = "".join(f"k{i}: {s}\nl{i}: [{s}, x]\n" for i, s in enumerate(scalars))
    try:
        expected = typed(pyyaml(text))
    except yaml.YAMLError:
        # Not YAML to PyYAML: yaml-rs may still read some of it (`[:0, x]`), a known
        # leniency of the fast reader, left to validation.
        return
    except ValueError:  # PyYAML's own failure on a number it matched (`0x_`): so is ours
        with pytest.raises(ValueError):
            read_yaml(text)
        return
    assert typed(read_yaml(text)) == expected


def test_load_config_reads_a_file_through_the_fast_reader(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(generate_config(50), encoding="utf-8")
    assert load_config(path) == parse_config(pyyaml(path.read_text(encoding="utf-8")))


def _key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _raw(tenants: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "backends": [{"name": "b", "kv_budget_tokens": 100_000}],
        "models": [
            {
                "name": m,
                "tokenizer": f"example/{m}",
                "backend": "b",
                "max_context": 4096,
                "default_max_new_tokens": 256,
            }
            for m in ("m1", "m2")
        ],
        "tenants": tenants,
    }


def test_equal_sections_of_tenants_are_one_object() -> None:
    tier = {"rpm": 600, "tpm": {"capacity": 60_000}}
    config = parse_config(
        _raw(
            [
                {
                    "name": "a",
                    "api_key_sha256": _key("a"),
                    "limits": tier,
                    "budget": {"daily_usd": "5"},
                },
                {
                    "name": "b",
                    "api_key_sha256": _key("b"),
                    "limits": dict(tier),
                    "budget": {"daily_usd": "5"},
                },
                {"name": "c", "api_key_sha256": _key("c"), "limits": {"rpm": {"limit": 600}}},
            ]
        )
    )
    a, b, c = config.tenants
    assert a.limits is b.limits
    assert a.budget is b.budget
    assert c.limits is not a.limits  # another raw shape: validated on its own
    snapshot = compile_snapshot(config)
    assert snapshot.tenants["a"].limits is snapshot.tenants["b"].limits
    assert snapshot.priorities["a"] is snapshot.priorities["c"]  # one default class
    assert snapshot.priorities["a"] == (0, frozenset())


def test_a_shared_bad_section_is_reported_at_every_tenant() -> None:
    bad = {"rpm": 0}
    raw = _raw(
        [
            {"name": "a", "api_key_sha256": _key("a"), "limits": bad},
            {"name": "b", "api_key_sha256": _key("b"), "limits": dict(bad)},
        ]
    )
    with pytest.raises(ConfigError) as raised:
        parse_config(raw)
    assert "tenants.0.limits.rpm.limit" in str(raised.value)
    assert "tenants.1.limits.rpm.limit" in str(raised.value)
    # A section's own model checks (around which the sharing sits) too.
    no_fallback = {"daily_usd": "1", "action": "fallback"}
    raw = _raw(
        [
            {"name": "a", "api_key_sha256": _key("a"), "budget": no_fallback},
            {"name": "b", "api_key_sha256": _key("b"), "budget": dict(no_fallback)},
        ]
    )
    with pytest.raises(ConfigError) as raised:
        parse_config(raw)
    assert str(raised.value).count("needs fallback_model") == 2
    assert "tenants.1.budget: action 'fallback' needs fallback_model" in str(raised.value)


def test_the_tenant_checks_still_hold() -> None:
    shared = [
        {"name": "a", "api_key_sha256": _key("x")},
        {"name": "b", "api_key_sha256": _key("x")},
    ]
    with pytest.raises(ConfigError, match="share an API key"):
        parse_config(_raw(shared))
    unknown = [{"name": "a", "api_key_sha256": _key("a"), "model_limits": {"m9": {"rpm": 1}}}]
    with pytest.raises(ConfigError, match="'m9' is not a configured model"):
        parse_config(_raw(unknown))
    team = [{"name": "a", "api_key_sha256": _key("a"), "teams": {"t": {"models": ["m9"]}}}]
    with pytest.raises(ConfigError, match=r"teams\.t\.models: 'm9'"):
        parse_config(_raw(team))


def test_the_collector_is_back_on_after_a_load() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    parse_config(_raw([{"name": "a", "api_key_sha256": _key("a")}]))
    assert gc.isenabled()


def _fleet(count: int) -> list[dict[str, Any]]:
    return [
        {
            "name": f"t{i}",
            "api_key_sha256": _key(f"t{i}"),
            "limits": {"rpm": 60 * (1 + i % 3)},
            **({"teams": {"research": {"limits": {"rpm": 10}}}} if i % 10 == 0 else {}),
        }
        for i in range(count)
    ]


def test_a_reload_changing_one_tenant_compiles_only_that_one() -> None:
    tenants = _fleet(200)
    before = compile_snapshot(parse_config(_raw(tenants)))
    tenants[7] = {**tenants[7], "limits": {"rpm": 7}}
    after = compile_snapshot(parse_config(_raw(tenants)), before)
    for i in range(200):
        name = f"t{i}"
        if i == 7:
            assert after.tenants[name] is not before.tenants[name]
            assert after.tenants[name].limits.rpm is not None
            assert after.tenants[name].limits.rpm.spec.capacity == 7
        else:
            assert after.tenants[name] is before.tenants[name]
            assert after.tenant_configs[name] is before.tenant_configs[name]
            assert after.priorities[name] is before.priorities[name]
    assert after.tenant_levels["t10"] is before.tenant_levels["t10"]
    # The new snapshot's config holds one object per tenant: the reused ones.
    assert after.config.tenants[8] is before.config.tenants[8]
    assert after.config.tenants[7] is after.tenant_configs["t7"]
    assert after == compile_snapshot(parse_config(_raw(tenants)))


def _same(incremental: RuntimeSnapshot, full: RuntimeSnapshot) -> None:
    for name in (
        "tenants_by_key_hash",
        "tenants",
        "priorities",
        "tenant_configs",
        "tenant_levels",
        "models",
        "backends",
    ):
        assert dict(getattr(incremental, name)) == dict(getattr(full, name)), name
        assert list(getattr(incremental, name)) == list(getattr(full, name)), name
    assert incremental.config == full.config
    assert incremental == full


LIMITS = st.fixed_dictionaries(
    {},
    optional={
        "rpm": st.integers(1, 3),
        "tpm": st.sampled_from([100, 200]),
        "concurrency": st.integers(1, 2),
    },
)
TENANT_EXTRAS = st.fixed_dictionaries(
    {},
    optional={
        "limits": LIMITS,
        "model_limits": st.dictionaries(st.sampled_from(["m1", "m2"]), LIMITS, max_size=2),
        "budget": st.fixed_dictionaries(
            {}, optional={"daily_usd": st.sampled_from(["1", "2.5"]), "shadow": st.booleans()}
        ),
        "priority": st.integers(-2, 2),
        "allowed_priorities": st.lists(st.integers(0, 2), max_size=2),
        "teams": st.dictionaries(
            st.sampled_from(["x", "y"]),
            st.fixed_dictionaries({}, optional={"limits": LIMITS, "models": st.just(["m1"])}),
            max_size=2,
        ),
        "users": st.dictionaries(
            st.sampled_from(["u1", "u2"]),
            st.fixed_dictionaries({}, optional={"budget": st.just({"daily_usd": "1"})}),
            max_size=1,
        ),
        "user_limits": st.fixed_dictionaries({}, optional={"limits": LIMITS}),
    },
)


@st.composite
def fleets(draw: st.DrawFn) -> list[dict[str, Any]]:
    names = draw(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True))
    return [
        {
            "name": n,
            "api_key_sha256": _key(n + draw(st.sampled_from(["", "2"]))),
            **draw(TENANT_EXTRAS),
        }
        for n in names
    ]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(old=fleets(), new=fleets(), keep=st.lists(st.booleans(), min_size=6, max_size=6))
def test_an_incremental_compile_equals_a_full_one(
    old: list[dict[str, Any]], new: list[dict[str, Any]], keep: list[bool]
) -> None:
    # The edit: some of the old tenants kept as they were, the rest as drawn anew.
    by_name = {t["name"]: t for t in old}
    edited = [
        by_name[t["name"]] if keep[i] and t["name"] in by_name else t for i, t in enumerate(new)
    ]
    keys = [t["api_key_sha256"] for t in edited]
    if len(set(keys)) != len(keys):
        return  # tenants sharing a key: not a config
    previous = compile_snapshot(parse_config(_raw(old)))
    _same(
        compile_snapshot(parse_config(_raw(edited)), previous),
        compile_snapshot(parse_config(_raw(edited))),
    )


def _at_once(raw: dict[str, Any]) -> str:
    """The message of `raw` validated as one KvgateConfig, the reference for its errors."""
    try:
        KvgateConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [
            "  "
            + (".".join(str(p) for p in e["loc"]) or "(top level)")
            + ": "
            + e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        ]
        return "<config>: invalid configuration\n" + "\n".join(lines)
    return "valid"


def _message(raw: dict[str, Any]) -> str:
    try:
        parse_config(raw)
    except ConfigError as exc:
        return str(exc)
    return "valid"


BROKEN_CONFIGS: list[dict[str, Any]] = [
    # Errors in tenants of several chunks, beside errors in the sections around them.
    {
        **_raw(_fleet(9)),
        "server": {"grpc_listen": "nowhere"},
        "bogus": 1,
        "tenants": [
            *_fleet(4),
            {"name": "bad name!", "limits": {"rpm": 0}},
            *_fleet(2),
            "not a tenant",
            {"name": "x", "api_key_sha256": "KEY", "tiers": 1},
        ],
        "backends": [{"name": "b"}],
    },
    # Tenant errors alone: no check across sections runs, as when validated at once.
    {**_raw([{"name": "a", "limits": {"rpm": -1}}]), "store": "memory"},
    # Valid tenants, the checks across them fail: named at the tenant's index.
    _raw([*_fleet(5), {"name": "late", "model_limits": {"m9": {"rpm": 1}}}]),
    _raw([*_fleet(5), {"name": "t1", "api_key_sha256": _key("z")}]),
    {**_raw(_fleet(3)), "tenants": None},
    {key: value for key, value in _raw(_fleet(3)).items() if key != "tenants"},
]


@pytest.mark.parametrize("raw", BROKEN_CONFIGS)
def test_tenants_validated_in_chunks_are_reported_as_at_once(
    raw: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model, "TENANT_CHUNK", 2)
    expected = _at_once(raw)
    assert expected != "valid"
    assert _message(raw) == expected


def test_a_tenant_error_is_located_at_its_index_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model, "TENANT_CHUNK", 3)
    text = generate_config(10).replace("name: tenant-000007", "name: tenant-000007\n    tier: 1")
    path = tmp_path / "fleet.yaml"
    path.write_text(text, encoding="utf-8")
    assert model._read_in_chunks(text) is not None
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert str(raised.value) == (
        f"{path}: invalid configuration\n  tenants.7.tier: Extra inputs are not permitted"
    )


FLEET_HEAD = """\
backends:
  - name: b
    kv_budget_tokens: 100000
models:
  - {name: m1, tokenizer: t, backend: b, max_context: 4096, default_max_new_tokens: 64}
"""
# Tenant sections as people write them, and ones a chunk boundary would cut wrongly.
TENANT_SECTIONS = [
    "tenants:\n"
    + "".join(f"  - name: t{i}\n    api_key_sha256: {_key(str(i))}\n" for i in range(7)),
    "tenants:  # the fleet\n\n"
    + "".join(f"- name: t{i}\n  api_key_sha256: {_key(str(i))}\n# t{i} done\n" for i in range(7)),
    "tenants:\n"
    + "".join(
        f"    -   name: t{i}\n        api_key_sha256:\n        - {_key(str(i))}\n"
        f"        limits: {{rpm: {i + 1},\n  tpm: 100}}\n"
        for i in range(7)
    )
    + "tracing: {}\n",
    # A quoted name spanning lines, one line of it looking like the next tenant.
    "tenants:\n"
    f'  - name: t0\n    api_key_sha256: {_key("0")}\n    teams: {{"x\n  - y": {{}}}}\n'
    + "".join(f"  - name: t{i}\n    api_key_sha256: {_key(str(i))}\n" for i in range(1, 5)),
    # A block scalar with a line like an item, more indented.
    "tenants:\n"
    + "".join(
        f"  - name: t{i}\n    api_key_sha256: {_key(str(i))}\n    users:\n      u: |\n"
        "        - not a tenant\n"
        for i in range(4)
    ),
    # What YAML 1.1 reads otherwise (yes, 010): the chunks are read by PyYAML.
    "tenants:\n"
    + "".join(
        f"  - name: t{i}\n    api_key_sha256: {_key(str(i))}\n    semantic_cache: yes\n"
        "    priority: 010\n"
        for i in range(5)
    ),
    # Not a block sequence of tenants: read whole.
    "tenants: []\n",
    "tenants:\n  bogus: 1\n",
]


@pytest.mark.parametrize("section", TENANT_SECTIONS)
@pytest.mark.parametrize("chunk", [1, 2, 1000])
@pytest.mark.parametrize("head", ["", "# on: a comment that sends the file to PyYAML\n"])
def test_tenants_read_in_chunks_read_as_the_whole_file(
    section: str, chunk: int, head: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model, "TENANT_CHUNK", chunk)
    text = head + FLEET_HEAD + section
    path = tmp_path / "fleet.yaml"
    path.write_text(text, encoding="utf-8")
    try:  # the file read whole, as load_config did before it read tenants in chunks
        data = read_yaml(text)
    except yaml.YAMLError as exc:
        with pytest.raises(ConfigError) as raised:
            load_config(path)
        assert str(raised.value) == f"{path}: not valid YAML: {exc}"
        return
    try:
        expected = parse_config(data, str(path))
    except ConfigError as exc:
        with pytest.raises(ConfigError) as raised:
            load_config(path)
        assert str(raised.value) == str(exc)
        return
    assert load_config(path) == expected


def test_a_fleet_is_read_in_chunks() -> None:
    text = generate_config(30)
    in_chunks = model._read_in_chunks(text)
    assert in_chunks is not None
    rest, chunks = in_chunks
    tenants = [tenant for chunk in chunks for tenant in chunk]
    assert typed({**rest, "tenants": tenants}) == typed(pyyaml(text))


def test_tenants_first_in_the_file_are_read_in_chunks_too() -> None:
    text = "tenants:\n" + generate_config(5).split("tenants:\n")[1] + FLEET_HEAD
    in_chunks = model._read_in_chunks(text)
    assert in_chunks is not None
    rest, chunks = in_chunks
    assert typed({**rest, "tenants": [t for c in chunks for t in c]}) == typed(pyyaml(text))


def test_a_fleet_yaml_1_1_reads_otherwise_is_read_in_chunks_by_pyyaml() -> None:
    text = generate_config(100).replace("priority: 5\n", "priority: 05\n") + "tracing: {}\n"
    text = text.replace("    response_cache: true", "    response_cache: on")
    assert model._yaml_1_1_only(text)
    in_chunks = model._read_in_chunks(text, model._pyyaml_reading)
    assert in_chunks is not None
    rest, chunks = in_chunks
    assert typed({**rest, "tenants": [t for c in chunks for t in c]}) == typed(pyyaml(text))
    # Directives or a second document: read whole.
    assert model._read_in_chunks("%YAML 1.1\n---\n" + text, model._pyyaml_reading) is None
    assert model._read_in_chunks(text + "---\nk: 1\n", model._pyyaml_reading) is None


def test_a_number_pyyaml_fails_on_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "odd.yaml"
    path.write_text("server:\n  shutdown_grace_s: 0x_\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)


def test_a_fleet_read_by_pyyaml_in_chunks_is_the_same_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model, "TENANT_CHUNK", 7)
    plain, one_one = tmp_path / "plain.yaml", tmp_path / "yaml-1-1.yaml"
    plain.write_text(generate_config(120), encoding="utf-8")
    one_one.write_text(generate_config(120, yaml_1_1=True), encoding="utf-8")
    assert "response_cache: on" in one_one.read_text(encoding="utf-8")
    assert load_config(one_one) == load_config(plain)
