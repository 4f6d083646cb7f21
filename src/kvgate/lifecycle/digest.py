"""One digest of a request body, computed once per request for every answer source.

The idempotency fingerprint and the exact-match cache key both name "this request body,
key order and spacing aside". Serialising a large body with sorted keys costs tens of
milliseconds per MiB, so it is done once, after the cheap pre-checks, and off the event
loop when the body is large (the adapter decides where it runs).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def body_digest(body: dict[str, Any]) -> str:
    """The parsed body's canonical SHA-256 (hex): sorted keys, no spacing, UTF-8."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()
