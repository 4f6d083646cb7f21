"""The benchmark's processes: one simulator, the gateways in front of it, and their arms.

Every arm talks to the same vLLM simulator process:

| arm            | path                                                              |
|----------------|-------------------------------------------------------------------|
| direct         | client -> simulator                                               |
| envoy          | client -> Envoy (envoy.yaml without the ext_proc filter) -> sim   |
| noop           | client -> Envoy (envoy.yaml) -> no-op Python ext_proc; -> sim     |
| kvgate         | client -> Envoy (envoy.yaml) -> kvgate, memory store; -> sim      |
| kvgate-redis   | the same, kvgate with the Redis store at 127.0.0.1:6379          |
| kvgate-split   | Envoy (envoy-observability.yaml) -> kvgate (the memory one); -> sim |
| litellm        | client -> LiteLLM proxy (own venv, custom-auth keys) -> sim       |

All listen on 127.0.0.1 on free ports. Processes come from testbed/harness.py
(ManagedProcess, render_envoy_config): logs in `<work_dir>/logs`, SIGTERM then SIGKILL on
stop. Everything is started once; arms take turns, so an idle arm costs only its health
checks. Envoy runs with `--concurrency 1` in every arm.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testbed.harness import (
    ENVOY_CONFIG,
    REPO_ROOT,
    ManagedProcess,
    ProcessError,
    free_port,
    render_envoy_config,
    sha256_hex,
)

VENV_BIN = REPO_ROOT / ".venv" / "bin"
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

ARM_ORDER = (
    "direct",
    "envoy",
    "noop",
    "kvgate",
    "kvgate-redis",
    "kvgate-redis-2",
    "kvgate-split",
    "litellm",
)


# The two kvgate processes of the kvgate-redis-2 arm.
PAIR = ("kvgate-redis-a", "kvgate-redis-b")
EXTPROC_CLUSTER = "kvgate_extproc"


def wait_extproc_healthy(admin_port: int, name: str, timeout: float = 30.0) -> None:
    """Until the Envoy behind `admin_port` sees its ext_proc cluster healthy (its first
    requests would otherwise fail open or closed, not be measured)."""
    url = f"http://127.0.0.1:{admin_port}/clusters"
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as resp:
                text = resp.read().decode()
            if any(
                line.startswith("kvgate_extproc::") and line.endswith("health_flags::healthy")
                for line in text.splitlines()
            ):
                return
        if time.monotonic() > deadline:
            raise ProcessError(f"{name}: ext_proc cluster not healthy after {timeout}s")
        time.sleep(0.2)


def git_output(*argv: str) -> str:
    """`git -C <repo> argv...`'s output, stripped ("?" when git cannot run): the results
    name the commit they measured."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *argv], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out.stdout.strip()


def envoy_argv(config: Path, *extra: str) -> list[str]:
    """A benchmark Envoy: one worker, no hot restart, warnings only."""
    return [
        _bin("envoy"),
        "-c",
        str(config),
        "--disable-hot-restart",
        "--concurrency",
        "1",
        "-l",
        "warning",
        *extra,
    ]


@dataclass
class SimSettings:
    ttft_ms: float = 0.0
    itl_ms: float = 0.0

    def argv(self) -> list[str]:
        return ["--ttft-ms", str(self.ttft_ms), "--itl-ms", str(self.itl_ms)]


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


# --------------------------------------------------------------------------- CPU accounting


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces.
    return raw[raw.rindex(")") + 2 :].split()


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), in seconds; 0 if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # After the name: state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def machine_busy_seconds() -> float:
    """Busy CPU time of the whole machine (all cores) from /proc/stat, in seconds."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    return (sum(values) - idle) / _CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and its live descendants (LiteLLM's workers, a shell's child)."""
    return sum(process_cpu_seconds(p) for p in [pid, *descendants(pid)])


# --------------------------------------------------------------------------- helpers


def _bin(name: str) -> str:
    candidate = VENV_BIN / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name}: not in {VENV_BIN} nor on PATH")
    return found


def http_get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def http_post_json(
    url: str, body: dict[str, Any], headers: dict[str, str], timeout: float = 60.0
) -> tuple[int, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read().decode() or "null")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def envoy_without_extproc(src: Path, dst: Path) -> Path:
    """A rendered Envoy config with every ext_proc filter and the kvgate cluster removed."""
    config = yaml.safe_load(src.read_text(encoding="utf-8"))
    for listener in config["static_resources"]["listeners"]:
        for chain in listener.get("filter_chains", []):
            for net_filter in chain.get("filters", []):
                hcm = net_filter.get("typed_config", {})
                if "http_filters" in hcm:
                    hcm["http_filters"] = [
                        f
                        for f in hcm["http_filters"]
                        if "ext_proc.v3.ExternalProcessor"
                        not in f.get("typed_config", {}).get("@type", "")
                    ]
    config["static_resources"]["clusters"] = [
        c for c in config["static_resources"]["clusters"] if c["name"] != "kvgate_extproc"
    ]
    dst.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return dst


def add_extproc_endpoints(path: Path, ports: tuple[int, ...]) -> Path:
    """More endpoints in the ext_proc cluster (several kvgate processes behind one Envoy)."""
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == EXTPROC_CLUSTER:
            endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            template = endpoints[0]
            for port in ports:
                endpoint = yaml.safe_load(yaml.safe_dump(template))
                endpoint["endpoint"]["address"]["socket_address"]["port_value"] = port
                endpoints.append(endpoint)
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


def envoy_unguarded(path: Path) -> Path:
    """The same rendered config with the routing guard replaced by one route to the backend.

    The shipped configs send a request upstream only on kvgate's routing header; the arms
    without kvgate (plain Envoy, the no-op ext_proc) never set it, so without this they
    would measure Envoy's local `not_admitted` reply instead of a proxied request."""
    config = yaml.safe_load(path.read_text(encoding="utf-8"))
    for listener in config["static_resources"]["listeners"]:
        for chain in listener.get("filter_chains", []):
            for net_filter in chain.get("filters", []):
                route_config = net_filter.get("typed_config", {}).get("route_config")
                if route_config is None:
                    continue
                for host in route_config["virtual_hosts"]:
                    host["routes"] = [
                        {
                            "match": {"prefix": "/"},
                            "route": {"cluster": BACKEND, "timeout": "0s", "idle_timeout": "3600s"},
                        }
                    ]
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path


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
        self.log_dir = work_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.wanted = arms
        self.redis_url = redis_url
        self.redis_prefix = f"kvbench-{os.getpid()}"
        self.litellm_venv = litellm_venv
        self.sim_settings = sim or SimSettings()
        self.model_dir = model_dir or _demo_model_dir()
        self.kvgate_args = kvgate_args  # extra `kvgate serve` arguments (e.g. --log-level)
        self.sim_port = free_port()
        self.procs: dict[str, ManagedProcess] = {}
        self.arms: dict[str, Arm] = {}
        self.skipped: dict[str, str] = {}
        self._ports: dict[str, int] = {}

    # ------------------------------------------------------------------ configs

    def _port(self, name: str) -> int:
        if name not in self._ports:
            taken = {*self._ports.values(), self.sim_port}
            port = free_port()
            while port in taken:  # free_port() can hand out the same free port twice
                port = free_port()
            self._ports[name] = port
        return self._ports[name]

    def kvgate_config(self, name: str, store: str, *, key_prefix: str = "") -> dict[str, Any]:
        config: dict[str, Any] = {
            "server": {
                "grpc_listen": f"127.0.0.1:{self._port(f'{name}:grpc')}",
                "http_listen": f"127.0.0.1:{self._port(f'{name}:http')}",
                "admin_listen": f"127.0.0.1:{self._port(f'{name}:admin')}",
            },
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
                }
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
        return config

    def _envoy(
        self,
        name: str,
        src: Path,
        extproc_port: int | None,
        more_extproc_ports: tuple[int, ...] = (),
    ) -> ManagedProcess:
        listen, admin = self._port(f"envoy-{name}:listen"), self._port(f"envoy-{name}:admin")
        dst = self.work_dir / f"envoy-{name}.yaml"
        render_envoy_config(
            src,
            dst,
            listen_port=listen,
            admin_port=admin,
            extproc_port=extproc_port or self._port(f"envoy-{name}:unused"),
            backends={BACKEND: self.sim_port},
        )
        if extproc_port is None:
            envoy_without_extproc(dst, dst)
        if more_extproc_ports:
            add_extproc_endpoints(dst, more_extproc_ports)
        if name in ("envoy", "noop"):
            envoy_unguarded(dst)
        proc = ManagedProcess(f"envoy-{name}", envoy_argv(dst), log_dir=self.log_dir)
        self.procs[f"envoy-{name}"] = proc
        return proc

    def _sim_argv(self) -> list[str]:
        return [
            _bin("vllm-sim"),
            "--model-dir",
            str(self.model_dir),
            "--served-model-name",
            MODEL,
            "--port",
            str(self.sim_port),
            "--max-model-len",
            str(MAX_CONTEXT),
            "--num-gpu-blocks",
            "4000000",
            "--block-size",
            "16",
            "--max-num-seqs",
            "100000",
            # The body's max_tokens decides the output length (finish_reason "length").
            "--default-output-tokens",
            "1000000",
            "--log-level",
            "warning",
            *self.sim_settings.argv(),
        ]

    def _litellm_config(self) -> Path:
        shutil.copy(BENCH_DIR / "litellm_auth.py", self.work_dir / "kvbench_litellm_auth.py")
        config = {
            "model_list": [
                {
                    "model_name": MODEL,
                    "litellm_params": {
                        "model": f"hosted_vllm/{MODEL}",
                        "api_base": f"http://127.0.0.1:{self.sim_port}/v1",
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
        sim = ManagedProcess("sim", self._sim_argv(), log_dir=self.log_dir).start()
        self.procs["sim"] = sim
        started: list[tuple[str, ManagedProcess]] = []

        def kvgate(name: str, store: str, key_prefix: str = "") -> ManagedProcess:
            path = self.work_dir / f"{name}.yaml"
            config = self.kvgate_config(name, store, key_prefix=key_prefix)
            path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
            argv = [sys.executable, "-m", "kvgate.cli", "serve", "--config", str(path)]
            argv += self.kvgate_args
            proc = ManagedProcess(name, argv, log_dir=self.log_dir).start()
            self.procs[name] = proc
            started.append((name, proc))
            return proc

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
        if "noop" in want:
            argv = [
                sys.executable,
                "-m",
                "bench.noop_extproc",
                "--listen",
                f"127.0.0.1:{self._port('noop:grpc')}",
            ]
            self.procs["noop-extproc"] = ManagedProcess(
                "noop-extproc", argv, log_dir=self.log_dir
            ).start()
        if "litellm" in want:
            self._start_litellm()

        envoys: dict[str, tuple[Path, int | None]] = {}
        more_ports: dict[str, tuple[int, ...]] = {}
        if "envoy" in want:
            envoys["envoy"] = (ENVOY_CONFIG, None)
        if "noop" in want:
            envoys["noop"] = (ENVOY_CONFIG, self._port("noop:grpc"))
        if "kvgate" in want:
            envoys["kvgate"] = (ENVOY_CONFIG, self._port("kvgate-memory:grpc"))
        if "kvgate-split" in want:
            envoys["kvgate-split"] = (OBSERVABILITY_CONFIG, self._port("kvgate-memory:grpc"))
        if "kvgate-redis" in want and "kvgate-redis" not in self.skipped:
            envoys["kvgate-redis"] = (ENVOY_CONFIG, self._port("kvgate-redis:grpc"))
        if "kvgate-redis-2" in want and "kvgate-redis-2" not in self.skipped:
            envoys["kvgate-redis-2"] = (ENVOY_CONFIG, self._port(f"{PAIR[0]}:grpc"))
            more_ports["kvgate-redis-2"] = (self._port(f"{PAIR[1]}:grpc"),)
        for name, (src, port) in envoys.items():
            self._envoy(name, src, port, more_ports.get(name, ())).start()

        # Readiness.
        sim.wait_http(f"http://127.0.0.1:{self.sim_port}/health", 120)
        for name, proc in started:
            try:
                proc.wait_http(f"http://127.0.0.1:{self._port(f'{name}:http')}/readyz", 120)
            except ProcessError as exc:
                arm = "kvgate-redis-2" if name in PAIR else name
                if arm in ("kvgate-redis", "kvgate-redis-2"):
                    self.skipped[arm] = f"kvgate with Redis did not start: {exc}"
                    proc.stop()
                else:
                    raise
        for name in envoys:
            if name in self.skipped:
                continue
            proc = self.procs[f"envoy-{name}"]
            proc.wait_http(f"http://127.0.0.1:{self._port(f'envoy-{name}:admin')}/ready", 60)
            if envoys[name][1] is not None:
                self._wait_extproc_healthy(name)

        if "direct" in want:
            self.arms["direct"] = Arm("direct", f"http://127.0.0.1:{self.sim_port}")
        for name in envoys:
            if name in self.skipped:
                continue
            pids = {"envoy": self._pid(f"envoy-{name}")}
            if name == "noop":
                pids["extproc"] = self._pid("noop-extproc")
            elif name in ("kvgate", "kvgate-split"):
                pids["kvgate"] = self._pid("kvgate-memory")
            elif name == "kvgate-redis":
                pids["kvgate"] = self._pid("kvgate-redis")
            elif name == "kvgate-redis-2":
                pids["kvgate"] = self._pid(PAIR[0])
                pids["kvgate-b"] = self._pid(PAIR[1])
            if name.startswith("kvgate-redis"):
                redis_pid = self._redis_pid()
                if redis_pid is not None:
                    pids["redis"] = redis_pid
            self.arms[name] = Arm(
                name, f"http://127.0.0.1:{self._port(f'envoy-{name}:listen')}", pids=pids
            )
        if "litellm" in want and "litellm" not in self.skipped:
            litellm = self.procs["litellm"]
            try:
                litellm.wait_http(
                    f"http://127.0.0.1:{self._port('litellm')}/health/liveliness", 180
                )
            except ProcessError as exc:
                self.skipped["litellm"] = f"LiteLLM did not start: {exc}"
                litellm.stop()
            else:
                self.arms["litellm"] = Arm(
                    "litellm",
                    f"http://127.0.0.1:{self._port('litellm')}",
                    pids={"litellm": self._pid("litellm")},
                )
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

    def _start_litellm(self) -> None:
        binary = self.litellm_venv / "bin" / "litellm"
        if not binary.exists():
            self.skipped["litellm"] = (
                f"LiteLLM not installed in {self.litellm_venv} (python -m bench.run installs it "
                "unless --no-litellm-install)"
            )
            return
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
        argv = [
            str(binary),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(self._port("litellm")),
            "--num_workers",
            "1",
        ]
        self.procs["litellm"] = ManagedProcess(
            "litellm", argv, log_dir=self.log_dir, env=env, cwd=self.work_dir
        ).start()

    def _pid(self, proc: str) -> int:
        pid = self.procs[proc].pid
        assert pid is not None
        return pid

    def _wait_extproc_healthy(self, name: str) -> None:
        wait_extproc_healthy(self._port(f"envoy-{name}:admin"), f"envoy-{name}")

    def restart_sim(self, settings: SimSettings) -> None:
        """Same port, new latencies (Envoy clusters and LiteLLM keep pointing at it)."""
        self.sim_settings = settings
        sim = self.procs["sim"]
        sim.stop()
        sim.argv = self._sim_argv()
        sim.start()
        sim.wait_http(f"http://127.0.0.1:{self.sim_port}/health", 120)

    def sim_idle(self, timeout: float = 30.0) -> bool:
        """Wait until the simulator runs nothing (the previous run's stragglers are done)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                stats = http_get_json(f"http://127.0.0.1:{self.sim_port}/sim/stats")
            except OSError:
                time.sleep(0.2)
                continue
            if not stats.get("running") and not stats.get("waiting"):
                return True
            time.sleep(0.2)
        return False

    def all_pids(self) -> list[int]:
        return [p.pid for p in self.procs.values() if p.pid is not None and p.running]

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
            start = time.monotonic()
            busy = machine_busy_seconds()
            while time.monotonic() - start < machine_timeout:
                time.sleep(window_s)
                now = machine_busy_seconds()
                if (now - busy) / window_s <= machine_max_cores:
                    break
                busy = now
            waited = time.monotonic() - start
        return quiet, waited

    def kvgate_metrics_url(self, arm: str) -> str | None:
        name = {"kvgate": "kvgate-memory", "kvgate-split": "kvgate-memory"}.get(arm, arm)
        if not name.startswith("kvgate"):
            return None
        return f"http://127.0.0.1:{self._port(f'{name}:http')}/metrics"

    def envoy_admin_url(self, arm: str) -> str:
        return f"http://127.0.0.1:{self._port(f'envoy-{arm}:admin')}"

    @property
    def sim_pid(self) -> int:
        return self._pid("sim")

    def stop(self) -> None:
        order = [n for n in self.procs if n.startswith("envoy-")]
        order += [n for n in self.procs if not n.startswith("envoy-") and n != "sim"]
        order.append("sim")
        for name in order:
            if name in self.procs:
                with contextlib.suppress(Exception):
                    self.procs[name].stop(timeout=10)
        if "kvgate-redis" in self.procs or PAIR[0] in self.procs:
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


def _demo_model_dir() -> Path:
    from testbed.demo_model import demo_model_dir

    return demo_model_dir()


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
