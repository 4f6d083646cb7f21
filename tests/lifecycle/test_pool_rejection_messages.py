"""What a client reads when a pool refuses: the pool's name, never an endpoint's address
(pod IP:PORT stay in kvgate's logs and metrics)."""

from __future__ import annotations

import pytest

from kvgate.lifecycle import Rejected
from kvgate.lifecycle.protocol import rejection_answer
from kvgate.openai import errors as openai_errors
from kvgate.openai.errors import invalid_request, rate_limited, without_addresses
from kvgate.policy import Reason
from tests.lifecycle.support import ENDPOINTS, Pool, pool_config


def assert_names_no_endpoint(rejected: Rejected) -> str:
    message = rejected.rejection.message
    body = rejection_answer(rejected.rejection, openai_errors).to_body().decode()
    for address in ENDPOINTS:
        host = address.partition(":")[0]
        assert host not in message, message
        assert host not in body, body
    assert "'pool'" in message, message
    return message


async def test_a_full_pool_answers_without_endpoint_addresses(pool: Pool) -> None:
    for i in range(6):
        await pool.admit("light", f"q{i}", 480)
    with pytest.raises(Rejected) as full:
        await pool.admit("light", "one-more", 480)
    assert full.value.rejection.reason is Reason.KV_BUDGET_EXHAUSTED
    message = assert_names_no_endpoint(full.value)
    assert "KV tokens free" in message  # still says what is short


async def test_a_request_no_endpoint_could_hold_names_the_pool(pool: Pool) -> None:
    with pytest.raises(Rejected) as too_big:
        await pool.admit("light", "big", 2000)
    assert too_big.value.rejection.reason is Reason.REQUEST_EXCEEDS_KV_BUDGET
    assert "holds in total" in assert_names_no_endpoint(too_big.value)


async def test_a_full_pool_with_a_busy_tenant_names_no_endpoint() -> None:
    # The tenant's TPM and the endpoint's KV both refuse; the answer names the longer wait.
    pool = Pool(pool_config(tpm=1500))
    await pool.start()
    try:
        for i in range(2):
            await pool.admit("heavy", f"h{i}", 480)
        for i in range(4):
            await pool.admit("light", f"l{i}", 480)
        with pytest.raises(Rejected) as refused:
            await pool.admit("heavy", "third", 480)
        message = refused.value.rejection.message
        for address in ENDPOINTS:
            assert address.partition(":")[0] not in message, message
    finally:
        await pool.close()


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("Backend 'pool/10.0.0.1:8000' is full.", "Backend 'pool/<endpoint>' is full."),
        ("Endpoint [fd00::7]:8000.", "Endpoint <endpoint>."),
        ("At 192.168.1.20 now", "At <endpoint> now"),
        ("Expected a value <= 2.5, but got 10.0.", "Expected a value <= 2.5, but got 10.0."),
        ("Invalid 'messages[0].content'", "Invalid 'messages[0].content'"),
        ("version 1.2.3", "version 1.2.3"),
    ],
)
def test_an_error_message_never_carries_an_ip_address(text: str, shown: str) -> None:
    assert without_addresses(text) == shown
    assert rate_limited(text).message == shown
    assert shown in invalid_request(text).to_body().decode()
