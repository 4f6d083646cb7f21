"""`kvgate usage`, `kvgate backends`, `kvgate reload`: a small client of the admin API.

The operator token (when kvgate has one) comes from `--token-file` or the environment variable
KVGATE_ADMIN_TOKEN, never from the command line (it would show in `ps` and shell history)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from kvgate.admin.v1 import admin_pb2, admin_pb2_grpc
from kvgate.config import ConfigError
from kvgate.config.secrets import read_secret_file

TOKEN_ENV = "KVGATE_ADMIN_TOKEN"


def operator_token(token_file: str | None) -> str | None:
    """The token to send: `--token-file` first, else $KVGATE_ADMIN_TOKEN, else none."""
    if token_file is not None:
        return read_secret_file(token_file, "--token-file")
    return os.environ.get(TOKEN_ENV) or None


async def _call(
    address: str, method: str, request: Any, timeout_s: float, token: str | None = None
) -> Any:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
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
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2

    def call(method: str, request: Any) -> Any:
        return asyncio.run(_call(args.admin, method, request, args.timeout, token))

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
                print(
                    f"{b.name:<20} KV {b.kv_tokens_in_flight:>9}/{b.kv_budget_tokens:<9} "
                    f"requests {b.requests_in_flight}/{b.max_concurrent_requests}"
                )
        else:
            reply = call("Reload", admin_pb2.ReloadRequest())
            if not reply.applied:
                print(f"reload refused: {reply.error}", file=sys.stderr)
                return 1
            print(f"reloaded: generation {reply.generation}")
    except grpc.aio.AioRpcError as exc:
        print(f"{args.admin}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    return 0


def add_admin_commands(subparsers: Any) -> None:
    for name, help_text in (
        ("usage", "tenant usage and remaining budget"),
        ("backends", "backend KV budget and in-flight work"),
        ("reload", "re-read the config file"),
    ):
        command = subparsers.add_parser(name, help=help_text)
        command.add_argument("--admin", default="127.0.0.1:50052", help="admin API address")
        command.add_argument("--timeout", type=float, default=5.0)
        command.add_argument(
            "--token-file",
            help=f"file holding the operator token (default: ${TOKEN_ENV}, else no token)",
        )
        if name != "reload":
            command.add_argument("--json", action="store_true")
        if name == "usage":
            command.add_argument("--tenant", help="one tenant (default: all)")
        command.set_defaults(func=run_admin_command, admin_command=name)
