"""`kvgate drain` and `kvgate wait-drained`: preStop hooks for a gateway pod (Envoy + kvgate).

The order a gateway pod must stop in (docs/operations.md, "Rolling a gateway pod"):

1. Envoy drains its listeners (admin `POST /drain_listeners?graceful`). With
   `--drain-strategy immediate` every response from then on carries `connection: close`
   (HTTP/1) and HTTP/2 clients get a GOAWAY; for `--drain-time-s` the listeners still accept
   connections (clients that have not seen the endpoint removal yet are served, not refused),
   then Envoy stops listening. Requests in flight keep streaming.
2. Wait until Envoy has no request in flight (the sum of `http.<stat_prefix>.downstream_rq_active`
   over its HTTP connection managers, the admin interface's own excluded), or a timeout.
   kvgate keeps serving (and SERVING for Envoy's health check) all this time: it has not been
   signalled yet.
3. kvgate gets SIGTERM: nothing is left in flight, and whatever is (after a timeout) it settles
   within `server.shutdown_grace_s`.
4. Envoy gets SIGTERM (it exits at once, so it must come last).

`drain` does steps 1 and 2; `wait-drained` only step 2 (for a pod whose Envoy container
triggers its own drain). Both exit 0 whatever happens, with one line saying what happened:
a preStop hook that fails only delays the kill and leaves an event nobody reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ADMIN = "http://127.0.0.1:9901"
# Envoy's admin interface counts its own requests under this HTTP connection manager prefix.
ADMIN_STAT_PREFIX = "admin"
_STATS_FILTER = (
    r"^(http\..+\.downstream_(rq|cx)_active"
    r"|listener_manager\.(listener_stopped|total_listeners_active))$"
)
_HCM_STAT = re.compile(r"^http\.(?P<prefix>.+)\.downstream_(?P<kind>rq|cx)_active$")


@dataclass(frozen=True)
class EnvoyState:
    """What the drain waits on, from one read of Envoy's admin /stats."""

    requests: int  # downstream requests in flight, every HTTP connection manager but admin's
    connections: int  # downstream connections open (idle HTTP/1 keep-alives included)
    listeners_active: int
    listeners_stopped: int

    @property
    def listeners_closed(self) -> bool:
        """The drain period is over: Envoy accepts no new connection."""
        return self.listeners_stopped > 0 and self.listeners_stopped >= self.listeners_active


class EnvoyAdmin:
    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def _open(self, path: str, method: str = "GET") -> str:
        request = urllib.request.Request(
            f"{self.url}{path}", data=b"" if method == "POST" else None, method=method
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            return str(response.read().decode("utf-8", errors="replace"))

    def start_drain(self) -> None:
        # Not `inboundonly`: every listener of the gateway's Envoy is inbound (clients, the
        # kubelet's probes); Envoy reaches kvgate and vLLM through clusters, not listeners.
        self._open("/drain_listeners?graceful", method="POST")

    def drain_settings(self) -> dict[str, Any]:
        """Envoy's `--drain-time-s` / `--drain-strategy`, for the log line."""
        info = json.loads(self._open("/server_info"))
        options = info.get("command_line_options", {})
        return {
            "drain_time": options.get("drain_time"),
            "drain_strategy": options.get("drain_strategy"),
        }

    def state(self) -> EnvoyState:
        text = self._open("/stats?filter=" + urllib.parse.quote(_STATS_FILTER, safe=""))
        requests = connections = active = stopped = 0
        for line in text.splitlines():
            name, sep, value = line.partition(": ")
            if not sep or not value.strip().lstrip("-").isdigit():
                continue
            number = int(value)
            if name == "listener_manager.total_listeners_active":
                active = number
            elif name == "listener_manager.listener_stopped":
                stopped = number
            else:
                match = _HCM_STAT.match(name)
                if match is None or match["prefix"] == ADMIN_STAT_PREFIX:
                    continue
                if match["kind"] == "rq":
                    requests += number
                else:
                    connections += number
        return EnvoyState(requests, connections, active, stopped)


@dataclass
class DrainResult:
    outcome: str  # drained | timeout | envoy-gone
    elapsed_s: float
    state: EnvoyState | None
    detail: str = ""

    def line(self, command: str) -> str:
        state = self.state
        figures = (
            f"{state.requests} requests in flight, {state.connections} downstream connections open"
            f", listeners {'closed' if state.listeners_closed else 'open'}"
            if state is not None
            else "no stats"
        )
        verdict = {
            "drained": "Envoy drained",
            "timeout": "timed out: Envoy still busy",
            "envoy-gone": "Envoy admin unreachable (nothing left to drain)",
        }[self.outcome]
        detail = f"; {self.detail}" if self.detail else ""
        return f"kvgate {command}: {verdict} after {self.elapsed_s:.1f}s ({figures}){detail}"


def wait_drained(
    admin: EnvoyAdmin,
    *,
    timeout_s: float,
    poll_s: float,
    idle_wait_s: float,
    started: float | None = None,
) -> DrainResult:
    """Wait until Envoy's listeners are closed and no request is in flight.

    Then, for at most `idle_wait_s`, also for the idle downstream connections to go away: an
    HTTP/1 keep-alive connection that sent nothing during the drain can still carry one more
    request after the listeners closed (Envoy answers it with `connection: close`), and that
    request would be cut by the SIGTERM that follows. Clients usually close idle connections
    within a few seconds (httpx and the OpenAI SDKs after 5 s). A new request resets the wait.
    """
    started = time.monotonic() if started is None else started
    deadline = started + timeout_s
    quiet_since: float | None = None
    state: EnvoyState | None = None
    while True:
        try:
            state = admin.state()
        except (OSError, ValueError) as exc:
            return DrainResult("envoy-gone", time.monotonic() - started, state, repr(exc))
        now = time.monotonic()
        if state.listeners_closed and state.requests == 0:
            quiet_since = now if quiet_since is None else quiet_since
            if state.connections == 0 or now - quiet_since >= idle_wait_s:
                return DrainResult("drained", now - started, state)
        else:
            quiet_since = None
        if now >= deadline:
            return DrainResult("timeout", now - started, state)
        time.sleep(min(poll_s, max(0.0, deadline - now)))


def _report(line: str, log_file: str | None) -> None:
    print(line, file=sys.stderr, flush=True)
    if log_file:
        # e.g. /proc/1/fd/2: a preStop hook's own output reaches no log, the container's does.
        try:
            with open(log_file, "a", encoding="utf-8") as out:
                out.write(line + "\n")
        except OSError:
            pass


def _write_done(path: str | None, outcome: str) -> None:
    if not path:
        return
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(outcome + "\n", encoding="utf-8")
        os.replace(tmp, target)  # the other container sees a whole file or none
    except OSError as exc:
        print(f"kvgate drain: cannot write {path}: {exc}", file=sys.stderr, flush=True)


def _clear_done(path: str | None) -> None:
    if path:
        with contextlib.suppress(OSError):
            Path(path).unlink(missing_ok=True)


def run(args: argparse.Namespace) -> int:
    command = "drain" if args.trigger else "wait-drained"
    started = time.monotonic()
    admin = EnvoyAdmin(args.envoy_admin)
    _clear_done(args.done_file)
    detail = ""
    if args.trigger:
        try:
            admin.start_drain()
            settings = admin.drain_settings()
            detail = f"drain_time {settings['drain_time']}, strategy {settings['drain_strategy']}"
        except (OSError, ValueError) as exc:
            result = DrainResult("envoy-gone", time.monotonic() - started, None, repr(exc))
            _report(result.line(command), args.log_file)
            _write_done(args.done_file, result.outcome)
            return 0
        _report(
            f"kvgate drain: Envoy at {admin.url} is draining its listeners ({detail}); "
            f"waiting up to {args.timeout:g}s for requests in flight",
            args.log_file,
        )
    result = wait_drained(
        admin,
        timeout_s=args.timeout,
        poll_s=args.poll,
        idle_wait_s=args.idle_wait,
        started=started,
    )
    _report(result.line(command), args.log_file)
    _write_done(args.done_file, result.outcome)
    return 0


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_drain_commands(subparsers: Any) -> None:
    for name, trigger, summary in (
        (
            "drain",
            True,
            "preStop hook: drain Envoy's listeners, wait for its requests in flight",
        ),
        (
            "wait-drained",
            False,
            "preStop hook: wait (without draining) until Envoy has closed its listeners and "
            "has no request in flight",
        ),
    ):
        p: argparse.ArgumentParser = subparsers.add_parser(
            name,
            help=summary,
            description=f"{summary}. Always exits 0; one line on stderr says what happened.",
        )
        p.add_argument(
            "--envoy-admin",
            default=DEFAULT_ADMIN,
            help=f"Envoy's admin interface (default {DEFAULT_ADMIN})",
        )
        p.add_argument(
            "--timeout",
            type=_non_negative,
            default=270.0,
            help="give up after this many seconds (keep it under the pod's "
            "terminationGracePeriodSeconds minus kvgate's shutdown_grace_s; default 270)",
        )
        p.add_argument(
            "--poll", type=_non_negative, default=0.5, help="seconds between reads (default 0.5)"
        )
        p.add_argument(
            "--idle-wait",
            type=_non_negative,
            default=5.0,
            help="once no request is in flight, wait at most this long for idle keep-alive "
            "connections to close (default 5)",
        )
        p.add_argument(
            "--done-file",
            help="write the outcome (drained / timeout / envoy-gone) here when done, for "
            "another container's preStop hook to wait on",
        )
        p.add_argument(
            "--log-file",
            help="also append the result line here (e.g. /proc/1/fd/2, the container's log)",
        )
        p.set_defaults(func=run, trigger=trigger)
