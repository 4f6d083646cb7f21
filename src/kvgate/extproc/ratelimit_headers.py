"""OpenAI's x-ratelimit-* response headers."""

from __future__ import annotations

from kvgate.policy import RateLimitView


def format_reset(seconds: float) -> str:
    """OpenAI's duration style: "20ms", "1s", "7.66s", "6m0s", "1h2m3s"."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    secs_text = f"{secs:.2f}".rstrip("0").rstrip(".")
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{secs_text}s"
    if minutes >= 1:
        return f"{int(minutes)}m{secs_text}s"
    return f"{secs_text}s"


def rate_limit_headers(view: RateLimitView | None) -> dict[str, str]:
    if view is None:
        return {}
    headers: dict[str, str] = {}
    if view.limit_requests is not None:
        headers["x-ratelimit-limit-requests"] = str(view.limit_requests)
        headers["x-ratelimit-remaining-requests"] = str(view.remaining_requests)
        headers["x-ratelimit-reset-requests"] = format_reset(view.reset_requests_s or 0.0)
    if view.limit_tokens is not None:
        headers["x-ratelimit-limit-tokens"] = str(view.limit_tokens)
        headers["x-ratelimit-remaining-tokens"] = str(view.remaining_tokens)
        headers["x-ratelimit-reset-tokens"] = format_reset(view.reset_tokens_s or 0.0)
    return headers
