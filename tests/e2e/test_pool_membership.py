"""Pool membership is a trust boundary, end to end through Envoy, kvgate and the simulator.

A pool's members get real prompts (and the backend's API key), and each member's own
/metrics sets its KV budget. Two hostile cases: a DNS name that resolves to an address no
pod should have (loopback here; the metadata service in the unit tests), and a pod whose
/metrics claims a gigantic cache so that it would take every prompt.
"""

from __future__ import annotations

import collections
import http.server
import os
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import yaml

from kvgate.tokenize import PromptCounter
from testbed.demo_model import demo_model_dir
from testbed.harness import (
    DEFAULT_MODEL_NAME,
    SimOptions,
    Stack,
    free_port,
    kvgate_metrics,
    sim_stats,
    wait_until,
)
from tests.e2e.support import assert_openai_error, document_messages

POOL = "vllm-pool"
BLOCKS = 500
BLOCK = 16
BUDGET = BLOCKS * BLOCK  # 8,000 tokens per honest replica
# 2,000 prompt + 1,000 new = 3,008 reserved (whole blocks): two fit 8,000 tokens, three do not.
PROMPT = 2_000
MAX_NEW = 1_000
PER_ENDPOINT = BUDGET // (((PROMPT + MAX_NEW + BLOCK - 1) // BLOCK) * BLOCK)
TIMEOUT = httpx.Timeout(60.0, connect=5.0)
# What the rogue pod claims: 10^9 blocks of 16 tokens.
CLAIMED_TOKENS = 1_000_000_000 * BLOCK
# max_auto_kv_budget_tokens when the config does not set it (the documented default).
DEFAULT_CAP = 4 * 1024 * 1024


def _model() -> dict[str, Any]:
    return {
        "name": DEFAULT_MODEL_NAME,
        "tokenizer": str(demo_model_dir()),
        "max_context": 32768,
        "default_max_new_tokens": 1024,
        "backend": POOL,
    }


def _scraped_often() -> dict[str, Any]:
    return {
        "metrics_url": "http://{endpoint}/metrics",
        "interval_s": 0.5,
        "timeout_s": 0.5,
        "max_staleness_s": 5,
    }


def _chat(
    stack: Stack, messages: list[dict[str, Any]], headers: dict[str, str] | None = None
) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        json={"model": DEFAULT_MODEL_NAME, "messages": messages, "max_tokens": MAX_NEW},
        headers={**stack.auth_headers(), **(headers or {})},
        timeout=TIMEOUT,
    )


def _reload(stack: Stack, edit: dict[str, Any]) -> None:
    """Merge `edit` into the pool's backend in kvgate's file and SIGHUP; wait until applied."""
    config = yaml.safe_load(stack.kvgate_config_path.read_text())
    config["backends"][0].update(edit)
    stack.kvgate_config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    before = kvgate_metrics(stack).total("kvgate_config_reloads_total", result="success")
    assert stack.kvgate is not None and stack.kvgate.pid is not None
    os.kill(stack.kvgate.pid, signal.SIGHUP)
    reloads = wait_until(
        lambda: kvgate_metrics(stack).total("kvgate_config_reloads_total", result="success"),
        lambda n: n > before,
        timeout=15,
    )
    assert reloads > before, stack.kvgate.log_tail()


# --------------------------------------------------------------------------- a discovered address


def test_a_name_resolving_to_loopback_brings_no_member_until_loopback_is_allowed() -> None:
    """`localhost` stands for a record pointed at this host: the simulator listening there is
    never sent a prompt, and the refusal is counted. The operator's explicit range (applied
    on reload) lets it in."""
    stack = Stack(
        models=[_model()],
        backends=[
            {
                "name": POOL,
                "kv_budget_tokens": BUDGET,
                "kv_block_size": BLOCK,
                "endpoint_discovery": {"dns_name": "localhost", "port": 0, "refresh_s": 0.5},
                "discovery": _scraped_often(),
            }
        ],
        pool_replicas={POOL: 1},
        sim=SimOptions(num_gpu_blocks=BLOCKS, block_size=BLOCK),
    )
    replica = f"{POOL}#0"
    stack.backends[0]["endpoint_discovery"]["port"] = stack.sim_ports[replica]
    with stack:
        counter = PromptCounter.from_model_dir(demo_model_dir())
        messages = document_messages(counter, 100, "loopback")
        refused = _chat(stack, messages)
        assert refused.status_code == 503, refused.text
        error = assert_openai_error(refused, 503, code="service_unavailable", type_="server_error")
        assert "0 known" in error["message"]  # no member at all, not a failing one
        assert sim_stats(stack, replica)["served"] == []
        samples = kvgate_metrics(stack)
        assert samples.value("kvgate_pool_refused_addresses_total", pool=POOL, reason="loopback")
        assert samples.value("kvgate_pool_endpoints", pool=POOL, state="pickable") == 0
        assert "refused as members" in stack.kvgate.log_text()  # type: ignore[union-attr]

        _reload(
            stack,
            {
                "endpoint_discovery": {
                    "dns_name": "localhost",
                    "port": stack.sim_ports[replica],
                    "refresh_s": 0.5,
                    "allowed_cidrs": ["127.0.0.0/8"],
                }
            },
        )
        admitted = wait_until(
            lambda: _chat(stack, messages), lambda r: r.status_code == 200, timeout=10
        )
        assert admitted.status_code == 200, admitted.text
        assert len(sim_stats(stack, replica)["served"]) == 1


# --------------------------------------------------------------------------- a claimed cache


class RoguePod:
    """A pod running a real engine (a simulator replica) whose /metrics lies: it reports
    10^9 KV blocks and an empty cache. Prompts are passed to the engine unchanged."""

    def __init__(self, port: int, engine_url: str) -> None:
        self.port = port
        self.engine_url = engine_url
        self.prompts = 0
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics_text(self) -> str:
        model = DEFAULT_MODEL_NAME
        return (
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{BLOCK}",engine="0",'
            'num_gpu_blocks="1000000000"} 1.0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.0\n'
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="{model}"}} 0.0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} 0.0\n'
        )

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        pod = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_args: object) -> None:
                pass

            def _answer(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._answer(200, pod.metrics_text().encode(), "text/plain; version=0.0.4")
                else:
                    self._answer(404, b"", "text/plain")

            def do_POST(self) -> None:
                with pod._lock:
                    pod.prompts += 1
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                skip = {"host", "content-length", "connection", "transfer-encoding"}
                forward = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                request = urllib.request.Request(
                    pod.engine_url + self.path, data=body, headers=forward, method="POST"
                )
                try:
                    with urllib.request.urlopen(request, timeout=60) as resp:
                        status, answer = resp.status, resp.read()
                        content_type = resp.headers.get("Content-Type", "application/json")
                except urllib.error.HTTPError as exc:
                    status, answer = exc.code, exc.read()
                    content_type = exc.headers.get("Content-Type", "application/json")
                self._answer(status, answer, content_type)

        return Handler

    def __enter__(self) -> RoguePod:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def rogue_stack() -> Iterator[tuple[Stack, RoguePod]]:
    """A pool of one honest replica (#0) and the rogue pod, whose engine is replica #1 (not a
    member itself). The budget is `auto`: each member's own /metrics sets it."""
    rogue_port = free_port()
    stack = Stack(
        models=[_model()],
        backends=[
            {
                "name": POOL,
                "kv_budget_tokens": "auto",
                "kv_block_size": BLOCK,
                "endpoints": [],  # set below, once the replicas' ports are known
                "discovery": _scraped_often(),
            }
        ],
        pool_replicas={POOL: 2},
        sim=SimOptions(num_gpu_blocks=BLOCKS, block_size=BLOCK),
    )
    honest, engine = stack.pool_endpoints(POOL)
    stack.backends[0]["endpoints"] = [honest, f"127.0.0.1:{rogue_port}"]
    with RoguePod(rogue_port, f"http://{engine}") as rogue, stack:
        yield stack, rogue


def test_a_pod_claiming_a_gigantic_kv_cache_gets_only_the_capped_budget(
    rogue_stack: tuple[Stack, RoguePod],
) -> None:
    stack, rogue = rogue_stack
    honest_key = f"{POOL}/{stack.pool_endpoints(POOL)[0]}"
    rogue_key = f"{POOL}/{rogue.address}"

    def budgets() -> dict[str, float | None]:
        samples = kvgate_metrics(stack)
        return {
            key: samples.get("kvgate_kv_budget_tokens", backend=key)
            for key in (honest_key, rogue_key)
        }

    # The default cap, with no setting at all: not the 16 G tokens claimed.
    seen = wait_until(budgets, lambda b: None not in b.values(), timeout=10)
    assert seen == {honest_key: BUDGET, rogue_key: DEFAULT_CAP}, seen
    samples = kvgate_metrics(stack)
    assert samples.value("kvgate_kv_budget_capped_reports_total", backend=rogue_key) >= 1
    assert samples.get("kvgate_kv_budget_capped_reports_total", backend=honest_key) is None
    log = stack.kvgate.log_text()  # type: ignore[union-attr]
    assert f"reports a KV cache of {CLAIMED_TOKENS} tokens" in log

    # The platform's own figure for its pods, applied on reload.
    _reload(stack, {"max_auto_kv_budget_tokens": BUDGET})
    seen = wait_until(budgets, lambda b: b[rogue_key] == BUDGET, timeout=10)
    assert seen == {honest_key: BUDGET, rogue_key: BUDGET}, seen

    # A burst of three requests per endpoint while each runs ~3 s: the rogue pod is given
    # what fits the budget it may have, no more, and the rest is refused, not sent there.
    counter = PromptCounter.from_model_dir(demo_model_dir())
    burst = 3 * 2
    slow = {"x-sim-output-tokens": "60", "x-sim-itl-ms": "50"}
    messages = [document_messages(counter, PROMPT, f"rogue-{i}") for i in range(burst)]
    with ThreadPoolExecutor(burst) as pool:
        answers = list(pool.map(lambda m: _chat(stack, m, slow), messages))
    statuses = collections.Counter(a.status_code for a in answers)
    assert statuses == {200: 2 * PER_ENDPOINT, 429: burst - 2 * PER_ENDPOINT}, statuses
    assert rogue.prompts == PER_ENDPOINT
    assert len(sim_stats(stack, f"{POOL}#0")["served"]) == PER_ENDPOINT
    assert len(sim_stats(stack, f"{POOL}#1")["served"]) == PER_ENDPOINT
