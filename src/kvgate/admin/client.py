"""`kvgate usage`, `kvgate backends`, `kvgate reload`: a small client of the admin API.

The operator token (when kvgate has one) comes from `--token-file` or the environment variable
KVGATE_ADMIN_TOKEN, never from the command line (it would show in `ps` and shell history).
For an admin listener with TLS (`server.operator_tls`): `--tls-ca` (the CA that signed kvgate's
certificate), and for mutual TLS `--tls-cert` / `--tls-key` (a client certificate); each also
from the environment (KVGATE_ADMIN_TLS_CA, _CERT, _KEY). Any of them turns TLS on."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc
from google.protobuf.json_format import MessageToDict

from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from kvgate.config import ConfigError
from kvgate.config.secrets import read_secret_file

TOKEN_ENV = "KVGATE_ADMIN_TOKEN"
# Flag (argparse dest) -> environment variable; the flag wins.
TLS_ENV = {
    "tls_ca": "KVGATE_ADMIN_TLS_CA",
    "tls_cert": "KVGATE_ADMIN_TLS_CERT",
    "tls_key": "KVGATE_ADMIN_TLS_KEY",
    "tls_server_name": "KVGATE_ADMIN_TLS_SERVER_NAME",
}
# protoc's gRPC plugin annotates nothing it generates: the stub's constructor, typed.
_admin_stub = cast(Callable[[grpc.aio.Channel], admin_pb2_grpc.AdminStub], admin_pb2_grpc.AdminStub)


@dataclass(frozen=True)
class ClientTls:
    root_certificates: bytes | None  # None: the system's CAs
    private_key: bytes | None
    certificate_chain: bytes | None
    server_name: str | None  # the name to verify instead of the address's host

    def channel(self, address: str) -> grpc.aio.Channel:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )
        options = (
            [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else None
        )
        return grpc.aio.secure_channel(address, credentials, options=options)


def _tls_setting(args: argparse.Namespace, dest: str) -> tuple[str | None, str]:
    """(value, what to name in an error): the flag, else its environment variable."""
    flag = "--" + dest.replace("_", "-")
    value = getattr(args, dest, None)
    if value:
        return value, flag
    env = TLS_ENV[dest]
    return os.environ.get(env) or None, f"{flag} (${env})"


def _read_pem(path: str, source: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read {path}: {exc.strerror or exc}") from None


def client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The TLS settings to call with, or None (plain text) when none is given."""
    ca, ca_source = _tls_setting(args, "tls_ca")
    cert, cert_source = _tls_setting(args, "tls_cert")
    key, key_source = _tls_setting(args, "tls_key")
    server_name, _ = _tls_setting(args, "tls_server_name")
    if not (ca or cert or key):
        if server_name:
            raise ConfigError("--tls-server-name is for TLS: give --tls-ca too")
        return None
    if bool(cert) != bool(key):
        raise ConfigError(
            "--tls-cert and --tls-key go together: a client certificate and its private key"
        )
    return ClientTls(
        root_certificates=_read_pem(ca, ca_source) if ca else None,
        private_key=_read_pem(key, key_source) if key else None,
        certificate_chain=_read_pem(cert, cert_source) if cert else None,
        server_name=server_name,
    )


def operator_token(token_file: str | None) -> str | None:
    """The token to send: `--token-file` first, else $KVGATE_ADMIN_TOKEN, else none."""
    if token_file is not None:
        return read_secret_file(token_file, "--token-file")
    return os.environ.get(TOKEN_ENV) or None


async def _call(
    address: str,
    method: str,
    request: Any,
    timeout_s: float,
    token: str | None = None,
    tls: ClientTls | None = None,
) -> Any:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    channel_context = tls.channel(address) if tls else grpc.aio.insecure_channel(address)
    async with channel_context as channel:
        stub = _admin_stub(channel)
        return await getattr(stub, method)(request, timeout=timeout_s, metadata=metadata)


def _print_usage(usage: admin_pb2.TenantUsage) -> None:
    for label, period in (("today", usage.today), ("this month", usage.this_month)):
        budget = (
            f" of ${period.budget_usd} (${period.remaining_usd} left)" if period.budget_usd else ""
        )
        print(
            f"{usage.tenant:<16} {label:<11} {period.period:<10} requests {period.requests:>8}  "
            f"prompt {period.prompt_tokens:>10}  output {period.output_tokens:>10}  "
            f"cost ${period.cost_usd}{budget}"
        )


def run_admin_command(args: argparse.Namespace) -> int:
    try:
        token = operator_token(args.token_file)
        tls = client_tls(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2

    def call(method: str, request: Any) -> Any:
        return asyncio.run(_call(args.admin, method, request, args.timeout, token, tls))

    try:
        if args.admin_command == "usage":
            if args.tenant:
                request: Any = admin_pb2.GetTenantUsageRequest(tenant=args.tenant)
                reply = call("GetTenantUsage", request)
                tenants = [reply]
            else:
                request = admin_pb2.ListTenantUsageRequest()
                reply = call("ListTenantUsage", request)
                tenants = list(reply.tenants)
            if args.json:
                print(json.dumps([MessageToDict(t) for t in tenants], indent=2))
            else:
                for usage in tenants:
                    _print_usage(usage)
        elif args.admin_command == "backends":
            reply = call("ListBackends", admin_pb2.ListBackendsRequest())
            if args.json:
                print(json.dumps(MessageToDict(reply), indent=2))
            for b in reply.backends if not args.json else ():
                _print_backend(b)
        elif args.admin_command == "reconcile":
            reply = call("Reconcile", admin_pb2.ReconcileRequest())
            if args.json:
                print(json.dumps(MessageToDict(reply), indent=2))
            else:
                _print_reconciliation(reply)
        else:
            reply = call("Reload", admin_pb2.ReloadRequest())
            if not reply.applied:
                print(f"reload refused: {reply.error}", file=sys.stderr)
                return 1
            print(f"reloaded: generation {reply.generation}")
    except grpc.aio.AioRpcError as exc:
        print(f"{args.admin}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        refused = "connection refused" in (exc.details() or "").lower()
        if exc.code() == grpc.StatusCode.UNAVAILABLE and not refused:
            print(
                "  (a TLS handshake that failed looks like this: "
                + (
                    "check --tls-ca against kvgate's certificate, and --tls-cert / --tls-key "
                    "against server.operator_tls.client_ca_file)"
                    if tls
                    else "with server.operator_tls, give --tls-ca, and --tls-cert / --tls-key "
                    "for mutual TLS)"
                ),
                file=sys.stderr,
            )
        return 2
    return 0


def _print_backend(backend: admin_pb2.Backend) -> None:
    """One line per backend; a pool's total, then one line per endpoint."""
    if not backend.pool:
        print(
            f"{backend.name:<20} KV {backend.kv_tokens_in_flight:>9}/{backend.kv_budget_tokens:<9} "
            f"requests {backend.requests_in_flight}/{backend.max_concurrent_requests}"
        )
        return
    print(
        f"{backend.name:<20} KV {backend.kv_tokens_in_flight:>9}/{backend.kv_budget_tokens:<9} "
        f"requests {backend.requests_in_flight} "
        f"(pool of {len(backend.endpoints)}, {backend.max_concurrent_requests} per endpoint)"
    )
    for e in backend.endpoints:
        budget = str(e.kv_budget_tokens) if e.kv_budget_tokens else "?"
        scraped = (
            f"scraped {e.last_scrape_age_s:.1f}s ago"
            if e.HasField("last_scrape_age_s")
            else "never scraped"
        )
        waiting = (
            f", engine queue {e.engine_requests_waiting}"
            if e.HasField("engine_requests_waiting")
            else ""
        )
        print(
            f"  {e.address:<18} KV {e.kv_tokens_in_flight:>9}/{budget:<9} "
            f"requests {e.requests_in_flight:<4} {e.state:<9} {scraped}{waiting}"
        )


def _print_reconciliation(reply: admin_pb2.ReconcileResponse) -> None:
    """The table: per engine, what it counted against what kvgate booked."""
    print(
        f"{'engine (ledger)':<28} {'engine prompt':>14} {'booked prompt':>14} {'unbooked':>10} "
        f"{'engine output':>14} {'booked output':>14} {'unbooked':>10} {'restarts':>8} "
        f"{'watching':>9}"
    )
    for e in reply.engines:
        print(
            f"{e.ledger:<28} {e.engine_prompt_tokens:>14} {e.booked_prompt_tokens:>14} "
            f"{e.unbooked_prompt_tokens:>10} {e.engine_output_tokens:>14} "
            f"{e.booked_output_tokens:>14} {e.unbooked_output_tokens:>10} "
            f"{e.engine_restarts:>8} {e.watching_s:>8.0f}s"
        )
    if not reply.engines:
        print("(no engine is scraped: give backends `discovery.metrics_url`)")


def add_admin_commands(subparsers: Any) -> None:
    for name, help_text in (
        ("usage", "tenant usage and remaining budget"),
        ("backends", "backend KV budget and in-flight work"),
        ("reload", "re-read the config file"),
        ("reconcile", "tokens booked per engine against the engines' own counters"),
    ):
        command = subparsers.add_parser(name, help=help_text)
        command.add_argument("--admin", default="127.0.0.1:50052", help="admin API address")
        command.add_argument("--timeout", type=float, default=5.0)
        command.add_argument(
            "--token-file",
            help=f"file holding the operator token (default: ${TOKEN_ENV}, else no token)",
        )
        tls = command.add_argument_group(
            "TLS", "for an admin listener with server.operator_tls; any of these turns TLS on"
        )
        tls.add_argument(
            "--tls-ca",
            help="CA certificate(s) that signed kvgate's certificate, PEM "
            f"(default: ${TLS_ENV['tls_ca']}, else the system's CAs)",
        )
        tls.add_argument(
            "--tls-cert",
            help=f"client certificate for mutual TLS, PEM (default: ${TLS_ENV['tls_cert']})",
        )
        tls.add_argument(
            "--tls-key",
            help=f"its private key, PEM (default: ${TLS_ENV['tls_key']})",
        )
        tls.add_argument(
            "--tls-server-name",
            help="the name kvgate's certificate must carry, when it is not the --admin host "
            f"(e.g. through a port-forward; default: ${TLS_ENV['tls_server_name']})",
        )
        if name != "reload":
            command.add_argument("--json", action="store_true")
        if name == "usage":
            command.add_argument("--tenant", help="one tenant (default: all)")
        command.set_defaults(func=run_admin_command, admin_command=name)
