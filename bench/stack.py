"""The benchmark's processes: one simulator, the gateways in front of it, and their arms.

Every arm talks to the same vLLM simulator process:

| arm            | path                                                              |
|----------------|-------------------------------------------------------------------|
| direct         | client -> simulator                                               |
| envoy          | client -> Envoy (envoy.yaml without the ext_proc filter) -> sim   |
| noop           | client -> Envoy (envoy.yaml) -> no-op Python ext_proc; -> sim     |
| kvgate         | client -> Envoy (envoy.yaml) -> kvgate, memory store; -> sim      |
| kvgate-redis   | the same, kvgate with the Redis store at 127.0.0.1:6379          |
| kvgate-keys    | as kvgate, but the client's key is one of 1,000,000 in the key    |
|                | directory (embedded SQLite file in the work dir), not in the YAML |
| kvgate-keys-   | as kvgate-redis, the client's key one of 1,000,000 in the Redis  |
| redis          | key directory (the state store's Redis, its own key prefix)       |
| kvgate-split   | Envoy (envoy-observability.yaml) -> kvgate (the memory one); -> sim |
| litellm        | client -> LiteLLM proxy (own venv, custom-auth keys) -> sim       |

All listen on 127.0.0.1 on free ports. The processes are testbed/rig.py's (the simulator,
kvgate, Envoy and the no-op ext_proc server of testbed/noop_extproc.py; Envoy configs from
testbed/envoy_variants.py): logs in `<work_dir>/logs`, SIGTERM then SIGKILL on stop. This
module chooses them per arm, adds LiteLLM and the shared Redis, and says which processes'
CPU each arm adds. Everything is started once; arms take turns, so an idle arm costs only
its health checks. Envoy runs with `--concurrency 1` in every arm.

The keys arms' directories are filled before their kvgate starts: one key made through the
directory's own `create` (the real schema and record; its secret is the arm's client key),
then the other 999,999 written straight into the store in bulk (SQLite: one executemany in
one transaction; Redis: pipelined, as bench/keys_scale.py writes them). The fill and a few
lookups on a directory opened on the filled store are recorded in `BenchStack.key_stores`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from bench.api_cases import EMBEDDING_MODEL
from bench.cpu import tree_cpu_seconds, wait_machine_quiet
from kvgate.config.model import hash_api_key
from kvgate.keys.directory import FIELDS, CachedDirectory, new_key_id, record_fields
from kvgate.keys.records import KeyRecord
from kvgate.keys.sqlite_directory import SqliteKeyDirectory
from testbed.harness import (
    ENVOY_CONFIG,
    REPO_ROOT,
    ManagedProcess,
    ProcessError,
    SimOptions,
    sha256_hex,
)
from testbed.pooling_models import WORDLLAMA_MAX_MODEL_LEN, wordllama_model_dir
from testbed.rig import EnvoyProcess, KvgateProcess, Rig, SimProcess

OBSERVABILITY_CONFIG = REPO_ROOT / "envoy" / "envoy-observability.yaml"
LITELLM_VENV = REPO_ROOT / "var" / "bench" / "litellm-venv"
BENCH_DIR = Path(__file__).resolve().parent

MODEL = "qwen2.5-demo"
BACKEND = "vllm-local"
MAX_CONTEXT = 131072  # 100k-token prompts need a >= 128k context
API_KEY = "sk-bench-1"
# Two tenants that are over their TPM limit after one request, for the cost of a 429.
# "limited": the bucket is left with fewer tokens than any request could need (the usual
# state of a tenant hammering past its limit), so a pre-check on a lower bound can refuse it
# before counting. "limited-short": the bucket keeps ~80 tokens, so only the exact count
# shows that a 1k-token request does not fit.
LIMITED_KEY = "sk-bench-limited"
SHORT_KEY = "sk-bench-limited-short"
# The same shape in kvgate and LiteLLM: a key -> a tenant with RPM and TPM limits. The main
# tenant's limits are set far above what a 2-core run reaches, so the limiter runs on every
# request but never rejects.
TENANT_RPM = 10_000_000
TENANT_TPM = 10_000_000_000
# A 1k-token request reserves ~1,022 tokens (prompt + 16): a 1,035 bucket keeps ~13 after
# it, fewer than the smallest possible request (1 prompt token + 16); 1,100 keeps ~78.
LIMITED_TPM = 1_035
SHORT_TPM = 1_100

_T = TypeVar("_T")

ARM_ORDER = (
    "direct",
    "envoy",
    "noop",
    "kvgate",
    "kvgate-redis",
    "kvgate-redis-2",
    "kvgate-keys",
    "kvgate-keys-redis",
    "kvgate-split",
    "litellm",
)
REDIS_ARMS = ("kvgate-redis", "kvgate-redis-2", "kvgate-keys-redis")
# The arms whose client key is in the key directory, among this many keys.
KEYS_ARMS = ("kvgate-keys", "kvgate-keys-redis")
DIRECTORY_KEYS = 1_000_000
# The directory keys' tenant: the bench client's (limits far above the run's).
DIRECTORY_TENANT = "bench"

# The two kvgate processes of the kvgate-redis-2 arm.
PAIR = ("kvgate-redis-a", "kvgate-redis-b")
# arm -> the kvgate processes behind its Envoy (kvgate-split shares kvgate's process).
KVGATES_OF_ARM = {
    "kvgate": ("kvgate-memory",),
    "kvgate-split": ("kvgate-memory",),
    "kvgate-redis": ("kvgate-redis",),
    "kvgate-redis-2": PAIR,
    "kvgate-keys": ("kvgate-keys",),
    "kvgate-keys-redis": ("kvgate-keys-redis",),
}


@dataclass
class SimSettings:
    """The simulator's latencies (the rest of its settings is the same in every run)."""

    ttft_ms: float = 0.0
    itl_ms: float = 0.0

    def options(self) -> SimOptions:
        return SimOptions(
            max_model_len=MAX_CONTEXT,
            num_gpu_blocks=4_000_000,
            block_size=16,
            max_num_seqs=100_000,
            # The body's max_tokens decides the output length (finish_reason "length").
            default_output_tokens=1_000_000,
            log_level="warning",
            ttft_ms=self.ttft_ms,
            itl_ms=self.itl_ms,
            # POST /v1/embeddings (the 1k-embeddings case) with a real embedding model.
            extra_args=["--embedding-model", "wordllama"],
        )


@dataclass
class Arm:
    name: str
    base_url: str
    api_key: str = API_KEY
    # role -> pid of the processes whose CPU this arm adds ("envoy", "kvgate", ...)
    pids: dict[str, int] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}/v1/chat/completions"

    def headers(self, api_key: str | None = None) -> dict[str, str]:
        return {
            "content-type": "application/json",
            "authorization": f"Bearer {api_key or self.api_key}",
        }


# --------------------------------------------------------------------------- the key stores


@dataclass
class KeyStoreFill:
    """A keys arm's directory: how it was filled and what lookups on it cost."""

    store: str  # "embedded" or "redis"
    keys: int
    fill_s: float
    # A directory opened on the store with only the client's key, then with all of them:
    # label -> {"open_ms", "first_lookup_ms", "cached_lookup_ms", "unknown_lookup_ms"}
    lookups: dict[str, dict[str, float]] = field(default_factory=dict)
    size_bytes: int | None = None  # the SQLite file, or Redis's used_memory growth


def _bulk_key_hash(i: int) -> str:
    return hash_api_key(f"kvg-bench-{i}")


async def directory_lookups(
    directory: CachedDirectory, client_hash: str, samples: list[str]
) -> dict[str, float]:
    """Opening a directory (start and the first generation read, which opens the store), then
    the first lookup of stored keys (median), a cached lookup and an unknown key's, in ms."""
    began = time.perf_counter()
    await directory.start()
    await directory.refresh()
    opened = time.perf_counter()
    first: list[float] = []
    for key_hash in [client_hash, *samples]:
        t0 = time.perf_counter()
        found = await directory.lookup(key_hash)
        first.append(time.perf_counter() - t0)
        if found is None:
            raise RuntimeError(f"a filled key is missing from the directory: {key_hash}")
    t0 = time.perf_counter()
    await directory.lookup(client_hash)
    cached = time.perf_counter() - t0
    t0 = time.perf_counter()
    await directory.lookup(hash_api_key(f"kvg-unknown-{uuid.uuid4()}"))
    unknown = time.perf_counter() - t0
    await directory.close()
    first.sort()
    return {
        "open_ms": (opened - began) * 1e3,
        "first_lookup_ms": first[len(first) // 2] * 1e3,
        "cached_lookup_ms": cached * 1e3,
        "unknown_lookup_ms": unknown * 1e3,
    }


def _sample_hashes(count: int) -> list[str]:
    """A few of the bulk keys, spread over the store."""
    step = max(count // 10, 1)
    return [_bulk_key_hash(i) for i in range(0, count, step)][:10]


def fill_sqlite_directory(path: Path, count: int, tenant: str) -> tuple[str, KeyStoreFill]:
    """`count` keys in a new SQLite key file: the client's through `create`, the rest in one
    transaction with the same schema. Returns the client's key and the fill's figures."""
    path.unlink(missing_ok=True)

    def directory() -> SqliteKeyDirectory:
        return SqliteKeyDirectory(path, cache_entries=100_000, refresh_s=0.25)

    async def create() -> tuple[str, str]:
        made = directory()
        new = await made.create(tenant)
        await made.close()
        return new.secret, new.record.key_hash

    began = time.perf_counter()
    secret, client_hash = asyncio.run(create())
    fill = KeyStoreFill("embedded", count, 0.0)
    fill.lookups["1 key"] = asyncio.run(directory_lookups(directory(), client_hash, []))
    # The bulk rows: the created record's flat fields, with their own id and hash.
    template = record_fields(KeyRecord(key_id="", key_hash="", tenant=tenant, created_at=0.0))
    template["created_at"] = repr(time.time())
    id_at, hash_at = FIELDS.index("key_id"), FIELDS.index("key_hash")

    def rows() -> Iterator[list[str]]:
        base = [template[name] for name in FIELDS]
        for i in range(count - 1):
            row = list(base)
            row[id_at] = new_key_id()
            row[hash_at] = _bulk_key_hash(i)
            yield row

    insert = f"INSERT INTO api_keys ({', '.join(FIELDS)}) VALUES ({', '.join('?' * len(FIELDS))})"
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("PRAGMA synchronous=OFF")  # this connection only: a bench file, rebuilt
        # The three indexes take keys in random order: a page cache holding them all keeps
        # the fill from rewriting pages (~280 MB file; this connection only, closed after).
        db.execute("PRAGMA cache_size=-400000")
        db.execute("BEGIN IMMEDIATE")
        db.executemany(insert, rows())
        db.execute("UPDATE generation SET value = value + 1 WHERE id = 1")
        db.execute("COMMIT")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()
    fill.fill_s = time.perf_counter() - began
    fill.size_bytes = path.stat().st_size
    fill.lookups[f"{count:,} keys"] = asyncio.run(
        directory_lookups(directory(), client_hash, _sample_hashes(count - 1))
    )
    return secret, fill


def fill_redis_directory(
    url: str, key_prefix: str, count: int, tenant: str
) -> tuple[str, KeyStoreFill]:
    """`count` keys in the Redis key directory under `key_prefix`: the client's through
    `create`, the rest pipelined (bench/keys_scale.py's layout)."""
    import redis.asyncio as aioredis

    from bench.keys_scale import write_keys
    from kvgate.keys.redis_directory import RedisKeyDirectory
    from kvgate.store.redis_store import hash_tag

    tag = hash_tag(key_prefix)

    async def with_directory(work: Callable[[RedisKeyDirectory], Awaitable[_T]]) -> _T:
        client = aioredis.Redis.from_url(url)
        try:
            return await work(
                RedisKeyDirectory(client, tag, cache_entries=100_000, refresh_s=0.25, timeout_s=5)
            )
        finally:
            await client.aclose()

    async def fill() -> tuple[str, KeyStoreFill]:
        began = time.perf_counter()
        made = await with_directory(lambda d: d.create(tenant))
        client_hash = made.record.key_hash
        result = KeyStoreFill("redis", count, 0.0)
        result.lookups["1 key"] = await with_directory(
            lambda d: directory_lookups(d, client_hash, [])
        )
        client = aioredis.Redis.from_url(url)
        try:
            memory_before = int((await client.info("memory"))["used_memory"])
            await write_keys(client, tag, count - 1, tenant=tenant)
            result.size_bytes = int((await client.info("memory"))["used_memory"]) - memory_before
        finally:
            await client.aclose()
        result.fill_s = time.perf_counter() - began
        result.lookups[f"{count:,} keys"] = await with_directory(
            lambda d: directory_lookups(d, client_hash, _sample_hashes(count - 1))
        )
        return made.secret, result

    return asyncio.run(fill())


def redis_available(url: str) -> str | None:
    """None when kvgate's Redis store can be used at `url`, else why not."""
    try:
        import redis

        from kvgate.store import RedisStore  # noqa: F401  (the store exists in this tree)
    except ImportError as exc:
        return f"store not available ({exc})"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
        client.ping()
        client.close()
    except Exception as exc:
        return f"store not available (Redis at {url}: {exc})"
    return None


# --------------------------------------------------------------------------- the stack


class BenchStack:
    def __init__(
        self,
        work_dir: Path,
        *,
        arms: tuple[str, ...] = ARM_ORDER,
        redis_url: str = "redis://127.0.0.1:6379/0",
        litellm_venv: Path = LITELLM_VENV,
        sim: SimSettings | None = None,
        model_dir: Path | None = None,
        kvgate_args: tuple[str, ...] = (),
    ) -> None:
        self.work_dir = work_dir
        self.rig = Rig(work_dir, model_dir=model_dir)
        self.log_dir = self.rig.log_dir
        self.model_dir = self.rig.model_dir
        self.wanted = arms
        self.redis_url = redis_url
        self.redis_prefix = f"kvbench-{os.getpid()}"
        self.litellm_venv = litellm_venv
        self.sim_settings = sim or SimSettings()
        self.kvgate_args = kvgate_args  # extra `kvgate serve` arguments (e.g. --log-level)
        self._sim: SimProcess | None = None
        self.kvgates: dict[str, KvgateProcess] = {}
        self.envoys: dict[str, EnvoyProcess] = {}
        self.arms: dict[str, Arm] = {}
        self.skipped: dict[str, str] = {}
        # The keys arms: the client's key (from the directory) and how its store was filled.
        self.directory_keys: dict[str, str] = {}
        self.key_stores: dict[str, KeyStoreFill] = {}
        self.directory_size = DIRECTORY_KEYS

    # ------------------------------------------------------------------ configs

    def kvgate_config(
        self, store: str, *, key_prefix: str = "", keys: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """kvgate's config (the rig adds the listen addresses); `keys`: its keys section."""
        config: dict[str, Any] = {
            "store": store,
            "tenants": [
                {
                    "name": "bench",
                    "api_key_sha256": sha256_hex(API_KEY),
                    "limits": {"rpm": TENANT_RPM, "tpm": TENANT_TPM},
                },
                {
                    "name": "limited",
                    "api_key_sha256": sha256_hex(LIMITED_KEY),
                    "limits": {"tpm": {"capacity": LIMITED_TPM, "refill_per_s": 0.001}},
                },
                {
                    "name": "limited-short",
                    "api_key_sha256": sha256_hex(SHORT_KEY),
                    "limits": {"tpm": {"capacity": SHORT_TPM, "refill_per_s": 0.001}},
                },
            ],
            "models": [
                {
                    "name": MODEL,
                    "tokenizer": str(self.model_dir),
                    "max_context": MAX_CONTEXT,
                    "default_max_new_tokens": 16,
                    "backend": BACKEND,
                },
                {
                    # The simulator's embedding model (the 1k-embeddings case).
                    "name": EMBEDDING_MODEL,
                    "tokenizer": str(wordllama_model_dir()),
                    "max_context": WORDLLAMA_MAX_MODEL_LEN,
                    "default_max_new_tokens": 16,
                    "backend": BACKEND,
                },
            ],
            "backends": [
                {
                    "name": BACKEND,
                    # Far above what the run can hold in flight: only the limited tenants
                    # are ever rejected.
                    "kv_budget_tokens": 200_000_000,
                    "kv_block_size": 16,
                    "max_concurrent_requests": 100_000,
                }
            ],
        }
        if store != "memory":
            config["redis"] = {"key_prefix": key_prefix or self.redis_prefix}
        if keys is not None:
            config["keys"] = keys
        return config

    def _litellm_config(self) -> Path:
        shutil.copy(BENCH_DIR / "litellm_auth.py", self.work_dir / "kvbench_litellm_auth.py")
        config = {
            "model_list": [
                {
                    "model_name": MODEL,
                    "litellm_params": {
                        "model": f"hosted_vllm/{MODEL}",
                        "api_base": f"{self.sim.url}/v1",
                        "api_key": "none",
                    },
                }
            ],
            "general_settings": {
                "master_key": "sk-bench-master",
                "custom_auth": "kvbench_litellm_auth.user_api_key_auth",
            },
            "litellm_settings": {"telemetry": False},
        }
        path = self.work_dir / "litellm.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        return path

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        want = set(self.wanted)
        rig = self.rig
        sim = self._sim = rig.sim("vllm", self.sim_settings.options())

        def kvgate(
            name: str, store: str, key_prefix: str = "", keys: dict[str, Any] | None = None
        ) -> None:
            config = self.kvgate_config(store, key_prefix=key_prefix, keys=keys)
            self.kvgates[name] = rig.kvgate(name, config, extra_args=self.kvgate_args)

        if want & {"kvgate", "kvgate-split"}:
            kvgate("kvgate-memory", "memory")
        if "kvgate-redis" in want:
            why = redis_available(self.redis_url)
            if why is None:
                kvgate("kvgate-redis", self.redis_url)
            else:
                self.skipped["kvgate-redis"] = why
        if "kvgate-redis-2" in want:
            # Two kvgate processes sharing one Redis state, both endpoints of Envoy's ext_proc
            # cluster: how a pod scales past one core.
            why = redis_available(self.redis_url)
            if why is None:
                for name in PAIR:
                    kvgate(name, self.redis_url, key_prefix=f"{self.redis_prefix}-pair")
            else:
                self.skipped["kvgate-redis-2"] = why
        if "kvgate-keys" in want:
            # As the kvgate arm (memory state store), the client's key in the embedded file.
            path = self.work_dir / "keys.sqlite3"
            print(f"  filling {path} with {self.directory_size:,} keys ...", flush=True)
            secret, fill = fill_sqlite_directory(path, self.directory_size, DIRECTORY_TENANT)
            self.directory_keys["kvgate-keys"], self.key_stores["kvgate-keys"] = secret, fill
            kvgate("kvgate-keys", "memory", keys={"store": "embedded", "path": str(path)})
        if "kvgate-keys-redis" in want:
            why = redis_available(self.redis_url)
            if why is None:
                prefix = f"{self.redis_prefix}-keys"
                print(f"  filling Redis {prefix} with {self.directory_size:,} keys ...", flush=True)
                secret, fill = fill_redis_directory(
                    self.redis_url, prefix, self.directory_size, DIRECTORY_TENANT
                )
                self.directory_keys["kvgate-keys-redis"] = secret
                self.key_stores["kvgate-keys-redis"] = fill
                kvgate("kvgate-keys-redis", self.redis_url, prefix, keys={"store": "redis"})
            else:
                self.skipped["kvgate-keys-redis"] = why
        noop = rig.noop_extproc() if "noop" in want else None
        litellm = self._start_litellm() if "litellm" in want else None

        # One Envoy per arm, in front of the simulator; the arms without kvgate route every
        # request upstream (nothing sets kvgate's routing header there).
        extprocs: dict[str, tuple[int, ...]] = {}
        if "envoy" in want:
            extprocs["envoy"] = ()
        if noop is not None:
            extprocs["noop"] = (noop.grpc_port,)
        for arm, names in KVGATES_OF_ARM.items():
            if arm in want and arm not in self.skipped:
                extprocs[arm] = tuple(self.kvgates[n].grpc_port for n in names)
        for arm, ports in extprocs.items():
            self.envoys[arm] = rig.envoy(
                f"envoy-{arm}",
                template=OBSERVABILITY_CONFIG if arm == "kvgate-split" else ENVOY_CONFIG,
                extproc=ports,
                backends={BACKEND: sim.port},
                route_all_to=BACKEND if arm in ("envoy", "noop") else None,
                quick_shutdown=False,
                access_log_flush_ms=None,
            )

        # Readiness.
        sim.wait_ready(120)
        for name, proc in self.kvgates.items():
            try:
                proc.wait_ready(120)
            except ProcessError as exc:
                arm = "kvgate-redis-2" if name in PAIR else name
                if arm not in REDIS_ARMS:
                    raise
                self.skipped[arm] = f"kvgate with Redis did not start: {exc}"
                proc.process.stop()
        for arm, envoy in self.envoys.items():
            if arm not in self.skipped:
                envoy.wait_ready(60)

        if "direct" in want:
            self.arms["direct"] = Arm("direct", sim.url)
        for arm, envoy in self.envoys.items():
            if arm in self.skipped:
                continue
            pids = {"envoy": envoy.pid}
            if noop is not None and arm == "noop":
                pids["extproc"] = noop.pid
            roles = ("kvgate", "kvgate-b")
            for role, name in zip(roles, KVGATES_OF_ARM.get(arm, ()), strict=False):
                pids[role] = self.kvgates[name].pid
            if arm in REDIS_ARMS:
                redis_pid = self._redis_pid()
                if redis_pid is not None:
                    pids["redis"] = redis_pid
            key = self.directory_keys.get(arm, API_KEY)
            self.arms[arm] = Arm(arm, envoy.base_url, api_key=key, pids=pids)
        if litellm is not None:
            proxy, url = litellm
            try:
                proxy.wait_http(f"{url}/health/liveliness", 180)
            except ProcessError as exc:
                self.skipped["litellm"] = f"LiteLLM did not start: {exc}"
                proxy.stop()
            else:
                assert proxy.pid is not None
                self.arms["litellm"] = Arm("litellm", url, pids={"litellm": proxy.pid})
        for name in self.wanted:
            if name not in self.arms and name not in self.skipped:
                self.skipped[name] = "not started"

    def _redis_pid(self) -> int | None:
        """The redis-server's pid (its CPU is part of the Redis arm's cost)."""
        try:
            import redis

            client = redis.Redis.from_url(self.redis_url, socket_timeout=1)
            pid = int(client.info("server")["process_id"])
            client.close()
        except Exception:
            return None
        return pid if Path(f"/proc/{pid}").exists() else None

    def _start_litellm(self) -> tuple[ManagedProcess, str] | None:
        """LiteLLM's proxy (started, not yet ready) and its URL; None when not installed."""
        binary = self.litellm_venv / "bin" / "litellm"
        if not binary.exists():
            self.skipped["litellm"] = (
                f"LiteLLM not installed in {self.litellm_venv} (python -m bench.run installs it "
                "unless --no-litellm-install)"
            )
            return None
        config = self._litellm_config()
        keys = {
            API_KEY: {"alias": "bench", "rpm": TENANT_RPM, "tpm": TENANT_TPM},
            LIMITED_KEY: {"alias": "limited", "rpm": TENANT_RPM, "tpm": LIMITED_TPM},
            SHORT_KEY: {"alias": "limited-short", "rpm": TENANT_RPM, "tpm": SHORT_TPM},
        }
        env = dict(os.environ)
        env.update(
            {
                "KVBENCH_LITELLM_KEYS": json.dumps(keys),
                # No network here: use the model cost map shipped in the package.
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "LITELLM_TELEMETRY": "False",
                "PYTHONPATH": str(self.work_dir),
            }
        )
        port = self.rig.ports.new()
        argv = [
            str(binary),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ]
        proc = self.rig.process("litellm", argv, env=env, cwd=self.work_dir)
        return proc, f"http://127.0.0.1:{port}"

    @property
    def sim(self) -> SimProcess:
        if self._sim is None:
            raise RuntimeError("the stack is not started")
        return self._sim

    def restart_sim(self, settings: SimSettings) -> None:
        """Same port, new latencies (Envoy clusters and LiteLLM keep pointing at it)."""
        self.sim_settings = settings
        self.sim.restart(settings.options(), timeout=120)

    def sim_idle(self, timeout: float = 30.0) -> bool:
        """Wait until the simulator runs nothing (the previous run's stragglers are done)."""
        return self.sim.wait_idle(timeout, interval=0.2)

    def all_pids(self) -> list[int]:
        return self.rig.pids()

    def stack_cpu_seconds(self) -> float:
        return sum(tree_cpu_seconds(pid) for pid in self.all_pids())

    def quiesce(
        self,
        *,
        window_s: float = 0.5,
        max_cores: float = 0.15,
        timeout: float = 60.0,
        machine_max_cores: float | None = None,
        machine_timeout: float = 0.0,
    ) -> tuple[bool, float]:
        """Wait until the whole stack is nearly idle (e.g. LiteLLM working off a backlog of
        requests its client gave up on, or kvgate finishing settlements) so that the next run
        does not share the CPU with the last one's leftovers; then, for at most
        `machine_timeout` s, until the whole machine is (other users' work included).
        Returns (stack quiet, seconds spent waiting for the machine)."""
        deadline = time.monotonic() + timeout
        before = self.stack_cpu_seconds()
        quiet = False
        while time.monotonic() < deadline:
            time.sleep(window_s)
            after = self.stack_cpu_seconds()
            if (after - before) / window_s <= max_cores:
                quiet = True
                break
            before = after
        waited = 0.0
        if machine_max_cores is not None and machine_timeout > 0:
            waited, _ = wait_machine_quiet(machine_timeout, machine_max_cores, window_s)
        return quiet, waited

    def kvgate_metrics_url(self, arm: str) -> str | None:
        """The metrics of the arm's kvgate process (None without one, or with two)."""
        names = KVGATES_OF_ARM.get(arm, ())
        if len(names) != 1 or names[0] not in self.kvgates:
            return None
        return self.kvgates[names[0]].metrics_url

    def envoy_admin_url(self, arm: str) -> str:
        return self.envoys[arm].admin_url

    @property
    def sim_pid(self) -> int:
        return self.sim.pid

    def stop(self) -> None:
        self.rig.stop()
        if self.kvgates.keys() & {"kvgate-redis", PAIR[0], "kvgate-keys-redis"}:
            self._clean_redis()

    def _clean_redis(self) -> None:
        with contextlib.suppress(Exception):
            import redis

            client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
            keys = list(client.scan_iter(match=f"*{self.redis_prefix}*", count=1000))
            for i in range(0, len(keys), 500):
                client.delete(*keys[i : i + 500])
            client.close()

    def __enter__(self) -> BenchStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> Iterator[str]:
        for name, arm in self.arms.items():
            yield f"{name:13s} {arm.base_url}  pids {arm.pids}"
        for name, why in self.skipped.items():
            yield f"{name:13s} skipped: {why}"


def ensure_litellm(venv: Path = LITELLM_VENV, log: Path | None = None) -> str | None:
    """Install LiteLLM's proxy into its own venv when missing; None on success, else why.

    Its own venv, not the project's: `litellm[proxy]` pins older huggingface-hub, rich and
    python-dateutil than kvgate's venv has (pip would downgrade them under the test suite).
    """
    if (venv / "bin" / "litellm").exists():
        return None
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        with open(log or os.devnull, "ab") as out:
            subprocess.run(
                [str(venv / "bin" / "pip"), "install", "--quiet", "litellm[proxy]", "uvloop"],
                check=True,
                timeout=900,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
    except (subprocess.SubprocessError, OSError) as exc:
        return f"installing litellm[proxy] failed: {exc}"
    return None
