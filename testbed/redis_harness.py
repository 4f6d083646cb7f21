"""Redis for tests that must break it, and a stack of two kvgate replicas sharing one Redis.

`RedisServer` runs a private `redis-server` on a free port (kill, pause and restart it at
will). `RedisStack` is the e2e `Stack` (simulator + kvgate + real Envoy) with a second kvgate
process: both replicas use the same Redis, and Envoy's ext_proc cluster lists both, so Envoy
spreads the gRPC streams (one per HTTP request) over them round robin.
"""

from __future__ import annotations

import copy
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import redis
import yaml

from testbed.envoy_variants import add_extproc_endpoints
from testbed.harness import (
    ManagedProcess,
    MetricSamples,
    ProcessError,
    Stack,
    extproc_health,
    free_port,
    kvgate_argv,
)

REDIS_SERVER = "/usr/bin/redis-server"


class RedisServer:
    """A private redis-server. `persistent=True`: AOF with fsync on every write, so a
    SIGKILL loses nothing acknowledged; otherwise nothing survives a restart."""

    def __init__(self, work_dir: Path, *, persistent: bool = False) -> None:
        self.port = free_port()
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.work_dir),
            "--save",
            "",
            "--protected-mode",
            "no",
        ]
        if persistent:
            argv += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            argv += ["--appendonly", "no"]
        self.process = ManagedProcess(f"redis-{self.port}", argv, log_dir=self.work_dir)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)

    def start(self, timeout: float = 15.0) -> Self:
        self.process.start()
        self.process.wait_tcp(self.port, timeout)
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while True:  # after a restart with AOF, Redis answers LOADING for a moment
                try:
                    if client.ping():
                        return self
                except redis.exceptions.RedisError:
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: as far as its clients can tell, the server vanished."""
        self.process.kill()

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections stay open, nothing answers)."""
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def restart(self) -> Self:
        self.kill()
        return self.start()

    def stop(self) -> None:
        if self.process.running and self.process.pid is not None:
            os.kill(self.process.pid, signal.SIGCONT)  # a paused server cannot exit
        self.process.stop(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisSentinel:
    """One redis-sentinel (quorum 1) watching `master` under the name `name`."""

    def __init__(self, work_dir: Path, master: RedisServer, name: str = "kvgate-master") -> None:
        self.port = free_port()
        self.name = name
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.work_dir / "sentinel.conf"  # sentinel rewrites its own config file
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.work_dir}\n"
            f"sentinel monitor {name} 127.0.0.1 {master.port} 1\n",
            encoding="utf-8",
        )
        self.process = ManagedProcess(
            f"sentinel-{self.port}",
            [REDIS_SERVER, str(config), "--sentinel"],
            log_dir=self.work_dir,
        )

    def start(self, timeout: float = 15.0) -> Self:
        self.process.start()
        self.process.wait_tcp(self.port, timeout)
        return self

    def stop(self) -> None:
        self.process.stop(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cluster_port() -> int:
    """A free port P <= 55535 whose cluster bus port P + 10000 is free too."""
    for _ in range(200):
        port = random.randint(20_000, 55_000)
        try:
            for candidate in (port, port + 10_000):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise OSError("no free port pair for a Redis Cluster node")


class RedisClusterNodes:
    """A real Redis Cluster on free ports: `masters` empty nodes joined with
    `redis-cli --cluster create` (16384 slots split between them, no replicas)."""

    def __init__(self, work_dir: Path, masters: int = 3) -> None:
        self.ports = [_cluster_port() for _ in range(masters)]
        self.work_dir = Path(work_dir)
        self.nodes: list[ManagedProcess] = []
        for port in self.ports:
            node_dir = self.work_dir / str(port)
            node_dir.mkdir(parents=True, exist_ok=True)
            argv = [
                REDIS_SERVER,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(node_dir),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--save",
                "",
                "--appendonly",
                "no",
            ]
            self.nodes.append(ManagedProcess(f"redis-cluster-{port}", argv, log_dir=node_dir))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self, timeout: float = 30.0) -> Self:
        for node, port in zip(self.nodes, self.ports, strict=True):
            node.start()
            node.wait_tcp(port, timeout)
        subprocess.run(
            [
                str(Path(REDIS_SERVER).with_name("redis-cli")),
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in self.ports),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        deadline = time.monotonic() + timeout
        for port in self.ports:
            with redis.Redis(port=port, socket_timeout=2) as client:
                while client.cluster("INFO").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise ProcessError(f"redis cluster not ok after {timeout:.0f}s")
                    time.sleep(0.05)
        return self

    def stop(self) -> None:
        for node in self.nodes:
            node.stop(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisStack(Stack):
    """Two kvgate replicas sharing one private Redis, behind one Envoy.

    `redis_config` is merged into kvgate's `redis:` section (both replicas), `redis_config2`
    on top of it for replica 2 only. Replica 1 is the base stack's `kvgate` (ports `grpc_port`,
    `kvgate_http_port`); replica 2 is `kvgate2`.
    """

    def __init__(
        self,
        *,
        redis_config: Mapping[str, Any] | None = None,
        redis_config2: Mapping[str, Any] | None = None,
        persistent_redis: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.redis = RedisServer(self.work_dir / "redis", persistent=persistent_redis)
        self.redis_config = {
            "key_prefix": f"e2e-{uuid.uuid4().hex[:10]}",
            "timeout_s": 0.3,
            **dict(redis_config or {}),
        }
        self.redis_config2 = dict(redis_config2 or {})
        self.grpc_port2 = free_port()
        self.kvgate_http_port2 = free_port()
        self.kvgate2_config_path = self.work_dir / "kvgate2.yaml"
        self.kvgate2: ManagedProcess | None = None

    # config -----------------------------------------------------------------
    def kvgate_config(self) -> dict[str, Any]:
        config = super().kvgate_config()
        config["store"] = self.redis.url
        config["redis"] = {**config.get("redis", {}), **self.redis_config}
        return config

    def kvgate2_config(self) -> dict[str, Any]:
        config = copy.deepcopy(self.kvgate_config())
        config["server"]["grpc_listen"] = f"127.0.0.1:{self.grpc_port2}"
        config["server"]["http_listen"] = f"127.0.0.1:{self.kvgate_http_port2}"
        config["redis"] = {**config["redis"], **self.redis_config2}
        if "admin_listen" in config["server"]:
            config["server"]["admin_listen"] = "127.0.0.1:0"  # any free port
        return config

    def write_configs(self) -> None:
        super().write_configs()
        self.kvgate2_config_path.write_text(
            yaml.safe_dump(self.kvgate2_config(), sort_keys=False), encoding="utf-8"
        )
        # The second replica joins the ext_proc cluster.
        add_extproc_endpoints(self.envoy_config_path, [self.grpc_port2])

    # processes --------------------------------------------------------------
    def _kvgate2_argv(self) -> list[str]:
        return kvgate_argv(self.kvgate2_config_path)

    def processes(self) -> list[ManagedProcess]:
        procs = super().processes()
        procs += [p for p in (self.redis.process, self.kvgate2) if p is not None]
        return procs

    def start(self) -> Self:
        if self._started:
            return self
        try:
            self.redis.start()
            super().start()
            self.kvgate2 = ManagedProcess(
                "kvgate2", self._kvgate2_argv(), log_dir=self.log_dir
            ).start()
            self.wait_kvgate2_ready()
        except BaseException:
            sys.stderr.write(self.dump_logs())
            self.keep_work_dir = True
            self.stop()
            raise
        return self

    def wait_kvgate2_ready(self, timeout: float | None = None) -> None:
        assert self.kvgate2 is not None
        url = f"http://127.0.0.1:{self.kvgate_http_port2}"
        self.kvgate2.wait_http(f"{url}/readyz", timeout or self.start_timeout)
        self.wait_endpoint_healthy(self.grpc_port2)

    def wait_endpoint_healthy(self, port: int, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while self.endpoint_health(port) != "healthy":
            if time.monotonic() > deadline:
                raise ProcessError(
                    f"Envoy does not see kvgate :{port} healthy after {timeout:.0f}s\n"
                    + self.dump_logs()
                )
            time.sleep(0.1)

    def endpoint_health(self, port: int) -> str:
        return extproc_health(self.envoy_admin_url).get(f"127.0.0.1:{port}", "unknown")

    def kill_kvgate2(self) -> None:
        assert self.kvgate2 is not None
        self.kvgate2.kill()

    def replica_metrics(self, replica: int) -> MetricSamples:
        """One scrape of replica 1 or 2."""
        port = self.kvgate_http_port if replica == 1 else self.kvgate_http_port2
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return MetricSamples(resp.read().decode())

    def ledger(self, tenant: str) -> dict[str, int]:
        """The tenant's all-time ledger, read from Redis (what every replica sees)."""
        tag = "{" + str(self.redis_config["key_prefix"]) + "}"
        totals = {"requests": 0, "prompt_tokens": 0, "output_tokens": 0}
        names = {"req": "requests", "pt": "prompt_tokens", "ot": "output_tokens"}
        with self.redis.client() as client:
            for field, value in client.hgetall(f"{tag}:tot").items():
                name, _, kind = field.decode().rpartition("|")
                if name.split("|")[0] == tenant and kind in names:
                    totals[names[kind]] += int(value)
        return totals

    def stop(self) -> None:
        if self.kvgate2 is not None:
            try:
                self.kvgate2.stop(timeout=10.0)
            except Exception as exc:
                sys.stderr.write(f"stopping kvgate2: {exc!r}\n")
        # Redis outlives the replicas (they settle into it on shutdown), then the work dir goes.
        keep = self.keep_work_dir
        self.keep_work_dir = True
        super().stop()
        self.redis.stop()
        self.keep_work_dir = keep
        if self._own_work_dir and not keep:
            shutil.rmtree(self.work_dir, ignore_errors=True)
