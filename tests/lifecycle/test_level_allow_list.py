"""A level's model allow-list: a model outside it is refused as an unknown model, before
anything is reserved."""

from __future__ import annotations

import pytest

from kvgate.lifecycle import Rejected
from kvgate.openai import parse_request
from kvgate.policy import Level, LevelKind, Reason
from tests.lifecycle.conftest import MODEL, Lifecycle
from tests.lifecycle.support import CHAT, chat


async def test_a_model_outside_a_levels_list_is_not_found(life: Lifecycle) -> None:
    tenant = life.snapshots.current.tenants["acme"]
    allowed = tenant.with_levels((Level(LevelKind.TEAM, "research", models=frozenset({MODEL})),))
    barred = tenant.with_levels(
        (
            Level(LevelKind.TEAM, "research"),
            Level(LevelKind.KEY, "key_a", models=frozenset({"another-model"})),
        )
    )
    admission = life.admission()
    with pytest.raises(Rejected) as refused:
        await admission.admit(parse_request(CHAT, chat(max_tokens=5)), barred, "r1", "r1/x")
    assert refused.value.rejection.reason is Reason.MODEL_NOT_FOUND
    assert refused.value.rejection.param == "model"
    with pytest.raises(Rejected) as slot:
        await admission.take_request_slot(MODEL, barred, "r2/x")
    assert slot.value.rejection.reason is Reason.MODEL_NOT_FOUND
    assert await life.in_flight() == (0, 0)
    ticket = await life.admission().admit(
        parse_request(CHAT, chat(max_tokens=5)), allowed, "r3", "r3/x"
    )
    assert ticket.reservation.hold is not None
    assert ticket.reservation.hold.level_scopes == ("@team:research",)
