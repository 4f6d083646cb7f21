"""LiteLLM proxy custom auth for the benchmark: virtual keys with RPM/TPM limits, no database.

LiteLLM keeps virtual keys in PostgreSQL through Prisma, and Prisma's query engine is a
prebuilt binary downloaded at install time, which this machine cannot fetch. LiteLLM's
documented alternative is a custom auth function: it maps the presented key to a
`UserAPIKeyAuth`, and the proxy's rate limiter enforces the `rpm_limit` / `tpm_limit` set on
that object exactly as for a database key (in memory, per key). That is the same shape as
kvgate's tenants: a hashed key -> a tenant with RPM and TPM limits.

The keys and limits come from the environment (bench/stack.py sets them):
KVBENCH_LITELLM_KEYS = JSON {"<key>": {"alias": "...", "rpm": N, "tpm": N}, ...}.
This file is copied next to the generated LiteLLM config and loaded by LiteLLM as
`general_settings.custom_auth: kvbench_litellm_auth.user_api_key_auth`.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from fastapi import Request
from litellm.proxy._types import UserAPIKeyAuth

_KEYS: dict[str, dict[str, Any]] = json.loads(os.environ.get("KVBENCH_LITELLM_KEYS", "{}"))


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    del request
    key = api_key.removeprefix("Bearer ").strip()
    limits = _KEYS.get(key)
    if limits is None:
        raise Exception("invalid api key")  # LiteLLM answers 401
    return UserAPIKeyAuth(
        api_key=key,
        token=hashlib.sha256(key.encode()).hexdigest(),
        key_alias=str(limits.get("alias", "bench")),
        rpm_limit=int(limits["rpm"]),
        tpm_limit=int(limits["tpm"]),
    )
