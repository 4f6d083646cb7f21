"""Page tokens for reading records a page at a time: the last record's (occurred_at,
record_id), opaque to the client and checked when it comes back (it is client input)."""

from __future__ import annotations

import base64
import binascii
import json
import math

from kvgate.usage_records.record import MAX_TEXT, UsageRecord

MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100


class BadPageToken(ValueError):
    pass


def page_token(last: UsageRecord) -> str:
    data = json.dumps([last.occurred_at, last.record_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def read_page_token(token: str) -> tuple[float, str] | None:
    """The position after which the next page starts (None: the first page)."""
    if not token:
        return None
    if len(token) > 4 * MAX_TEXT:
        raise BadPageToken("page_token is not one this server gave")
    try:
        data = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        at, record_id = json.loads(data)
    except (binascii.Error, ValueError, TypeError):
        raise BadPageToken("page_token is not one this server gave") from None
    if (
        type(at) not in (int, float)
        or not math.isfinite(at)
        or not isinstance(record_id, str)
        or len(record_id) > MAX_TEXT
    ):
        raise BadPageToken("page_token is not one this server gave")
    return float(at), record_id


def page_size(asked: int) -> int:
    if asked < 0 or asked > MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be 0..{MAX_PAGE_SIZE}")
    return asked or DEFAULT_PAGE_SIZE
