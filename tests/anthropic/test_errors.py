"""kvgate's refusals in Anthropic's shape: bodies, statuses, headers, and the exception
the official SDK raises for each."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import anthropic
import httpx2
import pytest

from kvgate.anthropic import AnthropicError, AnthropicErrors
from kvgate.anthropic.errors import error_type_for_status, format_reset
from kvgate.lifecycle.admission import ContextOverflow, Rejection
from kvgate.lifecycle.protocol import ErrorVocabulary, rejection_answer
from kvgate.policy import RateLimitView, Reason

# 2026-03-04T05:06:07Z
NOW = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC).timestamp()
ERRORS = AnthropicErrors(clock=lambda: NOW + 0.25)
VIEW = RateLimitView(
    limit_requests=60,
    remaining_requests=0,
    reset_requests_s=1.5,
    limit_tokens=10_000,
    remaining_tokens=9_000,
    reset_tokens_s=61.0,
)


def body_of(error: AnthropicError) -> dict[str, object]:
    payload = json.loads(error.to_body())
    assert set(payload) == {"type", "error"} and payload["type"] == "error"
    assert set(payload["error"]) == {"type", "message"}
    return payload["error"]


def test_the_vocabulary_satisfies_the_seam() -> None:
    vocabulary: ErrorVocabulary = ERRORS
    assert vocabulary.invalid_api_key().status == 401


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (ERRORS.invalid_request("bad"), 400, "invalid_request_error"),
        (ERRORS.missing_api_key(), 401, "authentication_error"),
        (ERRORS.invalid_api_key(), 401, "authentication_error"),
        (ERRORS.tenant_not_allowed_on_route(), 403, "permission_error"),
        (ERRORS.model_not_found("nope"), 404, "not_found_error"),
        (ERRORS.unsupported_path("/v1/x?key=secret"), 404, "not_found_error"),
        (ERRORS.method_not_allowed("GET", "/v1/messages"), 405, "invalid_request_error"),
        (ERRORS.idempotency_key_in_progress(2), 409, "invalid_request_error"),
        (ERRORS.idempotency_key_reused(), 422, "invalid_request_error"),
        (ERRORS.rate_limited("slow"), 429, "rate_limit_error"),
        (ERRORS.idempotency_keys_exhausted(1), 429, "rate_limit_error"),
        (ERRORS.idempotency_waiters_exceeded(1), 429, "rate_limit_error"),
        (ERRORS.internal_error(), 500, "api_error"),
        (ERRORS.route_misconfigured("kvgate.backend"), 500, "api_error"),
        (ERRORS.service_unavailable(retry_after_s=2), 503, "overloaded_error"),
    ],
)
def test_each_refusal_has_anthropics_status_and_type(
    error: AnthropicError, status: int, kind: str
) -> None:
    assert (error.status, error.type) == (status, kind)
    assert body_of(error)["type"] == kind


def test_messages_never_echo_a_key_a_query_or_an_address() -> None:
    assert "secret" not in ERRORS.unsupported_path("/v1/x?key=secret").message
    assert "sk-" not in ERRORS.invalid_api_key().message
    assert "10.0.0.7" not in ERRORS.service_unavailable("endpoint 10.0.0.7:8000 is down").message
    assert len(ERRORS.model_not_found("m" * 10_000).message) < 100


def test_the_header_the_key_goes_in_is_named() -> None:
    assert ERRORS.missing_api_key().message == "x-api-key header is required"
    assert ERRORS.missing_api_key("x-team-key").message == "x-team-key header is required"


def test_a_field_kvgate_names_apart_is_put_in_the_message() -> None:
    error = ERRORS.invalid_request("must be JSON", "content-type", "invalid_value")
    assert error.message == "content-type: must be JSON"


def test_context_overflow_in_anthropics_words() -> None:
    with_cap = ERRORS.context_length_exceeded(4000, 200, 4096)
    assert with_cap.message == (
        "input length and `max_tokens` exceed context limit: 4000 + 200 > 4096, decrease "
        "input length or `max_tokens` and try again"
    )
    alone = ERRORS.context_length_exceeded(5000, None, 4096, at_least=True)
    assert alone.message == "prompt is too long: at least 5000 tokens > 4096 maximum"
    assert alone.status == 400


def test_rate_limit_headers_are_anthropics_with_rfc3339_resets() -> None:
    assert ERRORS.rate_limit_headers(None) == {}
    assert ERRORS.rate_limit_headers(VIEW) == {
        "anthropic-ratelimit-requests-limit": "60",
        "anthropic-ratelimit-requests-remaining": "0",
        # now + 0.25 + 1.5, up to the whole second
        "anthropic-ratelimit-requests-reset": "2026-03-04T05:06:09Z",
        "anthropic-ratelimit-tokens-limit": "10000",
        "anthropic-ratelimit-tokens-remaining": "9000",
        "anthropic-ratelimit-tokens-reset": "2026-03-04T05:07:09Z",
    }
    only_requests = RateLimitView(limit_requests=5, remaining_requests=4, reset_requests_s=None)
    assert ERRORS.rate_limit_headers(only_requests) == {
        "anthropic-ratelimit-requests-limit": "5",
        "anthropic-ratelimit-requests-remaining": "4",
        "anthropic-ratelimit-requests-reset": "2026-03-04T05:06:08Z",
    }
    assert format_reset(NOW, -3) == "2026-03-04T05:06:07Z"


def test_a_rate_limit_refusal_carries_retry_after_and_the_limits() -> None:
    rejection = Rejection(
        Reason.RPM_EXCEEDED, "Rate limit reached for requests.", retry_after_s=1.2, rate_limits=VIEW
    )
    answer = rejection_answer(rejection, ERRORS)
    assert answer.status == 429
    assert answer.headers["retry-after"] == "2" and answer.headers["retry-after-ms"] == "1200"
    assert answer.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert json.loads(answer.to_body())["error"] == {
        "type": "rate_limit_error",
        "message": "Rate limit reached for requests.",
    }


def test_the_one_rejection_mapping_speaks_anthropic() -> None:
    budget = Rejection(Reason.BUDGET_EXCEEDED, "Daily budget spent.", retry_after_s=60)
    assert (rejection_answer(budget, ERRORS).status, rejection_answer(budget, ERRORS).type) == (
        429,
        "rate_limit_error",
    )
    overflow = Rejection(
        Reason.CONTEXT_LENGTH_EXCEEDED,
        "too long",
        context=ContextOverflow(prompt_tokens=5000, max_new_tokens=100, max_context=4096),
    )
    assert "5000 + 100 > 4096" in rejection_answer(overflow, ERRORS).message
    store = Rejection(Reason.STORE_UNAVAILABLE, "Store down.", retry_after_s=3)
    unavailable = rejection_answer(store, ERRORS)
    assert (unavailable.status, unavailable.type) == (503, "overloaded_error")
    assert unavailable.headers["retry-after"] == "3"
    missing = Rejection(Reason.MODEL_NOT_FOUND, "claude-x")
    assert rejection_answer(missing, ERRORS).message == "model: claude-x"


def test_types_by_status_follow_vllms_translation() -> None:
    assert error_type_for_status(413) == "request_too_large"
    assert error_type_for_status(418) == "invalid_request_error"
    assert error_type_for_status(502) == "api_error"
    assert error_type_for_status(529) == "overloaded_error"


@pytest.mark.parametrize(
    ("error", "raised"),
    [
        (ERRORS.invalid_request("bad"), anthropic.BadRequestError),
        (ERRORS.invalid_api_key(), anthropic.AuthenticationError),
        (ERRORS.tenant_not_allowed_on_route(), anthropic.PermissionDeniedError),
        (ERRORS.model_not_found("m"), anthropic.NotFoundError),
        (ERRORS.rate_limited("slow", retry_after_s=1), anthropic.RateLimitError),
        (ERRORS.internal_error(), anthropic.InternalServerError),
        (ERRORS.service_unavailable(), anthropic.InternalServerError),
    ],
)
def test_the_official_sdk_raises_the_matching_exception(
    error: AnthropicError, raised: type[anthropic.APIStatusError]
) -> None:
    def answer(request: httpx2.Request) -> httpx2.Response:
        headers = {**error.headers, "content-type": "application/json"}
        return httpx2.Response(error.status, headers=headers, content=error.to_body())

    client = anthropic.Anthropic(
        api_key="k",
        base_url="http://kvgate.test",
        http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
        max_retries=0,
    )
    with pytest.raises(raised) as caught:
        client.messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.status_code == error.status
    assert caught.value.body == json.loads(error.to_body())
