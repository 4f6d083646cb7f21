"""Process harness for end-to-end tests and benchmarks: the vLLM simulator, kvgate and the
real Envoy.

Everything listens on 127.0.0.1 on free ports, logs to files in a per-stack directory, and
is torn down (SIGTERM, then SIGKILL) when the stack stops. When a process fails to come up,
the error carries the tail of its log.

    with Stack() as stack:
        httpx.post(f"{stack.base_url}/v1/chat/completions", headers=stack.auth_headers(), ...)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml

from testbed.demo_model import demo_model_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
ENVOY_CONFIG = REPO_ROOT / "envoy" / "envoy.yaml"
VENV_BIN = REPO_ROOT / ".venv" / "bin"
DEFAULT_MODEL_DIR = REPO_ROOT / "var" / "models" / "qwen2.5-demo"
DEFAULT_MODEL_NAME = "qwen2.5-demo"
DEFAULT_BACKEND = "vllm-local"
DEMO_TENANT = "demo"
DEMO_API_KEY = "sk-kvgate-demo"

# Names the harness looks up in envoy/envoy.yaml (see the comment at its top).
EXTPROC_CLUSTER = "kvgate_extproc"
TEMPLATE_BACKEND_CLUSTER = "vllm-local"
# The ORIGINAL_DST cluster template for pools (backends with several endpoints).
TEMPLATE_POOL_CLUSTER = "vllm-pool"


def executable(name: str) -> str:
    """A console script of this venv, else one on PATH; fails loudly when neither exists."""
    candidate = VENV_BIN / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name}: not in {VENV_BIN} nor on PATH")
    return found


_bin = executable  # the name tests/ import


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- Envoy config


def _socket_address(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def _set_single_endpoint(cluster: dict[str, Any], port: int) -> None:
    cluster["load_assignment"] = {
        "cluster_name": cluster["name"],
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket_address(port)}}]}],
    }


def _iter_routes(config: dict[str, Any]) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = []
    for listener in config["static_resources"]["listeners"]:
        for chain in listener.get("filter_chains", []):
            for net_filter in chain.get("filters", []):
                route_config = net_filter.get("typed_config", {}).get("route_config")
                if not route_config:
                    continue
                for vhost in route_config.get("virtual_hosts", []):
                    routes.extend(vhost.get("routes", []))
    return routes


def render_envoy_config(
    src: Path,
    dst: Path,
    *,
    listen_port: int,
    admin_port: int,
    extproc_port: int,
    backends: Mapping[str, int],
    default_backend: str | None = None,
    pools: Sequence[str] = (),
) -> Path:
    """Write a copy of the Envoy bootstrap `src` to `dst` with loopback addresses and ports.

    - admin and every listener -> 127.0.0.1 (`listen_port` for the listener);
    - cluster `kvgate_extproc` -> 127.0.0.1:`extproc_port`;
    - one cluster per entry of `backends` (name -> port), each a copy of the `vllm-local`
      cluster (named after the backend, as kvgate's x-kvgate-backend header expects);
      the `vllm-local` template itself is dropped unless it is one of `backends`;
    - routes that pointed at `vllm-local` point at `default_backend` (default: `vllm-local`
      if listed, else the first backend);
    - one ORIGINAL_DST cluster per name in `pools`, a copy of the `vllm-pool` template (kvgate
      names the endpoint in x-kvgate-destination); the template itself is dropped.
    The result is not validated here; see `validate_envoy_config`.
    """
    if not backends:
        raise ValueError("render_envoy_config: at least one backend is needed")
    config = yaml.safe_load(Path(src).read_text(encoding="utf-8"))
    if default_backend is None:
        default_backend = (
            TEMPLATE_BACKEND_CLUSTER
            if TEMPLATE_BACKEND_CLUSTER in backends
            else next(iter(backends))
        )
    if default_backend not in backends:
        raise ValueError(f"default_backend {default_backend!r} is not one of {sorted(backends)}")

    config["admin"]["address"] = _socket_address(admin_port)
    listeners = config["static_resources"]["listeners"]
    if len(listeners) != 1:
        raise ValueError(f"{src}: expected exactly one listener, found {len(listeners)}")
    listeners[0]["address"] = _socket_address(listen_port)

    clusters: list[dict[str, Any]] = config["static_resources"]["clusters"]
    by_name = {c["name"]: c for c in clusters}
    if EXTPROC_CLUSTER not in by_name or TEMPLATE_BACKEND_CLUSTER not in by_name:
        raise ValueError(
            f"{src}: needs clusters {EXTPROC_CLUSTER!r} and {TEMPLATE_BACKEND_CLUSTER!r}"
        )
    _set_single_endpoint(by_name[EXTPROC_CLUSTER], extproc_port)

    template = by_name[TEMPLATE_BACKEND_CLUSTER]
    new_clusters = [
        c for c in clusters if c["name"] not in (TEMPLATE_BACKEND_CLUSTER, TEMPLATE_POOL_CLUSTER)
    ]
    for name in pools:
        if TEMPLATE_POOL_CLUSTER not in by_name:
            raise ValueError(f"{src}: pools need the {TEMPLATE_POOL_CLUSTER!r} cluster template")
        if (name in by_name and name != TEMPLATE_POOL_CLUSTER) or name in backends:
            raise ValueError(f"pool name {name!r} clashes with an existing Envoy cluster")
        cluster = copy.deepcopy(by_name[TEMPLATE_POOL_CLUSTER])
        cluster["name"] = name
        new_clusters.append(cluster)
    for name, port in backends.items():
        if name in by_name and name != TEMPLATE_BACKEND_CLUSTER:
            raise ValueError(f"backend name {name!r} clashes with an existing Envoy cluster")
        cluster = copy.deepcopy(template)
        cluster["name"] = name
        _set_single_endpoint(cluster, port)
        new_clusters.append(cluster)
    config["static_resources"]["clusters"] = new_clusters

    for route in _iter_routes(config):
        action = route.get("route", {})
        if action.get("cluster") == TEMPLATE_BACKEND_CLUSTER:
            action["cluster"] = default_backend

    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return dst


def validate_envoy_config(path: Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run `envoy --mode validate -c path`; the caller checks returncode (0 = valid)."""
    return subprocess.run(
        [
            _bin("envoy"),
            "--mode",
            "validate",
            "-c",
            str(path),
            "--disable-hot-restart",
            "-l",
            "warning",
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def envoy_argv(
    config: Path,
    *,
    log_level: str = "warning",
    quick_shutdown: bool = True,
    access_log_flush_ms: int | None = 100,
) -> list[str]:
    """An Envoy command line: one worker thread, no hot restart (each Envoy independent: no
    shared memory, no base-id clashes). `quick_shutdown`: drain 1 s, parent shutdown 2 s;
    `access_log_flush_ms`: how often access-log lines reach their file (Envoy's default,
    None, is 10 s)."""
    argv = [
        _bin("envoy"),
        "-c",
        str(config),
        "--disable-hot-restart",
        "--concurrency",
        "1",
        "-l",
        log_level,
    ]
    if quick_shutdown:
        argv += ["--drain-time-s", "1", "--parent-shutdown-time-s", "2"]
    if access_log_flush_ms is not None:
        argv += ["--file-flush-interval-msec", str(access_log_flush_ms)]
    return argv


def extproc_health(admin_url: str, timeout: float = 2.0) -> dict[str, str]:
    """Envoy's health flags of each endpoint of the ext_proc cluster ("127.0.0.1:PORT" ->
    "healthy" or e.g. "/failed_active_hc"), from its admin `/clusters` page; OSError when the
    admin port does not answer."""
    with urllib.request.urlopen(f"{admin_url}/clusters", timeout=timeout) as resp:
        text = resp.read().decode()
    flags: dict[str, str] = {}
    prefix = f"{EXTPROC_CLUSTER}::"
    for line in text.splitlines():
        if line.startswith(prefix):
            endpoint, sep, value = line[len(prefix) :].partition("::health_flags::")
            if sep:
                flags[endpoint] = value
    return flags


# --------------------------------------------------------------------------- processes


class ProcessError(RuntimeError):
    """A managed process did not start, died, or did not become ready; carries its log tail."""


class ManagedProcess:
    """A subprocess in its own session, stdout+stderr to `log_dir/<name>.log`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_dir = Path(log_dir)
        self.log_path = self.log_dir / f"{name}.log"
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd or REPO_ROOT
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None
        self.starts = 0

    # lifecycle --------------------------------------------------------------
    def start(self) -> Self:
        if self.running:
            raise ProcessError(f"{self.name}: already running (pid {self.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in _reap
        self.starts += 1
        self._log_file.write(f"==== start #{self.starts}: {' '.join(self.argv)}\n".encode())
        self._log_file.flush()
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=str(self.cwd),
                start_new_session=True,  # own process group: stop() reaches its children too
            )
        except OSError as exc:
            self._close_log()
            raise ProcessError(f"{self.name}: cannot start {self.argv[0]}: {exc}") from exc
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited after `timeout` s. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._close_log()
        return self.proc.returncode

    def kill(self) -> int | None:
        """SIGKILL at once (a crash, as far as the others can tell)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._close_log()
        return self.proc.returncode

    def restart(self, timeout: float = 10.0) -> Self:
        self.stop(timeout)
        return self.start()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # readiness --------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.proc is None:
            raise ProcessError(f"{self.name}: never started")
        code = self.proc.poll()
        if code is not None:
            raise ProcessError(f"{self.name}: exited with code {code}\n{self.describe()}")

    def wait_http(self, url: str, timeout: float = 30.0, *, status: int = 200) -> None:
        """Poll GET `url` until it answers `status`; fail early if the process dies."""
        deadline = time.monotonic() + timeout
        last = "no attempt"
        while True:
            self._check_alive()
            try:
                with urllib.request.urlopen(url, timeout=2.0) as resp:
                    if resp.status == status:
                        return
                    last = f"HTTP {resp.status}"
            except urllib.error.HTTPError as exc:
                if exc.code == status:
                    return
                last = f"HTTP {exc.code}"
            except (OSError, urllib.error.URLError) as exc:
                last = repr(exc)
            if time.monotonic() > deadline:
                raise ProcessError(
                    f"{self.name}: {url} not answering {status} after {timeout:.0f}s "
                    f"(last: {last})\n{self.describe()}"
                )
            time.sleep(0.1)

    def wait_tcp(self, port: int, timeout: float = 30.0, *, host: str = "127.0.0.1") -> None:
        """Wait until something accepts TCP connections on host:port."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    return
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ProcessError(
                        f"{self.name}: nothing listening on {host}:{port} after "
                        f"{timeout:.0f}s ({exc})\n{self.describe()}"
                    ) from exc
            time.sleep(0.1)

    # logs -------------------------------------------------------------------
    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def describe(self, lines: int = 80) -> str:
        return (
            f"---- {self.name} (pid {self.pid}, rc {self.returncode}) log {self.log_path}, "
            f"last {lines} lines:\n{self.log_tail(lines)}\n---- end {self.name}"
        )

    # context manager --------------------------------------------------------
    def __enter__(self) -> Self:
        if self.proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if exc is not None:
            sys.stderr.write(self.describe() + "\n")


# --------------------------------------------------------------------------- the stack


@contextlib.contextmanager
def embedding_sim(log_dir: Path, api_key: str | None = None) -> Iterator[str]:
    """A simulator serving `/v1/embeddings` with WordLlama (and the demo model), alone on a
    free port, until the block ends: yields its base URL (without `/v1`)."""
    port = free_port()
    argv = [
        _bin("vllm-sim"),
        "--model-dir",
        str(demo_model_dir()),
        "--served-model-name",
        "demo",
        "--port",
        str(port),
        "--embedding-model",
        "wordllama",
    ]
    if api_key is not None:
        argv += ["--api-key", api_key]
    proc = ManagedProcess("vllm-sim-embed", argv, log_dir=log_dir)
    proc.start()
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@dataclass
class SimOptions:
    """Options of the vLLM simulator (one per backend); None leaves the simulator's default."""

    num_gpu_blocks: int = 3000  # x16 = 48,000 tokens, the default backend budget
    block_size: int = 16
    ttft_ms: float | None = None
    itl_ms: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    default_output_tokens: int | None = None
    force_include_usage: bool = False
    log_level: str | None = None
    # vLLM's chat-rendering flags, passed as the simulator's flags of the same names (the
    # dicts as JSON; chat_template: a file path, a bundled template's name or the template).
    default_chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort_map: dict[str, str] | None = None
    chat_template: str | None = None
    chat_template_content_format: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    extra_args: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        args = ["--num-gpu-blocks", str(self.num_gpu_blocks), "--block-size", str(self.block_size)]
        optional = {
            "--ttft-ms": self.ttft_ms,
            "--itl-ms": self.itl_ms,
            "--max-model-len": self.max_model_len,
            "--max-num-seqs": self.max_num_seqs,
            "--default-output-tokens": self.default_output_tokens,
            "--log-level": self.log_level,
        }
        for flag, value in optional.items():
            if value is not None:
                args += [flag, str(value)]
        if self.force_include_usage:
            args.append("--force-include-usage")
        for flag, mapping in (
            ("--default-chat-template-kwargs", self.default_chat_template_kwargs),
            ("--reasoning-effort-map", self.reasoning_effort_map),
        ):
            if mapping is not None:
                args += [flag, json.dumps(mapping)]
        for flag, text in (
            ("--chat-template", self.chat_template),
            ("--chat-template-content-format", self.chat_template_content_format),
        ):
            if text is not None:
                args += [flag, text]
        if self.exclude_tools_when_tool_choice_none:
            args.append("--exclude-tools-when-tool-choice-none")
        return args + list(self.extra_args)


def sim_argv(
    port: int, options: SimOptions, *, model_dir: Path | str, served_model_name: str
) -> list[str]:
    """The simulator's command line: one model on 127.0.0.1:`port`."""
    return [
        _bin("vllm-sim"),
        "--model-dir",
        str(model_dir),
        "--served-model-name",
        served_model_name,
        "--port",
        str(port),
        *options.argv(),
    ]


def kvgate_argv(config: Path, *extra_args: str) -> list[str]:
    """`kvgate serve --config <config>` with this interpreter, then `extra_args`."""
    return [sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config), *extra_args]


def default_tenants() -> list[dict[str, Any]]:
    return [{"name": DEMO_TENANT, "api_key": DEMO_API_KEY}]


def default_models(model_dir: Path = DEFAULT_MODEL_DIR) -> list[dict[str, Any]]:
    return [
        {
            "name": DEFAULT_MODEL_NAME,
            "tokenizer": str(model_dir),
            "max_context": 32768,
            "default_max_new_tokens": 1024,
            "backend": DEFAULT_BACKEND,
        }
    ]


def default_backends() -> list[dict[str, Any]]:
    return [
        {
            "name": DEFAULT_BACKEND,
            "kv_budget_tokens": 48000,
            "kv_block_size": 16,
            "max_concurrent_requests": 256,
        }
    ]


def _demo_model_dir() -> Path:
    """The shared demo tokenizer dir, built on first use (testbed/demo_model.py)."""
    return demo_model_dir()


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class Stack:
    """vLLM simulator(s) + kvgate + Envoy on free loopback ports.

    tenants/models/backends replace the defaults (lists of dicts in kvgate's config schema).
    A tenant dict may carry `api_key` (plain text) instead of `api_key_sha256`; the harness
    hashes it and remembers the key in `api_keys`. `kvgate_overrides` is deep-merged into the
    top level of kvgate's config (e.g. `{"server": {"lease_ttl_s": 5}}`). One simulator is
    started per backend, serving the (first) model that names that backend; `sim` sets the
    options of all of them (a SimOptions or a dict of its fields), `sim_per_backend` overrides
    fields for one backend.
    """

    def __init__(
        self,
        *,
        tenants: Sequence[Mapping[str, Any]] | None = None,
        models: Sequence[Mapping[str, Any]] | None = None,
        backends: Sequence[Mapping[str, Any]] | None = None,
        sim: SimOptions | Mapping[str, Any] | None = None,
        sim_per_backend: Mapping[str, SimOptions | Mapping[str, Any]] | None = None,
        kvgate_overrides: Mapping[str, Any] | None = None,
        pool_replicas: Mapping[str, int] | None = None,
        envoy_config: Path = ENVOY_CONFIG,
        work_dir: Path | None = None,
        envoy_log_level: str = "warning",
        start_timeout: float = 60.0,
        keep_work_dir: bool = False,
    ) -> None:
        self._own_work_dir = work_dir is None
        self.keep_work_dir = keep_work_dir
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="kvgate-e2e-"))
        self.log_dir = self.work_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.envoy_config_src = Path(envoy_config)
        self.envoy_log_level = envoy_log_level
        self.start_timeout = start_timeout

        self.api_keys: dict[str, str] = {}
        self.tenants = [self._tenant(t) for t in (tenants or default_tenants())]
        if models is None:
            models = default_models(_demo_model_dir())
        self.models = [dict(m) for m in models]
        self.backends = [dict(b) for b in (backends or default_backends())]
        self.kvgate_overrides = dict(kvgate_overrides or {})

        # backend -> number of simulator replicas behind it: the backend is a pool whose
        # endpoints are those replicas (simulators named "<backend>#<i>").
        self.pool_replicas = dict(pool_replicas or {})
        base_sim = sim if isinstance(sim, SimOptions) else SimOptions(**dict(sim or {}))
        self.sim_options: dict[str, SimOptions] = {}
        for backend in self.backends:
            for sim_name in self._sim_names(backend["name"]):
                override = (sim_per_backend or {}).get(sim_name) or (sim_per_backend or {}).get(
                    backend["name"]
                )
                if override is None:
                    self.sim_options[sim_name] = copy.deepcopy(base_sim)
                elif isinstance(override, SimOptions):
                    self.sim_options[sim_name] = override
                else:  # a dict overrides fields of `sim` for this backend only
                    self.sim_options[sim_name] = dataclasses.replace(base_sim, **override)

        # ports
        self.listen_port = free_port()
        self.admin_port = free_port()
        self.grpc_port = free_port()
        self.kvgate_http_port = free_port()
        self.kvgate_admin_port = free_port()
        self.sim_ports = {
            sim_name: free_port() for b in self.backends for sim_name in self._sim_names(b["name"])
        }

        self.kvgate_config_path = self.work_dir / "kvgate.yaml"
        self.envoy_config_path = self.work_dir / "envoy.yaml"
        self.sims: dict[str, ManagedProcess] = {}
        self.kvgate: ManagedProcess | None = None
        self.envoy: ManagedProcess | None = None
        self._started = False

    # config -----------------------------------------------------------------
    def _sim_names(self, backend: str) -> list[str]:
        replicas = self.pool_replicas.get(backend)
        return [backend] if replicas is None else [f"{backend}#{i}" for i in range(replicas)]

    def pool_endpoints(self, backend: str) -> list[str]:
        """A pool's endpoints (IP:PORT), in replica order."""
        return [f"127.0.0.1:{self.sim_ports[name]}" for name in self._sim_names(backend)]

    def _tenant(self, tenant: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(tenant)
        key = out.pop("api_key", None)
        if key is not None:
            if "api_key_sha256" in out:
                raise ValueError(f"tenant {out.get('name')!r}: give api_key or api_key_sha256")
            out["api_key_sha256"] = sha256_hex(str(key))
            self.api_keys[str(out["name"])] = str(key)
        return out

    def kvgate_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "server": {
                "grpc_listen": f"127.0.0.1:{self.grpc_port}",
                "http_listen": f"127.0.0.1:{self.kvgate_http_port}",
                "admin_listen": f"127.0.0.1:{self.kvgate_admin_port}",
            },
            "store": "memory",
            "tenants": self.tenants,
            "models": self.models,
            "backends": [self._backend_config(b) for b in self.backends],
        }
        return _deep_merge(config, self.kvgate_overrides)

    def _backend_config(self, backend: dict[str, Any]) -> dict[str, Any]:
        if backend["name"] not in self.pool_replicas or "endpoint_discovery" in backend:
            return backend
        return {"endpoints": self.pool_endpoints(backend["name"]), **backend}

    def write_configs(self) -> None:
        self.kvgate_config_path.write_text(
            yaml.safe_dump(self.kvgate_config(), sort_keys=False), encoding="utf-8"
        )
        single = {
            b["name"]: self.sim_ports[b["name"]]
            for b in self.backends
            if b["name"] not in self.pool_replicas
        }
        if not single:
            # Pass-through routes (GET /v1/models) need a plain cluster: the first replica.
            first_pool = self.backends[0]["name"]
            single = {TEMPLATE_BACKEND_CLUSTER: self.sim_ports[self._sim_names(first_pool)[0]]}
        render_envoy_config(
            self.envoy_config_src,
            self.envoy_config_path,
            listen_port=self.listen_port,
            admin_port=self.admin_port,
            extproc_port=self.grpc_port,
            backends=single,
            pools=list(self.pool_replicas),
        )

    # urls -------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def sim_urls(self) -> dict[str, str]:
        return {name: f"http://127.0.0.1:{port}" for name, port in self.sim_ports.items()}

    @property
    def sim_url(self) -> str:
        """The first backend's simulator (a pool's first replica)."""
        return self.sim_urls[self._sim_names(self.backends[0]["name"])[0]]

    @property
    def kvgate_http_url(self) -> str:
        return f"http://127.0.0.1:{self.kvgate_http_port}"

    @property
    def kvgate_metrics_url(self) -> str:
        return f"{self.kvgate_http_url}/metrics"

    @property
    def kvgate_grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def envoy_admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def api_key(self, tenant: str = DEMO_TENANT) -> str:
        return self.api_keys[tenant]

    def auth_headers(self, tenant: str = DEMO_TENANT) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key(tenant)}"}

    # processes --------------------------------------------------------------
    def _sim_argv(self, sim_name: str) -> list[str]:
        opts = self.sim_options[sim_name]
        backend = sim_name.split("#", 1)[0]
        served = [m for m in self.models if m["backend"] == backend] or self.models[:1]
        return sim_argv(
            self.sim_ports[sim_name],
            opts,
            model_dir=str(served[0]["tokenizer"]),
            served_model_name=str(served[0]["name"]),
        )

    def _kvgate_argv(self) -> list[str]:
        return kvgate_argv(self.kvgate_config_path)

    def _envoy_argv(self) -> list[str]:
        # Access log lines reach the log file within 0.1 s (default: 10 s).
        return envoy_argv(self.envoy_config_path, log_level=self.envoy_log_level)

    def processes(self) -> list[ManagedProcess]:
        procs = list(self.sims.values())
        procs += [p for p in (self.kvgate, self.envoy) if p is not None]
        return procs

    def start(self) -> Self:
        if self._started:
            return self
        self._started = True
        try:
            self.write_configs()
            for name in self.sim_ports:
                self.sims[name] = ManagedProcess(
                    f"sim-{name.replace('#', '-')}", self._sim_argv(name), log_dir=self.log_dir
                ).start()
            self.kvgate = ManagedProcess(
                "kvgate", self._kvgate_argv(), log_dir=self.log_dir
            ).start()
            self.envoy = ManagedProcess("envoy", self._envoy_argv(), log_dir=self.log_dir).start()
            for name, sim in self.sims.items():
                sim.wait_http(f"{self.sim_urls[name]}/health", self.start_timeout)
            self.wait_kvgate_ready()
            self.envoy.wait_http(f"{self.envoy_admin_url}/ready", self.start_timeout)
            self.wait_extproc_healthy()
        except BaseException:
            sys.stderr.write(self.dump_logs())
            self.keep_work_dir = True  # the logs stay for a post-mortem
            self.stop()
            raise
        return self

    def wait_kvgate_ready(self, timeout: float | None = None) -> None:
        """kvgate's /healthz (alive) then /readyz (tokenizers loaded, admitting)."""
        assert self.kvgate is not None
        self.kvgate.wait_http(f"{self.kvgate_http_url}/healthz", timeout or self.start_timeout)
        self.kvgate.wait_http(f"{self.kvgate_http_url}/readyz", timeout or self.start_timeout)

    def wait_extproc_healthy(self, timeout: float = 15.0) -> None:
        """Wait until Envoy's gRPC health check marks kvgate's endpoint healthy."""
        assert self.envoy is not None
        deadline = time.monotonic() + timeout
        while True:
            status = self.extproc_health_flags()
            if status == "healthy":
                return
            if time.monotonic() > deadline:
                raise ProcessError(
                    f"Envoy still sees kvgate as {status!r} after {timeout:.0f}s\n"
                    + self.dump_logs()
                )
            time.sleep(0.1)

    def wait_extproc_serving(self, timeout: float = 30.0) -> None:
        """Wait until requests pass kvgate again (after a restart). Healthy in Envoy's
        /clusters is not enough: an endpoint that outlier detection ejected while kvgate
        was down stays out until the next outlier sweep (up to its 1 s interval), and the
        admin page does not say so. So: until `GET /v1/models` through Envoy answers 200."""
        self.wait_extproc_healthy(timeout)
        url = f"{self.base_url}/v1/models"
        headers = self.auth_headers()
        wait_until(
            lambda: _status_of(url, headers),
            lambda status: status == 200,
            timeout=timeout,
            interval=0.1,
        )
        if _status_of(url, headers) != 200:
            raise ProcessError(f"requests still fail through Envoy after {timeout:.0f}s")

    def extproc_health_flags(self) -> str:
        """'healthy', or Envoy's health flags for the kvgate endpoint (e.g. '/failed_active_hc')."""
        try:
            flags = extproc_health(self.envoy_admin_url)
        except OSError as exc:
            return f"admin unreachable: {exc!r}"
        return flags.get(self.kvgate_grpc_address, "unknown")

    def kill_kvgate(self) -> None:
        """SIGKILL kvgate (no drain, no settlement): a crash."""
        assert self.kvgate is not None
        self.kvgate.kill()

    def stop_kvgate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM kvgate (graceful shutdown), SIGKILL after `timeout`."""
        assert self.kvgate is not None
        return self.kvgate.stop(timeout)

    def start_kvgate(self, *, wait_envoy_healthy: bool = True) -> None:
        assert self.kvgate is not None
        self.kvgate.start()
        self.wait_kvgate_ready()
        if wait_envoy_healthy:
            self.wait_extproc_healthy()

    def restart_kvgate(self, *, graceful: bool = True, wait_envoy_healthy: bool = True) -> None:
        """Stop kvgate (SIGTERM, or SIGKILL with graceful=False), start it again, wait ready.

        It keeps its ports and config file (rewrite `kvgate_config_path` first to change it).
        """
        if graceful:
            self.stop_kvgate()
        else:
            self.kill_kvgate()
        self.start_kvgate(wait_envoy_healthy=wait_envoy_healthy)

    def stop(self) -> None:
        # Envoy first (no new traffic), then kvgate (settles), then the simulators.
        for proc in [self.envoy, self.kvgate, *self.sims.values()]:
            if proc is not None:
                try:
                    proc.stop(timeout=10.0)
                except Exception as exc:  # keep stopping the others
                    sys.stderr.write(f"stopping {proc.name}: {exc!r}\n")
        if self._own_work_dir and not self.keep_work_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    # logs -------------------------------------------------------------------
    def dump_logs(self, lines: int = 80) -> str:
        parts = [f"==== stack work dir {self.work_dir}"]
        parts += [p.describe(lines) for p in self.processes()]
        return "\n".join(parts) + "\n"

    def access_log(self) -> list[dict[str, Any]]:
        """Envoy's JSON access log lines so far (Envoy logs them to stdout)."""
        if self.envoy is None:
            return []
        entries: list[dict[str, Any]] = []
        for line in self.envoy.log_text().splitlines():
            if line.startswith("{"):
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return entries

    def wait_access_log(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float = 5.0,
    ) -> dict[str, Any]:
        """The first access-log entry matching `predicate`, waiting for Envoy to flush it.

        e.g. `stack.wait_access_log(lambda e: e["request_id"] == rid)`.
        """
        deadline = time.monotonic() + timeout
        while True:
            for entry in self.access_log():
                if predicate(entry):
                    return entry
            if time.monotonic() > deadline:
                tail = "\n".join(json.dumps(e) for e in self.access_log()[-10:])
                raise AssertionError(
                    f"no matching access-log entry after {timeout:.1f}s; last entries:\n{tail}"
                )
            time.sleep(0.05)

    def envoy_stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy counters and gauges whose names start with `prefix`."""
        with urllib.request.urlopen(
            f"{self.envoy_admin_url}/stats?filter=^{prefix}", timeout=5
        ) as resp:
            text = resp.read().decode()
        stats: dict[str, int] = {}
        for line in text.splitlines():
            name, sep, value = line.partition(": ")
            if sep and value.strip().lstrip("-").isdigit():
                stats[name] = int(value)
        return stats

    # context manager --------------------------------------------------------
    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            sys.stderr.write(self.dump_logs())
        self.stop()


# --------------------------------------------------------------------------- test helpers
# Read-only views of a running stack for assertions: kvgate's Prometheus metrics and usage
# ledger, the simulator's /sim/stats, and a bounded poll.

# Imported here, not at the top, to keep these helpers one additive block.
from typing import TypeVar  # noqa: E402

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

MetricKey = tuple[str, frozenset[tuple[str, str]]]


class MetricSamples:
    """One scrape of a Prometheus text page: sample name + labels -> value."""

    def __init__(self, text: str) -> None:
        self.samples: dict[MetricKey, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = (sample.name, frozenset(sample.labels.items()))
                self.samples[key] = float(sample.value)

    def get(self, name: str, **labels: str) -> float | None:
        """The sample with exactly these labels, or None when it is absent."""
        return self.samples.get((name, frozenset(labels.items())))

    def value(self, name: str, **labels: str) -> float:
        """The sample with exactly these labels; 0 when absent (a counter never touched)."""
        found = self.get(name, **labels)
        return 0.0 if found is None else found

    def total(self, name: str, **labels: str) -> float:
        """Sum of every sample of `name` whose labels include `labels` (0 when none)."""
        wanted = set(labels.items())
        return sum(
            value
            for (sample, sample_labels), value in self.samples.items()
            if sample == name and wanted <= sample_labels
        )


def kvgate_metrics(stack: Stack) -> MetricSamples:
    with urllib.request.urlopen(stack.kvgate_metrics_url, timeout=5) as resp:
        return MetricSamples(resp.read().decode())


def _status_of(url: str, headers: Mapping[str, str]) -> int:
    request = urllib.request.Request(url, headers=dict(headers))
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read().decode())


def kvgate_usage(stack: Stack) -> dict[str, Any]:
    """kvgate's operator ledger (`GET /admin/usage` on its HTTP port)."""
    report: dict[str, Any] = _get_json(f"{stack.kvgate_http_url}/admin/usage")
    return report


def tenant_totals(
    stack: Stack, tenant: str = DEMO_TENANT, period: str = "this_month", *, cache: bool = False
) -> dict[str, int]:
    """A tenant's ledger totals for `period` ("today" / "this_month"); zeros when none yet.
    With `cache`, the cache hits and the tokens they saved too."""
    totals = {"requests": 0, "prompt_tokens": 0, "output_tokens": 0}
    if cache:
        totals |= {"cache_hits": 0, "cache_saved_tokens": 0}
    for entry in kvgate_usage(stack).get("tenants", []):
        if entry.get("tenant") == tenant:
            for key in totals:
                totals[key] = int(entry[period][key])
    return totals


def assert_free_cache_hit_booked(
    stack: Stack, before: dict[str, int], answer: dict[str, Any], tenant: str = DEMO_TENANT
) -> int:
    """One free cache hit since `before` (tenant_totals with cache): no request charged, the hit and
    the tokens `answer` (the JSON the hit replayed) took booked in the ledger, which happens
    just after the hit is answered: waited for. Returns those tokens."""
    made = int(answer["usage"]["prompt_tokens"]) + int(answer["usage"]["completion_tokens"])
    after = wait_until(
        lambda: tenant_totals(stack, tenant, cache=True),
        lambda t: t["cache_hits"] > before["cache_hits"],
        timeout=5,
    )
    assert after["requests"] == before["requests"], (before, after)
    assert after["cache_hits"] == before["cache_hits"] + 1, (before, after)
    assert after["cache_saved_tokens"] == before["cache_saved_tokens"] + made, (before, after)
    return made


def sdk_stream_text(chunks: Iterable[Any]) -> tuple[str, Any]:
    """The text and the usage (None when the stream carried none) of an OpenAI SDK chat
    stream, as a client reads it."""
    parts, usage = [], None
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return "".join(parts), usage


def sim_stats(stack: Stack, backend: str | None = None) -> dict[str, Any]:
    """The simulator's `/sim/stats` (first backend's unless named)."""
    url = stack.sim_urls[backend] if backend else stack.sim_url
    stats: dict[str, Any] = _get_json(f"{url}/sim/stats")
    return stats


def sim_reset(stack: Stack, backend: str | None = None) -> None:
    """Zero the simulator's counters (preemptions, peaks, served records)."""
    url = stack.sim_urls[backend] if backend else stack.sim_url
    request = urllib.request.Request(f"{url}/sim/reset", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=5) as resp:
        resp.read()


_T = TypeVar("_T")


def wait_until(
    probe: Callable[[], _T],
    done: Callable[[_T], bool],
    *,
    timeout: float,
    interval: float = 0.05,
) -> _T:
    """Call `probe` until `done(result)`, for at most `timeout` s; returns the last result
    either way, so the caller's assertion shows the value that did not converge."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(interval)
