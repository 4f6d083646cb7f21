"""Processes one by one, for setups that `Stack` (one of each, wired together) does not fit:
several simulator replicas, several kvgate processes and Envoys side by side, a plain Envoy
or one in front of the no-op ext_proc server (benchmark arms, pools of replicas).

A `Rig` hands out distinct free loopback ports, starts each process as a handle that knows
its ports, URLs and readiness wait, and stops them all together (Envoys first, simulators
last). The caller wires them: an Envoy is given the ext_proc ports and backend ports it
routes to.

    with Rig(work_dir) as rig:
        sim = rig.sim("r0", SimOptions(ttft_ms=2))
        kv = rig.kvgate("kvgate", {"store": "memory", "tenants": [...], ...})
        envoy = rig.envoy("envoy", extproc=[kv.grpc_port], backends={"vllm-local": sim.port})
        rig.wait_ready()
        httpx.post(f"{envoy.base_url}/v1/chat/completions", ...)

Process logs go to `<work_dir>/logs/<name>.log`; configs to `<work_dir>/<name>.yaml`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import yaml

from testbed import envoy_variants
from testbed.harness import (
    DEFAULT_MODEL_NAME,
    ENVOY_CONFIG,
    ManagedProcess,
    MetricSamples,
    ProcessError,
    SimOptions,
    envoy_argv,
    extproc_health,
    free_port,
    kvgate_argv,
    render_envoy_config,
    sim_argv,
)
from testbed.noop_extproc import noop_extproc_argv


class Ports:
    """Free TCP ports on 127.0.0.1, each handed out once (`free_port()` alone may return a
    port it returned before, when nothing has bound it yet)."""

    def __init__(self) -> None:
        self.taken: set[int] = set()

    def new(self) -> int:
        port = free_port()
        while port in self.taken:
            port = free_port()
        self.taken.add(port)
        return port


def _get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return bytes(resp.read())


def _post(url: str, timeout: float) -> None:
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        resp.read()


class _Handle:
    """A started-or-not `ManagedProcess` with what its callers need of it."""

    process: ManagedProcess

    @property
    def pid(self) -> int:
        if self.process.pid is None:
            raise ProcessError(f"{self.process.name}: never started")
        return self.process.pid

    def start(self) -> Self:
        self.process.start()
        return self


class SimProcess(_Handle):
    """One vLLM simulator (`vllm-sim`) serving one model on its own port."""

    def __init__(
        self,
        name: str,
        port: int,
        options: SimOptions,
        *,
        log_dir: Path,
        model_dir: Path,
        served_model_name: str = DEFAULT_MODEL_NAME,
    ) -> None:
        self.name = name
        self.port = port
        self.options = options
        self.model_dir = model_dir
        self.served_model_name = served_model_name
        self.process = ManagedProcess(f"sim-{name}", self._argv(), log_dir=log_dir)

    def _argv(self) -> list[str]:
        return sim_argv(
            self.port,
            self.options,
            model_dir=self.model_dir,
            served_model_name=self.served_model_name,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        """IP:PORT, as a pool's endpoint list names it."""
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        self.process.wait_http(f"{self.url}/health", timeout)

    def restart(self, options: SimOptions | None = None, timeout: float = 120.0) -> None:
        """Stop it and start it again on the same port (with new options, when given): its
        clients keep pointing at it."""
        self.process.stop()
        if options is not None:
            self.options = options
            self.process.argv = self._argv()
        self.process.start()
        self.wait_ready(timeout)

    def stats(self, timeout: float = 15.0) -> dict[str, Any]:
        """`GET /sim/stats`: counters, peaks, what runs and waits, the requests served."""
        stats: dict[str, Any] = json.loads(_get(f"{self.url}/sim/stats", timeout))
        return stats

    def requests(self, timeout: float = 15.0) -> dict[str, Any]:
        """`GET /sim/requests`: the request history (arrival time and headers of each)."""
        history: dict[str, Any] = json.loads(_get(f"{self.url}/sim/requests", timeout))
        return history

    def reset(self) -> None:
        """`POST /sim/reset`: counters, peaks, served records and prefix cache emptied."""
        _post(f"{self.url}/sim/reset", 5.0)

    def wait_idle(self, timeout: float = 30.0, interval: float = 0.1) -> bool:
        """Until nothing runs or waits in it (a previous load's stragglers are done);
        False when that did not happen within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                stats = self.stats(timeout=5.0)
            except OSError:
                pass
            else:
                if not stats.get("running") and not stats.get("waiting"):
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(interval)


class KvgateProcess(_Handle):
    """One `kvgate serve` process with its own gRPC, HTTP and admin ports and config file.
    The config given to `write_config` / `start` / `reload` is kvgate's without the listen
    addresses: the `server` section gets them."""

    def __init__(
        self,
        name: str,
        ports: Ports,
        *,
        config_path: Path,
        log_dir: Path,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.grpc_port = ports.new()
        self.http_port = ports.new()
        self.admin_port = ports.new()
        self.config_path = config_path
        self.process = ManagedProcess(name, kvgate_argv(config_path, *extra_args), log_dir=log_dir)

    @property
    def listen(self) -> dict[str, str]:
        return {
            "grpc_listen": f"127.0.0.1:{self.grpc_port}",
            "http_listen": f"127.0.0.1:{self.http_port}",
            "admin_listen": f"127.0.0.1:{self.admin_port}",
        }

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.http_url}/metrics"

    def write_config(self, config: Mapping[str, Any]) -> None:
        server = {**self.listen, **dict(config.get("server") or {})}
        full = {"server": server, **{k: v for k, v in config.items() if k != "server"}}
        self.config_path.write_text(yaml.safe_dump(full, sort_keys=False), encoding="utf-8")

    def start(self, config: Mapping[str, Any] | None = None) -> Self:
        if config is not None:
            self.write_config(config)
        return super().start()

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until `/readyz` answers 200 (tokenizers loaded, admitting)."""
        self.process.wait_http(f"{self.http_url}/readyz", timeout)

    def restart(self, timeout: float = 120.0) -> None:
        """SIGTERM (SIGKILL after 15 s), start again with the config file as it is now."""
        self.process.restart(timeout=15)
        self.wait_ready(timeout)

    def metrics(self) -> MetricSamples:
        return MetricSamples(_get(self.metrics_url, 5.0).decode())

    def reload(self, config: Mapping[str, Any], timeout: float = 20.0) -> bool:
        """Write `config` and hot-reload it (SIGHUP); True once kvgate counts a successful
        reload, False when it counts a failed one or none within `timeout`."""
        before = self.metrics()
        ok0 = before.value("kvgate_config_reloads_total", result="success")
        bad0 = before.value("kvgate_config_reloads_total", result="failure")
        self.write_config(config)
        os.kill(self.pid, signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.metrics()
            if now.value("kvgate_config_reloads_total", result="failure") > bad0:
                return False
            if now.value("kvgate_config_reloads_total", result="success") > ok0:
                # The file watcher (every 2 s) may reload the same file once more: harmless.
                return True
        return False


class NoopExtprocProcess(_Handle):
    """The no-op ext_proc server (`testbed.noop_extproc`) on its own gRPC port."""

    def __init__(self, name: str, ports: Ports, *, log_dir: Path) -> None:
        self.name = name
        self.grpc_port = ports.new()
        self.process = ManagedProcess(
            name, noop_extproc_argv(f"127.0.0.1:{self.grpc_port}"), log_dir=log_dir
        )

    def wait_ready(self, timeout: float = 30.0) -> None:
        self.process.wait_tcp(self.grpc_port, timeout)


class EnvoyProcess(_Handle):
    """One Envoy on its own listener and admin ports, with a bootstrap rendered from
    `template` (`render_envoy_config`, then the variants of `testbed.envoy_variants`):

    - `extproc`: the ext_proc cluster's endpoints (ports); empty: plain Envoy, no ext_proc;
    - `backends`: backend cluster name -> simulator port; `pools`: ORIGINAL_DST clusters;
    - `round_robin`: cluster name -> ports, made a STATIC ROUND_ROBIN cluster of them;
    - `route_all_to`: one catch-all route to that cluster instead of the routing guard (for
      an Envoy whose ext_proc, if any, never sets kvgate's routing header).

    `quick_shutdown` and `access_log_flush_ms` go to `envoy_argv`.
    """

    def __init__(
        self,
        name: str,
        ports: Ports,
        *,
        work_dir: Path,
        log_dir: Path,
        backends: Mapping[str, int],
        extproc: Sequence[int] = (),
        template: Path = ENVOY_CONFIG,
        pools: Sequence[str] = (),
        round_robin: Mapping[str, Sequence[int]] | None = None,
        route_all_to: str | None = None,
        quick_shutdown: bool = True,
        access_log_flush_ms: int | None = 100,
        log_level: str = "warning",
    ) -> None:
        self.name = name
        self.listen_port = ports.new()
        self.admin_port = ports.new()
        self.extproc_ports = tuple(extproc)
        self.config_path = work_dir / f"{name}.yaml"
        render_envoy_config(
            template,
            self.config_path,
            listen_port=self.listen_port,
            admin_port=self.admin_port,
            extproc_port=self.extproc_ports[0] if self.extproc_ports else ports.new(),
            backends=backends,
            pools=pools,
        )
        if not self.extproc_ports:
            envoy_variants.strip_extproc(self.config_path)
        elif len(self.extproc_ports) > 1:
            envoy_variants.add_extproc_endpoints(self.config_path, self.extproc_ports[1:])
        if round_robin:
            envoy_variants.round_robin_clusters(self.config_path, round_robin)
        if route_all_to is not None:
            envoy_variants.route_all_to(self.config_path, route_all_to)
        argv = envoy_argv(
            self.config_path,
            log_level=log_level,
            quick_shutdown=quick_shutdown,
            access_log_flush_ms=access_log_flush_ms,
        )
        self.process = ManagedProcess(name, argv, log_dir=log_dir)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Admin `/ready`, then (with ext_proc) every ext_proc endpoint healthy: before that,
        its first requests would fail open or closed."""
        self.process.wait_http(f"{self.admin_url}/ready", timeout)
        if self.extproc_ports:
            self.wait_extproc_healthy()

    def wait_extproc_healthy(self, timeout: float = 30.0) -> None:
        wanted = [f"127.0.0.1:{port}" for port in self.extproc_ports]
        deadline = time.monotonic() + timeout
        flags: dict[str, str] = {}
        while True:
            try:
                flags = extproc_health(self.admin_url)
            except OSError:
                flags = {}
            if all(flags.get(endpoint) == "healthy" for endpoint in wanted):
                return
            if time.monotonic() > deadline:
                raise ProcessError(
                    f"{self.name}: ext_proc endpoints not healthy after {timeout:.0f}s: "
                    f"{flags}\n{self.process.describe()}"
                )
            time.sleep(0.1)


class Rig:
    """Processes started one by one on distinct free ports and stopped together."""

    def __init__(self, work_dir: Path, *, model_dir: Path | None = None) -> None:
        self.work_dir = Path(work_dir)
        self.log_dir = self.work_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if model_dir is None:
            from testbed.demo_model import demo_model_dir

            model_dir = demo_model_dir()
        self.model_dir = model_dir
        self.ports = Ports()
        self.sims: dict[str, SimProcess] = {}
        self.kvgates: dict[str, KvgateProcess] = {}
        self.extprocs: dict[str, NoopExtprocProcess] = {}
        self.envoys: dict[str, EnvoyProcess] = {}
        self.others: dict[str, ManagedProcess] = {}

    # starting ---------------------------------------------------------------
    def sim(
        self,
        name: str,
        options: SimOptions | None = None,
        *,
        served_model_name: str = DEFAULT_MODEL_NAME,
    ) -> SimProcess:
        """Start a simulator of the rig's model (log `sim-<name>.log`)."""
        sim = SimProcess(
            name,
            self.ports.new(),
            options or SimOptions(),
            log_dir=self.log_dir,
            model_dir=self.model_dir,
            served_model_name=served_model_name,
        )
        self.sims[name] = sim.start()
        return sim

    def kvgate(
        self, name: str, config: Mapping[str, Any], *, extra_args: Sequence[str] = ()
    ) -> KvgateProcess:
        """Start `kvgate serve` with `config` (written to `<work_dir>/<name>.yaml`)."""
        kvgate = KvgateProcess(
            name,
            self.ports,
            config_path=self.work_dir / f"{name}.yaml",
            log_dir=self.log_dir,
            extra_args=extra_args,
        )
        self.kvgates[name] = kvgate.start(config)
        return kvgate

    def noop_extproc(self, name: str = "noop-extproc") -> NoopExtprocProcess:
        """Start the no-op ext_proc server (the protocol's cost with nothing decided)."""
        extproc = NoopExtprocProcess(name, self.ports, log_dir=self.log_dir)
        self.extprocs[name] = extproc.start()
        return extproc

    def envoy(self, name: str, **options: Any) -> EnvoyProcess:
        """Start an Envoy (`EnvoyProcess`'s options: backends, extproc, template, ...)."""
        envoy = EnvoyProcess(
            name, self.ports, work_dir=self.work_dir, log_dir=self.log_dir, **options
        )
        self.envoys[name] = envoy.start()
        return envoy

    def process(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> ManagedProcess:
        """Start any other process (it stops with the rig, before the simulators)."""
        proc = ManagedProcess(name, argv, log_dir=self.log_dir, env=env, cwd=cwd)
        self.others[name] = proc.start()
        return proc

    # readiness --------------------------------------------------------------
    def wait_ready(self, timeout: float = 120.0) -> None:
        """Every simulator, ext_proc server and kvgate ready, then every Envoy (with its
        ext_proc endpoints healthy), each within `timeout` s. Other processes: the caller's
        to wait for."""
        for sim in self.sims.values():
            sim.wait_ready(timeout)
        for extproc in self.extprocs.values():
            extproc.wait_ready(timeout)
        for kvgate in self.kvgates.values():
            kvgate.wait_ready(timeout)
        for envoy in self.envoys.values():
            envoy.wait_ready(timeout)

    # state ------------------------------------------------------------------
    def managed(self) -> Iterator[ManagedProcess]:
        """Every process, in stopping order: Envoys, kvgates, ext_proc servers, others,
        simulators."""
        yield from (e.process for e in self.envoys.values())
        yield from (k.process for k in self.kvgates.values())
        yield from (x.process for x in self.extprocs.values())
        yield from self.others.values()
        yield from (s.process for s in self.sims.values())

    def pids(self) -> list[int]:
        """The pids of the processes running now."""
        return [p.pid for p in self.managed() if p.pid is not None and p.running]

    def dump_logs(self, lines: int = 80) -> str:
        parts = [f"==== rig work dir {self.work_dir}"]
        parts += [p.describe(lines) for p in self.managed()]
        return "\n".join(parts) + "\n"

    # stopping ---------------------------------------------------------------
    def stop(self) -> None:
        """Envoys first (no new traffic), then kvgate (settles), the rest, the simulators."""
        for proc in self.managed():
            try:
                proc.stop(timeout=15.0)
            except Exception as exc:  # keep stopping the others
                sys.stderr.write(f"stopping {proc.name}: {exc!r}\n")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
