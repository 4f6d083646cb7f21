"""Odd values in the headers kvgate reads: each is a clear OpenAI-shaped 4xx naming what
was wrong, never an internal error."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.session.conftest import SessionRig, _rig, body_msg, headers_msg, make_config
from tests.session.test_session import CHAT, error_of

PRIORITY_HEADER = "kvgate-priority"


@pytest.fixture
async def priority_rig() -> AsyncIterator[SessionRig]:
    """The tenant's own class is 0; it may also ask for 5 and -1."""
    config = make_config()
    config["tenants"][0]["allowed_priorities"] = [5, -1]
    async for rig in _rig(config):
        yield rig


@pytest.mark.parametrize(
    "value",
    [
        "--5",
        "---1",
        "-",
        "",
        "\u00b2",  # superscript two: str.isdigit() says yes, int() refuses it
        "\u0663",  # Arabic-Indic three: int() reads it as 3
        "\uff15",  # fullwidth five
        "+5",
        "5_0",
        "5.0",
        "0x5",
        "5 5",
        "1" * 5000,  # past int()'s digit limit
        "99999999999999999999",
        "5\n",
    ],
)
async def test_a_malformed_priority_is_a_400_naming_the_header(
    priority_rig: SessionRig, value: str
) -> None:
    stream = priority_rig.stream()
    status, body, headers = error_of(
        await stream.exchange(headers_msg(extra={PRIORITY_HEADER: value}))
    )
    assert status == 400
    assert body["error"]["param"] == PRIORITY_HEADER
    assert body["error"]["code"] == "invalid_value"
    assert body["error"]["type"] == "invalid_request_error"
    assert "allowed for this key: -1, 0, 5" in body["error"]["message"]
    assert headers["content-type"] == "application/json"
    assert priority_rig.server.metrics.internal_errors.labels("request_headers")._value.get() == 0


@pytest.mark.parametrize("value", ["5", " 5 ", "\t-1", "-1", "0", "-0", "005"])
async def test_a_plain_allowed_priority_is_admitted(priority_rig: SessionRig, value: str) -> None:
    stream = priority_rig.stream()
    reply = await stream.exchange(headers_msg(extra={PRIORITY_HEADER: value}))
    assert reply.WhichOneof("response") == "request_headers"
    reply = await stream.exchange(body_msg(CHAT))
    assert reply.WhichOneof("response") == "request_body"
    stream.reset()
    assert await priority_rig.in_flight_after_reset() == (0, 0)


@pytest.mark.parametrize("value", ["7", "-100", "100"])
async def test_a_well_formed_class_the_key_may_not_use_is_a_400(
    priority_rig: SessionRig, value: str
) -> None:
    stream = priority_rig.stream()
    status, body, _ = error_of(await stream.exchange(headers_msg(extra={PRIORITY_HEADER: value})))
    assert status == 400
    assert body["error"]["param"] == PRIORITY_HEADER
    assert "may not use (allowed: -1, 0, 5)" in body["error"]["message"]
