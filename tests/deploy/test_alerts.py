"""deploy/prometheus alerts and the Grafana dashboard's arithmetic over several replicas.

- Every series an alert, a recording rule or a dashboard panel reads is one kvgate exports, a
  recording rule, Prometheus' own `up`, or one a real Envoy serves on the sidecar pod's stats
  port (an Envoy is started here on the sidecar bootstrap and its /stats/prometheus read), and
  only labels those series carry are matched or grouped by.
- Every alert has a severity, a summary and a description that says what to look at; `critical`
  only for sustained conditions (`for:` >= 5 minutes, never "any increase").
- The operational alerts: per-target and all-gone absence, Envoy's ext_proc failures, the
  state store (down, errors at a rate, failing closed, settlements piling up).
- The ServiceMonitor names the jobs the alerts select.
- The dashboard: in-flight and budget panels aggregate replicas the same way (per store),
  the utilization panel per replica; the store and Envoy's ext_proc counters are charted.
- `promtool check rules` and `promtool test rules deploy/prometheus/tests/*.yaml` (promtool
  from PATH, or the one `make test` takes out of Debian's `prometheus` package).
"""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.extproc.services import GatewayServices
from testbed.harness import ManagedProcess, _bin
from tests.deploy.manifests import (
    DASHBOARD,
    DEPLOY,
    RULES,
    SERVICE_MONITOR,
    SIDECAR,
    TARGET_LABELS,
    container,
    dashboard,
    duration_s,
    kvgate_metrics,
    one,
    pod_templates,
    promql_names,
    recording_rules,
    sidecar_bootstrap,
    sidecar_bootstrap_on_loopback,
)

PROMTOOL_TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.yaml"))
# The rule file name the promtool test files list in rule_files.
PROMTOOL_RULE_FILE = "kvgate-rules.yaml"
KVGATE_JOB = "kvgate"
ENVOY_JOB = "kvgate-envoy"
# A page needs the condition to hold at least this long.
CRITICAL_MIN_FOR_S = 300


# --------------------------------------------------------------------------- loading


def rule_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = one(RULES, "PrometheusRule")["spec"]["groups"]
    return groups


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rule_groups() for r in g["rules"] if "alert" in r}


def alert(name: str) -> dict[str, Any]:
    found = alerts()
    assert name in found, f"no alert {name} in {RULES.name}"
    return found[name]


def compact(expr: str) -> str:
    return re.sub(r"\s+", "", expr)


def expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every rule and every dashboard target."""
    found = [
        (f"rule {r.get('alert') or r['record']}", r["expr"])
        for g in rule_groups()
        for r in g["rules"]
    ]
    for panel in dashboard()["panels"]:
        found += [(f"panel {panel['title']!r}", t["expr"]) for t in panel["targets"]]
    return found


# --------------------------------------------------------------------------- a real Envoy


def _parse_exposition(text: str) -> dict[str, tuple[str, set[str]]]:
    """Prometheus text format -> {sample name: (type, label names)}, names as Prometheus
    stores them (prometheus_client's parser would add `_total` to Envoy's counters)."""
    types: dict[str, str] = {}
    found: dict[str, tuple[str, set[str]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        match = re.match(r"([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s", line)
        assert match, f"unparsable sample line {line!r}"
        name, labels = match[1], match[2] or ""
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        kind = types.get(name) or types.get(family, "untyped")
        entry = found.setdefault(name, (kind, set()))
        entry[1].update(re.findall(r'(\w+)="', labels))
    return found


@pytest.fixture(scope="module")
def envoy_stats(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, set[str]]]:
    """What Prometheus gets from the sidecar's `envoy-stats` port: the bootstrap of
    deploy/kubernetes/gateway-with-sidecar.yaml, run on free loopback ports, after one model
    request that failed in ext_proc (no kvgate runs here: the filter fails closed)."""
    tmp_path = tmp_path_factory.mktemp("envoy-stats")
    bootstrap, _admin, ingress, readiness = sidecar_bootstrap_on_loopback()
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False), encoding="utf-8")
    argv = [_bin("envoy"), "-c", str(path), "--disable-hot-restart", "--concurrency", "1"]
    with ManagedProcess("envoy-stats", argv, log_dir=tmp_path) as envoy:
        envoy.wait_http(f"http://127.0.0.1:{readiness}/ready", timeout=30)
        request = urllib.request.Request(
            f"http://127.0.0.1:{ingress}/v1/chat/completions",
            data=b'{"model": "m", "messages": []}',
            headers={"authorization": "Bearer sk-test", "content-type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 503  # kvgate unreachable, failure_mode_allow false
        with urllib.request.urlopen(
            f"http://127.0.0.1:{readiness}/stats/prometheus", timeout=5
        ) as resp:
            text = resp.read().decode()
    stats = _parse_exposition(text)
    failed = re.search(r"^envoy_http_ext_proc_streams_failed\{[^}]*\} (\d+)", text, re.M)
    assert failed and int(failed[1]) >= 1, "the failed ext_proc stream was not counted"
    return stats


# --------------------------------------------------------------------------- series and labels


def test_exposition_parser() -> None:
    parsed = _parse_exposition(
        "# TYPE envoy_x counter\n"
        'envoy_x{envoy_http_conn_manager_prefix="ingress"} 3\n'
        "# TYPE envoy_h histogram\n"
        'envoy_h_bucket{le="1"} 0\nenvoy_h_sum 0\n'
    )
    assert parsed["envoy_x"] == ("counter", {"envoy_http_conn_manager_prefix"})
    assert parsed["envoy_h_bucket"] == ("histogram", {"le"})
    assert parsed["envoy_h_sum"][0] == "histogram"


def test_envoy_serves_the_ext_proc_counters(
    envoy_stats: dict[str, tuple[str, set[str]]],
) -> None:
    for name in (
        "envoy_http_ext_proc_streams_started",
        "envoy_http_ext_proc_streams_failed",
        "envoy_http_ext_proc_message_timeouts",
        "envoy_http_ext_proc_rejected_header_mutations",
        "envoy_http_ext_proc_failure_mode_allowed",
    ):
        assert envoy_stats[name] == ("counter", {"envoy_http_conn_manager_prefix"}), name


def test_every_series_is_exported(envoy_stats: dict[str, tuple[str, set[str]]]) -> None:
    """kvgate's, a recording rule, `up`, or the real Envoy's, with the labels used on it."""
    known = kvgate_metrics()
    for where, expr in expressions():
        names, selectors, grouping = promql_names(expr)
        assert names, f"{where}: no series"
        available: set[str] = set(TARGET_LABELS)
        for name in names:
            if name.startswith("envoy_"):
                assert name in envoy_stats, f"{where}: Envoy exports no {name}"
                kind, labels = envoy_stats[name]
                if "rate(" in expr or "increase(" in expr:
                    assert kind == "counter", f"{where}: rate of {name}, a {kind}"
                available |= labels
            else:
                assert name == "up" or name in known or name in recording_rules(), (
                    f"{where}: {name} is exported by neither kvgate nor Envoy"
                )
        for name, matched in selectors:
            if name.startswith("envoy_"):
                labels = envoy_stats[name][1] | TARGET_LABELS
                assert matched <= labels, f"{where}: {name} has no label(s) {matched - labels}"
            elif name == "up":
                assert matched <= TARGET_LABELS, f"{where}: up has no label(s) {matched}"
        # Mixed with kvgate's series, test_manifests.check_expr checks the grouping.
        if all(n == "up" or n.startswith("envoy_") for n in names):
            assert grouping <= available, f"{where}: grouping by {grouping - available}"


# --------------------------------------------------------------------------- every alert


def test_every_alert_is_actionable() -> None:
    for name, rule in alerts().items():
        assert re.fullmatch(r"Kvgate[A-Z][A-Za-z]+", name), name
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        annotations = rule["annotations"]
        assert annotations["summary"].strip(), name
        description = annotations["description"]
        # What it means and what to look at: more than a restated expression.
        assert len(description) >= 100 and description.count(".") >= 1, name
        duration_s(rule.get("for", "0s"))


def test_critical_only_when_sustained() -> None:
    critical = {n: r for n, r in alerts().items() if r["labels"]["severity"] == "critical"}
    assert critical, "no alert pages at all"
    for name, rule in critical.items():
        assert duration_s(rule.get("for", "0s")) >= CRITICAL_MIN_FOR_S, (
            f"{name} pages without {CRITICAL_MIN_FOR_S} s of the condition"
        )
        assert not re.search(r"increase\([^)]*\)\)?\s*>\s*0\b", rule["expr"]), (
            f"{name} pages on a single event"
        )
    # A store error is never a page by itself: only admission failing closed is.
    for name, rule in critical.items():
        names = promql_names(rule["expr"])[0]
        assert not {n for n in names if n.startswith("kvgate_store_")}, name


# --------------------------------------------------------------------------- the alerts


def test_absence_per_target_and_all_gone() -> None:
    per_target = alert("KvgateTargetDown")
    assert compact(per_target["expr"]) == f'up{{job="{KVGATE_JOB}"}}==0'
    assert per_target["labels"]["severity"] == "warning"
    assert 60 <= duration_s(per_target["for"]) <= 600
    all_down = alert("KvgateAllTargetsDown")
    assert compact(all_down["expr"]) == f'sumby(namespace)(up{{job="{KVGATE_JOB}"}})==0'
    assert all_down["labels"]["severity"] == "critical"
    absent = alert("KvgateMetricsAbsent")
    assert compact(absent["expr"]) == f'absent(up{{job="{KVGATE_JOB}"}})'
    assert absent["labels"]["severity"] == "critical"
    envoy = alert("KvgateEnvoyTargetDown")
    assert compact(envoy["expr"]) == f'up{{job="{ENVOY_JOB}"}}==0'


def test_envoy_ext_proc_alerts() -> None:
    used = {
        name: {n for n in promql_names(rule["expr"])[0] if n.startswith("envoy_")}
        for name, rule in alerts().items()
    }
    failing = used["KvgateExtProcStreamsFailing"]
    assert failing == {"envoy_http_ext_proc_streams_failed", "envoy_http_ext_proc_streams_started"}
    assert alert("KvgateExtProcStreamsFailing")["labels"]["severity"] == "warning"
    closed = alert("KvgateExtProcFailingClosed")
    assert closed["labels"]["severity"] == "critical" and duration_s(closed["for"]) >= 600
    assert "envoy_http_ext_proc_message_timeouts" in used["KvgateExtProcMessageTimeouts"]
    assert "envoy_http_ext_proc_rejected_header_mutations" in used["KvgateExtProcMutationsRejected"]
    # Envoy's streams are not only the sidecar's: the ext_proc alerts select no job.
    for name in ("KvgateExtProcStreamsFailing", "KvgateExtProcFailingClosed"):
        assert "job=" not in alert(name)["expr"], name


def test_store_alerts() -> None:
    down = alert("KvgateStoreDown")
    assert "kvgate_store_up" in down["expr"] and down["labels"]["severity"] == "warning"
    assert duration_s(down["for"]) >= 120
    errors = alert("KvgateStoreErrors")
    assert errors["labels"]["severity"] == "warning"
    threshold = re.search(
        r"rate\(kvgate_store_errors_total\[5m\]\)\)\s*>\s*([\d.]+)", errors["expr"]
    )
    assert threshold and float(threshold[1]) > 0, "a single store error must not alert"
    closed = alert("KvgateAdmissionFailingClosed")
    assert closed["labels"]["severity"] == "critical"
    assert "store_unavailable" in closed["expr"] and 'outcome="rejected"' in closed["expr"]
    piling = alert("KvgateStoreSettlementsPiling")
    assert "deriv(kvgate_store_pending_settlements" in compact(piling["expr"])
    assert (
        "kvgate_store_dropped_settlements_total" in alert("KvgateStoreSettlementsDropped")["expr"]
    )


def test_pool_alerts() -> None:
    """A pool's endpoints failing kvgate's checks (warning after 2 minutes), none it can pick
    while not merely shedding load (the page), requests whose queue wait expired (warning).
    One alert per pool: the replicas' series are aggregated by (namespace, pool)."""
    unhealthy = alert("KvgatePoolEndpointsUnhealthy")
    assert compact(unhealthy["expr"]) == (
        'maxby(namespace,pool)(kvgate_pool_endpoints{state="unhealthy"})>0'
    )
    assert unhealthy["labels"]["severity"] == "warning" and duration_s(unhealthy["for"]) == 120
    none = alert("KvgatePoolNoPickableEndpoint")
    assert compact(none["expr"]).startswith(
        'maxby(namespace,pool)(kvgate_pool_endpoints{state="pickable"})==0'
    )
    assert 'state="shedding"' in none["expr"]
    assert none["labels"]["severity"] == "critical"
    expired = alert("KvgateQueueWaitExpired")
    assert compact(expired["expr"]) == (
        'sumby(namespace,pool)(rate(kvgate_queue_drops_total{reason="wait_expired"}[5m]))>0'
    )
    assert expired["labels"]["severity"] == "warning"
    # The label values the rules match are the ones kvgate sets.
    from kvgate.lifecycle.queue import DropReason

    assert "wait_expired" in DropReason.__args__  # type: ignore[attr-defined]
    states = re.findall(r"\"(\w+)\": ", inspect.getsource(GatewayServices._refresh_pool_gauges))
    assert {"pickable", "unhealthy", "shedding"} <= set(states), states


def test_service_monitor_names_the_jobs() -> None:
    endpoints = {e["port"]: e for e in one(SERVICE_MONITOR, "ServiceMonitor")["spec"]["endpoints"]}

    def job_of(endpoint: dict[str, Any]) -> str:
        jobs = [
            r["replacement"]
            for r in endpoint.get("relabelings", [])
            if r.get("targetLabel") == "job" and r.get("action", "replace") == "replace"
        ]
        assert len(jobs) == 1, endpoint
        return str(jobs[0])

    assert job_of(endpoints["metrics"]) == KVGATE_JOB
    assert job_of(endpoints["envoy-stats"]) == ENVOY_JOB
    assert endpoints["envoy-stats"]["path"] == "/stats/prometheus"
    # The sidecar pod's envoy-stats port is the bootstrap's readiness listener, which serves
    # the admin interface's /stats/prometheus (test_manifests starts an Envoy to show it).
    (_, template), *_ = pod_templates(SIDECAR)
    ports = {p["name"]: p["containerPort"] for p in container(template, "envoy")["ports"]}
    listeners = {
        listener["name"]: listener["address"]["socket_address"]["port_value"]
        for listener in sidecar_bootstrap()["static_resources"]["listeners"]
    }
    assert ports["envoy-stats"] == listeners["readiness"]
    jobs = {m[1] for _, expr in expressions() for m in re.finditer(r'job\s*=\s*"([^"]+)"', expr)}
    assert jobs <= {KVGATE_JOB, ENVOY_JOB}, jobs


# --------------------------------------------------------------------------- the dashboard


REPLICATED_GAUGES = {
    "kvgate_kv_tokens_in_flight",
    "kvgate_requests_in_flight",
    "kvgate_kv_budget_tokens",
}


def test_dashboard_adds_up_replicas_per_store() -> None:
    """Memory store: each replica its own budget share and in-flight (sum both). Redis: the
    same shared numbers on every replica (max of both). A panel either follows the `store`
    variable for every such gauge, or takes a per-replica ratio and then the worst."""
    board = dashboard()
    store = {v["name"]: v for v in board["templating"]["list"]}["store"]
    assert store["type"] == "custom"
    assert {o["text"]: o["value"] for o in store["options"]} == {"memory": "sum", "redis": "max"}
    assert store["query"].replace(" ", "") == "memory:sum,redis:max"
    per_store = ratio = 0
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = compact(target["expr"])
            gauges = promql_names(target["expr"])[0] & REPLICATED_GAUGES
            if not gauges:
                continue
            where = f"panel {panel['title']!r}: {target['expr']}"
            if expr.startswith("$storeby(backend)("):
                assert len(gauges) == 1, where
                per_store += 1
            else:
                assert re.fullmatch(
                    r"maxby\(backend\)\(kvgate_kv_tokens_in_flight\{[^}]*\}"
                    r"/kvgate_kv_budget_tokens\{[^}]*\}\)",
                    expr,
                ), where
                ratio += 1
    assert per_store >= 3 and ratio >= 1


def test_dashboard_charts_the_store_and_envoy() -> None:
    used = {
        name
        for where, expr in expressions()
        if where.startswith("panel")
        for name in promql_names(expr)[0]
    }
    for name in (
        "kvgate_store_up",
        "kvgate_store_errors_total",
        "kvgate_store_fallback_decisions_total",
        "kvgate_store_pending_settlements",
        "kvgate_store_dropped_settlements_total",
        "envoy_http_ext_proc_streams_failed",
        "envoy_http_ext_proc_message_timeouts",
    ):
        assert name in used, f"no panel charts {name}"
    assert DASHBOARD.is_file()


def test_dashboard_charts_the_pools() -> None:
    """Every pool series is charted; per-replica queues are summed (each kvgate queues its
    own requests), the endpoint counts take the highest any replica reports."""
    found: dict[str, list[str]] = {}
    for where, expr in expressions():
        if where.startswith("panel"):
            for name in promql_names(expr)[0]:
                found.setdefault(name, []).append(compact(expr))
    for name in (
        "kvgate_pool_endpoints",
        "kvgate_pool_picks_total",
        "kvgate_queue_length",
        "kvgate_queue_wait_seconds_bucket",
        "kvgate_queue_drops_total",
    ):
        assert name in found, f"no panel charts {name}"
    assert found["kvgate_pool_endpoints"] == ["maxby(pool,state)(kvgate_pool_endpoints)"]
    assert found["kvgate_queue_length"] == ["sumby(pool,priority)(kvgate_queue_length)"]


# --------------------------------------------------------------------------- promtool


# Where `make promtool` (a step of `make test`) puts it.
FETCHED_PROMTOOL = Path(__file__).resolve().parents[2] / "var/tools/promtool"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None and FETCHED_PROMTOOL.exists():
        path = str(FETCHED_PROMTOOL)
    if path is None:
        pytest.skip("promtool is not there: `make promtool`; the Python checks above still ran")
    return path


def _write_rules(directory: Path, *, annotations: bool) -> Path:
    groups = rule_groups()
    if not annotations:
        groups = [
            {**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
            for g in groups
        ]
    path = directory / PROMTOOL_RULE_FILE
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False), encoding="utf-8")
    return path


def test_promtool_check_rules(tmp_path: Path) -> None:
    promtool = _promtool()
    rules = _write_rules(tmp_path, annotations=True)
    result = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in rule_groups())} rules found" in result.stdout


def test_promtool_unit_tests_exist() -> None:
    assert PROMTOOL_TESTS, "no promtool unit tests in deploy/prometheus/tests/"
    tested = set()
    for path in PROMTOOL_TESTS:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert spec["rule_files"] == [PROMTOOL_RULE_FILE], path
        tested |= {t["alertname"] for case in spec["tests"] for t in case["alert_rule_test"]}
    unknown = tested - set(alerts())
    assert not unknown, f"tests for alerts that do not exist: {unknown}"
    for name in (
        "KvgateTargetDown",
        "KvgateAllTargetsDown",
        "KvgateMetricsAbsent",
        "KvgateExtProcStreamsFailing",
        "KvgateExtProcFailingClosed",
        "KvgateExtProcMessageTimeouts",
        "KvgateStoreDown",
        "KvgateStoreErrors",
        "KvgateAdmissionFailingClosed",
        "KvgateStoreSettlementsPiling",
        "KvgateKvBudgetSaturated",
        "KvgatePoolEndpointsUnhealthy",
        "KvgatePoolNoPickableEndpoint",
        "KvgateQueueWaitExpired",
    ):
        assert name in tested, f"no promtool test for {name}"


@pytest.mark.parametrize("test_file", PROMTOOL_TESTS, ids=lambda p: p.name)
def test_promtool_test_rules(test_file: Path, tmp_path: Path) -> None:
    """The annotations are left out: promtool compares them verbatim, and the tests above
    check them."""
    promtool = _promtool()
    _write_rules(tmp_path, annotations=False)
    copy = tmp_path / test_file.name
    shutil.copyfile(test_file, copy)
    result = subprocess.run(
        [promtool, "test", "rules", str(copy)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
