"""OpenAI-shaped error bodies and the helpers kvgate uses to build them."""

from __future__ import annotations

import json

import pytest

from kvgate.openai import (
    ApiError,
    context_length_exceeded,
    invalid_api_key,
    invalid_request,
    method_not_allowed,
    missing_api_key,
    model_not_found,
    rate_limited,
    service_unavailable,
    unsupported_path,
)


def body_of(err: ApiError) -> dict:
    decoded = json.loads(err.to_body())
    # OpenAI's shape: one "error" object with exactly these four keys, null allowed.
    assert list(decoded) == ["error"]
    assert set(decoded["error"]) == {"message", "type", "param", "code"}
    return decoded["error"]


@pytest.mark.parametrize(
    ("err", "status", "type_", "code", "param"),
    [
        (invalid_request("bad", "messages[0].role", "invalid_value"), 400,
         "invalid_request_error", "invalid_value", "messages[0].role"),
        (invalid_request("bad"), 400, "invalid_request_error", None, None),
        (missing_api_key(), 401, "invalid_request_error", None, None),
        (invalid_api_key(), 401, "invalid_request_error", "invalid_api_key", None),
        (model_not_found("gpt-x"), 404, "invalid_request_error", "model_not_found", None),
        (context_length_exceeded(100, 20, 64), 400, "invalid_request_error",
         "context_length_exceeded", "messages"),
        (rate_limited("slow down", "tokens_per_minute", 1.5), 429, "rate_limit_exceeded",
         "tokens_per_minute", None),
        (unsupported_path("/v1/embeddings"), 404, "invalid_request_error", "unsupported_path",
         None),
        (method_not_allowed("GET"), 405, "invalid_request_error", "method_not_allowed", None),
        (service_unavailable(), 503, "server_error", "service_unavailable", None),
    ],
)  # fmt: skip
def test_status_type_code_param(
    err: ApiError, status: int, type_: str, code: str | None, param: str | None
) -> None:
    assert err.status == status
    body = body_of(err)
    assert body["type"] == type_
    assert body["code"] == code
    assert body["param"] == param
    assert body["message"] == err.message == str(err)
    assert isinstance(err, Exception)


def test_body_is_compact_utf8_json() -> None:
    err = invalid_request("modèle «x»")
    raw = err.to_body()
    expected = (
        '{"error":{"message":"modèle «x»","type":"invalid_request_error","param":null,"code":null}}'
    )
    assert raw == expected.encode()


def test_model_not_found_wording_matches_openai() -> None:
    assert model_not_found("gpt-4o").message == (
        "The model `gpt-4o` does not exist or you do not have access to it."
    )


def test_echoed_values_are_clipped() -> None:
    huge = "m" * 10_000
    assert len(model_not_found(huge).message) < 200
    assert len(unsupported_path("/" + huge).message) < 200
    assert len(method_not_allowed(huge).message) < 200


def test_unsupported_path_drops_query_string() -> None:
    err = unsupported_path("/v1/foo?api_key=sk-secret", "POST")
    assert err.message == "Invalid URL (POST /v1/foo)"
    assert "secret" not in err.to_body().decode()


def test_auth_errors_do_not_echo_anything_and_ask_for_bearer() -> None:
    for err in (missing_api_key(), invalid_api_key()):
        assert err.headers == {"www-authenticate": "Bearer"}
        assert "sk-" not in err.message


def test_context_length_message_names_both_numbers() -> None:
    msg = context_length_exceeded(4012, 256, 4097).message
    assert "4097" in msg and "4268" in msg and "4012" in msg and "256" in msg
    prompt_only = context_length_exceeded(5000, None, 4097, param="prompt")
    assert "5000" in prompt_only.message and "4097" in prompt_only.message
    assert prompt_only.param == "prompt"


@pytest.mark.parametrize(
    ("retry_after_s", "seconds", "millis"),
    [
        (0.0, "1", "1"),  # never tell a client to retry after 0 s
        (0.0002, "1", "1"),
        (0.2, "1", "200"),
        (1.0, "1", "1000"),
        (1.001, "2", "1001"),
        (59.5, "60", "59500"),
        (-3.0, "1", "1"),
    ],
)
def test_retry_after_headers(retry_after_s: float, seconds: str, millis: str) -> None:
    err = rate_limited("limited", "rpm", retry_after_s)
    assert err.headers["retry-after"] == seconds
    assert err.headers["retry-after-ms"] == millis


@pytest.mark.parametrize("retry_after_s", [None, float("inf"), float("nan")])
def test_no_retry_after_when_unknown(retry_after_s: float | None) -> None:
    err = rate_limited("limited", "concurrency", retry_after_s)
    assert "retry-after" not in err.headers
    assert "retry-after-ms" not in err.headers


def test_rate_limited_merges_extra_headers_lowercased() -> None:
    err = rate_limited(
        "limited",
        "tokens_per_minute",
        2.5,
        {"X-RateLimit-Remaining-Tokens": "0", "Retry-After": "99"},
    )
    assert err.headers == {
        "x-ratelimit-remaining-tokens": "0",
        "retry-after": "3",  # the computed value wins over a passed one
        "retry-after-ms": "2500",
    }


def test_rate_limited_openai_mimicry() -> None:
    err = rate_limited("Rate limit reached", error_type="tokens")
    body = body_of(err)
    assert body["type"] == "tokens" and body["code"] == "rate_limit_exceeded"


def test_method_not_allowed_sets_allow() -> None:
    assert method_not_allowed("GET").headers == {"allow": "POST"}
    err = method_not_allowed("GET", "/v1/chat/completions?key=sk-x")
    assert err.headers == {"allow": "POST"}
    assert err.message == "Method GET is not allowed on /v1/chat/completions; use POST."
    assert method_not_allowed("POST", "/v1/models").headers == {"allow": "GET, HEAD"}
    assert method_not_allowed("PUT", "/v1/models/m").headers == {"allow": "GET, HEAD"}
    assert method_not_allowed("PUT", "/x", ("GET",)).headers == {"allow": "GET"}


def test_service_unavailable_retry_after() -> None:
    assert service_unavailable(retry_after_s=2).headers["retry-after"] == "2"
    assert service_unavailable().headers == {}
