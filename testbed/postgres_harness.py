"""A private PostgreSQL server for tests that write to it and break it.

`PostgresServer` runs `initdb` in a temporary data directory and `postgres` on a free port of
127.0.0.1 (trust authentication, user `kvgate`), never the machine's own server. It can be
stopped and started again on the same data (a real outage), paused (SIGSTOP: connections
hang) and killed. As root, the server runs as the `postgres` user (it refuses root); the
binaries come from Debian's `postgresql` package (`make install` installs it when missing).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Self

from testbed.harness import ProcessError, free_port

DB_USER = "kvgate"
DB_NAME = "postgres"


def postgres_bindir() -> Path:
    """Where initdb and postgres are: Debian's versioned directory (newest), else PATH."""
    versioned = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda path: int(Path(path).parts[-3]) if Path(path).parts[-3].isdigit() else 0,
    )
    if versioned:
        return Path(versioned[-1]).parent
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    raise ProcessError(
        "PostgreSQL's server binaries (initdb, postgres) are missing: `make install` installs "
        "Debian's postgresql package"
    )


class PostgresServer:
    def __init__(self) -> None:
        self.bindir = postgres_bindir()
        # Its own directory under the system's temp dir: as root the `postgres` user must
        # reach it, which it cannot inside another test's private directory.
        self.work_dir = Path(tempfile.mkdtemp(prefix="kvgate-pg-"))
        self.data_dir = self.work_dir / "data"
        self.log_path = self.work_dir / "postgres.log"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        # postgres refuses to run as root: then it runs as the package's `postgres` user.
        self._user: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                raise ProcessError("running as root and there is no `postgres` user") from None
            self._user = "postgres"
            shutil.chown(self.work_dir, user="postgres")
            self.work_dir.chmod(0o700)

    @property
    def dsn(self) -> str:
        return f"postgresql://{DB_USER}@127.0.0.1:{self.port}/{DB_NAME}"

    def _run(self, argv: list[str]) -> None:
        result = subprocess.run(
            argv, capture_output=True, user=self._user, cwd=self.work_dir, check=False
        )
        if result.returncode != 0:
            raise ProcessError(
                f"{argv[0]} failed ({result.returncode}): {result.stderr.decode()[-2000:]}"
            )

    def start(self, timeout: float = 30.0) -> Self:
        if not (self.data_dir / "PG_VERSION").exists():
            self._run(
                [
                    str(self.bindir / "initdb"),
                    "-D",
                    str(self.data_dir),
                    "-U",
                    DB_USER,
                    "--auth=trust",
                    "--encoding=UTF8",
                    "--no-instructions",
                ]
            )
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child holds it
        try:
            self.proc = subprocess.Popen(
                [
                    str(self.bindir / "postgres"),
                    "-D",
                    str(self.data_dir),
                    "-p",
                    str(self.port),
                    "-c",
                    "listen_addresses=127.0.0.1",
                    "-c",
                    f"unix_socket_directories={self.work_dir}",
                    "-c",
                    "max_connections=50",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                user=self._user,
                cwd=self.work_dir,
                start_new_session=True,
            )
        finally:
            log.close()
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise ProcessError(f"postgres exited: {self.log_tail()}")
            ready = subprocess.run(
                [str(self.bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                capture_output=True,
                check=False,
            )
            if ready.returncode == 0:
                return
            time.sleep(0.1)
        raise ProcessError(f"postgres not ready after {timeout} s: {self.log_tail()}")

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-3000:]
        return ""

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """A fast shutdown (SIGINT): clients are disconnected, the data stays."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.resume()  # a paused server cannot exit
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None

    def _server_pids(self) -> list[int]:
        """The postmaster, then its children (each backend runs in a session of its own, so
        the postmaster's process group does not reach them)."""
        assert self.proc is not None
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == self.proc.pid:
                    children.append(int(stat.parent.name))
        return [self.proc.pid, *children]

    def pause(self) -> None:
        """SIGSTOP the postmaster (first: it forks no more) and every backend: connections
        stay open, nothing answers."""
        for pid in self._server_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in reversed(self._server_pids()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def create_database(self) -> str:
        """A new empty database; its URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self._run(
            [
                str(self.bindir / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                DB_USER,
                "-d",
                DB_NAME,
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                f"CREATE DATABASE {name}",
            ]
        )
        return self.dsn.rsplit("/", 1)[0] + f"/{name}"

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """One query on a fresh connection (tests read what kvgate wrote)."""
        import asyncio

        import asyncpg

        async def run() -> list[tuple[Any, ...]]:
            db = await asyncpg.connect(self.dsn, timeout=10)
            try:
                return [tuple(row) for row in await db.fetch(sql, *args)]
            finally:
                await db.close()

        return asyncio.run(run())

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
