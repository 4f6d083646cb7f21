"""`kvgate usage`, `kvgate backends`, `kvgate reload`, `kvgate keys ...`: a small client of
the admin API.

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
import re
import sys
import time
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
    for level in usage.levels:
        name = f"  {level.level} {level.name}"
        for label, spent in (("today", level.today), ("this month", level.this_month)):
            budget = (
                f" of ${spent.budget_usd} (${spent.remaining_usd} left)" if spent.budget_usd else ""
            )
            print(f"{name:<16} {label:<11} {spent.period:<10} cost ${spent.cost_usd}{budget}")


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
        if args.admin_command == "keys":
            return _run_keys(args, call)
        if args.admin_command == "usage":
            if args.tenant:
                request: Any = admin_pb2.GetTenantUsageRequest(
                    tenant=args.tenant,
                    teams=args.team or (),
                    users=args.user or (),
                    key_ids=args.key or (),
                )
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


def _add_connection_arguments(command: argparse.ArgumentParser) -> None:
    """--admin, --timeout, --token-file and the TLS flags: every admin command's."""
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


def add_admin_commands(subparsers: Any) -> None:
    for name, help_text in (
        ("usage", "tenant usage and remaining budget"),
        ("backends", "backend KV budget and in-flight work"),
        ("reload", "re-read the config file"),
        ("reconcile", "tokens booked per engine against the engines' own counters"),
    ):
        command = subparsers.add_parser(name, help=help_text)
        _add_connection_arguments(command)
        if name != "reload":
            command.add_argument("--json", action="store_true")
        if name == "usage":
            command.add_argument("--tenant", help="one tenant (default: all)")
            for level, what in (("team", "a team"), ("user", "a user"), ("key", "a key id")):
                command.add_argument(
                    f"--{level}",
                    action="append",
                    help=f"with --tenant: also {what}'s own spend (repeatable)",
                )
        command.set_defaults(func=run_admin_command, admin_command=name)
    _add_keys_command(subparsers)


# --------------------------------------------------------------------------- kvgate keys

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw]?)$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration_s(text: str) -> float:
    """ "90", "90s", "15m", "12h", "30d", "2w" -> seconds."""
    match = _DURATION.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 90s, 15m, 12h, 30d")
    return float(match[1]) * _SECONDS[match[2]]


def _label(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def _when(unix_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_s))


def _key_dict(key: admin_pb2.ApiKey) -> dict[str, Any]:
    return MessageToDict(key, preserving_proto_field_name=True)


def _print_key(key: admin_pb2.ApiKey) -> None:
    rows = [
        ("key_id", key.key_id),
        ("state", key.state),
        ("tenant", key.tenant),
        ("team", key.team if key.HasField("team") else "-"),
        ("user", key.user if key.HasField("user") else "-"),
        ("labels", ", ".join(f"{k}={v}" for k, v in sorted(key.labels.items())) or "-"),
        ("created", _when(key.created_at_unix_s)),
        ("expires", _when(key.expires_at_unix_s) if key.HasField("expires_at_unix_s") else "-"),
        ("revoked", _when(key.revoked_at_unix_s) if key.HasField("revoked_at_unix_s") else "-"),
        ("limits", key.limits_json or "-"),
    ]
    for name, value in rows:
        print(f"{name:<8} {value}")


def _print_key_table(keys: list[admin_pb2.ApiKey]) -> None:
    print(f"{'KEY ID':<21} {'STATE':<8} {'TENANT':<16} {'TEAM':<12} {'USER':<12} EXPIRES")
    for key in keys:
        expires = _when(key.expires_at_unix_s) if key.HasField("expires_at_unix_s") else "-"
        print(
            f"{key.key_id:<21} {key.state:<8} {key.tenant:<16} "
            f"{key.team if key.HasField('team') else '-':<12} "
            f"{key.user if key.HasField('user') else '-':<12} {expires}"
        )


def _created(reply: admin_pb2.CreatedKey, verb: str, as_json: bool) -> None:
    """The secret, shown this once: alone on stdout (one line a script can capture), or
    with the key in --json; what was done goes to stderr."""
    if as_json:
        print(json.dumps({"secret": reply.secret, "key": _key_dict(reply.key)}, indent=2))
    else:
        print(reply.secret)
    print(
        f"{verb} {reply.key.key_id} for tenant {reply.key.tenant}: the key above is shown "
        "only this once",
        file=sys.stderr,
    )


def _run_keys(args: argparse.Namespace, call: Callable[[str, Any], Any]) -> int:
    command = args.keys_command
    if command == "create":
        limits = args.limits or ""
        if args.models:
            try:
                level = json.loads(limits) if limits else {}
            except ValueError as exc:
                print(f"--limits: {exc}", file=sys.stderr)
                return 2
            if not isinstance(level, dict):
                print("--limits: a JSON object", file=sys.stderr)
                return 2
            level["models"] = [m for m in args.models.split(",") if m]
            limits = json.dumps(level)
        request = admin_pb2.CreateKeyRequest(
            tenant=args.tenant,
            team=args.team,
            user=args.user,
            labels=dict(args.label or ()),
            ttl_s=args.expires_in,
            expires_at_unix_s=args.expires_at,
            limits_json=limits,
        )
        _created(call("CreateKey", request), "created", args.json)
    elif command == "rotate":
        rotation = admin_pb2.RotateKeyRequest(key_id=args.key_id, grace_s=args.grace)
        _created(call("RotateKey", rotation), "rotated to", args.json)
    elif command in ("show", "revoke"):
        if command == "show":
            key = call("GetKey", admin_pb2.GetKeyRequest(key_id=args.key_id))
        else:
            key = call("RevokeKey", admin_pb2.RevokeKeyRequest(key_id=args.key_id))
        if args.json:
            print(json.dumps(_key_dict(key), indent=2))
        else:
            _print_key(key)
    else:
        keys: list[admin_pb2.ApiKey] = []
        token = args.page_token or ""
        while True:
            reply = call(
                "ListKeys",
                admin_pb2.ListKeysRequest(
                    tenant=args.tenant or "", page_size=args.page_size, page_token=token
                ),
            )
            keys += reply.keys
            token = reply.next_page_token
            if not token or not args.all:
                break
        if args.json:
            listing: dict[str, Any] = {"keys": [_key_dict(key) for key in keys]}
            if token:
                listing["next_page_token"] = token
            print(json.dumps(listing, indent=2))
        else:
            _print_key_table(keys)
            if token:
                print(f"(more: --page-token {token}, or --all)", file=sys.stderr)
    return 0


def _add_keys_command(subparsers: Any) -> None:
    keys = subparsers.add_parser("keys", help="API keys: create, list, show, revoke, rotate")
    actions = keys.add_subparsers(dest="keys_command", required=True)
    create = actions.add_parser("create", help="make a key; prints it once, on stdout")
    create.add_argument("--tenant", required=True)
    create.add_argument("--team")
    create.add_argument("--user")
    create.add_argument(
        "--label", action="append", type=_label, metavar="NAME=VALUE", help="repeatable"
    )
    expiry = create.add_mutually_exclusive_group()
    expiry.add_argument("--expires-in", type=duration_s, metavar="DURATION", help="e.g. 30d")
    expiry.add_argument("--expires-at", type=float, metavar="UNIX_SECONDS")
    create.add_argument(
        "--limits",
        metavar="JSON",
        help='the key\'s own limits, budget, models, e.g. \'{"limits": {"rpm": 60}}\'',
    )
    create.add_argument("--models", help="comma-separated models the key may use")
    listing = actions.add_parser("list", help="keys, a page at a time, ordered by key id")
    listing.add_argument("--tenant", help="one tenant (default: all)")
    listing.add_argument("--page-size", type=int, default=100)
    listing.add_argument("--page-token")
    listing.add_argument("--all", action="store_true", help="every page")
    rotate = actions.add_parser("rotate", help="a new key in its place; prints it once")
    rotate.add_argument("key_id")
    rotate.add_argument(
        "--grace",
        type=duration_s,
        default=0.0,
        metavar="DURATION",
        help="how long the old key keeps working (default: 0, revoked at once)",
    )
    for name, help_text in (("show", "one key"), ("revoke", "refuse a key from now on")):
        action = actions.add_parser(name, help=help_text)
        action.add_argument("key_id")
    for action in actions.choices.values():
        _add_connection_arguments(action)
        action.add_argument("--json", action="store_true")
    keys.set_defaults(func=run_admin_command, admin_command="keys")
