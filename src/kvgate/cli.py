"""`kvgate` command line: serve, check-config, hash-key, drain, wait-drained, ..."""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path

from kvgate.admin.client import add_admin_commands
from kvgate.capacity.cli import add_kv_budget_command
from kvgate.config import ConfigError, hash_api_key, load_config
from kvgate.drain import add_drain_commands
from kvgate.usage_records.cli import add_usage_commands


def _serve(args: argparse.Namespace) -> int:
    from kvgate.app import run
    from kvgate.logs import configure_logging

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    configure_logging(args.log_level or config.server.log_level)
    try:
        run(config, Path(args.config))
    except ConfigError as exc:  # a secret the config names cannot be read
        print(exc, file=sys.stderr)
        return 2
    return 0


def _check_config(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.secrets:
        from kvgate.config.secrets import check_secrets

        problems = check_secrets(config)
        if problems:
            print("\n".join(problems), file=sys.stderr)
            return 2
    if args.load_tokenizers:
        from kvgate.app import load_tokenizers

        try:
            load_tokenizers(config).close()
        except Exception as exc:  # any loader failure is a config problem here
            print(f"{args.config}: {exc}", file=sys.stderr)
            return 2
    print(
        f"{args.config}: OK ({len(config.tenants)} tenants, {len(config.models)} models, "
        f"{len(config.backends)} backends)"
    )
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    key = args.key
    if key is None:
        key = (
            sys.stdin.readline().rstrip("\n")
            if not sys.stdin.isatty()
            else getpass.getpass("API key: ")
        )
    if not key:
        print("an empty API key cannot be hashed", file=sys.stderr)
        return 2
    print(hash_api_key(key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the ext_proc server")
    serve.add_argument("--config", required=True)
    serve.add_argument("--log-level", help="overrides server.log_level")
    serve.set_defaults(func=_serve)

    check = sub.add_parser("check-config", help="validate a config file without serving")
    check.add_argument("config")
    check.add_argument(
        "--load-tokenizers", action="store_true", help="also load every model's tokenizer"
    )
    check.add_argument(
        "--secrets",
        action="store_true",
        help="also read the operator token, operator TLS files and Redis passwords the config "
        "names (never shown)",
    )
    check.set_defaults(func=_check_config)

    hash_key = sub.add_parser("hash-key", help="print the SHA-256 digest to put in the config")
    hash_key.add_argument("key", nargs="?", help="the key (read from stdin when omitted)")
    hash_key.set_defaults(func=_hash_key)

    add_kv_budget_command(sub)
    add_admin_commands(sub)
    add_drain_commands(sub)
    add_usage_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
