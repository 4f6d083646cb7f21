"""Closed-loop peak throughput with wrk (Debian package `wrk`), much lighter than Python.

One wrk thread keeps `connections` requests in flight for `duration_s`; a generated Lua
script sends the same body template as the Python generator, with a unique request id in
place of the marker, and reports totals from `done()`. Only 2xx responses count as
throughput. wrk's own latency numbers are closed-loop (they hide queueing) and are not used.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.loadgen import MARKER

_LUA = """
local f = assert(io.open("{body_path}", "rb"))
local body = f:read("*a")
f:close()
local s, e = string.find(body, "{marker}", 1, true)
local head = string.sub(body, 1, s - 1)
local tail = string.sub(body, e + 1)
local width = {width}
local counter = 0
wrk.method = "POST"
wrk.headers = {headers}
request = function()
  counter = counter + 1
  local id = "{prefix}" .. string.format("%x", counter)
  id = string.rep("0", width - #id) .. id
  return wrk.format("POST", "{path}", nil, head .. id .. tail)
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "KVBENCH requests=%d duration_us=%d status=%d connect=%d read=%d write=%d timeout=%d\\n",
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout))
end
"""


@dataclass
class WrkResult:
    requests: int
    duration_s: float
    non_2xx: int
    socket_errors: int

    @property
    def ok_rps(self) -> float:
        """2xx responses per second (wrk counts socket errors apart from responses)."""
        ok = self.requests - self.non_2xx
        return max(0, ok) / self.duration_s if self.duration_s else 0.0


def available() -> bool:
    return shutil.which("wrk") is not None


def run_wrk(
    url: str,
    body_path: Path,
    headers: dict[str, str],
    *,
    connections: int,
    duration_s: float,
    script_path: Path,
    id_prefix: str = "",
    timeout_s: float = 10.0,
) -> WrkResult:
    base, _, path = url.partition("://")[2].partition("/")
    lua_headers = "{" + ", ".join(f'["{k}"] = "{v}"' for k, v in headers.items()) + "}"
    script_path.write_text(
        _LUA.format(
            body_path=body_path,
            marker=MARKER.decode(),
            width=len(MARKER),
            headers=lua_headers,
            prefix=id_prefix,
            path="/" + path,
        ),
        encoding="utf-8",
    )
    argv = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(duration_s))}s",
        f"--timeout={max(1, round(timeout_s))}s",
        "-s",
        str(script_path),
        f"http://{base}",
    ]
    out = subprocess.run(
        argv, capture_output=True, text=True, timeout=duration_s + timeout_s + 30, check=False
    )
    match = re.search(
        r"KVBENCH requests=(\d+) duration_us=(\d+) status=(\d+) connect=(\d+) read=(\d+) "
        r"write=(\d+) timeout=(\d+)",
        out.stdout,
    )
    if match is None:
        raise RuntimeError(
            f"wrk gave no summary (rc {out.returncode}):\n{out.stdout}\n{out.stderr}"
        )
    req, dur, status, conn, read, write, tmo = (int(g) for g in match.groups())
    return WrkResult(
        requests=req,
        duration_s=dur / 1e6,
        non_2xx=status,
        socket_errors=conn + read + write + tmo,
    )
